"""Issue 49 ("The first hour, round 4"): the faults a fault probe found, each in its general form, and what a newcomer
reads first (`--help`, the configs' comments). Each test fails on the code before the fix."""
import json, math, os, subprocess, sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")


def cli(*args, cwd=None, env=None):
    code = "import sys\nfrom maxpost.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=env or ENV, timeout=600)


def one_line_error(r, code=2):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-3000:])
    return lines[0]


# --- metrics.jsonl is JSON for strict readers -------------------------------------------------------------------

def strict_loads(line: str):
    "A strict JSON reader (as jq or JavaScript's JSON.parse): NaN / Infinity are not JSON."
    def refuse(name): raise ValueError(f"{name} is not JSON")
    return json.loads(line, parse_constant=refuse)


def test_metrics_jsonl_is_strict_json_with_non_finite_values(tmp_path):
    """A logged inf or NaN (every episode failing makes a mean of nothing) is written so that a strict reader parses
    every line; the finite values are kept as they were and the non-finite ones read as null."""
    from maxpost.rundir import MetricsLogger, read_metrics
    log = MetricsLogger(tmp_path, total_steps=2, progress=False)
    log.log(1, {"loss": 0.5, "reward": float("inf"), "kl": float("nan"), "neg": -float("inf"), "n": 3})
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    recs = [strict_loads(l) for l in lines]
    assert recs == [{"step": 1, "kind": "train", "loss": 0.5, "reward": None, "kl": None, "neg": None, "n": 3}]
    assert read_metrics(tmp_path) == recs
    MetricsLogger(tmp_path, total_steps=2, initial_step=1, progress=False).close()   # a resume rewrites the file
    assert [strict_loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == recs
