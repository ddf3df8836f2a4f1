"""The README's Performance tables, rendered from a `benchmarks/run.py` results file.

Usage:
  python benchmarks/readme_tables.py benchmarks/results.json

Prints the row table and the ratio table in the README's Markdown, so that a new
run replaces them without copying numbers by hand. Reads the JSON only (no JAX).
"""

from __future__ import annotations

import argparse
import json
import re

#: The README's names for the benchmark's rows (the rest keep their own).
_ROW_NAMES = {
  "jit, 1 device": "`jax.jit`, 1 device",
  "pmap by hand, 8": "hand-written `jax.pmap`, 8",
  "jit(shard_map) by hand, 8": "hand-written `jit(shard_map)` + `pmean`, 8",
  "FSDP jit by hand, 8": "hand-written FSDP `jit`, 8",
  "shard_map GPipe by hand, P4 M8": "hand-written `shard_map` GPipe, P4 M8",
  "jit(shard_map) by hand, 8 + metrics": "hand-written `jit(shard_map)` + `pmean`, 8, + metrics",
  "FSDP jit by hand, 8 + metrics": "hand-written FSDP `jit`, 8, + metrics",
  "shard_map GPipe by hand, P4 M8 + metrics": "hand-written `shard_map` GPipe, P4 M8, + metrics",
  "FSDP jit by hand, 8, second copy + metrics": (
    "hand-written FSDP `jit`, 8 (timed again as a second row), + metrics"
  ),
  "FSDP jit by hand, 8, under 100,000 replicated + metrics": (
    "hand-written FSDP `jit`, 8, leaves under 100,000 elements replicated, + metrics"
  ),
  "shard_map GPipe by hand, remat dots_saveable, P4 M8 + metrics": (
    "hand-written `shard_map` GPipe, P4 M8, `jax.checkpoint` dots_saveable, + metrics"
  ),
  "shard_map GPipe by hand, remat nothing_saveable, P4 M8 + metrics": (
    "hand-written `shard_map` GPipe, P4 M8, `jax.checkpoint` nothing_saveable, + metrics"
  ),
  "shard_map 2 x GPipe by hand, P4 M4 + metrics": (
    "hand-written `shard_map` 2 x GPipe, P4 M4, + metrics"
  ),
  "shard_map 2 x GPipe by hand, remat nothing_saveable, P4 M4 + metrics": (
    "hand-written `shard_map` 2 x GPipe, P4 M4, `jax.checkpoint` nothing_saveable, + metrics"
  ),
}


def _row_name(name: str) -> str:
  if name in _ROW_NAMES:
    return _ROW_NAMES[name]
  name = re.sub(r", P4 M8$", "", name)
  name = re.sub(r"^(data_parallel|fsdp|pipeline|hybrid 2x4)", r"`\1`", name)
  name = name.replace(" K2", ", `exchange_every=2`")
  name = name.replace(" K1", ", `exchange_every=1`")
  name = name.replace(" unrolled", ", `unroll=True`")
  name = name.replace("`fsdp` replicate_below", "`fsdp` `replicate_below")
  name = name.replace("=100,000, 8", "=100_000`, 8")
  name = name.replace("interleaved_1f1b", "interleaved_1f1b v=2")
  return name


def row_table(strategies: dict) -> str:
  lines = [
    "| | median ms | IQR ms | examples/s | params+opt MiB/device | temp MiB "
    "| bubble: table (theory), lock-step, trace |",
    "| --- | --- | --- | --- | --- | --- | --- |",
  ]
  for name, row in strategies["rows"].items():
    bubble = ""
    if "bubble_scheduled" in row:
      theory = row["bubble_theory"]  # (None where the papers' formula does not hold)
      bubble = (
        f"{row['bubble_scheduled']:.3f} ({'n/a' if theory is None else f'{theory:.3f}'}), "
        f"{row['bubble_lockstep']:.3f}, {row['bubble_measured']:.3f}"
      )
    lines.append(
      f"| {_row_name(name)} | {row['median_s'] * 1e3:.2f} | {row['iqr_s'] * 1e3:.2f} "
      f"| {row['examples_per_s']:,.0f} | {row['param_opt_bytes_per_device'] / 2**20:.2f} "
      f"| {row['temp_bytes'] / 2**20:.2f} | {bubble} |"
    )
  return "\n".join(lines)


def _short(name: str) -> str:
  """A ratio row's name, as the README writes it."""
  name = name.replace(", P4 M8", "").replace(", 8", "").replace(" by hand", "")
  name = name.replace("hybrid 2x4, M4", "hybrid 2x4 M4").replace(
    "hybrid 2x4 save, M4", "hybrid 2x4 save M4"
  )
  return name


def ratio_table(strategies: dict) -> str:
  """parstrat / hand-written: bare, + metrics, same activations or layout (+ metrics)."""
  columns: dict[str, list[str]] = {}
  order: list[str] = []
  for key, ratio in strategies["ratios"].items():
    left, right = key.split(" / ", 1)
    if left.startswith("control:"):
      label, column, text = (
        "control: FSDP jit by hand + metrics, a second copy / FSDP jit",
        1,
        f"{ratio:.3f}",
      )
    else:
      column = (
        2 if ("same activations" in right or "same layout" in right) else int("+ metrics" in right)
      )
      hand = _short(right.split(",")[0].replace(" + metrics", ""))
      label, text = f"{_short(left)} / {hand}", f"{ratio:.2f}"
    if label not in columns:
      columns[label] = ["", "", ""]
      order.append(label)
    columns[label][column] = text
  lines = [
    "| parstrat / hand-written | bare | + metrics "
    "| same activations (pipelines) or layout (fsdp), + metrics |",
    "| --- | --- | --- | --- |",
  ]
  lines += [f"| {label} | " + " | ".join(columns[label]) + " |" for label in order]
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("results", help="a results JSON written by benchmarks/run.py")
  results = json.load(open(parser.parse_args().results))
  print(row_table(results["strategies"]))
  print()
  print(ratio_table(results["strategies"]))


if __name__ == "__main__":
  main()
