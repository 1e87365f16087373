"""DAPO's dynamic sampling in `maxpost rl` (issue 50 item 1): the batch the update receives holds only groups whose
rewards have spread, padded with rows of zero loss weight to one fixed shape; no program compiles after the first
round; the `dynamic_sampling/*` metrics count what the rewards say happened; it runs in every loop (asynchronous,
LoRA, episodes, another rollout engine); `max_sampling_rounds` alone is refused in one line."""
import os, subprocess, sys
from pathlib import Path

import jax, jax.numpy as jnp, numpy as np, pytest
from jax._src.dispatch import BACKEND_COMPILE_EVENT

from maxpost.commands import start_trainer
from maxpost.config import load_config
from maxpost.rl import RLTrainer
from maxpost.rundir import read_metrics
from maxpost.sharding import shard_batch

ROOT = Path(__file__).resolve().parent.parent
G, P = 4, 2                     # 2 prompts x 4 completions a round
SMALL = ["load_parameters_path=", "model_name=tiny", f"global_batch_size={G * P}", f"num_generations={G}",
         "mini_batch_size=0", "max_prompt_length=96", "max_completion_length=12", "eval_interval=0",
         "eval_num_prompts=4", "eval_k=2", "train_split=train[:64]", "learning_rate=1e-3", "log_period=1",
         "temperature=1.0", "reward_isolation=thread", "dynamic_sampling=true"]

TIE0, TIE1 = [0.0] * G, [1.0] * G               # a group with no spread: every completion scored alike
SPREAD_A, SPREAD_B = [0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]


def cfg_of(tmp_path, name, *extra):
    return load_config("rl", [f"base_output_directory={tmp_path}", f"run_name={name}", *SMALL, *extra])


class Scripted:
    "A reward that scores the k-th call (one round of P groups) by the k-th entry of `script`; records what it returned."
    def __init__(self, script): self.script, self.calls = script, []
    def __call__(self, prompts, completions, **kw):
        groups = self.script[len(self.calls) % len(self.script)]
        assert len(completions) == G * len(groups)
        r = [x for g in groups for x in g]
        self.calls.append(r)
        return list(r)


class Recorder:
    "An engine that passes every call to `inner` and keeps the completions and the seed of each."
    def __init__(self, inner): self.inner, self.rollouts, self.seeds = inner, [], []
    def generate(self, prompt_ids, **kw):
        r = self.inner.generate(prompt_ids, **kw)
        self.rollouts.append(np.array(r.completion_ids)); self.seeds.append(kw["seed"])
        return r
    def sync_weights(self, model): return self.inner.sync_weights(model)


def expected(calls, rollouts):
    "Counted here from the rewards alone: the groups with spread in round order, the first P of them fill the batch."
    spread = [(k, p) for k, r in enumerate(calls) for p in range(P) if max(r[p * G:(p + 1) * G]) > min(r[p * G:(p + 1) * G])]
    kept = spread[:P]
    return dict(rounds=len(calls), dropped=len(calls) * P - len(spread), filled=len(kept),
                ids=[rollouts[k][p * G:(p + 1) * G] for k, p in kept],
                reward=float(np.mean(np.concatenate(calls))))


# steps: [round, round, ...]; max_sampling_rounds=2. Step 0 runs out with 1 of 2 slots filled, step 1 fills at once,
# step 2 fills in its second round with one group with spread left over, step 3 finds none: every slot is padding.
STEPS = [[(TIE0, SPREAD_A), (TIE1, TIE0)], [(SPREAD_A, SPREAD_B)], [(SPREAD_B, TIE1), (SPREAD_A, SPREAD_B)],
         [(TIE0, TIE0), (TIE1, TIE1)]]


def test_the_update_sees_only_groups_with_spread_in_one_shape_and_padding_weighs_nothing(tmp_path):
    reward = Scripted([rnd for step in STEPS for rnd in step])
    tr = start_trainer(RLTrainer, cfg_of(tmp_path, "ds", "max_sampling_rounds=2", "beta=0.04"),
                       reward_fns=[(reward, 1.0, "scripted")])
    tr.engine = rec = Recorder(tr.engine)
    run_step, updates = tr.run_step, []
    def spy(name, *a):      # the update's inputs (before it donates them) and the weights it returns
        if name != "step_fn": return run_step(name, *a)
        before = (jax.device_get(a[0]), jax.device_get(a[2]), jax.device_get(a[3]))
        out = run_step(name, *a)
        updates.append((*before, jax.device_get(out[0]), jax.device_get(out[2])))
        return out
    tr.run_step = spy
    compiled = []
    listener = lambda event, duration, **kw: compiled.append(kw.get("fun_name")) if event == BACKEND_COMPILE_EVENT else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    infos, shapes, seen = [], [], 0
    try:
        for step, rounds in enumerate(STEPS):
            if step == 1: first_step, compiled[:] = list(compiled), []
            ro = tr.rollout(step)
            infos.append(tr.update(ro))
            n = len(rounds)
            want = expected(reward.calls[seen:seen + n], rec.rollouts[seen:seen + n])
            seen += n
            info, (_, _, mb, _, _) = infos[-1], updates[-1]
            shapes.append({k: v.shape for k, v in mb.items()})
            # what happened, counted from the rewards, against the metrics
            assert info["dynamic_sampling/rounds"] == want["rounds"] == n
            assert info["dynamic_sampling/prompts_drawn"] == n * P
            assert info["dynamic_sampling/groups_dropped"] == want["dropped"]
            assert info["dynamic_sampling/filled_fraction"] == want["filled"] / P
            assert abs(info["reward"] - want["reward"]) < 1e-6            # the rollout metrics: all that was sampled
            # the batch the update received: the kept groups in round order, then padding rows of no weight
            f = want["filled"] * G
            ids, mask, adv = mb["completion_ids"], mb["completion_mask"], mb["advantages"]
            np.testing.assert_array_equal(ids[:f], np.concatenate(want["ids"]) if f else ids[:0])
            assert (mask[:f].sum(1) > 0).all() and (mask[f:] == 0).all() and (adv[f:] == 0).all()
            live = adv[:f].reshape(-1, G)
            assert (np.abs(live).max(1) > 0).all()                        # no zero-spread group reaches the update
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert all(s == shapes[0] for s in shapes) and shapes[0]["completion_ids"] == (G * P, 12), shapes
    assert first_step.count("jit(_refill)") == 1, first_step           # step 0's two rounds: one refill program
    assert compiled == [], compiled        # steps 1-3 (five rounds, a full and an empty batch): nothing compiles
    assert len(set(rec.seeds)) == len(rec.seeds)                        # every round samples with its own seed
    assert [i["dynamic_sampling/filled_fraction"] for i in infos] == [0.5, 1.0, 1.0, 0.0]
    # padding weighs nothing: the same update with anything else in the padding rows moves the weights identically
    for step in (0, 3):
        params, opt_state, mb, after, metrics = updates[step]
        f = int(infos[step]["dynamic_sampling/filled_fraction"] * P) * G
        other = {k: np.array(v) for k, v in mb.items()}
        rng = np.random.default_rng(step)
        other["completion_ids"][f:] = rng.integers(3, 50, other["completion_ids"][f:].shape)
        other["advantages"][f:] = rng.normal(size=other["advantages"][f:].shape) * 3
        for k in ("sampler_logps", "ref_per_token_logps"):
            if k in other: other[k][f:] = -rng.random(other[k][f:].shape)
        fresh = lambda t: jax.tree.map(jnp.array, t)
        with jax.set_mesh(tr.mesh):
            moved, _, m2 = run_step("step_fn", fresh(params), tr.rest, fresh(opt_state), shard_batch(other, tr.mesh))
        for a, b in zip(jax.tree.leaves(jax.device_get(moved)), jax.tree.leaves(after)):
            np.testing.assert_array_equal(a, b)
        assert float(m2["loss"]) == float(metrics["loss"])


TIE_FIRST = [(TIE0, SPREAD_A)]      # every round: the first group ties, the second has spread -> two rounds a step


def _engine_stub():
    "Another rollout engine (as vLLM is to the trainer): random completions from its own seed, recorded."
    from maxpost.sampling import Rollout, left_pad
    class Stub:
        seeds = []
        def generate(self, prompt_ids, *, num_generations, max_prompt_length, max_completion_length, pad_id, seed, **kw):
            self.seeds.append(seed)
            B, T = len(prompt_ids) * num_generations, max_completion_length
            ids, mask, _ = left_pad(prompt_ids, max_prompt_length, pad_id, 16)
            c = np.random.default_rng(seed).integers(3, 60, (B, T)).astype(np.int32)
            return Rollout(np.repeat(ids, num_generations, 0), np.repeat(mask, num_generations, 0), c,
                           np.ones((B, T), np.int32), np.full((B, T), -2.0, np.float32), ["x"] * B)
        def sync_weights(self, model): return 0.0
    return Stub()


@pytest.mark.parametrize("loop", ["async", "lora", "episodes", "engine"])
def test_dynamic_sampling_runs_in_every_loop(tmp_path, loop):
    """Two steps of each loop with a reward whose first group always ties: each step takes two rounds, drops two
    groups and trains a full batch; the asynchronous loop's producer thread, LoRA's adapters, episodes and another
    rollout engine (vLLM's place) each go through the same rounds."""
    from maxpost.async_rl import AsyncRLTrainer
    extra = {"async": ["max_staleness=1"], "lora": ["lora_rank=4", "lora_alpha=8"], "engine": [],
             "episodes": ["model_overrides={num_layers: 1}", "environment=calculator", "max_turns=2",
                          "max_turn_tokens=6", "max_episode_tokens=16", "eval_k=0"]}[loop]
    cfg = cfg_of(tmp_path, loop, "steps=2", *extra)
    kw = {"engine": _engine_stub()} if loop == "engine" else {}
    tr = start_trainer(AsyncRLTrainer if loop == "async" else RLTrainer, cfg,
                       reward_fns=[(Scripted(TIE_FIRST), 1.0, "scripted")], **kw)
    assert tr.fit(progress=False)["step"] == 2
    recs = list(read_metrics(tmp_path / loop, "train"))
    assert [(r["dynamic_sampling/rounds"], r["dynamic_sampling/groups_dropped"], r["dynamic_sampling/prompts_drawn"],
             r["dynamic_sampling/filled_fraction"]) for r in recs] == [(2, 2, 2 * P, 1.0)] * 2, recs
    assert all(abs(r["frac_reward_zero_std"] - 0.5) < 1e-9 for r in recs)    # of what was sampled: 1 group of 2
    if loop == "engine": assert len(set(kw["engine"].seeds)) == len(kw["engine"].seeds) == 4


def test_max_sampling_rounds_without_dynamic_sampling_is_refused_in_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "maxpost.cli", "rl", "load_parameters_path=", "max_sampling_rounds=8",
                        f"base_output_directory={tmp_path}"], env=env, capture_output=True, text=True, timeout=300)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "max_sampling_rounds=8" in lines[0] and "dynamic_sampling=true" in lines[0], lines
    from maxpost.rl import recipe_problems
    assert recipe_problems(load_config("rl", [f"base_output_directory={tmp_path}", "run_name=ok",
                                              "dynamic_sampling=true", "max_sampling_rounds=8"])) == []
