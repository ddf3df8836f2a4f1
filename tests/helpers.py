"""Models and data shared by the tests."""

import importlib.util
import pathlib

import haiku as hk
import jax

#: The seed's MLP: 784 -> 512 -> 10, swish.
SEED_MLP = hk.transform(lambda x: hk.nets.MLP([512, 10], activation=jax.nn.swish)(x))

#: A deeper MLP with unequal widths: 8 layers, so it splits into 2, 4 or 8 stages.
DEEP_WIDTHS = [96, 64, 80, 48, 64, 32, 40, 10]
DEEP_MLP = hk.transform(lambda x: hk.nets.MLP(DEEP_WIDTHS, activation=jax.nn.swish)(x))


def mlp(widths):
  return hk.transform(lambda x: hk.nets.MLP(widths, activation=jax.nn.swish)(x))


def benchmark_module(name):
  """`benchmarks/<name>.py` as a module (the benchmarks folder is not a package)."""
  path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
