"""Issue 41, the loop at accelerator speed: where a run's wall time goes (`timing/*` in metrics.jsonl, timing.json),
no device-to-host transfer in a step that logs nothing, the next SFT batch prepared on a thread with an exact data
state, a non-finite step found later but named exactly, and a rerun that compiles nothing."""
import contextlib, json, os, subprocess, sys
from pathlib import Path

import jax, jax.numpy as jnp, numpy as np, optax, pytest

from maxpost.config import load_config, run_dir, TrainConfig
from maxpost.commands import start_trainer
from maxpost.rundir import read_metrics
from maxpost.sft import SFTTrainer, sft_data
from maxpost.train import Trainer, Prefetcher
from maxpost import tasks

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["model_name=tiny", "train_split=train[:256]", "eval_split=test[:16]", "global_batch_size=8",
         "max_target_length=96", "eval_batches=1", "warmup_steps=2", "learning_rate=3e-3", "eval_num_prompts=0"]
STEP_PARTS = ("input", "device", "host", "log", "checkpoint", "eval")
FIRST_PARTS = ("startup", "data", "backend", "weights", "compile", "memory_check", "first_eval", "resume", "logger", "first_run")


def test_the_parts_add_up_to_the_wall_step_and_to_the_first_step(tmp_path):
    cfg = load_config("sft", [f"base_output_directory={tmp_path}", "run_name=t", "steps=7", "log_period=3",
                              "checkpoint_period=2", "eval_interval=3", *SMALL])
    tr = start_trainer(SFTTrainer, cfg, progress=False)
    tr.fit(progress=False)
    recs = read_metrics(run_dir(cfg), "train")
    assert [r["step"] for r in recs] == [3, 6, 7]
    for r in recs:
        parts = sum(r[f"timing/{k}"] for k in STEP_PARTS)
        assert abs(parts - r["timing/step"]) <= 0.05 * r["timing/step"], r
        assert all(r[f"timing/{k}"] >= 0 for k in STEP_PARTS), r
        assert 0 < r["timing/device"] <= r["timing/step"]
    # the windows after step 1 saw checkpoints (steps 2, 4, 6) and an evaluation (step 3)
    assert recs[1]["timing/checkpoint"] > 0 and recs[1]["timing/eval"] > 0
    rec = json.loads((run_dir(cfg) / "timing.json").read_text())
    assert rec == tr.timing and rec["steps_timed"] == 6                           # steps 2..7
    first = rec["first_step"]
    assert set(first) == {*FIRST_PARTS, "compiles", "total", "other"}
    named = sum(first[k] for k in FIRST_PARTS)
    # (how many programs were compiled depends on what the persistent cache already holds: the rerun test counts them)
    assert abs(named + first["other"] - first["total"]) < 1e-6 and isinstance(first["compiles"], int), first
    # (the weights of a random policy are made on a thread beside the data: what is left of them may be all compile)
    assert first["data"] > 0 and first["weights"] >= 0 and first["compile"] > 0 and first["memory_check"] > 0
    assert first["first_run"] > 0
    assert first["startup"] > 0 and first["total"] > first["startup"]
    steps = rec["steps"]
    assert abs(sum(steps[f"timing/{k}"] for k in STEP_PARTS) - steps["timing/step"]) <= 0.05 * steps["timing/step"]
    # the mean over steps 2..7 is the step-weighted mean of the logged windows after step 1 (windows of 5 and 1 steps:
    # step 1's window was closed after it, unlogged)
    for k in ("step", "input", "checkpoint"):
        want = (recs[0][f"timing/{k}"] * 2 + recs[1][f"timing/{k}"] * 3 + recs[2][f"timing/{k}"]) / 6
        assert steps[f"timing/{k}"] == pytest.approx(want, rel=1e-6), k


@contextlib.contextmanager
def no_device_to_host():
    """JAX's transfer guard (which a GPU or TPU enforces) and, for the CPU, where arrays live in host memory and the guard
    never fires, every read of an array's value on the host (`float`, `np.asarray`, `jax.device_get`) refused."""
    from jax._src.array import ArrayImpl
    value = ArrayImpl._value
    def refuse(self): raise RuntimeError("Disallowed device-to-host transfer: an array's value read on the host")
    with jax.transfer_guard_device_to_host("disallow_explicit"):
        ArrayImpl._value = property(refuse)
        try: yield
        finally: ArrayImpl._value = value


class Guarded(SFTTrainer):
    """Every step that logs nothing runs under `no_device_to_host`."""
    non_logging_guard = staticmethod(no_device_to_host)


def test_a_step_that_logs_nothing_makes_no_device_to_host_transfer(tmp_path):
    # the one checkpoint (step 8) is written after the last guarded step: its background write reads the arrays
    base = [f"base_output_directory={tmp_path}", "log_period=4", "checkpoint_period=100", "steps=8", *SMALL]
    tr = start_trainer(Guarded, load_config("sft", [*base, "run_name=g"]), progress=False)
    out = tr.fit(progress=False)                      # steps 1-3 and 5-7 ran under the guard and fetched nothing
    assert out["step"] == 8 and [r["step"] for r in read_metrics(tmp_path / "g", "train")] == [4, 8]

    class Fetching(Guarded):                          # the planted bug: the loss read on the host every step
        def train_step(self):
            m = super().train_step(); float(m["loss"]); return m
    with pytest.raises(Exception, match="[Dd]isallowed device-to-host transfer"):
        start_trainer(Fetching, load_config("sft", [*base, "run_name=f"]), progress=False).fit(progress=False)


def test_prefetched_batches_are_the_iterator_batches_and_its_state_is_the_last_taken(tmp_path):
    cfg = load_config("sft", [f"base_output_directory={tmp_path}", "run_name=p", *SMALL])
    tok = __import__("maxpost.data", fromlist=["load_tokenizer"]).load_tokenizer(tasks.prepare_embedded_task(cfg)["tokenizer"])
    plain = sft_data(cfg, tok, cfg.train_split, shuffle=True)
    pf = Prefetcher(sft_data(cfg, tok, cfg.train_split, shuffle=True), depth=3)
    want = [next(plain) for _ in range(5)]
    got = [next(pf) for _ in range(3)]
    for a, b in zip(got, want):
        for k in a: np.testing.assert_array_equal(a[k], b[k])
    again = sft_data(cfg, tok, cfg.train_split, shuffle=True)
    for _ in range(3): next(again)
    assert pf.state() == again.state() != plain.state()   # the thread has gone ahead; the state has not
    resumed = Prefetcher(sft_data(cfg, tok, cfg.train_split, shuffle=True)).restore(pf.state())
    for a, b in zip([next(resumed), next(resumed)], want[3:]):
        for k in a: np.testing.assert_array_equal(a[k], b[k])
    pf.close(); resumed.close()


class NaNAtStep3(Trainer):
    """A toy trainer whose third step returns a NaN loss (its weights stay finite): found at the next fetch."""
    kind = "nan3"
    def train_step(self):
        if not hasattr(self, "_f"):
            self._f = jax.jit(lambda p, s: (p, jnp.where(s == 3, jnp.nan, 1.0), jnp.array(True)))
        self.params, loss, finite = self._f(self.params, self.step + 1)
        return {"loss": loss, "params_finite": finite}


def test_a_non_finite_step_between_fetches_is_named_and_nothing_is_saved_after_it(tmp_path):
    cfg = load_config(TrainConfig, [f"base_output_directory={tmp_path}", "run_name=n", "steps=10", "log_period=5",
                                    "checkpoint_period=2", "model_overrides={num_layers: 1, d_model: 32, mlp_dim: 64}"])
    with pytest.raises(FloatingPointError, match=r"non-finite loss \(nan\) at step 3; .*\(step 2\)"):
        start_trainer(NaNAtStep3, cfg).fit(progress=False)
    assert sorted(int(p.name) for p in (tmp_path / "n" / "checkpoints").iterdir() if p.name.isdigit()) == [2]
    assert read_metrics(tmp_path / "n", "train") == []            # nothing logged after (or at) the bad step


CHILD = """
import json, sys
import jax
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
jax.monitoring.register_event_time_span_listener(lambda name, a, b, **kw: events.append(name))
from maxpost.sft import main
main(sys.argv[1:])
compiled = events.count("/jax/core/compile/backend_compile_duration") - events.count("/jax/compilation_cache/cache_hits")
print(json.dumps({"compiled": compiled, "hits": events.count("/jax/compilation_cache/cache_hits")}))
"""


def test_a_rerun_of_the_same_command_compiles_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    def run(name, cache):
        args = [f"base_output_directory={tmp_path}", f"run_name={name}", "steps=3", "log_period=2", *SMALL,
                f"compilation_cache_dir={cache}"]
        r = subprocess.run([sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1]), json.loads((tmp_path / name / "timing.json").read_text())
    first, t1 = run("a", tmp_path / "jax")
    assert first["compiled"] >= 3 and t1["first_step"]["compiles"] >= 1, first
    second, t2 = run("b", tmp_path / "jax")            # a new run of the same command: every program from the cache
    assert second["compiled"] == 0 and second["hits"] >= first["compiled"] and t2["first_step"]["compiles"] == 0, second
    off, _ = run("c", "")                              # compilation_cache_dir= : no cache, everything compiled again
    assert off["compiled"] == first["compiled"] and off["hits"] == 0, off


def test_rl_rewards_are_a_part_of_the_step_of_their_own(tmp_path):
    """An RL step's reward scoring is its own part (`timing/rewards`), out of `device`: a reward that takes 0.3 s shows
    there, and the parts still add up to the wall step."""
    sys.path.insert(0, str(ROOT / "tests"))
    from rewards_for_tests import slow_length_reward
    from maxpost.rl import RLTrainer
    cfg = load_config("rl", [f"base_output_directory={tmp_path}", "run_name=t", "load_parameters_path=", "model_name=tiny",
                             "global_batch_size=8", "num_generations=4", "mini_batch_size=0", "max_prompt_length=64", "max_completion_length=8",
                             "eval_interval=0", "eval_num_prompts=0", "train_split=train[:32]", "log_period=1", "steps=3",
                             "reward_isolation=thread"])
    start_trainer(RLTrainer, cfg, reward_fns=[(slow_length_reward, 1.0, "length")]).fit(progress=False)
    for r in read_metrics(run_dir(cfg), "train")[1:]:       # past the step that compiled
        assert r["timing/rewards"] >= 0.3, r
        parts = sum(r[f"timing/{k}"] for k in (*STEP_PARTS, "rewards"))
        assert abs(parts - r["timing/step"]) <= 0.05 * r["timing/step"], r
        assert r["timing/device"] < r["timing/step"] - 0.3
    steps = json.loads((run_dir(cfg) / "timing.json").read_text())["steps"]
    assert steps["timing/rewards"] >= 0.3


def test_a_shell_that_execs_maxpost_late_does_not_lend_it_its_start(tmp_path):
    """`bash -c 'a && b && maxpost rl'` execs its last command: the process's start in /proc is the shell's, minutes
    before Python ran (a fresh clone's main job reported 724 s of 'startup' that were pip and SFT). The start is then
    the import of maxpost's first module; without a shell in front it is the process's own start."""
    code = ("import time; from maxpost.timing import process_start_time; from maxpost.config import _IMPORTED; "
            "print(time.time() - process_start_time(), _IMPORTED - process_start_time())")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    late = subprocess.run(["bash", "-c", f"sleep 7 && exec {sys.executable} -c '{code}'"], capture_output=True, text=True,
                          env=env, timeout=300)
    age, lead = map(float, late.stdout.split())
    assert age < 7 and lead == 0, late.stdout                  # not the shell's 7 s: maxpost's first import
    alone = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    age, lead = map(float, alone.stdout.split())
    assert 0 < lead < age, alone.stdout                         # the interpreter's own start, before maxpost's import


def test_the_summary_is_the_mean_of_the_last_steps_not_one_batch(tmp_path):
    """Issue 49 item 6: SmolLM2's 5-step first look ended on `reward=0`, one batch with no right answer, beside a
    held-out pass@1 that had risen. The summary a run returns (and prints) averages its training metrics over the logged
    steps of its last max(5, steps // 10) steps; a rerun of the finished run says the same."""
    cfg = load_config("sft", [f"base_output_directory={tmp_path}", "run_name=s", "steps=4", "log_period=1",
                              "eval_interval=0", "checkpoint_period=4", *SMALL])
    out = start_trainer(SFTTrainer, cfg, progress=False).fit(progress=False)
    losses = [r["loss"] for r in read_metrics(run_dir(cfg), "train")]
    assert len(losses) == 4 and losses[-1] != pytest.approx(np.mean(losses))
    assert out["loss"] == pytest.approx(np.mean(losses), rel=1e-6)
    again = start_trainer(SFTTrainer, cfg, progress=False).fit(progress=False)
    assert again["already_finished"] and again["loss"] == pytest.approx(out["loss"], rel=1e-6)
