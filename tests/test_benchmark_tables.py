"""The README's benchmark tables are those of `benchmarks/results.json`."""

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_tables():
  spec = importlib.util.spec_from_file_location(
    "readme_tables", ROOT / "benchmarks" / "readme_tables.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_readme_shows_the_latest_run_in_benchmarks_results_json():
  tables = _readme_tables()
  strategies = json.loads((ROOT / "benchmarks" / "results.json").read_text())["strategies"]
  readme = (ROOT / "README.md").read_text()
  for table in (tables.row_table(strategies), tables.ratio_table(strategies)):
    assert table in readme, table.splitlines()[2]
