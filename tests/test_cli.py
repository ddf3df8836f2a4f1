import json
import os
import subprocess
import sys

import pytest

import parstrat
from parstrat._src import cli

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _run(*args, timeout=300):
  return subprocess.run(
    [sys.executable, "-m", "parstrat", *args],
    capture_output=True,
    check=False,
    text=True,
    timeout=timeout,
    env=ENV,
  )


def test_train_end_to_end_on_the_sample():
  out = _run(
    "train",
    "--strategy",
    "data_parallel",
    "--epochs",
    "2",
    "--batch-size",
    "400",
    "--source",
    "sample",
    "--no-progress",
  )
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert "data: Dataset(sample: 8000 train, 2000 eval)" in lines
  assert any(line.startswith("epoch 2: loss") for line in lines)
  accuracy = next(float(x.split()[2]) for x in lines if x.startswith("eval accuracy:"))
  assert accuracy > 0.85
  assert "mesh: {'data': 8}" in lines
  assert any("examples/s" in line for line in lines)


def test_train_pipeline_prints_its_plan(capsys):
  # In this process (the `python -m parstrat` entry point runs in the tests above and below).
  code = cli.main(
    ["train", "--strategy", "pipeline", "--stages", "2", "--microbatches", "4", "--epochs", "1",
     "--steps", "1", "--hidden", "64", "--batch-size", "64", "--source", "sample", "--no-progress"]
  )  # fmt: skip
  out = capsys.readouterr().out
  assert code == 0
  assert "pipeline plan: 2 stages, cut by balanced params" in out
  assert "mesh: {'data': 1, 'stage': 2}" in out


def test_schedule_draws_a_png(tmp_path, capsys):
  png = tmp_path / "schedule.png"
  code = cli.main(
    ["schedule", "--stages", "4", "--microbatches", "8", "--schedule", "1f1b", "--out", str(png)]
  )
  out = capsys.readouterr().out
  assert code == 0
  assert "bubble fraction: 0.2727 idle share of the tick table, 0.2727 theory (P-1)/(M+P-1)" in out
  assert "in forwards of one stage: 58 recomputing activations, 40 saving them" in out
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_schedule_draws_what_the_strategies_run(capsys):
  # interleaved_1f1b exchanges every two ticks unless told otherwise, as the strategies
  # run it; its header then gives the lock-step bubbles beside the ticks' idle share.
  base = ["schedule", "--stages", "4", "--microbatches", "8", "--schedule", "interleaved_1f1b"]
  for extra, header in [
    ([], "52 ticks (26 exchanges, one every 2), bubble 0.385 of the ticks, 0.158 / 0.158 "),
    (["--exchange-every", "1"], "38 ticks, bubble 0.158 (theory (P-1)/(vM+P-1) = 0.158)"),
  ]:
    assert cli.main([*base, *extra]) == 0
    assert header in capsys.readouterr().out


def test_schedule_into_a_closed_pipe_writes_its_csv_without_a_traceback(tmp_path):
  # `parstrat schedule ... --csv X | head`: printing first lost the CSV to a traceback.
  csv = tmp_path / "s.csv"
  with subprocess.Popen(
    [sys.executable, "-m", "parstrat", "schedule", "--stages", "4", "--microbatches", "8",
     "--schedule", "1f1b", "--csv", str(csv)],
    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV,
  ) as process:  # fmt: skip
    process.stdout.close()  # the reader is gone before the first line
    err = process.stderr.read().decode()
    code = process.wait(timeout=300)
  assert code == 141 and err == ""  # no traceback, no "Exception ignored" at exit
  assert csv.read_text().splitlines()[0].startswith("0F0,0F1,0F2,0F3,")


@pytest.mark.parametrize(
  "args, message",
  [
    (["train", "--strategy", "nope"], "Unknown strategy 'nope'"),
    (
      ["train", "--compare", "data_parallel,fsdp,data_parallel"],
      "--compare names data_parallel twice: name each strategy once",
    ),
    (["train", "--devices", "16"], "--devices 16: only 8 cpu devices are available"),
    (["train", "--strategy", "pipeline", "--stages", "16"], "needs 16 devices, but only 8"),
    (
      ["train", "--strategy", "data_parallel", "--stages", "2"],
      # (named by the flag given: "its options are devices, debug, data" named fields)
      "--stages 2: data_parallel has no option 'stages' (it takes --devices, "
      "--strategy-option debug=VALUE, --data-parallel)",
    ),
    (["train", "--no-unroll"], "--no-unroll: data_parallel has no option 'unroll'"),
    (["train", "--strategy-option", "zero=02"], "--strategy-option zero=02: data_parallel has"),
    (["schedule", "--stages", "2", "--microbatches", "2", "--schedule", "1f1b"], None),
    # `--checkpoint-dir "$CKPT"` with CKPT unset trained and saved nothing, without a word.
    (["train", "--checkpoint-dir", "", "--overwrite"], "--checkpoint-dir is an empty path ('':"),
    (["train", "--out", " "], "--out is an empty path (' ':"),
    (["train", "--metrics", ""], "--metrics is an empty path"),
    # (a traceback before; with several processes, the others' too, in their collective)
    (["train", "--metrics", f"{'a' * 300}/m.jsonl"], "cannot check the paths given: [Errno 36]"),
    (["schedule", "--stages", "2", "--microbatches", "2", "--csv", ""], "--csv is an empty path"),
  ],
)
def test_errors_are_one_line_with_exit_code_2(args, message, capsys, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # (a run the empty paths let through writes here)
  code = cli.main(args)
  err = capsys.readouterr().err
  if message is None:
    assert code == 0
    return
  assert code == 2
  assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_metrics_file_the_run_must_not_replace_is_refused_before_anything_runs(
  tmp_path, monkeypatch, capsys
):
  # --metrics was written through a rename over whatever the path held: another run's
  # metrics, the run's own config or model file, a link's target (the link became a file).
  monkeypatch.chdir(tmp_path)
  (tmp_path / "old.jsonl").write_text('{"step": 1, "loss": 2.3}\n')
  (tmp_path / "run.toml").write_text('metrics = "run.toml"\n')
  (tmp_path / "mine.py").write_text("def model(): ...\n")
  (tmp_path / "link.jsonl").symlink_to(tmp_path / "old.jsonl")
  before = {p: p.read_bytes() for p in tmp_path.iterdir()}
  cases = [
    (["--metrics", "old.jsonl"], "--metrics old.jsonl already holds metrics (another run's?): "
     "pass --overwrite to replace it"),
    (["--metrics", "old.jsonl", "--checkpoint-dir", "ck"], "or --resume to continue it"),
    (["--config", "run.toml"], "--metrics run.toml is the --config file: give the metrics"),
    (["--metrics", "mine.py", "--model-fn", "mine.py:model", "--overwrite"],
     "--metrics mine.py is the --model-fn file"),
    (["--metrics", "mine.py", "--model-fn", "mine:model", "--overwrite"],  # (as a module)
     "--metrics mine.py is the --model-fn file"),
    (["--metrics", "mine.py", "--dataset", "mine:data", "--overwrite"],
     "--metrics mine.py is the --dataset file"),
    (["--metrics", "mine.py", "--import", "mine", "--overwrite"],
     "--metrics mine.py is the --import file"),
    (["--metrics", "ck/report.png", "--checkpoint-dir", "ck"],  # (drawn there without --out)
     "--metrics ck/report.png is the report picture"),
    (["--metrics", "link.jsonl", "--overwrite"], "--metrics link.jsonl is not a plain file"),
    (["--metrics", "o/report.png", "--out", "o"], "--metrics o/report.png is the report picture"),
    (["--metrics", "new/"], "--metrics new/ is a directory; give a file name"),
    (["--metrics", "ck/2", "--checkpoint-dir", "ck"],  # (its save failed after training)
     "--metrics ck/2 is where --checkpoint-dir saves step 2: give the metrics another name"),
    (["--compare", "data_parallel,fsdp", "--metrics", "old.jsonl"],  # (m.<name>.jsonl each)
     "--metrics old.fsdp.jsonl already holds metrics"),
  ]  # fmt: skip
  (tmp_path / "o").mkdir()
  (tmp_path / "ck").mkdir()
  (tmp_path / "old.fsdp.jsonl").write_text('{"step": 1}\n')
  for args, message in cases:
    assert cli.main(["train", *args]) == 2, args
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, (args, err)
  assert {p: p.read_bytes() for p in before} == before
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
    [*(p.name for p in before), "o", "ck", "old.fsdp.jsonl"]
  )


def test_an_empty_path_in_a_config_file_is_named_with_the_file(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "run.toml").write_text('checkpoint-dir = ""\n')
  assert cli.main(["train", "--config", "run.toml", "--overwrite"]) == 2
  assert (  # (as the file writes it, once: no "('': an unset variable?)" after it)
    'parstrat train: error: run.toml: checkpoint-dir = "": --checkpoint-dir is an empty path; '
    "give one, or leave the key out\n" == capsys.readouterr().err
  )
  assert list(tmp_path.iterdir()) == [tmp_path / "run.toml"]
  # A job's config file with resume-if-exists, and --resume given by hand: both named.
  (tmp_path / "run.toml").write_text('checkpoint-dir = "ckpt"\nresume-if-exists = true\n')
  assert cli.main(["train", "--config", "run.toml", "--resume"]) == 2
  assert (
    "--resume-if-exists (set in run.toml) with --resume: it resumes where there is a "
    "checkpoint: drop --resume" in capsys.readouterr().err
  )
  assert list(tmp_path.iterdir()) == [tmp_path / "run.toml"]


@pytest.mark.parametrize(
  "args, message",
  [
    (["train", "--epochs", "0"], "expected a positive"),
    (["train", "--lr", "-1"], "expected a positive"),
    (["train", "--batch-size", "x"], "expected a positive"),
    # (an OverflowError's traceback from jax.random.key; 2**32 trained as seed 0)
    (["train", "--seed", str(2**64)], "--seed: expected an integer from 0 to 4294967295, got"),
    (
      ["train", "--seed", str(2**32)],
      "(a JAX key keeps 32 bits of it without 64-bit mode: it would",
    ),
  ],
)
def test_argument_errors_exit_2(args, message, capsys):
  with pytest.raises(SystemExit) as info:
    cli.main(args)
  assert info.value.code == 2
  assert message in capsys.readouterr().err


def test_list_shows_every_strategy_with_axes(capsys):
  assert cli.main(["list"]) == 0
  out = capsys.readouterr().out
  assert "data_parallel    axes: data" in out
  assert "pipeline         axes: stage" in out
  assert "hybrid           axes: data, stage, model" in out
  assert "fsdp             axes: data" in out
  assert "tensor           axes: model" in out
  assert "auto             axes: chosen" in out


def test_list_imports_strategies_of_ones_own(tmp_path, capsys):
  mine = tmp_path / "my_strategies.py"
  mine.write_text(
    "import parstrat\n\n"
    "@parstrat.register('my_own_two_level_data_parallel')\n"
    "class Mine(parstrat.DataParallel):\n"
    '  """Data parallelism of my own."""\n'
  )
  try:
    assert cli.main(["list", "--import", str(mine)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (
      "my_own_two_level_data_parallel axes: data                 Data parallelism of my own."
      in (lines)
    )
    assert len({line.index(" axes: ") for line in lines}) == 1  # (a long name: columns aligned)
    assert (
      cli.main(["train", "--import", str(mine), "--strategy", "my_own_two_level_data_paralel"]) == 2
    )
    assert f"(--import {mine} registered no such name.)" in capsys.readouterr().err
  finally:
    parstrat.unregister("my_own_two_level_data_parallel")


def test_train_auto_prints_its_choice(capsys):
  common = ["train", "--strategy", "auto", "--devices", "2", "--hidden", "64", "--source",
            "sample", "--batch-size", "64", "--no-progress"]  # fmt: skip
  code = cli.main(
    [*common, "--steps", "2", "--epochs", "1", "--precision", "mixed_bfloat16", "--accumulate", "2",
     "--stages", "2", "--unroll"]  # (flags auto does not take: named, not silently dropped)
  )  # fmt: skip
  out = capsys.readouterr().out
  assert code == 0
  assert "auto chooses the mesh and pipeline options itself; not used: --stages 2, --unroll" in out
  assert "parstrat auto: 8 candidates, memory budget none per device" in out
  labels = ("data_parallel [data=2]", "fsdp zero=1 [data=2]", "tensor [model=2]")
  for label in (*labels, "pipeline [stage=2]", "pipeline activations=save [stage=2]"):
    assert label in out
  assert "chose " in out and "eval accuracy" in out


def test_compare_writes_metrics_and_one_picture_where_the_runs_agree(tmp_path, capsys):
  code = cli.main(
    ["train", "--compare", "data_parallel,pipeline,hybrid", "--data-parallel", "2", "--stages", "2",
     "--hidden", "64", "64", "--epochs", "1", "--steps", "4", "--batch-size", "64",
     "--source", "sample", "--no-progress", "--out", str(tmp_path)]
  )  # fmt: skip
  assert code == 0, capsys.readouterr().err
  assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG"
  losses = {}
  for name in ("data_parallel", "pipeline", "hybrid"):
    rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    losses[name] = [r["loss"] for r in rows if "loss" in r]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert all(r["examples_per_s"] > 0 for r in rows if "loss" in r)
    assert 0.0 <= [r for r in rows if "eval_accuracy" in r][0]["eval_accuracy"] <= 1.0
  assert losses["pipeline"] == pytest.approx(losses["data_parallel"], rel=1e-5)
  assert losses["hybrid"] == pytest.approx(losses["data_parallel"], rel=1e-5)


@pytest.mark.parametrize(
  "flags, message",
  [
    (["--stages", "3"], "stages=3 exceeds the model's 2 layers"),
    (
      ["--stages", "2", "--microbatches", "3"],
      "--batch-size 64: The batch size of the global batch must be a positive multiple of 3",
    ),
  ],  # fmt: skip
  ids=["too many stages", "a batch it cannot split"],
)
def test_compare_checks_every_strategy_before_the_first_trains(flags, message, tmp_path, capsys):
  # The first strategy trained to the end (hours, on a real run) before the second one's
  # layout was refused, and the same command was then refused: "--out holds another run".
  code = cli.main(
    ["train", "--compare", "data_parallel,pipeline", *flags, "--hidden", "64", "--epochs", "1",
     "--steps", "2", "--batch-size", "64", "--source", "sample", "--no-progress",
     "--out", str(tmp_path / "o")]
  )  # fmt: skip
  out, err = capsys.readouterr()
  assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
  assert "epoch" not in out and not list(tmp_path.rglob("metrics.jsonl")), out
  assert not (tmp_path / "o").exists()  # (checked before --out is made)


def test_a_run_refused_at_its_start_leaves_no_empty_folder(tmp_path, capsys):
  # --out's folders were made before the trainer's checks, and stayed, empty; a folder
  # that was there before stays.
  (tmp_path / "runs").mkdir()
  code = cli.main(
    ["train", "--strategy", "pipeline", "--stages", "2", "--microbatches", "3",
     "--hidden", "64", "--batch-size", "64", "--source", "sample", "--no-progress",
     "--out", str(tmp_path / "runs" / "mine")]
  )  # fmt: skip
  assert code == 2 and "must be a positive multiple of 3" in capsys.readouterr().err
  assert list(tmp_path.rglob("*")) == [tmp_path / "runs"]


def test_same_flags_print_the_same_losses():
  args = ("train", "--epochs", "1", "--steps", "3", "--batch-size", "64", "--source", "sample",
          "--no-progress", "--hidden", "64")  # fmt: skip
  first, second = _run(*args), _run(*args)
  assert first.returncode == 0 and second.returncode == 0
  pick = lambda text: [x for x in text.splitlines() if x.startswith(("epoch", "eval"))]  # noqa: E731
  assert pick(first.stdout) and pick(first.stdout) == pick(second.stdout)


def test_train_fsdp_replicate_below_keeps_small_leaves_whole(capsys):
  code = cli.main(
    ["train", "--strategy", "fsdp", "--replicate-below", "1000", "--devices", "2",
     "--hidden", "64", "--source", "sample", "--batch-size", "64", "--steps", "2",
     "--epochs", "1", "--no-progress"]
  )  # fmt: skip
  out = capsys.readouterr().out
  assert code == 0
  # 784x64 split; the 64-wide bias, the 64x10 weight (640 elements) and the 10-wide bias whole.
  assert (
    "ZeRO-3: params, gradients and optimizer state of 1 of 4 parameter leaves sharded over "
    "'data' (under 1000 elements: replicated); batch split"
  ) in out
  with pytest.raises(SystemExit) as info:
    cli.main(["train", "--strategy", "fsdp", "--replicate-below", "-1"])
  assert info.value.code == 2
  assert "--replicate-below: expected an integer >= 0, got -1" in capsys.readouterr().err
