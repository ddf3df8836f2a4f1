"""The README's benchmark tables are those of `benchmarks/results.json`."""

import json
import pathlib

from helpers import benchmark_module

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_readme_shows_the_latest_run_in_benchmarks_results_json():
  tables = benchmark_module("readme_tables")
  strategies = json.loads((ROOT / "benchmarks" / "results.json").read_text())["strategies"]
  readme = (ROOT / "README.md").read_text()
  for table in (tables.row_table(strategies), tables.ratio_table(strategies)):
    assert table in readme, table.splitlines()[2]
