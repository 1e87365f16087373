"""Where a program's compile time goes: tracing, lowering to StableHLO, and the backend's compile, one program at a time.

On the TPU v5e (bench/device/README.md, issue 47) the tiny model's programs took 12-18 s each to compile inside a run,
where this CPU takes well under a second for most of them: a fixed cost per program, not the depth. This probe runs
alone (no data loading, no other thread compiling beside it) and times each phase from JAX's own monitoring events
(the ones `maxpost.timing.CompileWatch` reads), so the next measurement says which phase holds the seconds:

- `trivial`: `x + 1` on a small array (the backend's fixed cost per program);
- `init`, `sft_step`: the tiny preset's model creation and SFT step, as `maxpost sft` compiles them;
- `sft_step_again`: the same step after `jax.clear_caches()` (JAX's in-memory caches emptied, the backend warm);
- `--preset P`: the SFT step of a real preset from shapes (nothing allocated; remat `full`, bf16 compute).

It prints the JAX version, the devices, the compilation-cache settings and the XLA / libtpu flags in the
environment, then one JSON line per program.

    python bench/compile_probe.py                          # the tiny programs (seconds on a CPU)
    python bench/compile_probe.py --preset llama3.2-1b     # and the 1B step (about 10 s on this CPU)
"""
from __future__ import annotations
import argparse, json, os, time

EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace", "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "backend"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default=None, help="also the SFT step of this preset, from shapes")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--parts", action="store_true", help="also the step's parts alone: attention (blockwise, splash, "
                   "the cond of both) forward and backward, and the step with JAX's persistent cache on (write, then read)")
    a = p.parse_args(argv)
    import jax, jax.numpy as jnp, optax
    from flax import nnx
    spans = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: spans.append((EVENTS[event], secs)) if event in EVENTS else None)
    print(json.dumps({"jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
                      "cache_dir": jax.config.jax_compilation_cache_dir,
                      "cache_min_compile_s": jax.config.jax_persistent_cache_min_compile_time_secs,
                      "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""), "LIBTPU_INIT_ARGS": os.environ.get("LIBTPU_INIT_ARGS", "")}),
          flush=True)

    def timed(name, fn):
        spans.clear(); t0 = time.perf_counter(); fn(); wall = time.perf_counter() - t0
        phases = {k: round(sum(s for n, s in spans if n == k), 3) for k in ("trace", "lower", "backend")}
        print(json.dumps({"program": name, "wall_s": round(wall, 3), **phases, "events": len(spans)}), flush=True)

    from maxpost.model import Decoder, create_model, get_model_config
    from maxpost.sft import make_sft_step
    timed("trivial", lambda: jax.block_until_ready(jax.jit(lambda x: x + 1)(jnp.ones((8, 128)))))
    cfg = get_model_config("tiny")
    box = {}
    timed("init", lambda: box.setdefault("model", jax.block_until_ready(create_model(cfg, seed=0))))
    graphdef, params, rest = nnx.split(box["model"], nnx.Param, ...)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    ids = jax.ShapeDtypeStruct((8, 192), jnp.int32)
    batch = dict(tokens=ids, positions=ids, segment_ids=ids, loss_mask=ids)
    args = (params, rest, jax.eval_shape(tx.init, params), batch)
    timed("sft_step", lambda: make_sft_step(graphdef, tx).lower(*args).compile())
    jax.clear_caches()
    timed("sft_step_again", lambda: make_sft_step(graphdef, tx).lower(*args).compile())
    if a.parts: parts(timed, a.batch, a.seq, lambda: make_sft_step(graphdef, tx).lower(*args).compile())
    if a.preset:
        big = get_model_config(a.preset, dtype="bfloat16", param_dtype="bfloat16", remat="full")
        g, p_, r_ = nnx.split(nnx.eval_shape(lambda: Decoder(big, rngs=nnx.Rngs(0))), nnx.Param, ...)
        ids = jax.ShapeDtypeStruct((a.batch, a.seq), jnp.int32)
        big_args = (p_, r_, jax.eval_shape(tx.init, p_), dict(tokens=ids, positions=ids, segment_ids=ids, loss_mask=ids))
        timed(f"sft_step {a.preset} {a.batch}x{a.seq}", lambda: make_sft_step(g, tx).lower(*big_args).compile())
    return 0


def parts(timed, b: int, t: int, compile_step) -> None:
    "The attention kernels alone at [b, t] with 1B's heads (32 x 64, 8 kv heads), forward and backward; then the tiny step through the persistent cache."
    import tempfile, jax, jax.numpy as jnp
    from maxpost.attention import Spans, attend
    n, k, h = 32, 8, 64
    q, kk, v = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((b, t, n, h), (b, k, h, t), (b, k, t, h)))
    pos = jax.ShapeDtypeStruct((b, t), jnp.int32)
    for impl in ("blockwise", "splash", "auto"):
        def loss(q, kk, v, p, s, impl=impl):
            return attend(q, kk, v, Spans(p, s, p, s), 0.125, causal=True, implementation=impl).astype(jnp.float32).sum()
        if impl != "auto" and impl not in ("blockwise",) and jax.default_backend() != "tpu": continue
        timed(f"attention {impl} fwd+bwd {b}x{t}", lambda: jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, kk, v, pos, pos).compile())
    d = tempfile.mkdtemp()
    jax.config.update("jax_compilation_cache_dir", d)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.clear_caches(); timed("sft_step cache write", compile_step)
    jax.clear_caches(); timed("sft_step cache read", compile_step)
    jax.config.update("jax_compilation_cache_dir", None)


if __name__ == "__main__":
    raise SystemExit(main())
