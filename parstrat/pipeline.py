"""Pipeline building blocks: stage cuts and schedules as data (and CSV).

`parstrat schedule` prints and draws the built-in schedules.
"""

from parstrat._src.pipeline.partition import Layer
from parstrat._src.pipeline.partition import StagePlan
from parstrat._src.pipeline.partition import plan_stages
from parstrat._src.pipeline.partition import stage_boundary
from parstrat._src.pipeline.schedule import Action
from parstrat._src.pipeline.schedule import Schedule
from parstrat._src.pipeline.schedule import build_schedule
from parstrat._src.pipeline.schedule import check_schedule
from parstrat._src.pipeline.schedule import theoretical_bubble
from parstrat._src.pipeline.schedule_csv import from_csv
from parstrat._src.pipeline.schedule_csv import to_csv

__all__ = [
  "Action",
  "Layer",
  "Schedule",
  "StagePlan",
  "build_schedule",
  "check_schedule",
  "from_csv",
  "plan_stages",
  "stage_boundary",
  "theoretical_bubble",
  "to_csv",
]
