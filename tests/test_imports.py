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


def _named_module(s, package: str) -> str | None:
    "The module a string names as `package.mod` or `package.mod:NAME` (what `importlib` would load), else None."
    m = re.fullmatch(rf"{package}\.(\w+)(\.\w+)*(:\w+)?", s) if isinstance(s, str) else None
    return m.group(1) if m else None


def imported_modules(source: str, package: str = "maxpost") -> set[str]:
    "The `package` modules that `source` imports anywhere (top level or inside functions), absolute or relative, and those it names for a later import: `importlib.import_module(...)` / `__import__(...)` calls and `\"package.mod:NAME\"` strings."
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and (m := _named_module(node.value, package)): out.add(m)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and (
                getattr(node.func, "attr", None) == "import_module" or getattr(node.func, "id", None) in ("import_module", "__import__")):
            if (m := _named_module(str(node.args[0].value), package)): out.add(m)
            elif node.args[0].value == package or str(node.args[0].value).startswith("."): out.add(str(node.args[0].value).lstrip("."))
        elif isinstance(node, ast.Import):
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
        for m in sorted(imported_modules(f.read_text()) - {f.stem}):   # a module naming itself (to pickle by reference) is no arrow
            if m in rank and rank[m] >= rank[f.stem]: bad.append(f"{f.stem} ({order.index(f.stem)}) imports {m} ({rank[m]})")
    return bad


def test_imports_parse_every_form():
    src = ("from .a import x\nfrom . import b, c\nimport maxpost.d\nfrom maxpost.e import y\nfrom maxpost import f\n"
           "def g():\n    from maxpost.h import z\n    import os\n")
    assert imported_modules(src) == set("abcdefh")
    named = ('import importlib\nx = importlib.import_module("maxpost.rl")\ny = key(choices="maxpost.model:WORDS")\n'
             'z = "see maxpost.lora.add_lora in the docs"\n')
    assert imported_modules(named) == {"rl", "model"}    # prose that mentions a module is not an import


def test_a_climbing_import_is_caught(tmp_path):
    "The check fails on an arrow back up the book, in each of the forms it reads (planted in a copy of two modules)."
    order = book_order()
    low, high = order[0], order[-1]
    for form in (f"from maxpost.{high} import main", f"import importlib\nimportlib.import_module('maxpost.{high}')",
                 f"WORDS = 'maxpost.{high}:KINDS'"):
        (tmp_path / f"{low}.py").write_text(form + "\n")
        assert climbing_imports(tmp_path, order) == [f"{low} (0) imports {high} ({len(order) - 1})"], form


def test_book_order_covers_every_module():
    order = book_order()
    assert len(order) == len(set(order)), f"two chapters export the same module: {order}"
    missing = [f.stem for f in PKG.glob("*.py") if not f.stem.startswith("_") and f.stem not in order]
    assert not missing, f"modules no chapter exports: {missing}"


def test_no_import_climbs_back():
    bad = climbing_imports()
    assert not bad, "imports that climb back up the book (move the code, or the name, to the earlier chapter):\n" + "\n".join(bad)


def test_kinds_are_found_below_the_cli():
    "`maxpost.cli` names every kind's module in its table `KIND_MODULES` (constant strings, so each is an arrow cli -> kind that the book-order check reads): every kind's chapter comes before the cli's, and each module of the table registers the kinds it is listed for."
    from maxpost.cli import KIND_MODULES, load_kinds
    order, kinds = book_order(), load_kinds()
    modules = {m.split(".")[1] for ms in KIND_MODULES.values() for m in ms}
    assert {"sft", "rl", "async_rl", "dpo", "distill", "eval_command"} <= modules, modules
    assert all(order.index(k) < order.index("cli") for k in modules), [k for k in modules if order.index(k) >= order.index("cli")]
    for name, (first, *_) in KIND_MODULES.items():   # the kind's own module first: the one that registers it
        assert kinds[name].main.__module__ == first, (name, kinds[name].main.__module__)


def computed_imports(source: str, package: str = "maxpost") -> int:
    "How many imports of a `package` module `source` computes: `import_module` / `__import__` given an f-string or a `+` that starts `package.` (such an import can reach any module, so no constant tells the book-order check which)."
    def starts_package(node) -> bool:
        if isinstance(node, ast.JoinedStr): node = node.values[0] if node.values else None
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add): return starts_package(node.left)
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith((package + ".", "."))
    return sum(1 for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call) and node.args and (
               getattr(node.func, "attr", None) == "import_module" or getattr(node.func, "id", None) in ("import_module", "__import__"))
               and not isinstance(node.args[0], ast.Constant) and starts_package(node.args[0]))


COMPUTES_IMPORTS = {"cli"}    # the top floor: the one module that may import a kind it does not name


def test_a_computed_import_is_seen():
    src = ('import importlib\nfor m in ms: importlib.import_module(f"maxpost.{m}")\nimportlib.import_module("maxpost." + m)\n'
           'importlib.import_module(module)\nimportlib.import_module("maxpost.rl")\n')
    assert computed_imports(src) == 2     # a user's module named by a variable (a reward plugin) is not maxpost's


def test_computed_imports_only_on_the_top_floor():
    "An f-string or `+` import of a maxpost module reaches past the book-order check: only the CLI may compute one."
    found = {f.stem for f in PKG.glob("*.py") if computed_imports(f.read_text())}
    assert found - COMPUTES_IMPORTS == set(), f"computed imports of maxpost modules below the CLI: {found - COMPUTES_IMPORTS}"
