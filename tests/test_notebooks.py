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


# ---- the papermill notebooks (nbs/runs/, nbs/tutorials/) as committed

import ast, json, re

PAPERMILL_NBS = sorted((ROOT / "nbs" / "runs").glob("*.ipynb")) + sorted((ROOT / "nbs" / "tutorials").glob("*.ipynb"))


def _cells(nb):
    return json.loads(nb.read_text())["cells"]


@pytest.mark.parametrize("nb", PAPERMILL_NBS, ids=[p.stem for p in PAPERMILL_NBS])
def test_papermill_notebook_is_committed_clean(nb):
    """No `injected-parameters` cell (opened in Jupyter it would override the parameters cell) and no temporary
    directory of the machine that executed it in the outputs (.ci/execute-notebooks.py strips both)."""
    cells = _cells(nb)
    assert not [c for c in cells if "injected-parameters" in c["metadata"].get("tags", [])], \
        f"{nb.name} holds papermill's injected-parameters cell"
    outputs = json.dumps([c.get("outputs", []) for c in cells if c["cell_type"] == "code"])
    assert not re.findall(r"/tmp/tmp\w+", outputs), f"{nb.name}'s outputs name a temporary directory"


@pytest.mark.parametrize("nb", PAPERMILL_NBS, ids=[p.stem for p in PAPERMILL_NBS])
def test_papermill_reads_every_parameter(nb, caplog):
    """papermill finds every name the parameters cell assigns (found here by Python's own parser), with no line it
    cannot parse: a parameter it cannot read is reported as unknown when a user passes it with -p."""
    import logging, papermill
    cell = next(c for c in _cells(nb) if "parameters" in c["metadata"].get("tags", []))
    assigned = [t.id for node in ast.parse("".join(cell["source"])).body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)]
    with caplog.at_level(logging.WARNING, logger="papermill"):
        found = papermill.inspect_notebook(str(nb))
    assert not [r for r in caplog.records if "Unable to parse" in r.getMessage()], \
        [r.getMessage() for r in caplog.records]
    assert list(found) == assigned


@pytest.mark.parametrize("nb", ["sft", "rl"])
def test_a_misspelt_papermill_parameter_stops_the_run(nb, tmp_path):
    """`-p stepz 3` is not papermill's warning and a run with the defaults: the run notebook stops before training,
    with the configuration's error naming the key it resembles."""
    import papermill
    with pytest.raises(papermill.PapermillExecutionError) as e:
        papermill.execute_notebook(str(ROOT / "nbs" / "runs" / f"{nb}.ipynb"), str(tmp_path / "out.ipynb"),
                                   parameters={"stepz": 3, "base_output_directory": str(tmp_path / "runs")},
                                   cwd=str(tmp_path), kernel_name="python3", progress_bar=False)
    assert e.value.ename == "ConfigError" and "unknown key 'stepz'" in e.value.evalue and "'steps'" in e.value.evalue
    assert not (tmp_path / "runs").exists()      # nothing was trained or written
