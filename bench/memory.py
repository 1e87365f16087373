"""Memory of maxpost's training steps: compile-only temporaries at real presets, their growth, and a real-shape run.

Three tables (bench/README.md, "Memory"), each measurement in its own subprocess printing one JSON line:

- `presets`: XLA's memory analysis of the whole SFT step (`make_sft_step`: loss, gradient, clipping, AdamW) and the
  whole RL update (`make_rl_step`) of a preset, lowered from `jax.ShapeDtypeStruct` inputs (parameters, optimizer
  state, batch) and compiled; nothing is allocated, so any preset can be measured on a CPU. bf16 compute, fp32
  parameters and AdamW state. SFT: 8 rows x T tokens; RL: 32 rows x (256 prompt + 1024 completion), G = 8.
- `growth`: the same for the SFT step of the 20M bench shape (fp32, batch 1) against the sequence length and the
  vocabulary, written as a table and a plot (`bench/results/memory_growth.png`).
- `real`: `maxpost sft` (the command a user runs) against TRL's `SFTTrainer` on a random-weight Qwen3ForCausalLM
  with Qwen3-0.6B's exact config saved as a local Hugging Face directory: one conversation of 2,048 tokens a step,
  fp32, 1 warm-up + 2 timed steps, without and with remat / gradient checkpointing. Peak RSS of the whole training
  process (`ru_maxrss` of the child) and seconds per step. Before each run it waits until the host has
  `--min-free-gb` (default 18) GB available, and runs one such process at a time; the compile drivers of the other
  tables, if running, wait meanwhile (the pause file).

The speed side (maxpost's 20M rows of bench/sft_throughput.py, rollout.py and grpo_step.py for two checkouts,
interleaved rounds) is bench/speed.py.

Each driver appends every record to bench/results/memory_{presets,growth,real}.json as soon as it is measured and
skips what is already there (`--fresh` measures anew), so an interrupted table resumes; it writes the markdown
table next to it (`.md`).

"Before" is another checkout of maxpost (e.g. `git worktree add ../maxpost-before b650bc3`), passed as `--before DIR`:
its package goes first on the workers' PYTHONPATH; the workers adapt to its older API (no `chunk_size`, remat only
none | full, RL update without micro-batches).

    python bench/memory.py presets --before ../maxpost-before          # table (a)
    python bench/memory.py presets --presets qwen3-0.6b --kinds sft   # one preset, this checkout only
    python bench/memory.py growth --before ../maxpost-before           # table (b) and its plot
    python bench/memory.py real                                       # table (c): maxpost vs TRL (needs 18 GB free)
    python bench/memory.py real --check-memory off                    # table (c)'s maxpost rows with check_memory=false
    python bench/memory.py real --frameworks maxpost --real-remats full --chunk 256   # ... with logits_chunk_size=256
    python bench/memory.py presets --report                           # rewrite a table from bench/results, measure nothing
    python bench/memory.py --worker compile --kind sft --preset qwen3-0.6b --seq 2048 --batch 8 --remat full
    python bench/memory.py --worker compile --kind sft --preset qwen3-0.6b --layers 2 --seq 128 --batch 1 \
        --remat full --dtype float32 --optimizer sgd                  # what the optimizer adds, on a small model
"""
from __future__ import annotations
import argparse, glob, json, os, resource, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

PRESETS = ["qwen3-0.6b", "qwen3-1.7b", "gemma3-1b", "llama3.2-1b", "llama3.1-8b"]
GiB = 2**30
RL_PROMPT, RL_COMPLETION, RL_ROWS, RL_G = 256, 1024, 32, 8
SFT_ROWS = 8


# --------------------------------------------------------------------------------------------------- compile worker
def _model_config(a):
    from maxpost.model import get_model_config
    over = dict(dtype=a.dtype, param_dtype="float32", remat=a.remat)
    if a.shape:
        s = dict(common.SHAPES[a.shape])
        if a.vocab: s["vocab_size"] = a.vocab
        s["max_seq_len"] = max(a.seq, 8192)
        return get_model_config("tiny", **s, **over)
    if a.layers: over["num_layers"] = a.layers
    return get_model_config(a.preset, **over)


def _accepts(fn, name: str) -> bool:
    import inspect
    return name in inspect.signature(fn).parameters


def compile_worker(a) -> dict:
    """Lower and compile the whole SFT step or RL update from shapes; XLA's memory analysis per device (bytes)."""
    import jax, jax.numpy as jnp, optax
    from flax import nnx
    from maxpost.model import Decoder
    cfg = _model_config(a)
    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
    adamw = optax.adamw(1e-5, weight_decay=0.01, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p))
    tx = {"adamw": optax.chain(optax.clip_by_global_norm(1.0), adamw), "adamw-noclip": adamw,
          "sgd": optax.sgd(1e-5), "none": optax.sgd(1e-5)}[a.optimizer]
    opt_state = jax.eval_shape(tx.init, params)
    chunk = {} if a.chunk is None else {"chunk_size": a.chunk or None}
    if a.kind == "sft":
        from maxpost.sft import make_sft_step
        if chunk and not _accepts(make_sft_step, "chunk_size"): raise SystemExit("this maxpost has no chunk_size")
        step = make_sft_step(graphdef, tx, accum=a.accum, **chunk)
        if a.optimizer == "none":   # the gradient alone (an output here, not a temporary): what autodiff holds
            from maxpost.sft_loss import model_sft_loss
            step = jax.jit(jax.grad(lambda p, r, b: model_sft_loss(nnx.merge(graphdef, p, r), b, **chunk)[0]))
        ids = jax.ShapeDtypeStruct((a.batch, a.seq), jnp.int32)
        batch = dict(tokens=ids, positions=ids, segment_ids=ids, loss_mask=ids)
        tokens = a.batch * a.seq
    else:
        if a.optimizer == "none": raise SystemExit("--optimizer none is for the SFT step")
        from maxpost.rl import make_rl_step
        loss_kwargs = dict(loss_algo="grpo", epsilon_low=0.2, epsilon_high=0.28, beta=0.04, kl_estimator="k3",
                           loss_agg_mode="token-mean")
        if _accepts(make_rl_step, "accum"):
            step = make_rl_step(graphdef, tx, loss_kwargs, 1.0, a.G, a.accum, **chunk)
        elif a.accum == 1 and not chunk:
            step = make_rl_step(graphdef, tx, loss_kwargs, 1.0, a.G)
        else:
            raise SystemExit("this maxpost's RL update has no micro-batches or chunk_size")
        ids = lambda t: jax.ShapeDtypeStruct((a.batch, t), jnp.int32)
        f32 = jax.ShapeDtypeStruct((a.batch, a.completion), jnp.float32)
        batch = dict(prompt_ids=ids(a.prompt), prompt_mask=ids(a.prompt), completion_ids=ids(a.completion),
                     completion_mask=ids(a.completion), advantages=jax.ShapeDtypeStruct((a.batch,), jnp.float32),
                     old_per_token_logps=f32, ref_per_token_logps=f32)
        tokens = a.batch * (a.prompt + a.completion)
    t0 = time.perf_counter()
    args = (params, rest, batch) if a.optimizer == "none" else (params, rest, opt_state, batch)
    compiled = step.lower(*args).compile()
    m = compiled.memory_analysis()
    out = dict(arguments=m.argument_size_in_bytes, outputs=m.output_size_in_bytes, aliased=m.alias_size_in_bytes,
               temporaries=m.temp_size_in_bytes)
    out["peak"] = out["arguments"] + out["temporaries"] + out["outputs"] - out["aliased"]
    n_params = sum(x.size for x in jax.tree.leaves(params))
    return {**out, "compile_s": round(time.perf_counter() - t0, 1), "params": int(n_params), "tokens": tokens,
            "vocab": cfg.vocab_size, "maxpost": str(Path(__import__("maxpost").__file__).parent.parent)}


def compile_args(kind: str, remat: str, *, preset=None, shape=None, seq=None, batch=None, vocab=None, dtype="bfloat16",
                 accum=1, chunk=None) -> list[str]:
    args = ["--worker", "compile", "--kind", kind, "--remat", remat, "--dtype", dtype, "--accum", str(accum)]
    args += ["--preset", preset] if preset else ["--shape", shape]
    if kind == "sft": args += ["--seq", str(seq), "--batch", str(batch or SFT_ROWS)]
    else: args += ["--batch", str(batch or RL_ROWS)]
    if vocab: args += ["--vocab", str(vocab)]
    if chunk is not None: args += ["--chunk", str(chunk)]
    return args


# ------------------------------------------------------------------------------------------------ real-shape run
# Qwen3-0.6B's config (its config.json on the hub, as in transformers' Qwen3 docs); checked against maxpost's preset.
QWEN3_06B = dict(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=True, max_position_embeddings=40_960, hidden_act="silu", attention_bias=False)
REAL_TOKENS, REAL_STEPS, REAL_WARMUP = 2048, 3, 1


def real_inputs(workdir: Path) -> tuple[Path, Path]:
    """A random-weight Qwen3ForCausalLM with Qwen3-0.6B's config and an id tokenizer saved by transformers as a local HF
    directory, and a jsonl of conversations (user + assistant) of REAL_TOKENS - 1 tokens each; made once."""
    hf, data = workdir / "qwen3-0.6b-random", workdir / "conversations.jsonl"
    if not (hf / "config.json").exists():
        import numpy as np, torch
        from transformers import Qwen3Config, Qwen3ForCausalLM
        from maxpost.model import PRESETS
        p, c = PRESETS["qwen3-0.6b"], QWEN3_06B
        mine = (p.vocab_size, p.d_model, p.mlp_dim, p.num_layers, p.num_heads, p.num_kv_heads, p.head_dim, p.rope_theta,
                p.norm_eps, p.tie_embeddings, p.max_seq_len)
        theirs = tuple(c[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                      "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
                                      "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings"))
        if mine != theirs: raise SystemExit(f"maxpost's qwen3-0.6b preset {mine} differs from Qwen3-0.6B's config {theirs}")
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(Qwen3Config(**c, dtype="float32"))
        model.save_pretrained(str(hf), safe_serialization=True)
        common.id_tokenizer(c["vocab_size"], hf)
        del model
        rng = np.random.default_rng(0)
        with open(data, "w") as f:
            for _ in range(8):
                ids = rng.integers(3, c["vocab_size"], size=REAL_TOKENS - 1)
                half = (REAL_TOKENS - 1) // 2
                f.write(json.dumps({"messages": [{"role": "user", "content": common.ids_to_text(ids[:half]) + " "},
                                                 {"role": "assistant", "content": common.ids_to_text(ids[half:])}]}) + "\n")
    return hf, data


def maxpost_real_command(hf: Path, data: Path, out: Path, remat: str, check_memory: str = "on",
                         chunk: int | None = None) -> list[str]:
    "`maxpost sft` on the real shape: one conversation a step, fp32, lr 1e-5 constant, AdamW, clip 1.0."
    return ["maxpost", "sft", f"run_name=real-{remat}", *(["check_memory=false"] if check_memory == "off" else []),
            *([f"logits_chunk_size={chunk}"] if chunk is not None else []),
            f"base_output_directory={out}", f"load_parameters_path={hf}",
            f"dataset_name={data}", f"eval_dataset_name={data}", "eval_split=train", "eval_on_train=true",
            "eval_batches=1", f"steps={REAL_STEPS}", "global_batch_size=1", f"max_target_length={REAL_TOKENS}",
            "packing=false", f"remat_policy={remat}", "dtype=float32", "param_dtype=float32", "learning_rate=1e-5",
            "lr_schedule=constant", "warmup_steps=0", "weight_decay=0.0", "log_period=1", "checkpoint_period=1000"]


def real_maxpost_worker(a) -> dict:
    """`maxpost sft` as a child process: its peak RSS (ru_maxrss of the children), seconds per step from its
    metrics.jsonl (`timing/step` of the steps after the warm-up), and the memory check's line."""
    import shutil, tempfile
    hf, data = real_inputs(Path(a.workdir))
    out = Path(tempfile.mkdtemp(prefix="real-", dir=a.workdir))
    cmd = maxpost_real_command(hf, data, out, a.remat, a.check_memory, a.chunk)
    exe = str(Path(sys.executable).parent / "maxpost")
    t0 = time.perf_counter()
    p = subprocess.run([exe, *cmd[1:]], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    log = (p.stdout + p.stderr).splitlines()
    rec = dict(framework="maxpost", remat=a.remat, check_memory=a.check_memory, chunk=a.chunk, returncode=p.returncode,
               child_peak_rss_mb=round(rss),
               wall_s=round(wall, 1), command=" ".join(cmd).replace(str(Path(a.workdir)), "$WORKDIR"),
               memory_check=[l.strip() for l in log if "memory" in l.lower()][:4])
    metrics = out / f"real-{a.remat}" / "metrics.jsonl"
    if metrics.exists():
        train = [json.loads(l) for l in metrics.read_text().splitlines() if '"timing/step"' in l]
        rec["step_times"] = [r.get("timing/step") for r in train]
        rec["loss"] = [r.get("loss") for r in train]
    if p.returncode != 0: rec["log_tail"] = log[-15:]
    shutil.rmtree(out, ignore_errors=True)
    return rec


def real_trl_worker(a) -> dict:
    """TRL's SFTTrainer on the same HF directory and conversations: batch 1, fp32, AdamW (torch), lr 1e-5 constant,
    clip 1.0, with or without gradient checkpointing; peak RSS of this process and its step times."""
    import tempfile, torch, datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTTrainer, SFTConfig
    torch.set_num_threads(common.THREADS); torch.manual_seed(0)
    hf, data = real_inputs(Path(a.workdir))
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(hf))
    ds = datasets.load_dataset("json", data_files=str(data), split="train")
    clock = common.step_clock()
    with tempfile.TemporaryDirectory(dir=a.workdir) as out:
        targs = SFTConfig(output_dir=out, per_device_train_batch_size=1, max_steps=REAL_STEPS, learning_rate=1e-5,
                          weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0,
                          logging_steps=10**6, save_strategy="no", report_to="none", use_cpu=True,
                          max_length=REAL_TOKENS, packing=False, dataloader_num_workers=0, seed=0,
                          optim="adamw_torch", disable_tqdm=True, bf16=False, fp16=False,
                          gradient_checkpointing=a.remat != "none")
        tr = SFTTrainer(model=model, args=targs, train_dataset=ds, processing_class=tok, callbacks=[clock])
        n_tokens = len(tr.train_dataset[0]["input_ids"])
        res = tr.train()
    return dict(framework="trl", remat=a.remat, step_times=clock.times, tokens_per_row=n_tokens,
                loss=float(res.training_loss), child_peak_rss_mb=round(common.peak_rss_mb()))


# ------------------------------------------------------------------------------------------------------------ main
WORKERS = {"compile": compile_worker, "real-maxpost": real_maxpost_worker, "real-trl": real_trl_worker}


def worker(a) -> None:
    keys = ("kind", "preset", "shape", "seq", "batch", "remat", "accum", "chunk", "dtype", "layers", "optimizer")
    common.emit({"worker": a.worker, **{k: getattr(a, k) for k in keys},
                 **WORKERS[a.worker](a)})


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("table", nargs="?", choices=["presets", "growth", "real"])
    ap.add_argument("--worker", choices=list(WORKERS))
    ap.add_argument("--before", help="a checkout of the earlier maxpost to compare with (its package is imported)")
    # compile worker
    ap.add_argument("--kind", choices=["sft", "rl"], default="sft")
    ap.add_argument("--preset"); ap.add_argument("--shape", choices=list(common.SHAPES))
    ap.add_argument("--seq", type=int, default=2048); ap.add_argument("--batch", type=int, default=SFT_ROWS)
    ap.add_argument("--prompt", type=int, default=RL_PROMPT); ap.add_argument("--completion", type=int, default=RL_COMPLETION)
    ap.add_argument("--G", type=int, default=RL_G)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--remat", default="none"); ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--layers", type=int, help="compile: the preset with this many layers (where the memory goes)")
    ap.add_argument("--optimizer", choices=["adamw", "adamw-noclip", "sgd", "none"], default="adamw",
                    help="compile (SFT): the trainers' clip + AdamW (default), AdamW without clipping, plain SGD, "
                         "or none (the gradient alone)")
    ap.add_argument("--chunk", type=int, help="logits_chunk_size (0 = whole logits); default: the step's default")
    # drivers
    ap.add_argument("--presets", help="comma-separated presets (default: all five)")
    ap.add_argument("--kinds", default="sft,rl"); ap.add_argument("--seqs", default="2048,4096")
    ap.add_argument("--remats", default="none,full,minimal")
    ap.add_argument("--minimal-presets", default="qwen3-0.6b", help="presets measured with remat minimal too")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per compile worker")
    ap.add_argument("--fresh", action="store_true", help="measure again what bench/results already holds")
    ap.add_argument("--after-first", action="store_true", help="every job of this checkout first, then --before's")
    ap.add_argument("--report", action="store_true", help="measure nothing: write the table of what bench/results holds")
    ap.add_argument("--workdir", default="/tmp/maxpost-bench-real", help="real: where the HF directory, data and runs go")
    ap.add_argument("--min-free-gb", type=float, default=18.0, help="real: wait for this much available memory first")
    ap.add_argument("--check-memory", choices=["on", "off"], default="on",
                    help="real: off runs maxpost sft with check_memory=false (its check refused a run that fits)")
    ap.add_argument("--frameworks", default="maxpost,trl"); ap.add_argument("--real-remats", default="none,full")
    return ap


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if a.worker: worker(a); return 0
    return TABLES[a.table](a)


# --------------------------------------------------------------------------------------------------------- drivers
RESULTS = Path(__file__).resolve().parent / "results"
PAUSE = os.environ.get("MAXPOST_BENCH_PAUSE", "/tmp/maxpost-bench-pause")   # while it exists, compile drivers wait
BUSY = f"{PAUSE}.busy.{os.getpid()}"                                           # while it exists, a compile runs


def _label(before: str | None) -> str: return "before" if before else "after"


def _load_records(name: str) -> list[dict]:
    p = RESULTS / f"{name}.json"
    return json.loads(p.read_text())["records"] if p.exists() else []


def _save_records(name: str, records: list[dict], **meta) -> None:
    common.save_results(name, {**meta, "records": records})


def _measure_all(name: str, jobs: list[tuple[dict, list[str]]], a) -> list[dict]:
    """Run each compile job (key, worker args) in its own process, after (this checkout) and, with --before, before;
    each record is appended to bench/results/{name}.json as soon as it is measured, and a job already recorded there
    is not run again (delete the file, or pass --fresh, to measure anew)."""
    if a.report: return _load_records(name)
    records = [] if a.fresh else _load_records(name)
    done = {json.dumps(r["key"], sort_keys=True) for r in records if "error" not in r}
    checkouts = [(None, "after")] + ([(str(Path(a.before).resolve()), "before")] if a.before else [])
    pairs = [(j, c) for j in jobs for c in checkouts]
    if a.after_first: pairs = [(j, c) for c in checkouts for j in jobs]
    for (key, args), (path, label) in pairs:
        k = {**key, "code": label}
        if json.dumps(k, sort_keys=True) in done: continue
        if label == "before" and key.get("remat", "none") not in ("none", "full"): continue   # before: none | full only
        if label == "before" and "chunk" in key: continue                                 # before: no logits_chunk_size
        while os.path.exists(PAUSE): time.sleep(10)   # another table (real) needs the machine's memory for now
        Path(BUSY).touch()
        try: rec = common.run_worker("memory.py", args, extra_path=path, timeout=a.timeout)
        finally: Path(BUSY).unlink(missing_ok=True)
        rec["key"] = k
        records = [r for r in _load_records(name) if r["key"] != k] + [rec]   # another driver may have added some
        _save_records(name, records)
        brief = {x: rec.get(x) for x in ("temporaries", "compile_s", "error")}
        print(label, key, brief, rec.get("log_tail", [""])[-1:] if "error" in rec else "", flush=True)
    return records


def _gb(x): return None if x is None else round(x / 1e9, 2)


def _temps(records, chunk=None, **key):
    key["chunk"] = chunk   # records measured at another logits_chunk_size than the default carry it in their key
    for r in records:
        if all(r["key"].get(k) == v for k, v in key.items()) and "error" not in r: return r["temporaries"]
    return None


def presets_table(a) -> int:
    """Table (a): SFT step (8 rows x 2048 / 4096) and RL update (32 x (256 + 1024), G = 8) per preset and remat."""
    presets = a.presets.split(",") if a.presets else PRESETS
    remats = a.remats.split(",")
    jobs = []
    for seq in [int(s) for s in a.seqs.split(",")]:
        for preset in presets:
            for kind in a.kinds.split(","):
                if kind == "rl" and seq != min(int(s) for s in a.seqs.split(",")): continue   # RL: one shape
                for remat in remats:
                    if remat == "minimal" and preset not in a.minimal_presets.split(","): continue
                    key = dict(kind=kind, preset=preset, seq=seq if kind == "sft" else RL_PROMPT + RL_COMPLETION,
                               remat=remat)
                    jobs.append((key, compile_args(kind, remat, preset=preset, seq=seq)))
    jobs.sort(key=lambda j: (j[0]["preset"] == "llama3.1-8b", j[0]["seq"] > 2048 and j[0]["kind"] == "sft"))   # the slowest last
    _measure_all("memory_presets", jobs, a)
    records = _load_records("memory_presets")
    rows = []
    for key, _ in jobs:
        shape = f"{SFT_ROWS} x {key['seq']}" if key["kind"] == "sft" else f"{RL_ROWS} x ({RL_PROMPT}+{RL_COMPLETION})"
        after, before = _temps(records, **key, code="after"), _temps(records, **key, code="before")
        rows.append(dict(kind=key["kind"].upper(), preset=key["preset"], shape=shape, remat=key["remat"],
                         before=_gb(before), after=_gb(after),
                         ratio=None if not (after and before) else round(before / after, 1)))
    missing = [("PYTHONPATH=$BEFORE " if code == "before" else "") + f"python bench/memory.py {' '.join(args)}"
               for key, args in jobs for code in ("after", "before")
               if _temps(records, **key, code=code) is None and not (code == "before" and key["remat"] == "minimal")]
    if missing: print("not measured yet:\n  " + "\n  ".join(missing), flush=True)
    todo = {}
    for r in rows:
        if r["after"] is None and r["before"] is None:
            todo.setdefault(f"{r['kind']} {r['preset']} {r['shape']}", []).append(r["remat"])
    todo = [f"{k} ({', '.join(v)})" for k, v in todo.items()]
    rows = [r for r in rows if r["after"] is not None or r["before"] is not None]
    out = common.print_table("Compile-only temporaries (GB), bf16 compute, fp32 parameters and AdamW", rows,
                             [("kind", "step"), ("preset", "preset"), ("shape", "rows x tokens"), ("remat", "remat"),
                              ("before", "before (GB)"), ("after", "after (GB)"), ("ratio", "before / after")])
    if todo: out += "\nNot measured yet (no cell): " + "; ".join(todo) + ".\n"
    (RESULTS / "memory_presets.md").write_text(out)
    return 0


GROWTH_SEQS = [512, 1024, 2048, 4096, 8192]
GROWTH_VOCABS = [8192, 16384, 32768, 65536, 131072, 262144]
GROWTH_VOCAB_SEQ = 1024


def growth_table(a) -> int:
    """Table (b): temporaries of the 20M shape's SFT step (fp32, batch 1, no remat) against sequence and vocabulary."""
    jobs = [(dict(axis="seq", seq=t, vocab=8192),
             compile_args("sft", "none", shape="20m", seq=t, batch=1, dtype="float32")) for t in GROWTH_SEQS]
    jobs += [(dict(axis="vocab", seq=GROWTH_VOCAB_SEQ, vocab=v),
              compile_args("sft", "none", shape="20m", seq=GROWTH_VOCAB_SEQ, batch=1, vocab=v, dtype="float32"))
             for v in GROWTH_VOCABS]
    jobs += [(dict(axis="vocab", seq=GROWTH_VOCAB_SEQ, vocab=v, chunk=256),   # the chunk, not the sequence, sets it
              compile_args("sft", "none", shape="20m", seq=GROWTH_VOCAB_SEQ, batch=1, vocab=v, dtype="float32",
                           chunk=256)) for v in (GROWTH_VOCABS[0], 131072)]
    _measure_all("memory_growth", jobs, a)
    records = _load_records("memory_growth")
    out = ""
    for axis, xs, col in (("seq", GROWTH_SEQS, "seq"), ("vocab", GROWTH_VOCABS, "vocab")):
        rows, prev = [], {}
        for x in xs:
            key = dict(axis=axis, seq=x if axis == "seq" else GROWTH_VOCAB_SEQ, vocab=x if axis == "vocab" else 8192)
            row = {col: x}
            if axis == "vocab":
                t = _temps(records, **key, chunk=256, code="after")
                row["chunk256"] = None if t is None else round(t / 2**20)
            for code in ("before", "after"):
                t = _temps(records, **key, code=code)
                row[code] = None if t is None else round(t / 2**20)
                if axis == "seq": row[code + "_x"] = None if (t is None or prev.get(code) is None) else round(t / prev[code], 2)
                prev[code] = t
            rows.append(row)
        cols = [(col, "sequence" if axis == "seq" else f"vocabulary (T = {GROWTH_VOCAB_SEQ})"),
                ("before", "before (MiB)"), ("after", "after (MiB)")]
        if axis == "seq": cols = cols[:2] + [("before_x", "before x prev")] + cols[2:] + [("after_x", "after x prev")]
        else: cols.append(("chunk256", "after, logits_chunk_size=256 (MiB)"))
        out += common.print_table(f"20M shape, SFT step temporaries against the {'sequence' if axis == 'seq' else 'vocabulary'}"
                                  " (fp32, batch 1, no remat)", rows, cols)
    (RESULTS / "memory_growth.md").write_text(out)
    _plot_growth(records)
    return 0


def _plot_growth(records) -> None:
    import matplotlib; matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, axis, xs in ((axes[0], "seq", GROWTH_SEQS), (axes[1], "vocab", GROWTH_VOCABS)):
        for code, style in (("before", "o--"), ("after", "s-")):
            pts = [(x, _temps(records, axis=axis, seq=x if axis == "seq" else GROWTH_VOCAB_SEQ,
                              vocab=x if axis == "vocab" else 8192, code=code)) for x in xs]
            pts = [(x, t / 2**20) for x, t in pts if t is not None]
            if pts: ax.plot(*zip(*pts), style, label=code)
        if axis == "vocab":
            pts = [(x, _temps(records, axis="vocab", seq=GROWTH_VOCAB_SEQ, vocab=x, chunk=256, code="after")) for x in xs]
            pts = [(x, t / 2**20) for x, t in pts if t is not None]
            if pts: ax.plot(*zip(*pts), "^-", label="after, logits_chunk_size=256")
        if axis == "seq":
            x0, t0 = xs[0], _temps(records, axis="seq", seq=xs[0], vocab=8192, code="after")
            if t0: ax.plot(xs, [t0 / 2**20 * x / x0 for x in xs], ":", color="gray", label="linear from 512 (after)")
        ax.set_xscale("log", base=2); ax.set_yscale("log"); ax.grid(True, which="both", alpha=0.3); ax.legend()
        ax.set_xlabel("sequence length (vocabulary 8192)" if axis == "seq" else f"vocabulary (sequence {GROWTH_VOCAB_SEQ})")
        ax.set_ylabel("XLA temporaries (MiB)")
    fig.suptitle("maxpost SFT step, 20M shape, batch 1, fp32, no remat: compile-only temporaries")
    fig.tight_layout(); fig.savefig(RESULTS / "memory_growth.png", dpi=110)


def available_gb() -> float:
    "MemAvailable of /proc/meminfo (what `free` shows as available), GB."
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"): return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def real_table(a) -> int:
    """Table (c): maxpost sft vs TRL SFTTrainer on the real shape, one process at a time, each started only when the
    host has --min-free-gb available (the compile drivers wait meanwhile: the pause file)."""
    records = [] if a.fresh else _load_records("memory_real")
    done = {json.dumps(r["key"], sort_keys=True) for r in records if "error" not in r and r.get("returncode", 0) == 0}
    Path(a.workdir).mkdir(parents=True, exist_ok=True)
    def wait_for_memory() -> float:
        "Wait until the host has --min-free-gb available with no compile of ours running (then compiles pause)."
        t0 = time.time()
        while time.time() - t0 < a.timeout:
            if available_gb() >= a.min_free_gb:
                Path(PAUSE).touch()
                while glob.glob(PAUSE + ".busy*"): time.sleep(5)
                if available_gb() >= a.min_free_gb: return available_gb()
                Path(PAUSE).unlink(missing_ok=True)
            print(f"waiting: {available_gb():.1f} GB available < {a.min_free_gb}", flush=True); time.sleep(20)
        return available_gb()
    try:
        for remat in a.real_remats.split(","):
            for fw in a.frameworks.split(","):
                key = dict(framework=fw, remat=remat, **({"check_memory": "off"} if fw == "maxpost" and
                                                          a.check_memory == "off" else {}),
                           **({"chunk": a.chunk} if fw == "maxpost" and a.chunk is not None else {}))
                if a.report or json.dumps(key, sort_keys=True) in done: continue
                free0 = wait_for_memory()
                if free0 < a.min_free_gb:
                    rec = {"error": f"never {a.min_free_gb} GB available within {a.timeout}s"}
                else:
                    chunk = ["--chunk", str(a.chunk)] if fw == "maxpost" and a.chunk is not None else []
                    rec = common.run_worker("memory.py", ["--worker", f"real-{fw}", "--remat", remat, "--workdir",
                                                          a.workdir, "--check-memory", a.check_memory, *chunk],
                                            timeout=3600,
                                           extra_path=common.TRL_SITE if fw == "trl" else None)
                rec.update(key=key, available_gb_before=round(free0, 1))
                Path(PAUSE).unlink(missing_ok=True)
                records = [r for r in records if r["key"] != key] + [rec]
                _save_records("memory_real", records)
                print(fw, remat, {k: rec.get(k) for k in ("child_peak_rss_mb", "step_times", "returncode", "error")},
                      rec.get("log_tail", ""), flush=True)
    finally:
        if not a.report: Path(PAUSE).unlink(missing_ok=True)
    rows = []
    order = lambda r: (r["key"]["remat"] != "none", r["key"]["framework"] != "maxpost", r["key"].get("check_memory", "on") != "on",
                       r["key"].get("chunk") is not None)
    for r in sorted(records, key=order):
        if "error" in r: continue
        times = (r.get("step_times") or [])[REAL_WARMUP:]
        refused = bool(r.get("returncode")) and any("short by" in l for l in r.get("log_tail", []))
        status = ("ok" if not r.get("returncode") else
                  f"refused by its memory check at step {len(r.get('step_times') or []) + 1}" if refused
                  else f"exit {r['returncode']}")
        flags = ((", check_memory=false" if r["key"].get("check_memory") == "off" else "") +
                 (f", logits_chunk_size={r['key']['chunk']}" if r["key"].get("chunk") is not None else ""))
        rows.append(dict(framework=("maxpost sft" + flags if r["key"]["framework"] == "maxpost" else "TRL SFTTrainer"),
                         remat=r["key"]["remat"] if r["key"]["framework"] == "maxpost" else
                         ("gradient checkpointing" if r["key"]["remat"] != "none" else "none"),
                         rss=round(r["child_peak_rss_mb"] / 1024, 1),
                         step=round(common.median(times), 1) if times and not r.get("returncode") else None,
                         steps=", ".join(f"{t:.0f}" for t in r.get("step_times") or []), status=status))
    out = common.print_table(f"Real shape: Qwen3-0.6B config (random weights), 1 x {REAL_TOKENS} tokens, fp32", rows,
                             [("framework", "trainer"), ("remat", "remat / checkpointing"), ("rss", "peak RSS (GiB)"),
                              ("step", "s / step (steps 2-3)"), ("steps", "each step (s)"), ("status", "status")])
    (RESULTS / "memory_real.md").write_text(out)
    return 0


TABLES = {"presets": presets_table, "growth": growth_table, "real": real_table}

if __name__ == "__main__":
    sys.exit(main())
