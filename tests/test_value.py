"""maxpost.value (PPO's critic): GAE against a plain NumPy loop and Tunix's own compute_gae_advantages (run itself),
the clipped value loss against NumPy ports of TRL's PPOTrainer and Tunix's ppo_value_loss_fn, masks and padding
included."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxpost.value import gae_advantages, masked_whiten, token_level_rewards, value_loss

import tunix.rl.algo_core as tunix_algo  # the dev extra installs Tunix: a missing Tunix fails, never skips


def _data(seed, B=6, T=10, holes=True):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, B)
    lengths[B // 2] = 0                                                    # an empty completion
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
    if holes:                                                              # an environment's tokens inside a row
        mask[0, 1:3] = 0
        mask[-1, T // 2] = 0
    values = rng.normal(0, 1, (B, T)).astype(np.float32)
    values[mask == 0] = rng.normal(0, 50, (mask == 0).sum())              # junk where masked
    scores = rng.normal(0, 1, B).astype(np.float32)
    kl = rng.uniform(-0.2, 0.5, (B, T)).astype(np.float32)
    return mask, values, scores, kl


def _loop_rewards(scores, mask, kl, beta):
    "Plain loop: -beta * kl on every completion token, the score on the last one."
    r = np.zeros(mask.shape)
    for b in range(mask.shape[0]):
        idx = [t for t in range(mask.shape[1]) if mask[b, t]]
        for t in idx:
            r[b, t] = -beta * kl[b, t]
        if idx:
            r[b, idx[-1]] += scores[b]
    return r


def _loop_gae(rewards, values, mask, gamma, lam):
    "Plain loop, walking back over the row and looking ahead for the next completion token by hand."
    B, T = rewards.shape
    adv, ret = np.zeros((B, T)), np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            # A_t = sum_l (gamma lam)^l delta_{t+l} over the completion tokens from t on
            later = [u for u in range(t, T) if mask[b, u]]
            total = 0.0
            for l, u in enumerate(later):
                v_next = values[b, later[l + 1]] if l + 1 < len(later) else 0.0
                delta = rewards[b, u] + gamma * v_next - values[b, u]
                total += (gamma * lam) ** l * delta
            adv[b, t], ret[b, t] = total, total + values[b, t]
    return adv, ret


@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_token_level_rewards_against_a_loop(beta):
    mask, _, scores, kl = _data(0)
    np.testing.assert_allclose(np.asarray(token_level_rewards(jnp.asarray(scores), jnp.asarray(mask), jnp.asarray(kl),
                                                              beta)), _loop_rewards(scores, mask, kl, beta), atol=1e-6)


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9), (1.0, 1.0), (1.0, 0.0), (0.8, 0.5)])
@pytest.mark.parametrize("seed", range(3))
def test_gae_against_a_plain_loop(gamma, lam, seed):
    mask, values, scores, kl = _data(seed)
    rewards = _loop_rewards(scores, mask, kl, 0.05).astype(np.float32)
    rewards[mask == 0] = 7.0                                               # junk rewards where masked: ignored
    adv, ret = jax.jit(gae_advantages)(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma, lam)
    la, lr = _loop_gae(np.where(mask > 0, rewards, 0.0), values, mask, gamma, lam)
    np.testing.assert_allclose(np.asarray(adv), la, atol=2e-5)
    np.testing.assert_allclose(np.asarray(ret), lr, atol=2e-5)
    assert (np.asarray(adv)[mask == 0] == 0).all() and (np.asarray(ret)[mask == 0] == 0).all()


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.7)])
def test_gae_matches_tunix(holes, gamma, lam):
    "Tunix's compute_gae_advantages returns whitened advantages and raw-advantage + value returns; compare on tokens."
    mask, values, scores, kl = _data(5, holes=holes)
    rewards = _loop_rewards(scores, mask, kl, 0.1).astype(np.float32)
    t_adv, t_ret = tunix_algo.compute_gae_advantages(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask),
                                                     gamma, lam)
    adv, ret = gae_advantages(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma, lam)
    on = mask > 0
    np.testing.assert_allclose(np.asarray(masked_whiten(adv, jnp.asarray(mask)))[on], np.asarray(t_adv)[on], atol=1e-4)
    np.testing.assert_allclose(np.asarray(ret)[on], np.asarray(t_ret)[on], atol=1e-5)


def test_gae_carries_no_gradient_into_the_values():
    mask, values, scores, _ = _data(1)
    rewards = token_level_rewards(jnp.asarray(scores), jnp.asarray(mask))
    g = jax.grad(lambda v: gae_advantages(rewards, v, jnp.asarray(mask))[0].sum())(jnp.asarray(values))
    assert float(jnp.abs(g).max()) == 0.0


def _trl_value_loss(vpred, values, returns, padding_mask_p1, cliprange_value):
    "NumPy port of TRL's PPOTrainer value loss (trl/experimental/ppo/ppo_trainer.py, huggingface/trl at f2cd577)."
    vpredclipped = np.clip(vpred, values - cliprange_value, values + cliprange_value)
    vf_losses1 = np.square(vpred - returns)
    vf_losses2 = np.square(vpredclipped - returns)
    vf_loss_max = np.maximum(vf_losses1, vf_losses2)
    keep = ~padding_mask_p1
    vf_loss = 0.5 * (vf_loss_max * keep).sum() / keep.sum()
    vf_clipfrac = ((vf_losses2 > vf_losses1) * keep).sum() / keep.sum()
    return vf_loss, vf_clipfrac


def _tunix_value_loss(vpreds, values, returns, completion_mask, clip_range_value):
    "NumPy port of the formula of Tunix's ppo_value_loss_fn (tunix/rl/algo_core.py), its masked_mean's 1e-8 included."
    vpred_clipped = np.clip(vpreds, values - clip_range_value, values + clip_range_value)
    l1, l2 = np.square(vpreds - returns), np.square(vpred_clipped - returns)
    return 0.5 * (np.maximum(l1, l2) * completion_mask).sum() / (completion_mask.sum() + 1e-8)


@pytest.mark.parametrize("c", [0.05, 0.2, 1.0])
@pytest.mark.parametrize("seed", range(3))
def test_value_loss_matches_trl_and_tunix(c, seed):
    mask, old, scores, kl = _data(10 + seed)
    rng = np.random.default_rng(seed)
    _, ret = gae_advantages(token_level_rewards(jnp.asarray(scores), jnp.asarray(mask), jnp.asarray(kl), 0.05),
                            jnp.asarray(old), jnp.asarray(mask))
    ret = np.asarray(ret)
    new = (old + rng.normal(0, 0.3, old.shape)).astype(np.float32)
    f = jax.jit(jax.value_and_grad(value_loss, has_aux=True))
    (loss, m), grad = f(jnp.asarray(new), jnp.asarray(old), jnp.asarray(ret), jnp.asarray(mask), c)
    on = mask > 0
    z = lambda x: np.where(on, x, 0.0)                                     # TRL and Tunix fill masked values with 0
    trl_loss, trl_clip = _trl_value_loss(z(new), z(old), ret, ~on, c)
    np.testing.assert_allclose(float(loss), trl_loss, rtol=1e-5)
    np.testing.assert_allclose(float(m["value/clipfrac"]), trl_clip, atol=1e-6)
    np.testing.assert_allclose(float(loss), _tunix_value_loss(z(new), z(old), ret, on, c), rtol=1e-5)
    # gradient by central differences of the TRL port, on the completion tokens only
    h, fd = 1e-3, np.zeros(new.shape)
    for b, t in zip(*np.nonzero(on)):
        xp, xm = z(new).astype(np.float64), z(new).astype(np.float64)
        xp[b, t] += h; xm[b, t] -= h
        fd[b, t] = (_trl_value_loss(xp, z(old), ret, ~on, c)[0] - _trl_value_loss(xm, z(old), ret, ~on, c)[0]) / (2 * h)
    np.testing.assert_allclose(np.asarray(grad), fd, atol=2e-4)
    assert (np.asarray(grad)[~on] == 0).all()
    if c < 1.0:
        assert 0 < trl_clip < 1


def test_value_loss_micro_batches_add_up():
    mask, old, _, _ = _data(20)
    ret = np.random.default_rng(0).normal(size=old.shape).astype(np.float32)
    new = old + 0.3
    whole = float(value_loss(jnp.asarray(new), jnp.asarray(old), jnp.asarray(ret), jnp.asarray(mask))[0])
    n = int(mask.sum())
    parts = [float(value_loss(jnp.asarray(new[s]), jnp.asarray(old[s]), jnp.asarray(ret[s]), jnp.asarray(mask[s]),
                              num_tokens=n)[0]) for s in (slice(0, 2), slice(2, None))]
    np.testing.assert_allclose(sum(parts), whole, rtol=1e-5)
