"""The recipes of issue 50 wired into `maxpost rl` (CISPO, RLOO, DAPO's overlong shaping): the advantages, rewards,
masks and losses that a trainer's step uses equal NumPy ports of the formulas on the same rollout (TRL's RLOO and
CISPO, the DAPO paper's soft overlong punishment, TRL's mask_truncated_completions), and each new key is refused in
one line where it does not apply."""
import subprocess, sys

import jax, jax.numpy as jnp, numpy as np, pytest

from maxpost.config import ConfigError, load_config
from maxpost.commands import start_trainer
from maxpost.policy_loss import CISPO_EPSILONS
from maxpost.rl import RLTrainer, SamplerEngine
from maxpost.sharding import shard_batch

from rewards_for_tests import length_reward

SMALL = ["load_parameters_path=", "model_name=tiny", "global_batch_size=8", "num_generations=4", "mini_batch_size=0",
         "max_prompt_length=96", "max_completion_length=12", "eval_interval=0", "eval_num_prompts=4", "eval_k=2",
         "train_split=train[:64]", "learning_rate=1e-3", "log_period=1", "temperature=1.0", "beta=0"]


def rl_cfg(tmp_path, *extra):
    return load_config("rl", [f"base_output_directory={tmp_path}", "run_name=t", *SMALL, *extra])


class CutEngine:
    """maxpost's sampler whose completions are then cut to lengths 3..T, every other one ending at a stop token and
    the rest cut off without one (a random tiny policy never stops by itself): lengths and truncation vary by row."""
    def __init__(self, tr, seed=0):
        self.inner, self.rng = SamplerEngine(tr.model, tr.tokenizer), np.random.default_rng(seed)
        self.eos, self.raw = tr.sampling["eos_ids"][0], []

    def generate(self, prompt_ids, **kw):
        r = self.inner.generate(prompt_ids, **kw)
        ids, mask = np.array(r.completion_ids), np.array(r.completion_mask)
        T = ids.shape[1]
        for i in range(len(ids)):
            n = int(self.rng.integers(3, T + 1))
            ids[i, n:], mask[i] = kw["pad_id"], 0
            mask[i, :n] = 1
            if i % 2: ids[i, n - 1] = self.eos
            elif ids[i, n - 1] == self.eos: ids[i, n - 1] = self.eos + 1
        r.completion_ids, r.completion_mask = ids, mask
        self.raw.append((ids.copy(), mask.copy(), list(r.text)))
        return r

    def sync_weights(self, model): return self.inner.sync_weights(model)


def trainer(tmp_path, *extra, cut=False):
    tr = start_trainer(RLTrainer, rl_cfg(tmp_path, *extra), reward_fns=[(length_reward, 1.0, "length")])
    if cut: tr.engine = CutEngine(tr)
    return tr


def numpy_rewards(texts):
    return np.array([len(t) / 50 for t in texts], np.float64)   # length_reward, recomputed


def numpy_grpo(r, G, eps=1e-6):
    "Group-relative advantages with the group's std (ddof 1); a group of equal rewards gets exactly 0."
    g = r.reshape(-1, G)
    adv = (g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + eps)
    return np.where(g.max(1, keepdims=True) == g.min(1, keepdims=True), 0.0, adv).reshape(-1)


def numpy_rloo(r, G, normalize=False):
    """TRL's RLOOTrainer (trl/trainer/rloo_trainer.py, `_generate_and_score_completions`) ported: the baseline of each
    completion is the mean of the other G - 1 rewards of its prompt; `normalize_advantages` whitens the batch's
    advantages with the unbiased std plus 1e-4."""
    g = r.reshape(-1, G)
    adv = (g - (g.sum(1, keepdims=True) - g) / (G - 1)).reshape(-1)
    return (adv - adv.mean()) / (adv.std(ddof=1) + 1e-4) if normalize else adv


def on_policy_grpo_loss(adv, mask):
    "GRPO's token-mean loss of one on-policy update (every ratio 1, no clip active): -sum(A m) / sum(m)."
    return -(adv[:, None] * mask).sum() / mask.sum()


# --- advantage_estimator=rloo ---

@pytest.mark.parametrize("normalize", [False, True])
def test_rloo_step_uses_the_leave_one_out_advantages(tmp_path, normalize):
    tr = trainer(tmp_path, "advantage_estimator=rloo", f"normalize_advantages={str(normalize).lower()}")
    ro = tr.rollout()
    r = numpy_rewards(ro["text"])
    want = numpy_rloo(r, tr.cfg.num_generations, normalize)
    assert np.abs(want).max() > 0.01                                   # not a batch of equal rewards
    np.testing.assert_allclose(ro["batch"]["advantages"], want, atol=2e-5)
    assert not np.allclose(ro["batch"]["advantages"], numpy_grpo(r, tr.cfg.num_generations), atol=1e-3)
    info = tr.update(ro)                                               # and the update's loss is built on them
    mask = ro["batch"]["completion_mask"].astype(np.float64)
    np.testing.assert_allclose(info["loss"], on_policy_grpo_loss(want, mask), rtol=1e-4, atol=1e-6)


# --- loss_algo=cispo ---

def numpy_cispo_loss(lp, old, adv, mask, eps_low, eps_high):
    """TRL's GRPOTrainer `loss_type="cispo"` (MiniMax-M1's CISPO) ported, token-mean: each token's log-prob times the
    importance weight clipped to [1 - eps_low, 1 + eps_high] (no gradient), times the advantage."""
    w = np.clip(np.exp(lp - old), 1 - eps_low, 1 + eps_high)
    return -(adv[:, None] * w * lp * mask).sum() / mask.sum()


@pytest.mark.parametrize("extra,eps", [((), CISPO_EPSILONS), (("epsilon_high=0.002",), (CISPO_EPSILONS[0], 0.002))])
def test_cispo_step_loss_is_the_clipped_weight_times_the_log_prob(tmp_path, extra, eps):
    """Two passes (mu = 2) over one rollout: the second is off-policy, so the weights differ from 1 and, with a tight
    epsilon_high, some are clipped. Each update's logged loss equals the NumPy CISPO loss on that update's policy."""
    tr = trainer(tmp_path, "loss_algo=cispo", "num_iterations=2", "learning_rate=3e-3", *extra)
    assert (tr.cfg.epsilon_low, tr.cfg.epsilon_high) == eps            # CISPO's defaults unless the user set one
    seen, run_step = [], tr.run_step
    def spy(name, *a):
        if name == "step_fn": seen.append((jax.tree.map(jnp.copy, a[0]), a[3]))   # the params this update starts from
        return run_step(name, *a)
    tr.run_step = spy
    ro = tr.rollout()
    tr.update(ro)
    assert len(seen) == 2
    mask = ro["batch"]["completion_mask"].astype(np.float64)
    adv, old = ro["batch"]["advantages"].astype(np.float64), tr.last_batch["old_per_token_logps"].astype(np.float64)
    clipped = []
    for (params, mb), logged in zip(seen, tr.last_update_metrics):
        with jax.set_mesh(tr.mesh): lp = np.asarray(tr.logps_fn(params, tr.rest, mb)).astype(np.float64)
        np.testing.assert_allclose(logged["loss"], numpy_cispo_loss(lp, old, adv, mask, *eps), rtol=2e-4, atol=1e-6)
        clipped.append(((np.exp(lp - old) > 1 + eps[1]) & (mask > 0)).any())
    assert clipped[1] == (eps[1] < 1)                                  # the tight cap clips on the second pass


# --- overlong_buffer_length / overlong_penalty_factor, mask_truncated_completions ---

def numpy_overlong(n, L_max, L_cache, factor):
    "DAPO (Yu et al. 2025) eq. 13, in tokens, times the factor."
    out = np.where(n <= L_max - L_cache, 0.0, np.where(n <= L_max, ((L_max - L_cache) - n) / L_cache, -1.0))
    return factor * out


def test_overlong_penalty_is_a_reward_term_with_its_own_metric(tmp_path):
    tr = trainer(tmp_path, "overlong_buffer_length=6", "overlong_penalty_factor=0.5", cut=True)
    ro = tr.rollout()
    ids, mask, texts = tr.engine.raw[-1]
    pen = numpy_overlong(mask.sum(1), 12, 6, 0.5)
    assert pen.min() < pen.max() <= 0                                 # lengths inside and past the buffer
    total = numpy_rewards(texts) + pen
    np.testing.assert_allclose(ro["info"]["rewards/overlong_penalty/mean"], pen.mean(), atol=1e-6)
    np.testing.assert_allclose(ro["info"]["reward"], total.mean(), atol=1e-6)
    np.testing.assert_allclose(ro["batch"]["advantages"], numpy_grpo(total, 4), atol=1e-4)
    np.testing.assert_array_equal(ro["batch"]["completion_mask"], mask)   # the penalty masks nothing


def test_masked_truncated_completions_leave_the_loss_but_not_the_baseline(tmp_path):
    tr = trainer(tmp_path, "mask_truncated_completions=true", cut=True)
    ro = tr.rollout()
    ids, mask, texts = tr.engine.raw[-1]
    eos = np.asarray(tr.sampling["eos_ids"])
    truncated = ~(np.isin(ids, eos) & (mask > 0)).any(1)            # TRL: no EOS among the completion's tokens
    assert truncated.any() and not truncated.all()
    want_mask = np.where(truncated[:, None], 0, mask)
    np.testing.assert_array_equal(ro["batch"]["completion_mask"], want_mask)
    adv = numpy_grpo(numpy_rewards(texts), 4)                        # every completion's reward still counts
    np.testing.assert_allclose(ro["batch"]["advantages"], adv, atol=1e-4)
    assert ro["info"]["completions/clipped_ratio"] == truncated.mean()   # measured on the rollout, before the mask
    info = tr.update(ro)
    np.testing.assert_allclose(info["loss"], on_policy_grpo_loss(adv, want_mask.astype(np.float64)), rtol=1e-4, atol=1e-6)


# --- refusals ---

@pytest.mark.parametrize("extra,says", [
    (["normalize_advantages=true"], "normalize_advantages=true whitens RLOO's advantages but advantage_estimator=grpo"),
    (["advantage_estimator=rloo", "advantage_scale=batch"], "advantage_scale=batch scales group-relative advantages"),
    (["advantage_estimator=gae", "loss_algo=gspo"], "loss_algo=gspo takes one per completion"),
    (["advantage_estimator=vtrace"], "advantage_estimator='vtrace' is not one of"),
    (["overlong_buffer_length=12"], "overlong_buffer_length=12 must be below max_completion_length=12"),
    (["overlong_buffer_length=-1"], "overlong_buffer_length=-1 must be >= 0"),
    (["overlong_penalty_factor=0.5"], "overlong_penalty_factor=0.5 scales the soft overlong penalty, which is off"),
    (["overlong_buffer_length=4", "overlong_penalty_factor=0"], "overlong_penalty_factor=0"),
    (["mask_truncated_completions=true", "environment=calculator"], "with environment=calculator"),
    (["overlong_buffer_length=4", "environment=calculator"], "with environment=calculator"),
    (["loss_algo=cipso"], "loss_algo='cipso' is not one of"),
    (["max_sampling_rounds=8"], "max_sampling_rounds=8 bounds the rounds of dynamic sampling, which is off"),
    (["dynamic_sampling=true", "max_sampling_rounds=0"], "max_sampling_rounds=0 must be > 0"),
])
def test_each_new_key_is_refused_where_it_does_not_apply(tmp_path, extra, says):
    with pytest.raises(ConfigError, match=None) as e: rl_cfg(tmp_path, *extra)
    assert says in str(e.value), str(e.value)


def test_the_recipes_are_accepted_together(tmp_path):
    cfg = rl_cfg(tmp_path, "loss_algo=cispo", "advantage_estimator=rloo", "normalize_advantages=true",
                 "mask_truncated_completions=true", "overlong_buffer_length=4", "overlong_penalty_factor=0.5")
    assert (cfg.epsilon_low, cfg.epsilon_high, cfg.loss_agg_mode) == (*CISPO_EPSILONS, "token-mean")


def test_the_cli_refuses_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "maxpost.cli", "rl", f"base_output_directory={tmp_path}", *SMALL,
                        "overlong_buffer_length=20"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "overlong_buffer_length=20 must be below max_completion_length=12" in lines[0], r.stderr
