"""The accelerator run anyone can repeat (issue 41 item 3): four maxpost commands, each time-boxed, ~8 minutes in all.

(a) the README's main job on the embedded default: `maxpost sft`, then `maxpost rl` from its checkpoint;
(b) `maxpost sft model_name=M dtype=bfloat16 global_batch_size=8 max_target_length=1024 steps=30`;
(c) `maxpost rl` at M from random weights: 64 completions (8 prompts x 8) of 64 prompt + 256 new tokens, 5 steps;
(d) `maxpost dpo` at M from random weights at that shape: 32 pairs (64 sequences) of 64 + 256 tokens, 10 steps.

Each command runs in a subprocess (bench/overhead.py's `launch`: SIGTERM at its time box, so maxpost saves and
stops, SIGKILL 30 s later) and prints, from the run's timing.json / metrics.jsonl, a markdown table: time to first
step, steady wall step (mean past the first logged record), device step, host overhead %, MFU (maxpost logs `mfu`
where it knows the chip's peak). Parts a run does not report show as "—".

    python bench/e2e.py                                   # M = llama3.2-1b, fp32 weights and AdamW
    python bench/e2e.py --param-dtype bfloat16            # a 1B on a 16 GiB TPU v5e: bf16 weights and AdamW state
    python bench/e2e.py --model qwen3-0.6b                # or a smaller preset
    JAX_PLATFORMS=cpu python bench/e2e.py --quick         # tiny shapes on a CPU: the script end to end, ~10 min here

Logs, e2e.json and e2e.md go to $OUT (default /tmp/e2e_out); the runs (checkpoints) to --work (default a temporary
directory, removed at the end).
"""
from __future__ import annotations
import argparse, json, os, shutil, sys, tempfile, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import ROOT, fmt, launch, ms, summarize   # noqa: E402

RL_SHAPE = ["global_batch_size=64", "num_generations=8", "mini_batch_size=32", "max_prompt_length=64",
            "max_completion_length=256"]
# 16 pairs: 32 sequences of 320 tokens, the RL update's mini-batch (32 pairs need 8.80 GiB of temporaries beside 6.91 GiB
# of bf16 weights and AdamW state and the reference's 2.30 GiB: 2.34 GiB short on a 16 GiB v5e, bench/device/README.md)
DPO_SHAPE = ["global_batch_size=16", "max_prompt_length=64", "max_completion_length=256"]
EVAL_SMALL = ["eval_num_prompts=64", "eval_k=0"]     # (c), (d): greedy pass@1 on 64 held-out prompts, before and after


def parts(model: str, param_dtype: str) -> list[tuple[str, str, list[str], float]]:
    "(part, kind, key=value arguments, time box in s) of the full run, in order."
    m = [f"model_name={model}", "dtype=bfloat16", f"param_dtype={param_dtype}"]
    return [
        ("a", "sft", [], 100),
        ("a", "rl", [], 100),
        ("b", "sft", [*m, "global_batch_size=8", "max_target_length=1024", "steps=30", "log_period=5",
                      "eval_interval=0", "eval_num_prompts=0"], 110),
        # no micro-batches: their carried gradient sum is a second set of gradients, more memory, not less, at 1B on
        # a 16 GiB v5e (bench/device/README.md)
        # (c), (d): issue 47 asks for RL's first step within 120 s; its evaluations before and after come on top
        ("c", "rl", [*m, "load_parameters_path=", *RL_SHAPE, "steps=5", "log_period=1", *EVAL_SMALL], 180),
        ("d", "dpo", [*m, "load_parameters_path=", *DPO_SHAPE, "steps=10", "log_period=1", *EVAL_SMALL], 120),
    ]


def quick_parts() -> list[tuple[str, str, list[str], float]]:
    "The same commands at tiny shapes, for a CPU: every part runs to the end."
    m = ["model_name=tiny", "dtype=bfloat16", "param_dtype=float32"]
    small_eval = ["eval_num_prompts=16", "eval_k=0"]
    return [
        ("a", "sft", ["steps=20", "log_period=5", "eval_interval=0"], 600),
        ("a", "rl", ["steps=3", "log_period=1", *small_eval], 600),
        ("b", "sft", [*m, "global_batch_size=8", "max_target_length=256", "steps=6", "log_period=2", "eval_interval=0",
                      "eval_num_prompts=0"], 600),
        ("c", "rl", [*m, "load_parameters_path=", "global_batch_size=16", "num_generations=8", "mini_batch_size=8",
                     "max_prompt_length=32", "max_completion_length=64", "steps=3", "log_period=1", *small_eval], 600),
        ("d", "dpo", [*m, "load_parameters_path=", "global_batch_size=8", "max_prompt_length=32",
                      "max_completion_length=64", "steps=3", "log_period=1", *small_eval, "eval_batches=1"], 600),
    ]


def run_part(part: str, kind: str, args: list[str], box: float, work: Path, out: Path) -> dict:
    "One command of a part under `work/<part>` (the parts' runs stay apart; a's rl loads a's sft), its row."
    base = work / part
    run_name = {"sft": "embedded-sft"}.get(kind) if part == "a" else f"e2e-{kind}"
    argv = [kind, f"base_output_directory={base}", *([f"run_name={run_name}"] if run_name else []), *args]
    run_dir = base / (run_name or "embedded-grpo")
    launched = launch(ROOT, argv, run_dir, out / f"{part}-{kind}.log", box)
    row = summarize(kind, launched, run_dir)
    times = lambda kinds: [t for _, k, t in launched["arrivals"] if k in kinds]   # when the records appeared
    last_train, last = max(times({"train"}), default=None), max(times({"train", "eval"}), default=None)
    row.update(last_train_s=last_train, last_record_s=last,   # after the last record: the summary, the save, the exit
               after_last_record_s=None if last is None else launched["wall_s"] - last)
    row.update(part=part, command="maxpost " + " ".join(a for a in argv if not a.startswith("base_output_directory")),
               box_s=box)
    print(json.dumps({k: v for k, v in row.items() if v is not None}), flush=True)
    return row


def status(r: dict) -> str:
    if r["timed_out"]: return f"stopped at {r['box_s']:.0f} s box"
    return "ok" if r["returncode"] == 0 else f"exit {r['returncode']} (see {r['part']}-{r['kind']}.log)"


def table(rows: list[dict]) -> str:
    head = ["part", "command", "process s", "first step s", "wall step ms", "device ms", "host %", "MFU %",
            "train records", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        mfu = None if r["step/mfu"] is None else 100 * r["step/mfu"]
        cells = [r["part"], f"`{r['command']}`", fmt(r["wall_s"]), fmt(r["first_step_s"]), fmt(ms(r["step/step"])),
                 fmt(ms(r["step/device"])), fmt(r.get("host_pct"), 2), fmt(mfu, 2), str(r["steps_done"]), status(r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def device_line() -> str:
    "The accelerator the commands saw, asked in a subprocess (this process keeps off the chip: one holder at a time)."
    import subprocess
    code = "import jax; d = jax.devices()[0]; print(jax.__version__, d.platform, d.device_kind, jax.device_count())"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path})
    return p.stdout.strip() or p.stderr.strip().splitlines()[-1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3.2-1b", help="the preset of parts b-d (see maxpost.model.PRESETS)")
    p.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of the weights and AdamW state of parts b-d (bfloat16: a 1B fits 16 GiB)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, no time boxes that bite: a CPU smoke run")
    p.add_argument("--parts", default="abcd", help="which parts to run, e.g. 'bc'")
    p.add_argument("--box-scale", type=float, default=1.0, help="multiply every time box by this")
    p.add_argument("--work", type=Path, help="where the runs go (default: a temporary directory, removed after)")
    a = p.parse_args(argv)
    out = Path(os.environ.get("OUT", "/tmp/e2e_out")); out.mkdir(parents=True, exist_ok=True)
    work = a.work or Path(tempfile.mkdtemp(prefix="maxpost-e2e-"))
    todo = [x for x in (quick_parts() if a.quick else parts(a.model, a.param_dtype)) if x[0] in a.parts]
    device, t0 = device_line(), time.perf_counter()
    print(f"device: {device}", flush=True)
    rows = []
    try:
        for i, (part, kind, args, box) in enumerate(todo):
            rows.append(run_part(part, kind, args, box * a.box_scale, work, out))
            if a.work is None and (i + 1 == len(todo) or todo[i + 1][0] != part):
                shutil.rmtree(work / part, ignore_errors=True)   # a 1B run's checkpoints: gigabytes of /tmp
    finally:
        if a.work is None: shutil.rmtree(work, ignore_errors=True)
    total = time.perf_counter() - t0
    text = f"{table(rows)}\n\n{device}; {total:.0f} s in all (`python bench/e2e.py {' '.join(sys.argv[1:])}`)"
    print("\n" + text)
    (out / "e2e.md").write_text(text + "\n")
    (out / "e2e.json").write_text(json.dumps({"argv": sys.argv[1:], "device": device, "total_s": total, "rows": rows}, indent=1))
    print(f"written: {out / 'e2e.md'}, {out / 'e2e.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
