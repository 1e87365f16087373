"""The benchmark scripts are code users run (bench/README.md gives their commands): each one at least parses.

A merge once left three of them with an import at column 0 inside a function (an IndentationError at start-up) and no
test ran them; compiling every script catches that class of break in milliseconds."""
import py_compile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "bench").rglob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[str(p.relative_to(ROOT)) for p in SCRIPTS])
def test_bench_script_parses(script, tmp_path):
    py_compile.compile(str(script), cfile=str(tmp_path / "x.pyc"), doraise=True)
