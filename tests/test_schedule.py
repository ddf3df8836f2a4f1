"""Schedules are plain data: checked here without any device."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from parstrat import pipeline
from parstrat.pipeline import Action

SCHEDULES = ["gpipe", "1f1b"]


def _simulate_messages(schedule):
  """Replays the tables with microbatch ids as payloads; returns what each action read."""
  P = schedule.stages
  stash = np.full((P, schedule.num_act_slots), -1)
  inbox = np.full((P, schedule.num_grad_slots), -1)
  for t in range(schedule.num_ticks):
    sent_act, sent_grad = [-1] * P, [-1] * P
    for s in range(P):
      a, m = schedule.action[t, s], schedule.microbatch[t, s]
      if a == Action.IDLE:
        continue
      if s > 0:
        assert stash[s, schedule.act_slot[t, s]] == m, f"tick {t} stage {s} reads the wrong input"
      if a == Action.BACKWARD and s < P - 1:
        assert inbox[s, schedule.grad_slot[t, s]] == m, f"tick {t} stage {s} reads the wrong grad"
      if a == Action.FORWARD:
        sent_act[s] = m
      else:
        sent_grad[s] = m
    for s in range(P):
      if schedule.recv_act_slot[t, s] >= 0:
        assert sent_act[s - 1] >= 0
        stash[s, schedule.recv_act_slot[t, s]] = sent_act[s - 1]
      if schedule.recv_grad_slot[t, s] >= 0:
        assert sent_grad[s + 1] >= 0
        inbox[s, schedule.recv_grad_slot[t, s]] = sent_grad[s + 1]


@settings(max_examples=60, deadline=None)
@given(
  name=st.sampled_from(SCHEDULES),
  stages=st.integers(1, 12),
  microbatches=st.integers(1, 24),
)
def test_tables_obey_dependencies_and_buffers_deliver(name, stages, microbatches):
  schedule = pipeline.build_schedule(name, stages, microbatches)
  pipeline.check_schedule(schedule)
  _simulate_messages(schedule)
  assert schedule.num_ticks == 2 * (microbatches + stages - 1)
  assert schedule.bubble_fraction() == pytest.approx(
    pipeline.theoretical_bubble(stages, microbatches)
  )


@settings(max_examples=40, deadline=None)
@given(stages=st.integers(1, 12), microbatches=st.integers(1, 24))
def test_1f1b_keeps_at_most_p_microbatches_alive(stages, microbatches):
  one_f = pipeline.build_schedule("1f1b", stages, microbatches)
  gpipe = pipeline.build_schedule("gpipe", stages, microbatches)
  assert max(one_f.max_live_activations()) <= min(stages, microbatches)
  assert one_f.num_act_slots <= stages
  assert max(gpipe.max_live_activations()) == microbatches


def test_check_schedule_catches_a_broken_table():
  schedule = pipeline.build_schedule("gpipe", 3, 4)
  action = schedule.action.copy()
  microbatch = schedule.microbatch.copy()
  # Swap stage 1's first forward with an idle slot before stage 0 produced it.
  t = int(np.flatnonzero(action[:, 1] == Action.FORWARD)[0])
  action[0, 1], microbatch[0, 1] = action[t, 1], microbatch[t, 1]
  action[t, 1], microbatch[t, 1] = Action.IDLE, -1
  broken = type(schedule)(**{**schedule.__dict__, "action": action, "microbatch": microbatch})
  with pytest.raises(AssertionError, match="stage 1 runs forward 0 at tick 0"):
    pipeline.check_schedule(broken)


def test_text_table():
  schedule = pipeline.build_schedule("1f1b", 2, 3)
  assert schedule.table().splitlines() == [
    "stage 0: F0 F1  . B0 F2 B1  . B2",
    "stage 1:  . F0 B0 F1 B1 F2 B2  .",
  ]


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(name="zigzag", stages=2, microbatches=2), "Unknown schedule 'zigzag'"),
    (dict(name="gpipe", stages=0, microbatches=2), "stages must be a positive integer, got 0"),
    (
      dict(name="1f1b", stages=2, microbatches=-1),
      "microbatches must be a positive integer, got -1",
    ),
  ],
)
def test_bad_arguments(kwargs, message):
  with pytest.raises(ValueError, match=message):
    pipeline.build_schedule(**kwargs)
