"""Every test the README names as evidence exists: a renamed or removed test is a broken claim."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _defined_tests() -> dict[str, set[str]]:
  return {
    path.name: set(re.findall(r"^\s*def (test_\w+)\(", path.read_text(), re.MULTILINE))
    for path in (ROOT / "tests").glob("test_*.py")
  }


def test_every_test_the_readme_names_is_defined():
  defined = _defined_tests()
  everywhere = set().union(*defined.values())
  modules = {name.removesuffix(".py") for name in defined}
  named = set(re.findall(r"\b(test_\w+)", README)) - modules
  assert named, "the README names no tests"
  assert sorted(named - everywhere) == []
  # A file named with or without "tests/" holds the test named after it.
  for module, name in re.findall(r"\b(test_\w+\.py)::\s*(test_\w+)", README):
    assert module in defined, module
    assert name in defined[module], f"tests/{module}::{name}"


def test_every_parametrized_test_id_the_readme_names_is_collected(request):
  found = re.findall(r"tests/test_\w+\.py::\s*test_\w+\[[^\]\s`]+\]", README)
  ids = sorted({re.sub(r"\s", "", x) for x in found})  # (an ID may wrap after "::")
  assert ids
  # The IDs this session collected count (a run of the whole suite collects every test,
  # in each xdist worker too); those it did not (a run of this file alone, a -k, a
  # root elsewhere) are collected by a pytest of their own, as the README's reader would.
  collected = {item.nodeid for item in request.session.items}
  missing = [i for i in ids if i not in collected]
  stdout = ""
  if missing:
    out = subprocess.run(
      [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
       *missing],
      cwd=ROOT,
      check=False,
      capture_output=True,
      text=True,
      timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    stdout = out.stdout
    collected |= set(stdout.split())
  assert [i for i in ids if i not in collected] == [], stdout[-3000:]
