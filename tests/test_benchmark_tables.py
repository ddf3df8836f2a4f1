"""The README's benchmark tables are those of the results files in `benchmarks/`."""

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


def test_the_readme_shows_the_13_core_runs_ratio_table():
  # `benchmarks/results_13_cores.json`: the latest run on the 13-core host, whose ratio
  # table the README shows inside the list of runs (indented two spaces).
  tables = benchmark_module("readme_tables")
  results = json.loads((ROOT / "benchmarks" / "results_13_cores.json").read_text())
  table = tables.ratio_table(results["strategies"])
  indented = "\n".join("  " + line for line in table.splitlines())
  assert indented in (ROOT / "README.md").read_text()
