"""Compile time against depth: the SFT train step, the RL update and the decode step at llama3.2-1b's width with 2 and
with 16 layers (`num_layers` replaced, nothing else), lowered from `jax.ShapeDtypeStruct`s (nothing allocated) and
compiled on this CPU. With the layers in a Python loop XLA receives L copies of the layer and the time grows with L;
with one `lax.scan` over stacked layers (issue 47) it compiles one layer, whatever L.

Each measurement runs in its own process (no persistent compilation cache), under the thread settings of
bench/common.py; the record has the seconds of `lower` and of `compile`. bfloat16 compute, float32 parameters and
AdamW state, remat `full`; SFT: 8 rows x 1024 tokens; RL update: 16 rows x (128 prompt + 256 completion), G = 8;
decode: one token for 64 rows over a 512-slot KV cache.

    python bench/compile_depth.py                                 # this checkout: table + bench/results/compile_depth.json
    python bench/compile_depth.py --before /tmp/i47-before --label before    # another checkout's package, same script
    python bench/compile_depth.py --report                        # the table from the json, measuring nothing
    python bench/compile_depth.py --worker --program sft --layers 2   # one measurement, one JSON line
"""
from __future__ import annotations
import argparse, json, os, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

PROGRAMS = ("sft", "rl", "decode")
LAYERS = (2, 16)
PRESET = "llama3.2-1b"
OUT = Path(__file__).resolve().parent / "results" / "compile_depth.json"


def _accepts(fn, name: str) -> bool:
    import inspect
    return name in inspect.signature(fn).parameters


def worker(program: str, layers: int) -> dict:
    "Lower and compile one program from shapes; seconds of each."
    import jax, jax.numpy as jnp, optax
    jax.config.update("jax_enable_compilation_cache", False)
    from flax import nnx
    from maxpost.model import Decoder, get_model_config, init_cache
    cfg = get_model_config(PRESET, num_layers=layers, dtype="bfloat16", param_dtype="float32", remat="full")
    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-5, weight_decay=0.01))
    opt_state = jax.eval_shape(tx.init, params)
    ids = lambda b, t: jax.ShapeDtypeStruct((b, t), jnp.int32)
    if program == "sft":
        from maxpost.sft import make_sft_step
        step = make_sft_step(graphdef, tx)
        batch = dict(tokens=ids(8, 1024), positions=ids(8, 1024), segment_ids=ids(8, 1024), loss_mask=ids(8, 1024))
        args = (params, rest, opt_state, batch)
    elif program == "rl":
        from maxpost.rl import make_rl_step
        loss_kwargs = dict(loss_algo="grpo", epsilon_low=0.2, epsilon_high=0.28, beta=0.04, kl_estimator="k3",
                           loss_agg_mode="token-mean")
        step = make_rl_step(graphdef, tx, loss_kwargs, 1.0, 8, 1) if _accepts(make_rl_step, "accum") else \
            make_rl_step(graphdef, tx, loss_kwargs, 1.0, 8)
        f32 = jax.ShapeDtypeStruct((16, 256), jnp.float32)
        batch = dict(prompt_ids=ids(16, 128), prompt_mask=ids(16, 128), completion_ids=ids(16, 256),
                     completion_mask=ids(16, 256), advantages=jax.ShapeDtypeStruct((16,), jnp.float32),
                     old_per_token_logps=f32, ref_per_token_logps=f32)
        args = (params, rest, opt_state, batch)
    else:
        state = nnx.state(nnx.merge(graphdef, params, rest))
        def decode(state, tok, pos, cache):
            return nnx.merge(graphdef, state)(tok, pos, jnp.ones_like(pos), cache=cache)
        step = jax.jit(decode, donate_argnums=3)
        args = (state, ids(64, 1), ids(64, 1), jax.eval_shape(lambda: init_cache(cfg, 64, 512)))
    t0 = time.perf_counter()
    lowered = step.lower(*args)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return dict(program=program, layers=layers, lower_s=round(t1 - t0, 2), compile_s=round(t2 - t1, 2),
                total_s=round(t2 - t0, 2))


def table(records: list[dict]) -> str:
    "Markdown: per code and program, lower + compile seconds at each depth and the ratio 16 / 2."
    rows = ["| code | program | 2 layers: lower + compile (s) | 16 layers: lower + compile (s) | 16 / 2 |", "| --- | --- | ---: | ---: | ---: |"]
    for label in dict.fromkeys(r["label"] for r in records):
        for p in PROGRAMS:
            got = {r["layers"]: r for r in records if r["label"] == label and r["program"] == p and "total_s" in r}
            if not got: continue
            cell = lambda n: f"{got[n]['lower_s']:.1f} + {got[n]['compile_s']:.1f} = {got[n]['total_s']:.1f}" if n in got else "-"
            ratio = f"{got[16]['total_s'] / got[2]['total_s']:.2f}" if 2 in got and 16 in got else "-"
            rows.append(f"| {label} | {p} | {cell(2)} | {cell(16)} | {ratio} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--program", choices=PROGRAMS)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--programs", nargs="+", default=list(PROGRAMS), choices=PROGRAMS)
    ap.add_argument("--depths", nargs="+", type=int, default=list(LAYERS))
    ap.add_argument("--before", help="another checkout: its package goes first on the workers' path")
    ap.add_argument("--label", default="after")
    ap.add_argument("--report", action="store_true")
    a = ap.parse_args(argv)
    if a.worker:
        print("BENCH_RESULT " + json.dumps(worker(a.program, a.layers)), flush=True)
        return 0
    records = json.loads(OUT.read_text()) if OUT.exists() else []
    if not a.report:
        records = [r for r in records if (r.get("label"), r.get("program"), r.get("layers")) not in
                   {(a.label, p, n) for p in a.programs for n in a.depths}]      # measured anew
        for p in a.programs:
            for n in a.depths:
                rec = common.run_worker("compile_depth.py", ["--worker", "--program", p, "--layers", str(n)],
                                        extra_path=a.before, timeout=1800)
                rec.update(label=a.label, program=p, layers=n)
                print(json.dumps(rec), flush=True)
                records.append(rec)
                OUT.parent.mkdir(parents=True, exist_ok=True)
                OUT.write_text(json.dumps(records, indent=1) + "\n")
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
