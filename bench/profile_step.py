"""Where a maxpost step spends its time: one profiled call, XLA's ops summed by the JAX operation they came from.

Runs one of maxpost's compiled programs on a bench shape (after a warmup call that compiles it) under
`jax.profiler.trace`, reads the Perfetto trace back, maps every executed XLA op (fusion, dot, copy, ...) to the
`op_name` and output shape of its HLO instruction (from an XLA dump of the optimized module), and prints the
total time per (operation, shape) with its share of all op time. This is how the fixes listed in bench/README.md
were found: a large share on `copy` / `transpose` ops, or a dot far below the matmul peak of `matmul_shapes.py`,
points at a layout the CPU backend has to repack.

    python bench/profile_step.py sft --shape 20m --seq 512 --batch 8      # one SFT train step
    python bench/profile_step.py rollout --shape 20m --batch 64 --new 128  # one `generate` call (prefill + decode)
    python bench/profile_step.py rl --shape 20m --batch 32 --G 4 --new 64  # one GRPO update (make_rl_step)
"""
from __future__ import annotations
import argparse, collections, glob, gzip, json, os, re, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))   # this checkout's maxpost, also from an untracked copy
import common


def build(a):
    "A zero-argument function running one step of the chosen program, and the jitted function's name in the dump."
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from maxpost.model import create_model
    if a.preset:   # a real preset (an accelerator's measurement): its shapes, the compute dtype and remat given
        from maxpost.model import get_model_config
        cfg = get_model_config(a.preset, dtype=a.dtype, param_dtype=a.dtype, remat=a.remat)
    else:
        cfg = common.maxpost_config(a.shape)
    if a.preset and a.what == "rollout":   # constant weights: a decode's speed does not depend on them, and a 1B
        gd, st = nnx.split(nnx.eval_shape(lambda: create_model(cfg, seed=0)))   # eager random init compiles for minutes on a TPU
        st = jax.tree.map(lambda x: jnp.full(x.shape, 0.01, x.dtype) * (1 + jnp.arange(x.shape[-1], dtype=x.dtype) % 7), st)
        model = nnx.merge(gd, st)
    else:
        model = create_model(cfg, seed=0)
    if a.what == "rollout":
        from maxpost.sampling import generate
        prompts = common.prompt_ids(a.batch, a.prompt, cfg.vocab_size, seed=1)
        return (lambda: generate(model, prompts, max_prompt_length=a.prompt, max_completion_length=a.new,
                                 temperature=1.0, eos_ids=())), "sample_completions"
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-5, weight_decay=0.0))
    st = {"p": params, "o": tx.init(params)}
    if a.what == "sft":
        from maxpost.sft import make_sft_step
        step = make_sft_step(graphdef, tx)
        batch = {k: jnp.asarray(v) for k, v in common.sft_batch(a.batch, a.seq, cfg.vocab_size).items()}
    else:
        from maxpost.rl import make_rl_step
        from maxpost.sampling import make_logps_fn
        step = make_rl_step(graphdef, tx, dict(loss_algo="grpo", epsilon_low=0.2, epsilon_high=0.2, beta=0.04,
                                               kl_estimator="k3", loss_agg_mode="token-mean"), 1.0, a.G)
        rng = np.random.default_rng(0)
        batch = dict(prompt_ids=np.repeat(rng.integers(3, cfg.vocab_size, (a.batch // a.G, a.prompt)), a.G, 0).astype(np.int32),
                     prompt_mask=np.ones((a.batch, a.prompt), np.int32),
                     completion_ids=rng.integers(3, cfg.vocab_size, (a.batch, a.new)).astype(np.int32),
                     completion_mask=np.ones((a.batch, a.new), np.int32),
                     advantages=rng.normal(size=a.batch).astype(np.float32))
        batch["ref_per_token_logps"] = make_logps_fn(graphdef, 1.0, a.G)(params, rest, batch)
    def one():
        st["p"], st["o"], m = step(st["p"], rest, st["o"], batch)
        jax.block_until_ready(m)
    return one, "step"


def op_names(dump_dir: str, module: str) -> dict[str, str]:
    """HLO instruction name -> 'op_name output-shape' from the largest optimized dump of `module`. Instructions XLA
    added itself carry no op_name (the copies that copy insertion puts around in-place updates and loop carries):
    they are listed as '<opcode> (XLA) output-shape', so that a copy the program did not ask for shows up."""
    files = sorted(glob.glob(f"{dump_dir}/*jit_{module}.*after_optimizations.txt"), key=os.path.getsize)   # cpu_, tpu_
    out = {}
    for line in open(files[-1]):
        m = re.match(r"\s+(?:ROOT )?%(\S+) = (\(.*?\)|\S+) ([\w\-]+)\(", line)   # tuple shapes hold spaces
        if not m: continue
        named = re.search(r"op_name=\"([^\"]+)\"", line)
        out[m.group(1)] = (f"{named.group(1).split('/')[-1]} {m.group(2)}" if named else f"{m.group(3)} (XLA) {m.group(2)}")
    return out


def covered(spans) -> float:
    "Length of the union of the (start, end) intervals."
    out, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end: out += b - max(a, end); end = b
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["sft", "rollout", "rl"])
    ap.add_argument("--shape", default="20m", choices=list(common.SHAPES))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--G", type=int, default=4, help="rl: rows per prompt (groups of G share a prompt)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--preset", default=None, help="a maxpost preset instead of --shape (e.g. llama3.2-1b)")
    ap.add_argument("--dtype", default="bfloat16", help="with --preset: compute and parameter dtype")
    ap.add_argument("--remat", default="full", help="with --preset: the remat policy")
    ap.add_argument("--save-hlo", default=None, help="write the optimized HLO of the profiled program here (.txt.gz)")
    ap.add_argument("--platform", default="cpu", help="JAX_PLATFORMS ('': the machine's accelerator)")
    a = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="maxpost_profile_")
    os.environ["XLA_FLAGS"] = f"--xla_dump_to={work}/hlo --xla_dump_hlo_as_text"   # before JAX starts
    if a.platform: os.environ.setdefault("JAX_PLATFORMS", a.platform)
    import jax
    one, module = build(a)
    one()                                                      # compile
    t0 = time.perf_counter(); one(); wall = time.perf_counter() - t0
    with jax.profiler.trace(f"{work}/trace", create_perfetto_trace=True): one()
    names = op_names(f"{work}/hlo", module)
    if a.save_hlo:   # the optimized module, to read the ops' fusions and layouts afterwards
        import shutil
        src = sorted(glob.glob(f"{work}/hlo/*jit_{module}.*after_optimizations.txt"), key=os.path.getsize)[-1]
        with open(src, "rb") as f, gzip.open(a.save_hlo, "wb") as g: shutil.copyfileobj(f, g)
    trace = json.load(gzip.open(glob.glob(f"{work}/trace/**/*.trace.json.gz", recursive=True)[0]))
    total, calls, spans, threads = collections.Counter(), collections.Counter(), [], set()
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e["name"] in names:
            total[names[e["name"]]] += e["dur"]; calls[names[e["name"]]] += 1
            spans.append((e["ts"], e["ts"] + e["dur"])); threads.add((e.get("pid"), e.get("tid")))
    all_us = sum(total.values())
    print(f"{a.what} on {a.preset or a.shape} ({jax.devices()[0].device_kind}): {wall:.3f} s a call unprofiled; {all_us / 1e6:.3f} s of XLA ops in the profiled call, "
          f"on {len(threads)} threads, covering {covered(spans) / 1e6:.3f} s of it")
    if len(threads) > 1:   # XLA's CPU runtime runs independent ops at the same time: their times overlap
        print("ops ran concurrently: an op's time includes waiting for the cores its neighbours used, so small ops "
              "next to large products look slower than they are alone")
    print("| ms | share | calls | operation and output shape |\n|---|---|---|---|")
    for k, us in total.most_common(a.top):
        print(f"| {us / 1e3:.1f} | {100 * us / all_us:.1f}% | {calls[k]} | `{k[:120]}` |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
