"""README's runnable code blocks run as written: the Quickstart, the config and model files.

Each block is read out of README.md at test time, so an edit that breaks one
fails here. (Fragments that continue an earlier block, such as `memory_budget=`
or `precision=` on a trainer built above, are not run on their own.)
"""

import ast
import pathlib
import re

import numpy as np

from parstrat._src import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _block_after(heading: str, fence: str, first_line: str | None = None) -> str:
  """The first ```fence block after `heading` (whose first line is `first_line`, if given)."""
  section = README[README.index(heading) :]
  for m in re.finditer(rf"^```{fence}\n(.*?)^```$", section, re.MULTILINE | re.DOTALL):
    if first_line is None or m.group(1).startswith(first_line):
      return m.group(1)
  raise AssertionError(f"no ```{fence} block after {heading!r} starting with {first_line!r}")


def test_the_quickstart_runs_as_written_and_its_comments_are_what_it_returns():
  code = _block_after("## Quickstart", "python")
  scope: dict = {}
  exec(code, scope)  # noqa: S102 - the README's own lines
  metrics, params, logits = scope["metrics"], scope["params"], scope["logits"]
  assert np.isfinite(float(metrics["loss"]))
  assert set(params) == {"mlp/~/linear_0", "mlp/~/linear_1"}
  assert logits.shape == (256, 10)
  # The comment after parstrat.available() is the list it returns.
  comment = re.search(r"^parstrat\.available\(\)\s*#\s*(\[.*\])$", code, re.MULTILINE)
  assert comment, "the Quickstart no longer shows parstrat.available()'s result"
  assert scope["parstrat"].available() == ast.literal_eval(comment.group(1))


def test_the_config_file_and_model_file_run_as_written(tmp_path, monkeypatch, capsys):
  toml = _block_after("### Your model, your data, a config file", "toml", "# run.toml")
  model_file = _block_after("### Your model, your data, a config file", "python", "# mymodel.py")
  (tmp_path / "run.toml").write_text(toml)
  (tmp_path / "mymodel.py").write_text(model_file)
  monkeypatch.chdir(tmp_path)
  # The README's command, stopped after 3 of the file's 5 epochs x 64 batches, on the
  # cosine those 320 steps would have (its default length is the run's last step).
  assert cli.main(["train", "--config", "run.toml", "--steps", "3", "--schedule-steps", "320"]) == 0
  out = capsys.readouterr().out
  assert "mesh: data=2 x stage=2" in out, out
  loss = re.search(r"^epoch 1: loss ([0-9.]+) \(mean of 3 steps\)", out, re.MULTILINE)
  assert loss and np.isfinite(float(loss.group(1))), out
  assert (tmp_path / "runs" / "mine" / "report.png").is_file()  # the file's out = "runs/mine"
