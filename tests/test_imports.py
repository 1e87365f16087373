"""The book reads front to back: a module imports only modules of earlier chapters (README's chapter table), so
there is no import circle and no import that climbs back up the book. The order is the notebooks' file names in
`nbs/` (NN_ / NNb_ prefixes sort as the book reads) and each one's `#| default_exp`; every import counts, the lazy
ones inside functions too."""
import ast, json, re
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent
NBS, PKG = ROOT / "nbs", ROOT / "maxpost"


def book_order(nbs: Path = NBS) -> list[str]:
    "The modules the chapters export, in the book's order."
    order = []
    for nb in sorted(nbs.glob("*.ipynb")):
        for c in json.loads(nb.read_text())["cells"]:
            m = re.search(r"#\|\s*default_exp\s+(\S+)", "".join(c["source"])) if c["cell_type"] == "code" else None
            if m:
                order.append(m.group(1)); break
    return order


def imported_modules(source: str, package: str = "maxpost") -> set[str]:
    "The `package` modules that `source` imports anywhere (top level or inside functions), absolute or relative."
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith(package + ".")}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module: out.add(node.module.split(".")[0])
            elif node.level == 1: out |= {a.name for a in node.names}                # from . import sharding
            elif node.module == package: out |= {a.name for a in node.names}         # from maxpost import lora
            elif node.module and node.module.startswith(package + "."): out.add(node.module.split(".")[1])
    return out


def climbing_imports(pkg: Path = PKG, order: list[str] | None = None) -> list[str]:
    "'a imports b' for every module a that imports a module b of the same or a later chapter."
    order = order or book_order()
    rank = {m: i for i, m in enumerate(order)}
    bad = []
    for f in sorted(pkg.glob("*.py")):
        if f.stem not in rank: continue
        for m in sorted(imported_modules(f.read_text())):
            if m in rank and rank[m] >= rank[f.stem]: bad.append(f"{f.stem} ({order.index(f.stem)}) imports {m} ({rank[m]})")
    return bad


def test_imports_parse_every_form():
    src = ("from .a import x\nfrom . import b, c\nimport maxpost.d\nfrom maxpost.e import y\nfrom maxpost import f\n"
           "def g():\n    from maxpost.h import z\n    import os\n")
    assert imported_modules(src) == set("abcdefh")


def test_book_order_covers_every_module():
    order = book_order()
    assert len(order) == len(set(order)), f"two chapters export the same module: {order}"
    missing = [f.stem for f in PKG.glob("*.py") if not f.stem.startswith("_") and f.stem not in order]
    assert not missing, f"modules no chapter exports: {missing}"


def test_no_import_climbs_back():
    bad = climbing_imports()
    assert not bad, "imports that climb back up the book (move the code, or the name, to the earlier chapter):\n" + "\n".join(bad)
