"""Execute the book in place, so that the notebooks are committed with their outputs (plots included) and a reader
on GitHub sees what each cell printed. Not run by CI (CI runs the notebooks as tests, without saving outputs);
run it after changing a chapter, then `nbdev_clean` and commit:

    .venv/bin/python .ci/execute-notebooks.py                  # every chapter, index.ipynb, the run notebooks
    .venv/bin/python .ci/execute-notebooks.py nbs/09_sft.ipynb # some of them
    .venv/bin/python .ci/execute-notebooks.py --tutorial       # the tutorial, in its full mode (about 15 minutes)

Each notebook runs in its own process, as `nbdev_test` runs them. Cells marked `#| eval: false`, `#| gpu` or
`#| tpu` are not run (no accelerator here); `#| slow` cells are: their output is what a reader comes for.
The run notebooks (`nbs/runs/`) and the tutorial write their runs under a temporary directory, never under `nbs/`.
"""
import argparse, os, subprocess, sys, tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NBS = ROOT / "nbs"


def skipped(cell) -> bool:
    "Whether a cell is not to be run: markdown, `#| eval: false`, or accelerator-only."
    if cell.cell_type != "code": return True
    directives = [line[3:].strip().replace(" ", "") for line in cell.source.splitlines() if line.startswith("#|")]
    return any(d in ("eval:false", "gpu", "tpu") for d in directives)


def execute_here(path: Path) -> None:
    "Run one notebook in this process with execnb and write it back with its outputs."
    from execnb.shell import CaptureShell
    shell = CaptureShell(path)
    os.chdir(path.parent)
    shell.execute(path, path, exc_stop=True, preproc=skipped)
    if shell.exc: raise SystemExit(f"{path.name} failed:\n{shell.prettytb(fname=path)}")


def strip_papermill(path: Path, tmp: str, base_output_directory: str) -> None:
    """Make a notebook papermill executed read as if run where it lies: drop the `injected-parameters` cell (opened in
    Jupyter it would override the parameters cell), and write the temporary run directory in outputs as the default
    `maxpost_runs` and the temporary working directory as `.`."""
    import nbformat
    nb = nbformat.read(path, as_version=4)
    nb.cells = [c for c in nb.cells if "injected-parameters" not in c.get("metadata", {}).get("tags", [])]
    def clean(text: str) -> str:
        return text.replace(base_output_directory, "maxpost_runs").replace(os.path.realpath(tmp), ".").replace(tmp, ".")
    for c in nb.cells:
        for out in c.get("outputs", []):
            if "text" in out: out["text"] = clean(out["text"])
            for k, v in out.get("data", {}).items():
                if k.startswith("text/") and isinstance(v, str): out["data"][k] = clean(v)
    nbformat.write(nb, path)


def execute(path: Path, **parameters) -> None:
    "Run `path` in a fresh process (papermill with `parameters` for the run notebooks and the tutorial)."
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if parameters or "runs" in path.parts or "tutorials" in path.parts:
        with tempfile.TemporaryDirectory() as tmp:
            parameters.setdefault("base_output_directory", str(Path(tmp) / "runs"))
            cmd = [sys.executable, "-m", "papermill", str(path), str(path), "--cwd", tmp, "--kernel", "python3",
                   "--no-progress-bar", *[a for k, v in parameters.items() for a in ("-p", k, str(v))]]
            subprocess.run(cmd, check=True, env=env)
            strip_papermill(path, tmp, parameters["base_output_directory"])
    else:   # a chapter: its 8 virtual devices, with collectives that wait for a starved device thread (tests/conftest.py)
        env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                       "--xla_cpu_collective_call_terminate_timeout_seconds=900")
        subprocess.run([sys.executable, __file__, "--one", str(path)], check=True, env=env)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("notebooks", nargs="*", type=Path)
    p.add_argument("--tutorial", action="store_true", help="the tutorial in its full mode")
    p.add_argument("--one", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one: execute_here(a.one.resolve()); raise SystemExit(0)
    todo = [n.resolve() for n in a.notebooks] or \
           sorted(NBS.glob("*.ipynb")) + sorted((NBS / "runs").glob("*.ipynb"))
    if a.tutorial: todo = [NBS / "tutorials" / "sft_grpo_gspo.ipynb"]
    for nb in todo:
        print(f"executing {nb.relative_to(ROOT)}", flush=True)
        execute(nb)
    subprocess.run([str(Path(sys.executable).with_name("nbdev_clean"))], cwd=ROOT, check=True)
