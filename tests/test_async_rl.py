"""Asynchronous RL (issue 30, item 2; chapter 15c): k = 0 is the synchronous trainer bit for bit; no trained batch ever
lags more than k versions, whatever the speeds of producer and trainer; a k = 1 run trains end to end with the
correction against pi_prox; a k = 1 run killed after a checkpoint resumes to a consistent record."""
import json, random, time
from pathlib import Path

import jax, jax.numpy as jnp, numpy as np, pytest

from maxpost.config import load_config, ConfigError
from maxpost.commands import start_trainer
from maxpost import sharding
from maxpost.rl import RLTrainer, SamplerEngine
from maxpost.async_rl import AsyncRLTrainer, RolloutProducer
from maxpost.rundir import read_metrics

from rewards_for_tests import length_reward   # rewards that differ within a group: the policy moves every step

SMALL = ["load_parameters_path=", "model_name=tiny", "model_overrides={num_layers: 1}", "global_batch_size=8",
         "num_generations=4", "mini_batch_size=0", "max_prompt_length=96", "max_completion_length=8",
         "eval_interval=0", "eval_num_prompts=2", "eval_k=0", "train_split=train[:64]", "learning_rate=1e-3",
         "log_period=1", "temperature=1.0", "beta=0", "reward_isolation=thread"]
LENGTH = [(length_reward, 1.0, "length")]


def cfg_of(tmp_path, name, *extra):
    return load_config("rl", [f"base_output_directory={tmp_path}", f"run_name={name}", *SMALL, *extra])


def meta(run, step):
    return json.loads((run / "checkpoints" / str(step) / "meta" / "metadata").read_text())


VARYING = ("timing/", "tokens_per_s", "mfu")   # wall-clock measurements (and rewards/<name>/seconds): the only
                                                # fields two equal runs may differ in


def test_k0_is_the_synchronous_trainer_bit_for_bit(tmp_path):
    runs = {}
    for name, cls in (("sync", RLTrainer), ("k0", AsyncRLTrainer)):
        tr = start_trainer(cls, cfg_of(tmp_path, name, "steps=3"), reward_fns=LENGTH)
        tr.fit(progress=False)
        assert getattr(tr, "producer", None) is None          # no thread was started
        runs[name] = (read_metrics(tmp_path / name), jax.device_get(tr.params))
    (a, pa), (b, pb) = runs["sync"], runs["k0"]
    strip = lambda recs: [{k: v for k, v in r.items() if not (k.startswith(VARYING) or k.endswith("/seconds"))} for r in recs]
    assert len(a) == len(b)
    for x, y in zip(strip(a), strip(b)):
        assert x == y, {k: (x[k], y.get(k)) for k in x if x[k] != y.get(k)}
    assert any(r.get("loss", 0) != 0 for r in a)              # the policy moved: the comparison is not of zeros
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)): np.testing.assert_array_equal(x, y)


def _pattern(k, rollout_s, update_s, steps, seed, sync=1):
    "One producer / trainer race with random sleeps, weights published every `sync` steps with AsyncRLTrainer's `ahead`; returns what was trained on and the producer."
    rng, t_rng = random.Random(seed), random.Random(seed + 7)
    def rollout(weights, index):
        time.sleep(rollout_s * rng.random()); return {"weights": weights, "index": index}
    p, trained = RolloutProducer(rollout, k, weights=("w", 0), version=0, ahead=k - sync + 1), []
    for step in range(steps):
        ro, lag = p.next(step)
        trained.append((step, ro["version"], ro["weights"], ro["index"], lag, p.index))
        time.sleep(update_s * t_rng.random())
        if (step + 1) % sync == 0: p.publish(("w", step + 1), step + 1)
    p.close()
    return trained, p


def test_no_trained_batch_lags_more_than_k():
    """Many random speed patterns (producer faster, slower, both jittery) and weights published every w <= k steps:
    every batch trained on was made by the one snapshot its version names, lags the trainer by at most k, versions
    never go backwards, no rollout is made only to be dropped (the producer starts one only when it will be trained on
    in time), and the producer never has more than k - w + 1 rollouts finished beyond those taken."""
    seen = set()
    for seed in range(24):
        r = random.Random(seed)
        k = r.choice([1, 1, 2, 3])
        sync = r.choice(range(1, k + 1))
        rollout_s, update_s = r.choice([0.0005, 0.003, 0.01]), r.choice([0.0005, 0.003, 0.01])
        trained, p = _pattern(k, rollout_s, update_s, steps=15, seed=seed, sync=sync)
        for step, version, weights, index, lag, made in trained:
            assert weights == ("w", version) and version % sync == 0, (seed, step, version, weights)
            assert lag == step - version and 0 <= lag <= k, (seed, k, sync, step, version)
            assert made - (step + 1) <= k - sync + 1, (seed, k, sync, step, made)
        assert [v for _, v, *_ in trained] == sorted(v for _, v, *_ in trained)
        assert [i for _, _, _, i, *_ in trained] == list(range(len(trained))) and p.dropped == 0   # none made in vain
        assert sum(p.staleness.values()) == len(trained)
        seen |= {(k, lag) for *_, lag, _ in trained}
    assert {(1, 1), (2, 2), (3, 3)} <= seen   # the patterns reached the bound


def test_rollouts_on_devices_of_their_own(tmp_path):
    """rollout_devices=4 of 8: the trainer's weights live on devices 0-3 only, the producer's snapshot on 4-7 only (a
    copy off the trainer's devices), and sampling there gives the completions and log-probs that the trainer's own
    mesh gives from the same weights, prompts and seed (data-parallel sampling changes nothing but where it runs)."""
    tr = start_trainer(AsyncRLTrainer, cfg_of(tmp_path, "split", "steps=2", "max_staleness=1", "rollout_devices=4"), reward_fns=LENGTH)
    try:
        tr.fit(progress=False)                       # a step moves the weights, so the copy has something to carry
        devices = lambda tree: {d.id for x in jax.tree.leaves(tree) for d in x.devices()}
        assert devices(tr.params) == {0, 1, 2, 3} and devices(tr.opt_state) <= {0, 1, 2, 3}
        snap = tr.snapshot()
        assert devices(snap) == {4, 5, 6, 7}
        tr.rollout_rest = sharding.shard_state(tr.rest, tr.rollout_mesh)
        state = tr.prompts.state()
        there = tr.produce(snap, 7)
        tr.prompts.restore(state)
        with jax.set_mesh(tr.mesh): here = tr.rollout(7, SamplerEngine(tr.model, tr.tokenizer))
        assert there["examples"] == here["examples"]
        np.testing.assert_array_equal(there["batch"]["completion_ids"], here["batch"]["completion_ids"])
        m = here["batch"]["completion_mask"] > 0
        np.testing.assert_allclose(there["sampler_logps"][m], here["sampler_logps"][m], atol=1e-5)
    finally: tr.close()


class Recording(AsyncRLTrainer):
    "Keeps a copy of the trainer's weights after every step (version -> weights) and every batch it trains on."
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.history, self.consumed = {0: jax.tree.map(jnp.copy, self.params)}, []
    def update(self, ro):
        self.consumed.append(ro); return super().update(ro)
    def train_step(self):
        info = super().train_step()
        self.history[self.step + 1] = jax.tree.map(jnp.copy, self.params); return info


def test_k1_trains_end_to_end_with_the_correction(tmp_path):
    """k = 1: every batch lags at most one version and was generated by exactly the weights its version names (the
    sampler's log-probs are the teacher-forced log-probs of the trainer's weights after that many steps, and not of
    the next version's); the default correction is token_truncate against pi_prox: a batch of lag 0 shows only
    rounding between sampler and trainer, one of lag 1 a real difference."""
    cfg = cfg_of(tmp_path, "k1", "steps=5", "max_staleness=1")
    assert cfg.importance_sampling_mode == "token_truncate"
    tr = start_trainer(Recording, cfg, reward_fns=LENGTH)
    out = tr.fit(progress=False)
    assert out["step"] == 5 and tr.producer is None            # closed
    rec = read_metrics(tmp_path / "k1", "train")
    assert [r["step"] for r in rec] == [1, 2, 3, 4, 5]
    lags = [r["async/staleness"] for r in rec]
    assert max(lags) <= 1 and lags[0] == 0 and 1 in lags, lags
    assert [s - ro["version"] for s, ro in enumerate(tr.consumed)] == lags
    with jax.set_mesh(tr.mesh):
        for ro in tr.consumed:
            v, b, m = ro["version"], ro["batch"], ro["batch"]["completion_mask"] > 0
            own = np.asarray(tr.logps_fn(tr.history[v], tr.rest, b))[m]
            np.testing.assert_allclose(own, ro["sampler_logps"][m], atol=1e-3)
            assert np.abs(np.asarray(tr.logps_fn(tr.history[v + 1], tr.rest, b))[m] - own).max() > 1e-2
    for r in rec:
        for key in ("sampling/importance_sampling_ratio/mean", "sampling/sampling_logp_difference/mean", "async/dropped"):
            assert key in r, key
        diff = r["sampling/sampling_logp_difference/mean"]
        assert (diff < 1e-4) if r["async/staleness"] == 0 else (diff > 1e-3), (r["step"], r["async/staleness"], diff)
    assert [r["async/dropped"] for r in rec] == sorted(r["async/dropped"] for r in rec)


def test_the_synchronous_trainer_refuses_a_staleness(tmp_path):
    with pytest.raises(ConfigError, match="AsyncRLTrainer"): start_trainer(RLTrainer, cfg_of(tmp_path, "s", "max_staleness=1"))
    with pytest.raises(ConfigError, match="set rollout_devices=0"): cfg_of(tmp_path, "v", "max_staleness=1",
                                                                          "rollout_engine=vllm", "rollout_devices=4")
    with pytest.raises(ConfigError, match="set max_staleness >= 1"): cfg_of(tmp_path, "d", "rollout_devices=4")
    with pytest.raises(ConfigError, match="set max_staleness >= 2"): cfg_of(tmp_path, "w", "max_staleness=1",
                                                                           "weight_sync_steps=2")


class Killed(Exception): pass


class KilledAfter(AsyncRLTrainer):
    "Dies (as a kill would, between two checkpoints) when it is about to take step `at + 1`."
    at = 3
    def train_step(self):
        if self.step == self.at: raise Killed()
        return super().train_step()


def test_a_killed_k1_run_resumes_consistently(tmp_path):
    """k = 1, checkpoints every 2 steps, killed after step 3: the rerun resumes from checkpoint 2 (the queue's rollouts
    are lost, the producer restarts from the checkpointed weights) and finishes. One record per step; each checkpoint's
    prompt position counts the rollouts trained on or dropped, never the ones still queued or under way."""
    run, extra = tmp_path / "r", ["steps=5", "max_staleness=1", "checkpoint_period=2"]
    with pytest.raises(Killed): start_trainer(KilledAfter, cfg_of(tmp_path, "r", *extra), reward_fns=LENGTH).fit(progress=False)
    assert sorted(int(d.name) for d in (run / "checkpoints").iterdir() if d.name.isdigit()) == [2]
    first = {r["step"]: r for r in read_metrics(run, "train")}
    assert sorted(first) == [1, 2, 3]
    per_step, pos2 = 8 // 4, meta(run, 2)["data"]["position"]    # prompts per rollout; checkpoint 2's position
    assert pos2 == per_step * (2 + first[2]["async/dropped"])
    tr = start_trainer(AsyncRLTrainer, cfg_of(tmp_path, "r", *extra), reward_fns=LENGTH)
    assert tr.fit(progress=False)["step"] == 5
    rec = read_metrics(run, "train")
    assert [r["step"] for r in rec] == [1, 2, 3, 4, 5]         # step 3 of the killed run replaced by the rerun's
    assert rec[2]["async/staleness"] == 0                       # the resumed producer starts from the checkpoint
    assert all(r["async/staleness"] <= 1 for r in rec)
    assert meta(run, 5)["data"]["position"] == pos2 + per_step * (3 + rec[-1]["async/dropped"])


def test_maxpost_rl_with_k1_resumes_after_sigkill(tmp_path):
    """The real thing through the CLI: `maxpost rl max_staleness=1` is killed (SIGKILL, queue and thread included) after
    a checkpoint and rerun: it resumes from the last checkpoint and finishes with one record per step, no lag above 1,
    and a prompt position that counts exactly the rollouts trained on or dropped since that checkpoint."""
    import os, signal, subprocess, sys
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    run, steps = tmp_path / "cli", 8
    cmd = [sys.executable, "-m", "maxpost.cli", "rl", f"base_output_directory={tmp_path}", "run_name=cli", *SMALL,
           f"steps={steps}", "max_staleness=1", "checkpoint_period=2", "reward_functions=[correctness, format]"]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ck, deadline = run / "checkpoints", time.time() + 600
    while time.time() < deadline and not (ck / "4" / "meta" / "metadata").exists() and p.poll() is None: time.sleep(0.01)
    p.send_signal(signal.SIGKILL); p.wait()
    done = sorted(int(d.name) for d in ck.iterdir() if d.name.isdigit() and (d / "meta" / "metadata").exists())
    assert done and max(done) < steps, f"the run finished before it could be killed: {done}"
    start = max(done); pos = meta(run, start)["data"]["position"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = read_metrics(run, "train")
    assert [x["step"] for x in rec] == list(range(1, steps + 1))
    assert all(x["async/staleness"] <= 1 for x in rec) and rec[start]["async/staleness"] == 0   # fresh producer
    assert meta(run, steps)["data"]["position"] == pos + 2 * (steps - start + rec[-1]["async/dropped"])
