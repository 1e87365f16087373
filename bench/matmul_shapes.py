"""fp32 matmul GFLOP/s of JAX (XLA CPU) vs torch (MKL / oneDNN) at the shapes the 20m benchmarks multiply.

The model benchmarks spend most of their time in dense matmuls, so the rate each library reaches on them bounds
what each framework can do. Shapes [M,K] x [K,N]: the 20m model's projections with M = 4096 rows (an SFT step:
batch 8 x 512 tokens), M = 64 and 16 rows (a decode step at batch 64 / 16), and two squares.

    python bench/matmul_shapes.py                  # driver: one subprocess per library, prints a table
    python bench/matmul_shapes.py --worker jax     # one library, prints a BENCH_RESULT JSON line
"""
from __future__ import annotations
import argparse, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

SHAPES = [(4096, 384, 1152), (4096, 1152, 384), (4096, 384, 384), (4096, 384, 8192),
          (64, 384, 1152), (64, 1152, 384), (64, 384, 8192), (16, 384, 1152), (1024, 1024, 1024), (2048, 2048, 2048)]


def worker(lib: str, reps: int) -> None:
    if lib == "jax":
        import jax, jax.numpy as jnp
        mm = jax.jit(lambda x, y: x @ y)
        make = lambda m, k, key: jax.random.normal(jax.random.key(key), (m, k), jnp.float32)
        sync = lambda o: o.block_until_ready()
    else:
        import torch
        torch.set_num_threads(common.THREADS); torch.manual_seed(0)
        mm, make, sync = (lambda x, y: x @ y), (lambda m, k, key: torch.randn(m, k)), (lambda o: o)
    out = {}
    for m, k, n in SHAPES:
        a, b = make(m, k, 0), make(k, n, 1)
        times, _ = common.timed(lambda: mm(a, b), warmup=3, reps=reps, sync=sync)
        out[f"{m}x{k}x{n}"] = 2 * m * k * n / common.median(times) / 1e9
    common.emit({"name": lib, "gflops": out, "threads": common.THREADS})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=["jax", "torch"])
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args(argv)
    if a.worker: worker(a.worker, a.reps); return 0
    print(f"load average before: {common.load_avg()}; threads {common.THREADS}", flush=True)
    recs = {lib: common.run_worker("matmul_shapes.py", ["--worker", lib, "--reps", str(a.reps)]) for lib in ("jax", "torch")}
    for lib, r in recs.items():
        if "error" in r: print(lib, r); return 1
    rows = [{"shape": f"[{s.split('x')[0]},{s.split('x')[1]}] x [{s.split('x')[1]},{s.split('x')[2]}]",
             "jax": recs["jax"]["gflops"][s], "torch": recs["torch"]["gflops"][s],
             "ratio": recs["jax"]["gflops"][s] / recs["torch"]["gflops"][s]} for s in recs["jax"]["gflops"]]
    common.print_table("fp32 matmul GFLOP/s (median of reps)", rows,
                       [("shape", "[M,K] x [K,N]"), ("jax", "JAX GFLOP/s"), ("torch", "torch GFLOP/s"),
                        ("ratio", "JAX / torch")])
    print(f"load average after: {recs['torch']['load_avg_after']}")
    common.save_results("matmul_shapes", {"runs": list(recs.values())})
    return 0


if __name__ == "__main__":
    sys.exit(main())
