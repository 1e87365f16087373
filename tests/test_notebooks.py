"""Every chapter notebook (not nbs/runs/ or nbs/tutorials/, which have papermill tests) runs through nbdev's
test runner, one process per notebook, with 8 virtual CPU devices. Cells flagged slow/gpu/tpu are skipped."""
import os, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent
NBS = sorted(p for p in (ROOT / "nbs").glob("*.ipynb"))


def test_there_are_chapters():
    assert len(NBS) >= 2, NBS


@pytest.mark.parametrize("nb", NBS, ids=[p.stem for p in NBS])
def test_notebook(nb):
    exe = Path(sys.executable).with_name("nbdev_test")
    r = subprocess.run([str(exe), "--path", str(nb.relative_to(ROOT / "nbs")), "--n_workers", "0"],
                       cwd=ROOT / "nbs", capture_output=True, text=True, timeout=900, env=os.environ.copy())
    assert r.returncode == 0, f"{nb.name} failed:\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}"
