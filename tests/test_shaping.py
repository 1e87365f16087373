"""maxpost.shaping (DAPO's dynamic sampling and overlong shaping) against the DAPO paper's formulas, TRL's truncation
mask and plain Python references: no zero-spread group is ever kept, the batch shape never changes, padding is masked."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxpost.shaping import (fill_groups, filled_rows, groups_with_spread, is_truncated, mask_truncated_completions,
                             overlong_penalty)


def _dapo_r_length(n, L_max, L_cache):
    "DAPO (Yu et al. 2025), eq. 13, written as the paper states it, in tokens."
    if n <= L_max - L_cache:
        return 0.0
    if L_max - L_cache < n <= L_max:
        return ((L_max - L_cache) - n) / L_cache
    return -1.0


@pytest.mark.parametrize("L_max,L_cache,factor", [(20480, 4096, 1.0), (128, 32, 0.5), (64, 64, 2.0), (10, 1, 1.0)])
def test_overlong_penalty_is_daposs_formula(L_max, L_cache, factor):
    rng = np.random.default_rng(L_max)
    n = np.unique(np.r_[rng.integers(0, L_max + 50, 300), L_max - L_cache, L_max - L_cache + 1, L_max, L_max + 1, 0])
    ours = np.asarray(jax.jit(overlong_penalty, static_argnums=(1, 2))(n, L_max, L_cache, factor))
    np.testing.assert_allclose(ours, [factor * _dapo_r_length(int(k), L_max, L_cache) for k in n], atol=1e-6)


@pytest.mark.parametrize("buffer_len", [0, -1, 200])
def test_overlong_buffer_out_of_range_is_refused(buffer_len):
    with pytest.raises(ValueError, match="overlong_buffer_length"):
        overlong_penalty(np.arange(5), 128, buffer_len)


def test_mask_truncated_completions_matches_trl():
    "TRL's GRPOTrainer: is_truncated = no EOS among the completion's tokens; completion_mask * (~is_truncated)."
    rng = np.random.default_rng(0)
    B, T, eos, pad = 32, 12, 2, 0
    ids = rng.integers(3, 50, (B, T))
    lengths = rng.integers(1, T + 1, B)
    stops = rng.random(B) < 0.6
    for b in range(B):
        if stops[b]:
            ids[b, lengths[b] - 1] = eos
        ids[b, lengths[b]:] = pad
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
    trl_truncated = np.array([eos not in ids[b, :lengths[b]].tolist() for b in range(B)])
    trl_mask = mask * (~trl_truncated)[:, None].astype(np.int32)
    truncated = np.asarray(is_truncated(ids, mask, [eos]))
    np.testing.assert_array_equal(truncated, trl_truncated)
    np.testing.assert_array_equal(np.asarray(mask_truncated_completions(mask, truncated)), trl_mask)
    assert truncated.any() and (~truncated).any()


def test_groups_with_spread_against_a_loop():
    rng = np.random.default_rng(1)
    r = rng.integers(0, 2, (64, 4)).astype(np.float32)
    r[::5] = rng.normal(size=(13, 4))
    np.testing.assert_array_equal(np.asarray(groups_with_spread(r)), [len(set(row.tolist())) > 1 for row in r])


def _reference_fill(rounds, P, G):
    "Plain Python: walk the rounds, append each group with spread while there is room."
    kept = []
    for ids, rewards in rounds:
        for p in range(len(rewards) // G):
            g = rewards[p * G:(p + 1) * G]
            if max(g) > min(g) and len(kept) < P:
                kept.append(ids[p * G:(p + 1) * G])
    return kept


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("P,G,rounds", [(4, 2, 3), (8, 4, 2), (6, 8, 5)])
def test_dynamic_sampling_keeps_no_zero_spread_group_and_never_changes_shape(seed, P, G, rounds):
    rng = np.random.default_rng(seed)
    traces = []

    def counted(*a):
        traces.append(1)            # runs once per compilation, not per call
        return fill_groups(*a, G)

    step = jax.jit(counted)
    shape = {"ids": (P * G, 3), "rewards": (P * G,), "mask": (P * G, 5)}
    buf = {k: jnp.zeros(s, jnp.float32 if k == "rewards" else jnp.int32) for k, s in shape.items()}
    filled, seen = jnp.int32(0), []
    for k in range(rounds):
        easy = rng.random(P) < 0.6                                     # many groups with no spread
        rewards = np.where(easy[:, None], rng.integers(0, 2, (P, 1)), rng.integers(0, 2, (P, G))).astype(np.float32)
        ids = (np.arange(P * G * 3).reshape(P * G, 3) + 1000 * (k + 1)).astype(np.int32)
        batch = {"ids": jnp.asarray(ids), "rewards": jnp.asarray(rewards.reshape(-1)),
                 "mask": jnp.ones((P * G, 5), jnp.int32)}
        buf, filled = step(buf, filled, batch, groups_with_spread(rewards))
        seen.append((ids, rewards.reshape(-1).tolist()))
        assert {k: v.shape for k, v in buf.items()} == shape
    assert len(traces) == 1                                            # one compiled program for every round
    n = int(filled)
    ref = _reference_fill(seen, P, G)
    assert n == len(ref)
    np.testing.assert_array_equal(np.asarray(buf["ids"])[:n * G], np.concatenate(ref) if ref else np.zeros((0, 3)))
    r = np.asarray(buf["rewards"]).reshape(P, G)
    assert (r[:n].max(1) > r[:n].min(1)).all()                         # no zero-spread group among the kept
    rows = np.asarray(filled_rows(filled, P, G))
    np.testing.assert_array_equal(rows, np.repeat(np.arange(P) < n, G))
    masked = np.asarray(buf["mask"]) * rows[:, None]
    assert (masked[n * G:] == 0).all() and (masked[:n * G] == 1).all()  # padding rows are masked, kept rows are not


def test_fill_groups_drops_what_does_not_fit_and_refuses_bad_shapes():
    G = 2
    buf = {"x": jnp.zeros(4, jnp.int32)}
    batch = {"x": jnp.arange(6, dtype=jnp.int32)}
    out, filled = fill_groups(buf, jnp.int32(1), batch, jnp.array([True, True, True]), G)
    assert int(filled) == 2 and np.asarray(out["x"]).tolist() == [0, 0, 0, 1]
    with pytest.raises(ValueError, match="groups of G=2"):
        fill_groups(buf, jnp.int32(0), {"x": jnp.arange(5)}, jnp.array([True, True]), G)
