"""Measured fp32 matmul peak of JAX on this machine: the denominator of the benchmarks' MFU.

    python bench/matmul_peak.py [--quick]          # driver: runs the worker in a subprocess, prints a table
    python bench/matmul_peak.py --worker [--n N]   # one measurement, prints a BENCH_RESULT JSON line
"""
from __future__ import annotations
import argparse, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common


def worker(n_list: list[int], reps: int) -> None:
    import jax, jax.numpy as jnp
    out = {}
    for n in n_list:
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
        b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
        f = jax.jit(lambda x, y: x @ y)
        times, _ = common.timed(lambda: f(a, b), warmup=2, reps=reps, sync=lambda o: o.block_until_ready())
        out[str(n)] = {"median_s": common.median(times), "gflops": 2 * n ** 3 / common.median(times) / 1e9,
                       "best_gflops": 2 * n ** 3 / min(times) / 1e9}
    best = max(out.values(), key=lambda r: r["gflops"])
    common.emit({"name": "jax_fp32_matmul", "sizes": out, "peak_gflops": best["gflops"],
                 "best_gflops": max(r["best_gflops"] for r in out.values()), "devices": str(jax.devices()),
                 "threads": common.THREADS})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--n", type=int, nargs="*", default=None)
    ap.add_argument("--reps", type=int, default=None)
    a = ap.parse_args(argv)
    sizes = a.n or ([1024, 2048] if a.quick else [1024, 2048, 4096])
    reps = a.reps or (5 if a.quick else 10)
    if a.worker: worker(sizes, reps); return 0
    print(f"load average before: {common.load_avg()}", flush=True)
    rec = common.run_worker("matmul_peak.py", ["--worker", "--n", *map(str, sizes), "--reps", str(reps)])
    if "error" in rec: print(rec); return 1
    rows = [{"n": n, **r} for n, r in rec["sizes"].items()]
    common.print_table("JAX fp32 matmul (median of reps)", rows,
                       [("n", "n"), ("median_s", "median s"), ("gflops", "GFLOP/s (median)"), ("best_gflops", "GFLOP/s (best)")])
    print(f"peak (median of best size): {rec['peak_gflops']:.1f} GFLOP/s; load average after: {rec['load_avg_after']}")
    common.save_results("matmul_peak", rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
