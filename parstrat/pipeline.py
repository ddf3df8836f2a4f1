"""Pipeline building blocks: stage cuts, schedules as data, and drawing them."""

from parstrat._src.pipeline.partition import Layer, StagePlan, plan_stages, stage_boundary
from parstrat._src.pipeline.schedule import (
  Action,
  Schedule,
  build_schedule,
  check_schedule,
  theoretical_bubble,
)

__all__ = [
  "Action",
  "Layer",
  "Schedule",
  "StagePlan",
  "build_schedule",
  "check_schedule",
  "plan_stages",
  "stage_boundary",
  "theoretical_bubble",
]
