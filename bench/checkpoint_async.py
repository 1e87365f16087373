"""What an asynchronous checkpoint costs the loop (issue 41): a train state at the Qwen3-0.6B shape (random init,
float32 parameters and AdamW moments of random values, as after training: zeros would compress on disk) saved with
`save_state` through a synchronous and an asynchronous Orbax manager (nbs/03_checkpoint), as `RunCheckpoints` saves it
(`save_concurrent_gb=save_limit_gb(...)`, one CPU device).

Three configurations, in interleaved rounds (sync, async, async-busy, sync, ...) so that each sees the same machine
and disk; each saves into a fresh directory, deleted after the round:

- `sync`: the loop is blocked for the whole write (blocked = write).
- `async`: blocked = until `save_state` returns; write = until `finish_saves` returns, called at once (the loop idle).
- `async-busy`: the same save, with the loop running a stand-in step (a jitted chain of two 512^3 matmuls that does not
  touch the state) until the write completes, as a training loop would; reports the stand-in's steps per second
  during the write against its rate alone (measured before each round), i.e. what the write's threads take from
  the loop on this CPU.

    nice .venv/bin/python bench/checkpoint_async.py                       # qwen3-0.6b, 3 rounds
    nice .venv/bin/python bench/checkpoint_async.py --model tiny --rounds 2 --record ""   # a quick look
"""
import argparse, json, os, shutil, statistics, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def random_state(model: str, seed: int = 0):
    "The model's float32 parameters and an AdamW state, every float array filled with random values."
    import jax, jax.numpy as jnp, optax
    from flax import nnx
    from maxpost.model import create_model, get_model_config
    cfg = get_model_config(model)
    params = nnx.state(create_model(cfg, seed=seed), nnx.Param)
    opt = optax.adamw(1e-4).init(params)
    keys = iter(jax.random.split(jax.random.key(seed + 1), 4 * len(jax.tree.leaves((params, opt)))))
    fill = jax.jit(lambda x, k: x + 0.02 * jax.random.normal(k, x.shape, x.dtype), donate_argnums=0)
    opt = jax.tree.map(lambda x: fill(x, next(keys)) if getattr(x, "dtype", None) == jnp.float32 and x.ndim else x, opt)
    return jax.block_until_ready((params, opt))


def stand_in_step():
    "A jitted step that keeps the cores busy without touching the train state: 2 chained 512^3 matmuls."
    import jax, jax.numpy as jnp
    a = jax.random.normal(jax.random.key(0), (512, 512))
    f = jax.jit(lambda x: jnp.tanh(x @ a @ a * 1e-3))
    x = f(a).block_until_ready()
    return lambda: f(x).block_until_ready()


def rate(step, seconds: float = 3.0) -> float:
    "Steps per second of `step` alone."
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds: step(); n += 1
    return n / (time.perf_counter() - t0)


def one_save(kind: str, state, where: Path, step) -> dict:
    from maxpost.checkpoint import checkpoint_manager, finish_saves, save_limit_gb, save_state, state_bytes
    params, opt = state
    mgr = checkpoint_manager(where, save_concurrent_gb=save_limit_gb(params, opt), async_save=kind != "sync")
    out = {"config": kind, "bytes": state_bytes(params, opt)}
    if kind == "async-busy": out["standin_alone_per_s"] = rate(step)
    t0 = time.perf_counter()
    save_state(mgr, 1, params, opt, meta={"data": {"position": 0}})
    out["blocked_s"] = time.perf_counter() - t0
    if kind == "async-busy":
        n = 0
        while mgr.is_saving_in_progress(): step(); n += 1
        t1 = time.perf_counter()
        finish_saves(mgr)
        out["standin_during_write_per_s"] = n / max(t1 - t0 - out["blocked_s"], 1e-9)
    else: finish_saves(mgr)
    out["write_s"] = time.perf_counter() - t0
    mgr.close()
    out["on_disk"] = sum(f.stat().st_size for f in where.rglob("*") if f.is_file())
    assert (where / "1").is_dir(), "the save did not complete"
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--configs", nargs="+", default=["sync", "async", "async-busy"])
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--record", default=str(ROOT / "bench" / "results" / "checkpoint_async.json"))
    a = p.parse_args(argv)
    import jax
    t0 = time.perf_counter()
    state = random_state(a.model)
    print(f"{a.model}: state of {sum(x.nbytes for x in jax.tree.leaves(state)) / 2**30:.2f} GiB built in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    step = stand_in_step()
    base = Path(a.dir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    rows = []
    for r in range(a.rounds):
        for kind in a.configs:
            where = base / f"{kind}-{r}"
            row = {"round": r, **one_save(kind, state, where, step)}
            shutil.rmtree(where)
            rows.append(row)
            print(json.dumps(row), flush=True)
    med = lambda kind, key: statistics.median(x[key] for x in rows if x["config"] == kind and key in x)
    sync_s = med("sync", "write_s") if "sync" in a.configs else None
    print(f"\n{a.model}, {rows[0]['bytes'] / 2**30:.2f} GiB, median of {a.rounds} rounds (this CPU: "
          f"{os.cpu_count()} cores, shared)")
    print(f"| config | loop blocked (s) | write (s) | blocked / sync save | stand-in step rate during the write |")
    print("| --- | --- | --- | --- | --- |")
    for kind in a.configs:
        rel = f"{100 * med(kind, 'blocked_s') / sync_s:.1f} %" if sync_s else "-"
        busy = (f"{100 * med(kind, 'standin_during_write_per_s') / med(kind, 'standin_alone_per_s'):.0f} % of alone"
                if kind == "async-busy" else "-")
        print(f"| {kind} | {med(kind, 'blocked_s'):.3f} | {med(kind, 'write_s'):.1f} | {rel} | {busy} |")
    if a.record:
        Path(a.record).write_text(json.dumps({"model": a.model, "rounds": rows, "jax": jax.__version__,
                                              "cpu_count": os.cpu_count()}, indent=1) + "\n")
        print(f"recorded in {a.record}")


if __name__ == "__main__":
    main()
