"""maxpost.advantages against Tunix's own advantage estimators and a NumPy reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxpost.advantages import group_advantages, rloo_advantages

import tunix.rl.algo_core as tunix_algo  # the dev extra installs Tunix: a missing Tunix fails, never skips


def _rewards(seed, B):
    rng = np.random.default_rng(seed)
    r = rng.normal(size=B).astype(np.float32)
    r[: B // 2] = rng.integers(0, 2, B // 2)  # binary rewards too
    return r


def _numpy(r, G, scale, ddof=1, eps=1e-6):
    "Vectorised NumPy in float64, written from the formulas."
    g = np.asarray(r, np.float64).reshape(-1, G)
    centred = g - g.mean(-1, keepdims=True)
    if scale == "group":
        centred = centred / (g.std(-1, ddof=ddof, keepdims=True) + eps)
    elif scale == "batch":
        centred = centred / (g.std(ddof=ddof) + eps)
    return centred.reshape(-1)


@pytest.mark.parametrize("G", [2, 3, 4, 8])
@pytest.mark.parametrize("seed", range(3))
def test_group_scale_matches_tunix(G, seed):
    r = _rewards(seed, 6 * G)
    ours = np.asarray(group_advantages(r, G))
    theirs = np.asarray(tunix_algo.compute_advantages(r, G))
    finite = np.isfinite(theirs)  # Tunix divides 0 by ~0 for equal groups; we return exact zeros there
    np.testing.assert_allclose(ours[finite], theirs[finite], atol=1e-5)


@pytest.mark.parametrize("G", [2, 4, 8])
def test_none_scale_matches_tunix_drgrpo(G):
    r = _rewards(7, 5 * G)
    ours = np.asarray(group_advantages(r, G, scale="none"))
    theirs = np.asarray(tunix_algo.compute_drgrpo_advantages(jnp.asarray(r), G))
    np.testing.assert_allclose(ours, theirs, atol=1e-5)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("ddof,eps", [(1, 1e-6), (0, 1e-4), (1, 1e-4)])
def test_matches_numpy(scale, ddof, eps):
    r = _rewards(11, 24)
    r[12:] = np.random.default_rng(1).normal(size=12)  # no equal groups in the second half
    np.testing.assert_allclose(np.asarray(group_advantages(r, 4, scale=scale, std_ddof=ddof, eps=eps)),
                               np.where(_equal_mask(r, 4), 0.0, _numpy(r, 4, scale, ddof, eps)), atol=2e-5)


def _equal_mask(r, G):
    g = r.reshape(-1, G)
    return np.repeat(g.max(-1) == g.min(-1), G)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_invariants(scale):
    r = _rewards(3, 32)
    adv = np.asarray(group_advantages(r, 8, scale=scale))
    np.testing.assert_allclose(adv.reshape(4, 8).sum(-1), 0.0, atol=1e-5)  # zero mean per group
    # order within a group is preserved
    g, a = r.reshape(4, 8), adv.reshape(4, 8)
    for i in range(4):
        np.testing.assert_array_equal(np.argsort(g[i], kind="stable"), np.argsort(a[i], kind="stable"))
    # shifting a group's rewards changes nothing; scaling changes nothing for scale="group"
    r2 = r.copy()
    r2[:8] += 5.0
    np.testing.assert_allclose(np.asarray(group_advantages(r2, 8, scale="none"))[:8], adv[:8] if scale == "none"
                               else np.asarray(group_advantages(r, 8, scale="none"))[:8], atol=1e-5)
    if scale == "group":
        np.testing.assert_allclose(np.asarray(group_advantages(3 * r, 8)), adv, atol=1e-4)


def test_equal_rewards_give_exact_zeros():
    "Equal rewards whose float32 mean is not exactly representable still give exact zeros (Tunix: noise)."
    r = np.full(12, 0.1, np.float32)
    r[6:] = 0.7
    np.testing.assert_array_equal(np.asarray(group_advantages(r, 3)), 0.0)
    np.testing.assert_array_equal(np.asarray(group_advantages(r, 6, scale="batch")), 0.0)


def test_single_generation_gives_zeros_not_nan():
    r = _rewards(0, 5)
    for scale in ("group", "batch", "none"):
        np.testing.assert_array_equal(np.asarray(group_advantages(r, 1, scale=scale)), 0.0)
    assert np.isnan(np.asarray(tunix_algo.compute_advantages(r, 1))).all()  # what we deliberately avoid


def test_errors_name_b_and_g():
    with pytest.raises(ValueError, match=r"B=10.*G=4"):
        group_advantages(np.zeros(10, np.float32), 4)
    with pytest.raises(ValueError, match="group, batch, none"):
        group_advantages(np.zeros(8, np.float32), 4, scale="whiten")
    with pytest.raises(ValueError, match=r"\[B\]"):
        group_advantages(np.zeros((2, 4), np.float32), 4)


def test_jit_matches_eager():
    r = _rewards(5, 16)
    f = jax.jit(group_advantages, static_argnums=1, static_argnames=("scale", "std_ddof"))
    for scale in ("group", "batch", "none"):
        np.testing.assert_allclose(np.asarray(f(r, 4, scale=scale)), np.asarray(group_advantages(r, 4, scale=scale)),
                                   atol=1e-6)


# ---- RLOO against TRL's RLOOTrainer. TRL is not called: the advantage lines of RLOOTrainer._generate_and_score_completions
# (trl/trainer/rloo_trainer.py, huggingface/trl at commit f2cd577, July 2026) and its `nanstd` (trl/trainer/utils.py)
# are ported to NumPy below, with every reward scorable (no NaN).

def _trl_nanstd(x):
    mean = np.nanmean(x)
    variance = np.nanmean((x - mean) ** 2)
    count = np.sum(~np.isnan(x))
    return np.sqrt(variance * count / (count - 1))                  # Bessel's correction


def _trl_rloo(rewards, num_generations, normalize_advantages):
    rewards = np.asarray(rewards, np.float64)
    grouped_rewards = rewards.reshape(-1, num_generations)
    scorable_counts = (~np.isnan(grouped_rewards)).sum(1, keepdims=True)
    grouped_sum = np.nansum(grouped_rewards, 1, keepdims=True)
    if num_generations > 1:
        baselines = ((grouped_sum - grouped_rewards) / (scorable_counts - 1)).reshape(-1)
        advantages = rewards - baselines
    else:
        advantages = np.zeros_like(rewards)
    if normalize_advantages:
        advantages = (advantages - np.nanmean(advantages)) / (_trl_nanstd(advantages) + 1e-4)
    return np.nan_to_num(advantages, nan=0.0)


def _loop_rloo(rewards, G):
    "A plain loop: each sample minus the mean of the other samples of its group."
    out = []
    for i, r in enumerate(rewards):
        others = [rewards[j] for j in range(i // G * G, i // G * G + G) if j != i]
        out.append(r - sum(others) / len(others) if others else 0.0)
    return np.array(out)


@pytest.mark.parametrize("G", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_rloo_matches_trl_and_a_loop(G, normalize, seed):
    r = _rewards(seed, 6 * G)
    ours = np.asarray(rloo_advantages(r, G, normalize_advantages=normalize))
    np.testing.assert_allclose(ours, _trl_rloo(r, G, normalize), atol=2e-5)
    if not normalize:
        np.testing.assert_allclose(ours, _loop_rloo(r.astype(np.float64), G), atol=2e-6)
    assert np.abs(ours).max() > 0.1 or G == 1


def test_rloo_equal_groups_are_exactly_zero_and_in_jit():
    r = np.array([0.3, 0.3, 0.3, 1.0, 0.0, 0.5], np.float32)
    adv = np.asarray(jax.jit(rloo_advantages, static_argnums=1)(r, 3))
    assert (adv[:3] == 0).all()
    np.testing.assert_allclose(adv[3:], [1.0 - 0.25, -0.75, 0.0], atol=1e-6)
