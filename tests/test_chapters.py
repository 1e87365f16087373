"""The chapters read like fastcore's own notebooks: every public name of a module is used by a check cell (a cell
that is not exported) of its notebook, so the notebook documents what it exports; the cell that sets the virtual
device count is hidden; every chapter is listed on the book's front page."""
import json, re
from pathlib import Path
import pytest

NBS = Path(__file__).resolve().parent.parent / "nbs"


def cells(nb):
    return [(c["cell_type"], "".join(c["source"])) for c in json.loads(nb.read_text())["cells"]]


def module_of(nb):
    m = next((re.search(r"#\|\s*default_exp\s+(\S+)", s) for t, s in cells(nb) if t == "code" and "default_exp" in s), None)
    return m.group(1) if m else None


CHAPTERS = [nb for nb in sorted(NBS.glob("*.ipynb")) if module_of(nb)]


def exported_names(nb):
    "The names `nbdev` puts in the module's __all__: top-level defs, classes and assignments of exported cells."
    names = []
    for t, s in cells(nb):
        if t != "code" or not re.match(r"\s*#\|\s*export\s*$", s.splitlines()[0] if s else ""): continue
        for line in s.splitlines():
            m = re.match(r"(?:def|class)\s+([A-Za-z]\w*)|([A-Z][A-Z0-9_]*)\s*(?::[^=]+)?=", line)
            if m and not (m.group(1) or m.group(2)).startswith("_"): names.append(m.group(1) or m.group(2))
    return names


@pytest.mark.parametrize("nb", CHAPTERS, ids=[nb.stem for nb in CHAPTERS])
def test_every_public_name_has_a_check(nb):
    checks = "\n".join(s for t, s in cells(nb) if t == "code" and "#| export" not in s and "#| default_exp" not in s)
    missing = [n for n in exported_names(nb) if not re.search(rf"\b{re.escape(n)}\b", checks)]
    assert not missing, f"{nb.name}: public names without a check cell that uses them: {missing}"


@pytest.mark.parametrize("nb", sorted(NBS.glob("*.ipynb")), ids=[nb.stem for nb in sorted(NBS.glob("*.ipynb"))])
def test_setup_cell_is_hidden(nb):
    for t, s in cells(nb):
        if t == "code" and "xla_force_host_platform_device_count" in s:
            assert s.lstrip().startswith("#| hide"), f"{nb.name}: the device-count setup cell is shown:\n{s}"


def test_front_page_lists_every_chapter():
    front = (NBS / "index.ipynb").read_text()
    missing = [nb.name for nb in CHAPTERS if f"({nb.name})" not in front]
    assert not missing, f"index.ipynb does not link {missing}"


BOOK = sorted(NBS.glob("*.ipynb")) + sorted((NBS / "runs").glob("*.ipynb")) + sorted((NBS / "tutorials").glob("*.ipynb"))


@pytest.mark.parametrize("nb", BOOK, ids=[nb.stem for nb in BOOK])
def test_committed_with_outputs(nb):
    "A reader on GitHub sees what the book printed: every notebook is committed executed (.ci/execute-notebooks.py)."
    nbj = json.loads(nb.read_text())
    assert any(c.get("outputs") for c in nbj["cells"] if c["cell_type"] == "code"), \
        f"{nb.name} has no outputs: run .ci/execute-notebooks.py {nb.relative_to(NBS.parent)} and commit it"
