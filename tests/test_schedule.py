"""Schedules are plain data: checked here without any device."""

import ast
import dataclasses
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import parstrat
from parstrat import pipeline
from parstrat._src.pipeline import engine
from parstrat._src.pipeline import schedule as schedule_lib
from parstrat.pipeline import Action

SCHEDULES = ["gpipe", "1f1b"]


@settings(max_examples=60, deadline=None)
@given(
  name=st.sampled_from(SCHEDULES),
  stages=st.integers(1, 12),
  microbatches=st.integers(1, 24),
)
def test_tables_obey_dependencies_and_buffers_deliver(name, stages, microbatches):
  schedule = pipeline.build_schedule(name, stages, microbatches)
  pipeline.check_schedule(schedule)
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
  with pytest.raises(AssertionError, match="stage 1 runs the forward of microbatch 0 at tick 0"):
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
    (
      dict(name="1f1b", stages=2, microbatches=2, virtual_stages=2),
      "virtual_stages=2 needs schedule 'interleaved_1f1b'; '1f1b' runs one chunk",
    ),
    (
      dict(name="interleaved_1f1b", stages=2, microbatches=2, virtual_stages=0),
      "virtual_stages must be a positive integer, got 0",
    ),
    (
      dict(name="interleaved_1f1b", stages=4, microbatches=6),
      "microbatches to be a multiple of stages, got microbatches=6 with stages=4",
    ),
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


def _all_tables():
  """Every schedule for P <= 8, M <= 16 (and v <= 3 when interleaved): cheap, no devices."""
  for name in ("gpipe", "1f1b", "zb_h1"):
    for stages in range(1, 9):
      for microbatches in range(1, 17):
        yield pipeline.build_schedule(name, stages, microbatches)
  for stages in range(1, 9):
    for microbatches in range(stages, 17, stages):
      for v in (1, 2, 3):
        yield pipeline.build_schedule("interleaved_1f1b", stages, microbatches, virtual_stages=v)


def test_every_exchange_keeps_the_messages_the_passes_send():
  # At K = 1: what each tick's passes send (an activation on, a gradient back) is what
  # the receivers keep, and every GPipe and 1F1B exchange is one permutation of the
  # devices, which the engine moves in one `ppermute` (`engine.exchange_plan`).
  for s in _all_tables():
    P, G = s.stages, s.model_stages
    for t, kept in enumerate(s.messages()):
      sent = set()
      for d in range(P):
        kind, g = Action(int(s.action[t, d])), int(s.model_stage[t, d])
        activation, gradient = schedule_lib.sends(kind, max(g, 0), G)
        if activation:
          sent.add((d, (d + 1) % P, "activation"))
        if gradient:
          sent.add((d, (d - 1) % P, "gradient"))
      assert kept == sent, (s.name, P, s.microbatches, t)


def _reads(s, recv_act_slot, recv_grad_slot, ways=None):
  """Each read of the stash and the inbox as ((tick, device, kind), (tick sent, sender)).

  Replays the exchanges at K = 1: `ways[e]` is how exchange e moves each device's
  last message (`None`: as the table has it, straight after its tick).
  """
  P, G, T = s.stages, s.model_stages, s.num_ticks
  stash, inbox, outbox, reads = {}, {}, [None] * P, {}
  neighbour = lambda d: d if s.virtual_stages > 1 or 0 <= d < P else None
  for t in range(T):
    for d in range(P):
      if s.act_slot[t, d] >= 0:
        reads[(t, d, "activation")] = stash[(d, int(s.act_slot[t, d]))]
      if s.grad_slot[t, d] >= 0:
        reads[(t, d, "gradient")] = inbox[(d, int(s.grad_slot[t, d]))]
      g = max(int(s.model_stage[t, d]), 0)
      if any(schedule_lib.sends(Action(int(s.action[t, d])), g, G)):
        outbox[d] = (t, d)
    way = engine.BOTH_WAYS if ways is None else ways[t]
    if way == engine.BOTH_WAYS:
      ahead = [neighbour(d - 1) for d in range(P)]
      behind = [neighbour(d + 1) for d in range(P)]
      from_prev = [None if a is None else outbox[a % P] for a in ahead]
      from_next = [None if b is None else outbox[b % P] for b in behind]
    else:
      from_prev = [None] * P
      for sender, receiver in way:
        from_prev[receiver] = outbox[sender]
      from_next = from_prev
    for d in range(P):
      for slots, buffer, arrived in (
        (recv_act_slot, stash, from_prev[d]),
        (recv_grad_slot, inbox, from_next[d]),
      ):
        if slots[t, d] >= 0:
          assert arrived is not None, (s.name, P, s.microbatches, t, d)
          buffer[(d, int(slots[t, d]))] = arrived
  return reads


def _k1_tables():
  yield from _all_tables()
  for stages in range(1, 9):
    for microbatches in range(stages, 17, stages):
      yield pipeline.build_schedule(
        "interleaved_1f1b", stages, microbatches, virtual_stages=2, exchange_every=1
      )


def test_the_exchange_plan_delivers_what_the_table_does():
  # Replayed with (tick sent, sender) as payloads, every pass reads the message the
  # table's own exchanges would give it, although in ZB-H1 some messages wait on their
  # sender for a later exchange: then no exchange needs two `ppermute`s.
  for s in _k1_tables():
    plan = engine.exchange_plan(s)
    where = (s.name, s.stages, s.microbatches, s.virtual_stages)
    expected = _reads(s, s.recv_act_slot, s.recv_grad_slot)
    ways = [plan.ways[i] for i in plan.way_index]
    assert _reads(s, plan.recv_act_slot, plan.recv_grad_slot, ways) == expected, where
    for way in ways:
      if way != engine.BOTH_WAYS:  # (one permutation: each sends and receives one at most)
        assert len({a for a, _ in way}) == len({b for _, b in way}) == len(way), where
    if s.name in ("gpipe", "1f1b"):  # (as the table has it: nothing waits)
      assert not plan.waits and engine.BOTH_WAYS not in ways, where
    if s.name == "zb_h1":
      assert engine.BOTH_WAYS not in ways, where
  # Interleaved devices send in every tick of the steady state: at P=4, M=8 nothing
  # waits, and two exchanges take two `ppermute`s.
  s = pipeline.build_schedule("interleaved_1f1b", 4, 8, virtual_stages=2, exchange_every=1)
  plan = engine.exchange_plan(s)
  assert not plan.waits and sum(plan.ways[i] == engine.BOTH_WAYS for i in plan.way_index) == 2


def test_every_table_checks_and_takes_the_papers_ticks():
  count = 0
  for s in _all_tables():
    count += 1
    P, M, v = s.stages, s.microbatches, s.virtual_stages
    pipeline.check_schedule(s)  # dependencies, and every message read from the right slot
    stage = s.model_stage
    busy = stage >= 0
    assert np.all(stage[busy] % P == np.nonzero(busy)[1]), "model stage g runs on device g % P"
    if s.name in ("gpipe", "1f1b"):
      assert s.num_ticks == 2 * (M + P - 1)
    elif s.name == "zb_h1":
      # ZB-H1 with F = I = W = one tick: 3M work plus a bubble of P - 1 (Qi et al.).
      if M >= P:
        assert s.num_ticks == 3 * M + P - 1, (P, M)
        assert s.bubble_fraction() == pytest.approx(s.theoretical_bubble())
      # At 1F1B's activation memory: at most P microbatches between F and W.
      assert max(s.max_live_activations()) <= P
      assert s.num_act_slots <= P
    else:
      # Megatron: 2vM chunk ticks of work plus 2(P - 1).
      assert s.num_ticks == 2 * v * M + 2 * (P - 1), (P, M, v)
      assert s.bubble_fraction() == pytest.approx(s.theoretical_bubble())
  assert count > 500


@pytest.mark.parametrize("microbatches", [4, 8, 16])
def test_at_p4_zb_h1_and_interleaved_have_the_papers_bubble(microbatches):
  P, M = 4, microbatches
  one_f = pipeline.build_schedule("1f1b", P, M)
  zb = pipeline.build_schedule("zb_h1", P, M)
  idle = zb.num_ticks * P - int(np.count_nonzero(zb.action))
  # ZB-H1: (P - 1) idle ticks per device when F, I and W take one tick each,
  # i.e. (P-1)/(3M) of the work, where 1F1B with its B = I + W (two ticks) idles
  # 3(P - 1) ticks per device.
  assert abs(idle / P - (P - 1)) <= 1
  for v in (2, 4):
    inter = pipeline.build_schedule("interleaved_1f1b", P, M, virtual_stages=v)
    idle = inter.num_ticks * P - int(np.count_nonzero(inter.action))
    work = 2 * v * M  # chunk ticks per device
    # Megatron: a bubble of (P - 1)/(vM) of the work: 2(P - 1) chunk ticks per device.
    assert abs(idle / P - 2 * (P - 1)) <= 1
    assert idle / P / work == pytest.approx((P - 1) / (v * M), abs=1 / work)
    assert inter.bubble_fraction() < one_f.bubble_fraction()


def test_text_tables_of_the_new_schedules():
  assert pipeline.build_schedule("zb_h1", 2, 2).table().splitlines() == [
    "stage 0: F0 F1  . I0 W0 I1 W1",
    "stage 1:  . F0 I0 F1 I1 W0 W1",
  ]
  inter = pipeline.build_schedule("interleaved_1f1b", 2, 2, virtual_stages=2)
  assert inter.table().splitlines() == [
    "device 0: 0F0 0F1 2F0 2F1   . 2B0   . 2B1 0B0 0B1",
    "device 1:   . 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1   .",
  ]
  assert "theory (P-1)/(vM+P-1) = 0.200" in str(inter)


def _replace(schedule, **tables):
  return type(schedule)(**{**schedule.__dict__, **tables})


def test_check_schedule_catches_weight_before_input_grad_and_a_misdelivered_message():
  zb = pipeline.build_schedule("zb_h1", 2, 2)
  action = zb.action.copy()
  # Swap stage 0's I0 and W0 (ticks 3 and 4).
  action[3, 0], action[4, 0] = action[4, 0], action[3, 0]
  with pytest.raises(
    AssertionError,
    match=r"stage 0 runs the weight backward \(W\) of "
    r"microbatch 0 at tick 3, not after its input backward \(I, tick 4\)",
  ):
    pipeline.check_schedule(_replace(zb, action=action))
  one_f = pipeline.build_schedule("1f1b", 3, 4)
  recv = one_f.recv_act_slot.copy()
  t = int(np.flatnonzero(recv[:, 1] >= 0)[1])  # the second activation stage 1 receives
  recv[t, 1] = recv[int(np.flatnonzero(recv[:, 1] >= 0)[0]), 1]  # lands on the first's slot
  with pytest.raises(AssertionError, match="stage 1 reads the wrong input"):
    pipeline.check_schedule(_replace(one_f, recv_act_slot=recv))


# ------------------------------------------------------------------------ CSV
def _tables(s):
  return [s.action, s.microbatch, s.chunk, s.act_slot, s.grad_slot, s.recv_act_slot]


@pytest.mark.parametrize(
  "name, stages, microbatches, v, k",
  [
    ("gpipe", 3, 4, 1, 1),
    ("1f1b", 4, 6, 1, 1),
    ("zb_h1", 4, 8, 1, 1),
    ("interleaved_1f1b", 4, 8, 2, 1),
    ("interleaved_1f1b", 2, 4, 2, 2),  # (what `parstrat schedule --csv` writes for it)
    ("zb_h1", 4, 8, 1, 2),
    ("gpipe", 3, 4, 1, 3),
  ],
)
def test_csv_round_trip(name, stages, microbatches, v, k):
  s = pipeline.build_schedule(name, stages, microbatches, virtual_stages=v, exchange_every=k)
  text = pipeline.to_csv(s)
  back = pipeline.from_csv(text, exchange_every=k)
  assert (back.stages, back.microbatches, back.virtual_stages) == (stages, microbatches, v)
  assert (back.exchange_every, back.num_exchanges) == (k, s.num_exchanges)
  np.testing.assert_array_equal(back.recv_grad_slot, s.recv_grad_slot)
  for a, b in zip(_tables(s), _tables(back), strict=True):
    np.testing.assert_array_equal(a, b)
  assert pipeline.to_csv(back) == text
  assert back.name == "imported" and back.theoretical_bubble() is None


def test_the_theory_is_given_only_for_the_built_table_and_the_sizes_it_covers():
  zb = pipeline.build_schedule("zb_h1", 4, 8)
  named_back = pipeline.from_csv(pipeline.to_csv(zb), name="zb_h1")
  assert named_back.theoretical_bubble() == pytest.approx(3 / 27)  # the same table
  # A GPipe table under ZB-H1's name was given ZB-H1's 0.111 beside its own 0.273.
  other = pipeline.from_csv(pipeline.to_csv(pipeline.build_schedule("gpipe", 4, 8)), name="zb_h1")
  assert other.theoretical_bubble() is None
  assert other.bubble_text() == "bubble 0.273 (no theory for an imported or edited schedule)"
  # ZB-H1's formula holds for M >= P: at M=2 it said 0.333 beside the table's 0.455.
  few = pipeline.build_schedule("zb_h1", 4, 2)
  assert few.theoretical_bubble() is None
  assert few.bubble_text() == "bubble 0.455 (theory (P-1)/(3M+P-1) holds for M >= P only)"


def test_csv_is_torch_pipelinings_format():
  # One row per rank, one cell per step, "" when idle; torch writes `{stage}{F|I|B|W}{mb}`
  # (B: full backward, I: input gradient, W: weight gradient) and stage g on rank g % P.
  text = pipeline.to_csv(pipeline.build_schedule("zb_h1", 2, 2))
  assert text == "0F0,0F1,,0I0,0W0,0I1,0W1\n,1F0,1I0,1F1,1I1,1W0,1W1\n"
  inter = pipeline.to_csv(pipeline.build_schedule("interleaved_1f1b", 2, 2))
  assert inter.splitlines()[1] == ",1F0,1F1,3F0,3B0,3F1,3B1,1B0,1B1,"
  # A table designed elsewhere: rows may be ragged, and a stage may mix B with I/W.
  mixed = pipeline.from_csv("0F0,0F1,,0B0,,0I1,0W1\n,1F0,1B0,1F1,1I1,1W1\n")
  assert mixed.num_ticks == 7 and mixed.max_live_activations() == [2, 1]
  # torch before 2.6 wrote I as B (next to a W) and a full backward as BW.
  legacy = "0F0,0F1,,0B0,0W0,0B1,0W1\n,1F0,1B0,1F1,1B1,1W0,1W1\n"
  np.testing.assert_array_equal(
    pipeline.from_csv(legacy).action, pipeline.build_schedule("zb_h1", 2, 2).action
  )
  full = pipeline.to_csv(pipeline.build_schedule("1f1b", 2, 2)).replace("B", "BW")
  np.testing.assert_array_equal(
    pipeline.from_csv(full).action, pipeline.build_schedule("1f1b", 2, 2).action
  )
  # Trailing blank and whitespace-only lines are no devices.
  assert pipeline.from_csv("0F0,,,0B0\n,1F0,1B0,\n \n\n").stages == 2
  # retime: only each row's order counts; ticks are recomputed as early as possible.
  squeezed = pipeline.from_csv("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n", retime=True)
  np.testing.assert_array_equal(squeezed.action, pipeline.build_schedule("1f1b", 2, 2).action)


@pytest.mark.parametrize(
  "text, message",
  [
    ("0F0,0X0\n1F0\n", r"Row 0, column 1: cannot read '0X0'"),
    ("0F0,1F0\n,\n", r"Row 0, column 1: '1F0' runs stage 1 on device 0; .* device 1"),
    (
      "0F0,,0B0\n,1F0,1B0\n",
      r"stage 0 runs the backward of microbatch 0 at tick 2, but "
      r"needs stage 1's gradient, computed at tick 2: it must come later",
    ),
    ("0F0,,0B0\n,1F0\n", r"stage 1 never runs the backward \(B\) of microbatch 0"),
    ("0F0,0F0\n", r"stage 0 runs the forward \(F\) of microbatch 0 twice \(ticks 0 and 1\)"),
    (  # (three stages on two devices: it said stage 3 never ran, a stage it never named)
      "0F0,,2F0,2B0,,0B0\n,1F0,,,1B0\n",
      r"names stages 0..2 on 2 devices \(rows\): .* must be a multiple of 2 \(stage 2 first "
      r"at row 0, column 2: '2F0'\)",
    ),
    (  # a typo'd microbatch: the cell is named, not only what looks missing
      "0F0,0F1,0B0,0F9,0B1\n",
      r"stage 0 never runs the forward \(F\) of microbatch 2: .* \(the last stage first at row "
      r"0, column 0: '0F0'; the last microbatch first at row 0, column 3: '0F9'\)",
    ),
    (
      "(1F1;1B0)OVERLAP_F_B,0F0\n",
      r"Row 0, column 0: '\(1F1;1B0\)OVERLAP_F_B' is one of torch's communication actions",
    ),
    (
      "0F0,0B0\n1F0,1B0\n",
      "stage 0 runs the backward of microbatch 0 at tick 1, but needs "
      "stage 1's gradient, computed at tick 1: it must come later",
    ),
    ("", "no rows"),
    (" \n\n", "no rows"),
    ("0F0,,0B0\n\n,1F0,1B0\n", r"Row 1 of 3 is empty: each row is one device's actions"),
    ("0F0,0SEND_F0\n", r"Row 0, column 1: '0SEND_F0' is one of torch's communication actions"),
    ("0UNSHARD,0F0\n", r"Row 0, column 0: '0UNSHARD' is one of torch's communication actions"),
    ("0F0,0B0,0F99999999999\n", r"column 2: '0F99999999999': a stage or microbatch index above"),
    (  # (named at once, not after walking a hundred million microbatches)
      "0F0,0B0,0F99999999\n",
      r"stage 0 never runs the forward \(F\) of microbatch 1: .* 100000000 forwards and has 2",
    ),
  ],
)
def test_csv_import_names_the_problem(text, message):
  with pytest.raises(ValueError, match=message):
    pipeline.from_csv(text)
  if "must come later" in message:  # the same order, retimed, is fine
    pipeline.from_csv(text, retime=True)


@pytest.mark.parametrize("k", [0, None, 1.5, True])
def test_csv_import_names_a_bad_exchange_every(k):
  with pytest.raises(ValueError, match=rf"exchange_every must be a positive integer, got {k!r}"):
    pipeline.from_csv("0F0,,0B0\n,1F0,1B0\n", exchange_every=k, retime=True)


def test_csv_import_reads_a_byte_order_mark_and_names_a_deadlock_in_its_own_notation():
  assert pipeline.from_csv("\ufeff0F0,0F1,,0B0,,0B1\n,1F0,1B0,1F1,1B1,\n").microbatches == 2
  with pytest.raises(
    ValueError,
    match=r"deadlocks at tick 1: no stage can proceed \(device 0 waits to run 0B0, device 1 "
    r"waits to run 1F1\)",
  ):
    pipeline.from_csv("0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n", retime=True)


def test_csv_import_refuses_two_messages_one_way_in_an_exchange_with_a_value_error():
  # (check_schedule's AssertionError escaped from_csv, which documents ValueError)
  with pytest.raises(ValueError, match="tick 1: stage 0 sends two activations in one exchange"):
    pipeline.from_csv("0F0,0F1,,,0B0,,0B1,\n,,1F0,1B0,1F1,1B1,,\n", exchange_every=2)


def test_check_schedule_names_tables_of_the_wrong_shape_and_slots_outside_the_buffers():
  schedule = pipeline.build_schedule("1f1b", 4, 8)
  with pytest.raises(
    AssertionError, match=r"tick 3, stage 1: Schedule.act_slot is 2, outside the num_act_slots=2"
  ):
    pipeline.check_schedule(dataclasses.replace(schedule, num_act_slots=2))
  with pytest.raises(AssertionError, match=r"Schedule.grad_slot has shape \(21, 4\), not"):
    pipeline.check_schedule(dataclasses.replace(schedule, grad_slot=schedule.grad_slot[1:]))
  # Float tables and sizes failed raw (IndexError, TypeError) or reached the engine.
  with pytest.raises(
    AssertionError, match=r"Schedule.act_slot must hold integers, got dtype float"
  ):
    pipeline.check_schedule(dataclasses.replace(schedule, act_slot=schedule.act_slot * 1.0))
  with pytest.raises(AssertionError, match=r"Schedule.microbatch must hold integers"):
    pipeline.check_schedule(dataclasses.replace(schedule, microbatch=schedule.microbatch + 0.3))
  for size in ("num_act_slots", "exchange_every"):
    with pytest.raises(
      AssertionError, match=rf"Schedule.{size} must be a positive integer, got 2.0"
    ):
      pipeline.check_schedule(dataclasses.replace(schedule, **{size: 2.0}))


def test_schedule_checks_hold_under_python_optimize():
  # The checks raise, not `assert`: `python -O` must not run a broken table.
  code = (
    "from parstrat import pipeline\n"
    "try:\n"
    "  pipeline.from_csv('0F0,,0B0\\n1F0,1B0,\\n')\n"  # (stage 1 runs with stage 0)
    "except ValueError as e:\n"
    "  print('refused:', e)\n"
  )
  out = subprocess.run(
    [sys.executable, "-O", "-c", code], capture_output=True, text=True, check=True, timeout=120
  )
  assert "refused:" in out.stdout, out.stdout + out.stderr


def test_the_package_holds_no_assert_statement():
  # Every check of the package raises: an `assert` (gone under `python -O`) anywhere,
  # such as one that turned a schedule check back into one, fails here.
  package = pathlib.Path(parstrat.__file__).parent
  found = [
    f"{path.relative_to(package)}:{node.lineno}"
    for path in sorted(package.rglob("*.py"))
    for node in ast.walk(ast.parse(path.read_text()))
    if isinstance(node, ast.Assert)
  ]
  assert not found, found


# ------------------------------------------------------------------------ CLI
def test_cli_draws_the_three_kinds_of_work_and_exports_csv(tmp_path, capsys):
  import matplotlib.image

  from parstrat._src import cli
  from parstrat._src.pipeline import drawing

  png, table = tmp_path / "zb.png", tmp_path / "zb.csv"
  args = ["schedule", "--stages", "4", "--microbatches", "8", "--schedule", "zb_h1"]
  assert cli.main([*args, "--out", str(png), "--csv", str(table)]) == 0
  assert (
    "0.1111 idle share of the tick table, 0.1111 theory (P-1)/(3M+P-1)" in capsys.readouterr().out
  )
  assert pipeline.to_csv(pipeline.build_schedule("zb_h1", 4, 8)) == table.read_text()
  pixels = {
    tuple(p)
    for p in (matplotlib.image.imread(png)[..., :3] * 255).round().astype(int).reshape(-1, 3)
  }
  for colour in (drawing.FORWARD_COLOUR, drawing.INPUT_GRAD_COLOUR, drawing.WEIGHT_GRAD_COLOUR):
    assert tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5)) in pixels, colour

  inter = ["schedule", "--stages", "2", "--microbatches", "4", "--schedule", "interleaved_1f1b"]
  assert cli.main([*inter, "--virtual-stages", "3"]) == 0
  assert "2 devices x 3 virtual stages x 4 microbatches" in capsys.readouterr().out
  assert cli.main([*args[:-1], "gpipe", "--virtual-stages", "2"]) == 2
  assert "virtual_stages=2 needs schedule 'interleaved_1f1b'" in capsys.readouterr().err
  paired = ["schedule", "--stages", "2", "--microbatches", "3", "--exchange-every", "2"]
  assert cli.main([*paired, "--out", str(tmp_path / "k2.png")]) == 0
  out = capsys.readouterr().out
  assert "10 ticks (5 exchanges, one every 2)" in out
  assert "stage 0: F0  . F1  . F2 B0 B1  . B2  ." in out
  assert "in forwards of one stage: 16 recomputing activations, 12 saving them" in out
  with pytest.raises(SystemExit):
    cli.main(["schedule", "--help"])
  assert "(default: 1f1b)" in capsys.readouterr().out


def test_cli_schedule_says_which_file_it_wrote_and_refuses_what_it_cannot_write(tmp_path, capsys):
  from parstrat._src import cli

  args = ["schedule", "--stages", "2", "--microbatches", "4", "--schedule", "interleaved_1f1b"]
  assert (
    cli.main([*args, "--out", str(tmp_path / "timeline"), "--csv", str(tmp_path / "i.csv")]) == 0
  )
  out = capsys.readouterr().out
  assert f"wrote {tmp_path / 'timeline.png'}\n" in out and (tmp_path / "timeline.png").exists()
  # Interleaved exchanges every 2 ticks by default; the CSV cannot say so.
  assert "i.csv (ticks only: read it back with pipeline.from_csv(text, exchange_every=2))" in out
  back = pipeline.from_csv((tmp_path / "i.csv").read_text(), exchange_every=2)
  drawn = pipeline.build_schedule("interleaved_1f1b", 2, 4, virtual_stages=2, exchange_every=2)
  assert back.num_exchanges == drawn.num_exchanges == 12
  for out_arg, message in (
    (tmp_path / "t.txt", "--out: cannot draw into .*t.txt: matplotlib does not write '.txt' files"),
    (tmp_path, "is a directory; give an image file"),
  ):
    assert cli.main([*args, "--out", str(out_arg)]) == 2
    err = capsys.readouterr().err.strip()
    assert re.search(message, err) and "\n" not in err, err
  assert (
    not (tmp_path / "t.txt").exists() and not (tmp_path.parent / f"{tmp_path.name}.png").exists()
  )


def test_lockstep_time_charges_each_tick_its_slowest_pass():
  unit = dict.fromkeys(list(Action)[1:], 1.0)
  for name in ("gpipe", "1f1b", "zb_h1"):
    s = pipeline.build_schedule(name, 4, 8)
    assert s.lockstep_time(unit) == s.num_ticks
    assert s.lockstep_bubble(unit) == pytest.approx(s.bubble_fraction())
  # GPipe's ticks are all forwards, then all backwards (3 forwards each with recompute).
  gpipe = pipeline.build_schedule("gpipe", 4, 8)
  assert gpipe.lockstep_time() == 11 * 1 + 11 * 3
  # 1F1B mixes them: from tick 2 on, some device runs a backward in every tick.
  one_f = pipeline.build_schedule("1f1b", 2, 3)
  assert one_f.lockstep_time() == 1 + 1 + 6 * 3
  assert one_f.lockstep_bubble() > one_f.bubble_fraction()
  # The README's figures at P=4, M=8: the lock-step idle shares under "recompute"
  # (GPipe 0.273, 1F1B 0.448, ZB-H1 and interleaved 0.347) and the table of lock-step
  # times ("recompute", "save") and live microbatches on device 0, K = 1 and 2.
  for name, v, k, times, live, bubble in (
    ("gpipe", 1, 1, (44, 33), 8, 0.273),
    ("1f1b", 1, 1, (58, 40), 4, 0.448),
    ("1f1b", 1, 2, (44, 33), 7, None),
    ("zb_h1", 1, 1, (49, 27), 4, 0.347),
    ("zb_h1", 1, 2, (39, 27), 7, None),
    ("interleaved_1f1b", 2, 1, (49, 34), 11, 0.347),
    ("interleaved_1f1b", 2, 2, (38, 28.5), 11, None),
  ):
    s = pipeline.build_schedule(name, 4, 8, virtual_stages=v, exchange_every=k)
    assert (s.lockstep_time("recompute"), s.lockstep_time("save")) == times, (name, k)
    assert s.max_live_activations()[0] == live, (name, k)
    if bubble is not None:
      assert round(s.lockstep_bubble(), 3) == bubble, (name, k)


# ------------------------------------------------- an exchange every K ticks
def test_every_table_with_an_exchange_every_k_ticks_checks():
  count = 0
  for K in (2, 3):
    for name in ("gpipe", "1f1b", "zb_h1", "interleaved_1f1b"):
      for P in range(1, 7):
        step = P if name == "interleaved_1f1b" else 1  # (M a multiple of P)
        for M in range(step, 13, step):
          s = pipeline.build_schedule(name, P, M, exchange_every=K)
          # Dependencies across stages only after an exchange, one activation and one
          # gradient per device per exchange, every message read from the right slot.
          pipeline.check_schedule(s)
          assert s.exchange_every == K and s.num_ticks == K * s.num_exchanges
          count += 1
  assert count > 300


def test_an_exchange_every_two_ticks_brings_every_schedule_to_gpipes_lockstep_time():
  for P in range(2, 9):
    for M in range(P, 3 * P + 1, P):
      gpipe = pipeline.build_schedule("gpipe", P, M).lockstep_time("save")
      assert gpipe == 3 * (M + P - 1)  # (M + P - 1) (F + B): the hand-written GPipe's
      one_f = pipeline.build_schedule("1f1b", P, M)
      paired = pipeline.build_schedule("1f1b", P, M, exchange_every=2)
      assert one_f.lockstep_time("save") > gpipe  # a tick with one B costs a B everywhere
      assert paired.lockstep_time("save") == gpipe
      assert paired.max_live_activations()[0] == min(2 * P - 1, M)  # not M (GPipe)
      zb = pipeline.build_schedule("zb_h1", P, M).lockstep_time("save")
      assert zb < gpipe
      # ZB-H1 already fills its ticks: pairing them gains nothing.
      assert pipeline.build_schedule("zb_h1", P, M, exchange_every=2).lockstep_time("save") >= zb
      inter = pipeline.build_schedule("interleaved_1f1b", P, M, exchange_every=2)
      assert inter.lockstep_time("save") < gpipe
      assert inter.max_live_activations() == (
        pipeline.build_schedule("interleaved_1f1b", P, M).max_live_activations()
      )
  one_f = pipeline.build_schedule("1f1b", 2, 3, exchange_every=2)
  assert one_f.table().splitlines() == [
    "stage 0: F0  . F1  . F2 B0 B1  . B2  .",
    "stage 1:  .  . F0 B0 F1 B1 F2 B2  .  .",
  ]
  with pytest.raises(ValueError, match=r"Unknown pass costs 'saved'; give a dict or one of"):
    one_f.lockstep_time("saved")
  assert one_f.lockstep_time(None) == one_f.lockstep_time("recompute") == 16
  # Exchanges after ticks 1, 3, ...: at most F + B each: 1 + 3 + 3 + 3 + 2 in all.
  assert one_f.lockstep_time("save") == 1 + 3 + 3 + 3 + 2 == 3 * (3 + 2 - 1)


def test_interleaved_gains_from_two_ticks_per_exchange_at_no_memory_cost():
  # Why `exchange_every` defaults to 2 for "interleaved_1f1b" (and only there: 1F1B
  # pays for it with 2P - 1 live activations, above): never a longer lock-step
  # time, under either pass cost, fewer exchanges, and no more live activations or
  # slots (activation, gradient, residual) on any device.
  for P in (2, 3, 4, 8):
    for M in (P, 2 * P, 4 * P):
      for v in (2, 3, 4):
        one = pipeline.build_schedule("interleaved_1f1b", P, M, virtual_stages=v)
        two = pipeline.build_schedule("interleaved_1f1b", P, M, virtual_stages=v, exchange_every=2)
        for cost in ("recompute", "save"):
          assert two.lockstep_time(cost) <= one.lockstep_time(cost), (P, M, v, cost)
        assert two.num_exchanges < one.num_exchanges
        live = zip(two.max_live_activations(), one.max_live_activations(), strict=True)
        assert all(a <= b for a, b in live)
        assert two.num_act_slots <= one.num_act_slots
        assert two.num_grad_slots <= one.num_grad_slots
        assert two.residual_slots()[1] <= one.residual_slots()[1]
  one = pipeline.build_schedule("interleaved_1f1b", 4, 8)
  two = pipeline.build_schedule("interleaved_1f1b", 4, 8, exchange_every=2)
  assert (one.lockstep_time("recompute"), two.lockstep_time("recompute")) == (49, 38)


def _edit(schedule, moves):
  """`schedule` with ops moved: {(tick, stage): new tick}."""
  action, microbatch = schedule.action.copy(), schedule.microbatch.copy()
  for (t, s), new in moves.items():
    action[new, s], microbatch[new, s] = action[t, s], microbatch[t, s]
    action[t, s], microbatch[t, s] = Action.IDLE, -1
  return type(schedule)(**{**schedule.__dict__, "action": action, "microbatch": microbatch})


def test_check_schedule_catches_a_message_used_before_its_exchange():
  schedule = pipeline.build_schedule("1f1b", 2, 3, exchange_every=2)
  # Stage 1's F0 moved to tick 1, the exchange where stage 0 computes it.
  with pytest.raises(
    AssertionError, match=r"microbatch 0 at tick 1, .* \(it arrives after tick 1\)"
  ):
    pipeline.check_schedule(_edit(schedule, {(2, 1): 1}))
  # Stage 0's F1 moved next to its F0: two activations for one exchange.
  with pytest.raises(AssertionError, match="tick 1: stage 0 sends two activations in one exchange"):
    pipeline.check_schedule(_edit(schedule, {(2, 0): 1}))
  with pytest.raises(ValueError, match="exchange_every must be a positive integer, got 0"):
    pipeline.build_schedule("1f1b", 2, 3, exchange_every=0)
