"""`.ci/check-outputs.py` (run by `.ci/run`) fails on a committed notebook output holding a traceback or a
developer's absolute path, and passes on clean outputs (issue 43 item 7)."""
import json, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _nb(path: Path, outputs: list) -> Path:
    cells = [{"cell_type": "code", "execution_count": 1, "id": "a", "metadata": {}, "source": "x = 1", "outputs": outputs}]
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


def _check(tmp_path, nb):
    return subprocess.run([sys.executable, str(ROOT / ".ci" / "check-outputs.py"), str(tmp_path), str(nb)],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("output", [
    {"output_type": "stream", "name": "stderr", "text": "Traceback (most recent call last):\n  File x\nRuntimeError: Event loop is closed\n"},
    {"output_type": "error", "ename": "ValueError", "evalue": "bad", "traceback": ["ValueError: bad"]},
    {"output_type": "stream", "name": "stderr", "text": "/home/me/wt-dpo/maxpost/sampling.py:131: UserWarning: x\n"},
    {"output_type": "stream", "name": "stdout", "text": "saved to /work/wt-43/runs/a\n"},
    {"output_type": "stream", "name": "stdout", "text": "run dir /tmp/tmpab12/run\n"},
    {"output_type": "execute_result", "execution_count": 1, "metadata": {},
     "data": {"text/plain": "PosixPath('/Users/x/maxpost_runs')"}},
    {"output_type": "stream", "name": "stderr", "text": "proj/.venv/lib/python3.11/site-packages/tqdm/auto.py:21: TqdmWarning\n"},
])
def test_a_dirty_committed_output_fails(tmp_path, output):
    r = _check(tmp_path, _nb(tmp_path / "dirty.ipynb", [output]))
    assert r.returncode == 1 and "dirty.ipynb: cell 0" in r.stderr, r.stderr


def test_clean_outputs_pass(tmp_path):
    outs = [{"output_type": "stream", "name": "stdout", "text": "loss 0.69 at step 3; run dir maxpost_runs/embedded-dpo\n"},
            {"output_type": "execute_result", "execution_count": 1, "metadata": {}, "data": {"text/plain": "{'a': 1}"}}]
    r = _check(tmp_path, _nb(tmp_path / "clean.ipynb", outs))
    assert r.returncode == 0, r.stderr
