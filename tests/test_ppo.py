"""PPO with a critic (`maxpost rl advantage_estimator=gae`, chapter 15f_ppo) at trainer level on the tiny model: the
advantages of an update equal a plain NumPy GAE loop fed with the critic's own values and the scores, whitened as
TRL's PPOTrainer; the critic's loss equals the clipped value loss computed in NumPy from its values before and after
an update; warm-up trains the critic alone; the critic's weights and optimizer state are in the memory check's
programs and in every checkpoint; PPO's keys are refused in one line where they do not apply."""
import subprocess, sys

import jax, numpy as np, pytest
from flax import nnx

from maxpost.config import ConfigError, load_config
from maxpost.commands import start_trainer
from maxpost.memory import memory_needed
from maxpost.ppo import PPOTrainer, critic_values
from maxpost.sampling import _teacher_forced_inputs
from maxpost.train import RunCheckpoints, _resume

from rewards_for_tests import length_reward

SMALL = ["load_parameters_path=", "model_name=tiny", "global_batch_size=8", "num_generations=4", "mini_batch_size=0",
         "max_prompt_length=96", "max_completion_length=12", "eval_interval=0", "eval_num_prompts=4", "eval_k=2",
         "train_split=train[:64]", "learning_rate=1e-3", "log_period=1", "temperature=1.0", "beta=0",
         "advantage_estimator=gae"]


def ppo_cfg(tmp_path, *extra, name="t"):
    return load_config("rl", [f"base_output_directory={tmp_path}", f"run_name={name}", *SMALL, *extra])


def trainer(tmp_path, *extra, name="t"):
    return start_trainer(PPOTrainer, ppo_cfg(tmp_path, *extra, name=name), reward_fns=[(length_reward, 1.0, "length")])


def copy(tree): return jax.tree.map(np.array, tree)   # np.array, not asarray: the steps donate (reuse) the buffers


def numpy_gae(scores, values, mask, gamma, lam):
    "A plain loop over each row's completion tokens (right to left): the score on the last one, V = 0 past it."
    adv = np.zeros(values.shape, np.float64)
    for b in range(len(scores)):
        idx = np.nonzero(mask[b])[0]
        nxt_v = nxt_a = 0.0
        for j, t in enumerate(idx[::-1]):
            r = float(scores[b]) if j == 0 else 0.0
            delta = r + gamma * nxt_v - float(values[b, t])
            adv[b, t] = nxt_a = delta + gamma * lam * nxt_a
            nxt_v = float(values[b, t])
    return adv


def numpy_whiten(adv, mask):
    "TRL's masked_whiten: (x - mean) / sqrt(unbiased var + 1e-8) over the masked tokens."
    x = adv[mask > 0]
    return np.where(mask > 0, (adv - x.mean()) / np.sqrt(x.var(ddof=1) + 1e-8), 0.0)


def numpy_values(tr, params, b):
    "The critic's values from its own forward pass: its head's weight times the hidden state before each completion token."
    critic = nnx.merge(tr.critic_graphdef, params, tr.critic_rest)
    P, T = b["prompt_ids"].shape[1], b["completion_ids"].shape[1]
    with jax.set_mesh(tr.mesh):
        h = np.asarray(critic(*_teacher_forced_inputs(*(np.asarray(b[k], np.int32) for k in ("prompt_ids", "prompt_mask",
                                                                                              "completion_ids"))),
                              return_hidden=True), np.float64)
    return np.where(b["completion_mask"] > 0, h[:, P - 1:P + T - 1] @ np.asarray(params["score"]["weight"], np.float64), 0.0)


def test_the_update_s_advantages_are_gae_of_the_critic_s_values(tmp_path):
    tr = trainer(tmp_path, "gamma=0.99", "lam=0.9", "critic_warmup_steps=1", "critic_learning_rate=0.01")
    tr.update(tr.rollout()); tr.step += 1            # the warm-up: the critic's head is no longer 0
    ro = tr.rollout()
    scores, mask, before = np.asarray(ro["batch"]["advantages"]), ro["batch"]["completion_mask"], copy(tr.critic_params)
    np.testing.assert_allclose(scores, [length_reward(None, [t])[0] for t in ro["text"]], atol=1e-6)   # the scores, as they are
    tr.update(ro)
    values = tr.last_critic_batch["old_values"]
    np.testing.assert_allclose(values, numpy_values(tr, before, ro["batch"]), atol=2e-5)
    assert np.abs(values[mask > 0]).min() > 0        # a critic that has learned something: not the zero head's values
    want = numpy_whiten(numpy_gae(scores, values.astype(np.float64), mask, 0.99, 0.9), mask)
    np.testing.assert_allclose(tr.last_batch["advantages"], want, atol=2e-5)   # what the policy's update took
    np.testing.assert_allclose(tr.last_critic_batch["returns"][mask > 0],
                               (numpy_gae(scores, values.astype(np.float64), mask, 0.99, 0.9) + values)[mask > 0], atol=2e-5)


def numpy_k3(lp, ref):
    "Schulman's k3 estimate of KL[pi || pi_ref] per token: exp(ref - lp) - (ref - lp) - 1."
    d = ref.astype(np.float64) - lp.astype(np.float64)
    return np.exp(d) - d - 1


def test_with_beta_the_kl_penalty_is_a_reward_on_every_token(tmp_path):
    "beta > 0: r_t = -beta k3_t on every completion token, plus the score on the last (TRL's PPOTrainer), and no KL term in the loss."
    tr = trainer(tmp_path, "beta=0.5", "num_iterations=2", "learning_rate=3e-3")
    tr.update(tr.rollout()); tr.step += 1            # the policy moves away from the reference
    ro = tr.rollout()
    scores, mask = np.asarray(ro["batch"]["advantages"]), ro["batch"]["completion_mask"]
    info = tr.update(ro)
    lp, ref = tr.last_batch["old_per_token_logps"], tr.last_batch["ref_per_token_logps"]
    kl = np.where(mask > 0, numpy_k3(lp, ref), 0.0)
    assert kl[mask > 0].mean() > 1e-4                # a penalty that matters
    np.testing.assert_allclose(info["kl"], kl[mask > 0].mean(), rtol=1e-3)
    values, rewards = tr.last_critic_batch["old_values"].astype(np.float64), -0.5 * kl
    for b in range(len(scores)):
        if mask[b].any(): rewards[b, np.nonzero(mask[b])[0][-1]] += scores[b]
    adv = np.zeros_like(values)                      # the same loop as numpy_gae, on per-token rewards
    for b in range(len(scores)):
        nxt_v = nxt_a = 0.0
        for t in np.nonzero(mask[b])[0][::-1]:
            adv[b, t] = nxt_a = rewards[b, t] + nxt_v - values[b, t] + 0.95 * nxt_a
            nxt_v = values[b, t]
    np.testing.assert_allclose(tr.last_batch["advantages"], numpy_whiten(adv, mask), atol=5e-5)
    for m in tr.last_update_metrics:                 # and not in the loss: the policy's loss is its surrogate alone
        assert m["loss/kl"] > 0 and abs(m["loss"] - m["loss/policy"]) < 1e-7, m


def test_the_value_loss_is_the_clipped_formula_of_the_values_before_and_after(tmp_path):
    tr = trainer(tmp_path, "num_iterations=2", "cliprange_value=0.01", "vf_coef=0.5")
    seen, step = [], tr.critic_step
    def recording(params, rest, opt_state, mb):
        seen.append((copy(params), jax.tree.map(np.asarray, mb)))
        return step(params, rest, opt_state, mb)
    tr.critic_step = recording
    ro = tr.rollout()
    tr.update(ro)
    assert len(seen) == 2 == len(tr.last_critic_metrics)
    (p1, mb), (p2, _) = seen
    old, ret, m = tr.last_critic_batch["old_values"], tr.last_critic_batch["returns"], mb["completion_mask"] > 0
    np.testing.assert_allclose(numpy_values(tr, p1, mb), old, atol=2e-5)   # the first pass: the rollout's values
    v = numpy_values(tr, p2, mb)                                           # the second: after one critic step
    clipped = np.clip(v, old - 0.01, old + 0.01)
    want = 0.5 * np.maximum((v - ret) ** 2, (clipped - ret) ** 2)[m].mean()
    np.testing.assert_allclose(tr.last_critic_metrics[1]["loss/value"], want, rtol=1e-4)
    frac = ((clipped - ret) ** 2 > (v - ret) ** 2)[m].mean()
    assert frac > 0 and abs(tr.last_critic_metrics[1]["value/clipfrac"] - frac) < 1e-6   # the clip acted on some tokens
    np.testing.assert_allclose(tr.last_critic_metrics[0]["loss/value"], 0.5 * ((old - ret) ** 2)[m].mean(), rtol=1e-4)


def test_warm_up_trains_the_critic_alone(tmp_path):
    tr = trainer(tmp_path, "critic_warmup_steps=1")
    p0, c0 = copy(tr.params), copy(tr.critic_params)
    info = tr.update(tr.rollout())
    assert info["critic_warmup"] == 1.0 and info["loss"] == info["loss/value"]
    assert jax.tree.all(jax.tree.map(np.array_equal, p0, copy(tr.params)))            # the policy did not move
    assert not np.array_equal(c0["score"]["weight"], np.asarray(tr.critic_params["score"]["weight"]))
    tr.step += 1
    c1 = copy(tr.critic_params)
    assert tr.update(tr.rollout())["critic_warmup"] == 0.0
    assert not jax.tree.all(jax.tree.map(np.array_equal, p0, copy(tr.params)))        # then both
    assert not jax.tree.all(jax.tree.map(np.array_equal, c1, copy(tr.critic_params)))


def shard_bytes(tree):
    "Bytes of `tree` on the first device (what a compiled program's memory analysis counts per device)."
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def test_the_memory_check_counts_the_critic_s_weights_and_optimizer_state(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MAXPOST_DEVICE_MEMORY", str(64 << 30))
    tr = trainer(tmp_path, "check_memory=true")
    tr.update(tr.rollout())
    said = capsys.readouterr().err
    assert "memory: the critic's update needs" in said and "memory: the critic's values needs" in said, said
    (key, program), = tr.critic_step.programs.items()
    critic = shard_bytes(tr.critic_params) + shard_bytes(tr.critic_opt_state) + shard_bytes(tr.critic_rest)
    assert critic > shard_bytes(tr.critic_params) > 0
    batch = sum(np.prod(s) * d.itemsize for s, d, _ in key[1][-6:]) // len(jax.devices())   # the mini-batch's 6 arrays
    assert memory_needed(program)["arguments"] == critic + batch


def test_a_checkpoint_holds_the_critic_and_a_resume_restores_it(tmp_path):
    tr = trainer(tmp_path, "steps=1", "checkpoint_period=1")
    tr.fit(progress=False)
    saved = copy((tr.critic_params, tr.critic_opt_state))
    tr2 = trainer(tmp_path, "steps=2", "checkpoint_period=1")
    fresh = copy(tr2.critic_params)
    ckpts = RunCheckpoints(tr2.cfg, tr2.model_cfg, tr2.tok_dir)
    try: _resume(tr2, ckpts)
    finally: ckpts.close()
    assert tr2.step == 1
    assert not np.array_equal(fresh["score"]["weight"], saved[0]["score"]["weight"])
    assert jax.tree.all(jax.tree.map(np.array_equal, saved, copy((tr2.critic_params, tr2.critic_opt_state))))


@pytest.mark.parametrize("extra,says", [
    (["advantage_estimator=grpo", "lam=0.9"], "lam=0.9 applies to PPO's critic, but advantage_estimator=grpo"),
    (["advantage_estimator=rloo", "vf_coef=0.5"], "vf_coef=0.5 applies to PPO's critic, but advantage_estimator=rloo"),
    (["advantage_estimator=grpo", "gamma=0.9"], "gamma=0.9 applies to PPO's critic"),
    (["advantage_estimator=grpo", "cliprange_value=0.5"], "cliprange_value=0.5 applies to PPO's critic"),
    (["advantage_estimator=grpo", "critic_path=/x"], "critic_path=/x applies to PPO's critic"),
    (["advantage_estimator=grpo", "critic_learning_rate=1e-4"], "critic_learning_rate=0.0001 applies to PPO's critic"),
    (["advantage_estimator=grpo", "critic_warmup_steps=3"], "critic_warmup_steps=3 applies to PPO's critic"),
    (["loss_algo=gspo"], "loss_algo=gspo takes one per completion"),
    (["advantage_scale=batch"], "advantage_scale=batch scales group-relative advantages"),
    (["max_staleness=1"], "max_staleness=1 needs the asynchronous one"),
    (["environment=calculator"], "environment=calculator runs episodes"),
    (["lora_rank=4"], "set lora_rank=0"),
    (["lam=1.5"], "lam=1.5"),
])
def test_ppo_s_keys_are_refused_where_they_do_not_apply(tmp_path, extra, says):
    with pytest.raises(ConfigError) as e: ppo_cfg(tmp_path, *extra)
    assert says in str(e.value), str(e.value)


def test_the_cli_refuses_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "maxpost.cli", "rl", f"base_output_directory={tmp_path}", *SMALL[:-1],
                        "critic_warmup_steps=2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "critic_warmup_steps=2 applies to PPO's critic, but advantage_estimator=grpo" in lines[0], r.stderr
