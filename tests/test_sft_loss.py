"""maxpost.sft_loss against a naive NumPy cross-entropy; gradient accumulation; masking; z-loss."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxpost.sft_loss import sft_loss, summarize_metrics, target_weights, token_logps


def _naive(logits, batch, num_loss_tokens=None, z_loss=0.0):
    "Loop over positions in float64: (sum of NLL + z_loss * sum logZ^2) / N, accuracy, count."
    z = np.asarray(logits, np.float64)
    tok, seg, lm = (np.asarray(batch[k]) for k in ("tokens", "segment_ids", "loss_mask"))
    nll, zs, n, correct = 0.0, 0.0, 0, 0
    for b in range(tok.shape[0]):
        for t in range(1, tok.shape[1]):
            if lm[b, t] == 1 and seg[b, t] != 0 and seg[b, t] == seg[b, t - 1]:
                row = z[b, t - 1]
                lse = row.max() + np.log(np.exp(row - row.max()).sum())
                nll += lse - row[tok[b, t]]
                zs += lse**2
                n += 1
                correct += int(row[tok[b, t]] > np.delete(row, tok[b, t]).max())   # strictly the largest: ties are wrong
    denom = max(n if num_loss_tokens is None else num_loss_tokens, 1)
    return (nll + z_loss * zs) / denom, correct, n


def _batch(rng, B=4, L=12, V=17):
    seg = np.zeros((B, L), np.int32)
    for b in range(B):  # 1-3 packed segments then padding
        cuts = np.sort(rng.choice(np.arange(1, L), size=rng.integers(1, 4), replace=False))
        s, start = 1, 0
        for c in list(cuts):
            seg[b, start:c] = s
            s, start = s + 1, c
        # leave the tail after the last cut as padding (segment 0)
    return {"tokens": rng.integers(0, V, (B, L)).astype(np.int32), "segment_ids": seg,
            "loss_mask": (rng.random((B, L)) < 0.6).astype(np.int32)}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_token_logps_matches_naive(dtype):
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3, 7, 29)) * 4, dtype)
    tokens = rng.integers(0, 29, (3, 7))
    got = token_logps(logits, jnp.asarray(tokens))
    assert got.dtype == jnp.float32
    z = np.asarray(logits.astype(jnp.float32), np.float64)
    ref = np.take_along_axis(z, tokens[..., None], -1)[..., 0] - np.log(np.exp(z).sum(-1))
    np.testing.assert_allclose(np.asarray(got), ref, atol=2e-5)


def test_token_logps_has_no_one_hot():
    "The jaxpr of token_logps gathers: no [B,T,V] equality/one-hot against the vocabulary iota."
    jaxpr = str(jax.make_jaxpr(token_logps)(jnp.zeros((2, 3, 50)), jnp.zeros((2, 3), jnp.int32)))
    assert "gather" in jaxpr and "iota" not in jaxpr and " eq " not in jaxpr


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("z_loss", [0.0, 1e-4, 0.3])
def test_sft_loss_matches_naive(seed, z_loss):
    rng = np.random.default_rng(seed)
    batch = _batch(rng)
    logits = rng.normal(size=(4, 12, 17)).astype(np.float32) * 2
    loss, m = sft_loss(jnp.asarray(logits), batch, z_loss=z_loss)
    ref, correct, n = _naive(logits, batch, z_loss=z_loss)
    np.testing.assert_allclose(float(loss), ref, rtol=1e-5, atol=1e-6)
    assert float(m["num_loss_tokens"]) == n and float(m["num_correct"]) == correct
    s = summarize_metrics(m)
    np.testing.assert_allclose(float(s["mean_token_accuracy"]), correct / max(n, 1), rtol=1e-6)
    np.testing.assert_allclose(float(s["nll"]), _naive(logits, batch)[0], rtol=1e-5)
    # given a global count, the loss is the sum divided by it
    lg, _ = sft_loss(jnp.asarray(logits), batch, num_loss_tokens=3 * n + 1, z_loss=z_loss)
    np.testing.assert_allclose(float(lg), _naive(logits, batch, 3 * n + 1, z_loss)[0], rtol=1e-5, atol=1e-7)


def test_z_loss_term_alone():
    "The z-loss adds coefficient * mean over loss tokens of logsumexp^2 (PaLM)."
    rng = np.random.default_rng(1)
    batch = _batch(rng)
    logits = rng.normal(size=(4, 12, 17)).astype(np.float32) + 3.0  # logZ far from 0
    base = float(sft_loss(jnp.asarray(logits), batch)[0])
    with_z = float(sft_loss(jnp.asarray(logits), batch, z_loss=1e-2)[0])
    w = np.asarray(target_weights(batch), bool)
    z = np.asarray(logits, np.float64)[:, :-1]
    lse = np.log(np.exp(z).sum(-1))
    np.testing.assert_allclose(with_z - base, 1e-2 * (lse[w] ** 2).mean(), rtol=1e-4)


def test_gradient_accumulation_equals_big_batch():
    "Sum over micro-batches of loss/grad with the global count == loss/grad of the big batch; mean of means is not."
    rng = np.random.default_rng(2)
    B, L, V = 8, 10, 13
    batch = _batch(rng, B, L, V)
    batch["segment_ids"][:4, :] = np.where(np.arange(L) < 3, 1, 0)  # first half: very short rows
    logits = jnp.asarray(rng.normal(size=(B, L, V)), jnp.float32)
    f = lambda lg, bt, n=None, z=0.0: sft_loss(lg, bt, num_loss_tokens=n, z_loss=z)[0]
    for z in (0.0, 1e-3):
        N = float(target_weights(batch).sum())
        big_l, big_g = jax.value_and_grad(f)(logits, batch, None, z)
        acc_l, acc_g, means = 0.0, [], []
        for s in (slice(0, 2), slice(2, 5), slice(5, 8)):  # uneven micro-batches
            mb = {k: v[s] for k, v in batch.items()}
            l, g = jax.value_and_grad(f)(logits[s], mb, N, z)
            acc_l, means = acc_l + l, means + [f(logits[s], mb, None, z)]
            acc_g.append(g)
        np.testing.assert_allclose(float(acc_l), float(big_l), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(jnp.concatenate(acc_g)), np.asarray(big_g), atol=1e-7)
        assert abs(float(np.mean(means)) - float(big_l)) > 1e-3  # the biased alternative really differs here


def test_padding_and_cross_segment_targets_never_count():
    "Changing tokens/logits at ignored targets (pad, a segment's first token, mask 0) changes neither loss nor grad."
    rng = np.random.default_rng(3)
    batch = _batch(rng)
    batch["loss_mask"][:] = 1  # a careless mask: only segment ids protect pads and boundaries
    logits = rng.normal(size=(4, 12, 17)).astype(np.float32)
    w = np.asarray(target_weights(batch))
    seg = batch["segment_ids"]
    ignored = w == 0
    assert ignored.any() and (seg[:, 1:] != seg[:, :-1]).any()
    # manual rule check
    expected = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)
    np.testing.assert_array_equal(w.astype(bool), expected)
    f = lambda lg, bt: sft_loss(lg, bt, z_loss=1e-3)[0]
    l0, g0 = jax.value_and_grad(f)(jnp.asarray(logits), batch)
    noisy, b2 = logits.copy(), {k: v.copy() for k, v in batch.items()}
    bi, ti = np.nonzero(ignored)
    noisy[bi, ti] = rng.normal(size=(len(bi), 17)) * 100
    b2["tokens"][bi, ti + 1] = rng.integers(0, 17, len(bi))
    l1, g1 = jax.value_and_grad(f)(jnp.asarray(noisy), b2)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(g1)[bi, ti], 0.0)
    keep = ~ignored
    np.testing.assert_allclose(np.asarray(g1)[:, :-1][keep], np.asarray(g0)[:, :-1][keep], atol=1e-7)
    assert np.all(np.asarray(g0)[:, -1] == 0)  # the last position predicts nothing


def test_gradient_matches_naive_analytic():
    "d loss / d logits = w * (softmax + 2*zc*lse*softmax - onehot) / N, computed in NumPy."
    rng = np.random.default_rng(4)
    batch = _batch(rng)
    logits = rng.normal(size=(4, 12, 17)).astype(np.float32)
    zc = 1e-2
    g = jax.grad(lambda lg: sft_loss(lg, batch, z_loss=zc)[0])(jnp.asarray(logits))
    z = np.asarray(logits, np.float64)[:, :-1]
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    lse = np.log(np.exp(z).sum(-1))
    onehot = np.eye(17)[batch["tokens"][:, 1:]]
    w = np.asarray(target_weights(batch), np.float64)
    ref = w[..., None] * (p - onehot + zc * 2 * lse[..., None] * p) / w.sum()
    np.testing.assert_allclose(np.asarray(g)[:, :-1], ref, atol=1e-6)


def test_jit_matches_eager():
    rng = np.random.default_rng(5)
    batch = _batch(rng)
    logits = jnp.asarray(rng.normal(size=(4, 12, 17)), jnp.float32)
    eager = sft_loss(logits, batch, num_loss_tokens=40, z_loss=1e-3)
    jitted = jax.jit(lambda lg, bt, n: sft_loss(lg, bt, num_loss_tokens=n, z_loss=1e-3))(logits, batch, 40)
    for k in eager[1]:
        np.testing.assert_allclose(float(jitted[1][k]), float(eager[1][k]), rtol=1e-6)


# ---- the chunked loss: never the [B,T,V] logits, the same numbers

from flax import nnx
from maxpost.model import TunixPolicy, create_model, get_model_config
from maxpost.model import LOGITS_CHUNK_SIZE
from maxpost.sft_loss import chunked_sft_loss, model_sft_loss


def _sft_batch(rng, B, L, V):
    b = _batch(rng, B, L, V)
    b["positions"] = np.zeros_like(b["tokens"])
    for i in range(B):                        # positions restart with each packed segment
        for s in np.unique(b["segment_ids"][i]):
            idx = np.nonzero(b["segment_ids"][i] == s)[0]
            b["positions"][i, idx] = np.arange(len(idx))
    return b


@pytest.mark.parametrize("tie,chunk_size,z,n", [(True, 9, 0.0, None), (False, 9, 1e-2, 37), (True, 4096, 1e-2, None)])
def test_model_sft_loss_chunked_equals_logits_path(tie, chunk_size, z, n):
    """A Decoder's chunked loss equals sft_loss on its full logits: loss, metrics and every parameter's gradient, fp32,
    for tied and untied heads, a packed batch, z-loss and a global count; 9 tokens a chunk = 2 positions of 4 rows,
    13 positions (ragged); 4096: one chunk."""
    model = create_model(get_model_config("tiny", num_layers=1, d_model=32, head_dim=16, mlp_dim=64, vocab_size=61,
                                          tie_embeddings=tie), seed=3)
    batch = _sft_batch(np.random.default_rng(6), 4, 14, 61)
    def run(chunk):
        f = lambda m: model_sft_loss(m, batch, num_loss_tokens=n, z_loss=z, chunk_size=chunk)
        return nnx.jit(lambda m: nnx.value_and_grad(f, has_aux=True)(m))(model)
    ((lc, mc), gc), ((lr, mr), gr) = run(chunk_size), run(None)
    np.testing.assert_allclose(float(lc), float(lr), rtol=1e-6, atol=1e-6)
    for k in mr:
        np.testing.assert_allclose(float(mc[k]), float(mr[k]), rtol=1e-5, atol=1e-6)
    for a, r in zip(jax.tree.leaves(nnx.state(gc)), jax.tree.leaves(nnx.state(gr))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=1e-5)
    ref, correct, count = _naive(model(jnp.asarray(batch["tokens"]), jnp.asarray(batch["positions"]),
                                       jnp.asarray(batch["segment_ids"])), batch, n, z)
    np.testing.assert_allclose(float(lc), ref, rtol=1e-5)
    assert float(mc["num_correct"]) == correct and float(mc["num_loss_tokens"]) == count


def test_chunked_sft_loss_gradient_matches_analytic():
    "d loss / d h = sum_v dz_v W_v with dz = w (p (1 + 2 zc lse) - onehot) / N: the closed form, in NumPy float64."
    rng = np.random.default_rng(7)
    batch = _batch(rng, 3, 10, 17)
    h = rng.normal(size=(3, 10, 6)).astype(np.float32); W = rng.normal(size=(17, 6)).astype(np.float32)
    zc = 1e-2
    gh, gw = jax.grad(lambda h, w: chunked_sft_loss(h, w, batch, z_loss=zc, chunk_size=6)[0], (0, 1))(h, W)
    z = np.einsum("btd,vd->btv", h[:, :-1].astype(np.float64), W.astype(np.float64))
    lse = np.log(np.exp(z).sum(-1))
    p = np.exp(z - lse[..., None])
    wts = np.asarray(target_weights(batch), np.float64)
    dz = wts[..., None] * (p * (1 + 2 * zc * lse[..., None]) - np.eye(17)[batch["tokens"][:, 1:]]) / wts.sum()
    np.testing.assert_allclose(np.asarray(gh)[:, :-1], np.einsum("btv,vd->btd", dz, W), atol=1e-6)
    np.testing.assert_allclose(np.asarray(gh)[:, -1], 0.0)
    np.testing.assert_allclose(np.asarray(gw), np.einsum("btv,btd->vd", dz, h[:, :-1]), atol=1e-6)


def test_model_sft_loss_on_a_wrapped_policy_uses_the_logits():
    "A policy that is not a Decoder (TunixPolicy) has no hidden-state path: model_sft_loss scores its logits."
    class Bigram(nnx.Module):          # a Tunix-style model: (tokens, positions, cache, mask) -> (logits, cache)
        def __init__(self): self.w = nnx.Param(jax.random.normal(jax.random.key(0), (23, 23)))
        def __call__(self, tokens, positions, cache, mask): return self.w[...][tokens], cache
    policy = TunixPolicy(Bigram())
    batch = _sft_batch(np.random.default_rng(8), 2, 9, 23)
    loss, m = model_sft_loss(policy, batch)
    np.testing.assert_allclose(float(loss), _naive(np.asarray(policy.model.w[...])[batch["tokens"]], batch)[0], rtol=1e-5)


def test_chunked_sft_loss_on_8_devices_equals_1():
    "Rows sharded over a data x fsdp x tensor mesh (vocabulary split over `tensor`): the same loss and gradients."
    from maxpost.sharding import make_mesh
    cfg = get_model_config("tiny", num_layers=1, d_model=32, head_dim=16, mlp_dim=64, vocab_size=64, tie_embeddings=False)
    batch = _sft_batch(np.random.default_rng(9), 8, 12, 64)
    f = lambda m: nnx.value_and_grad(lambda m: model_sft_loss(m, batch, z_loss=1e-3, chunk_size=16)[0])(m)
    ref = nnx.jit(f)(create_model(cfg, seed=2))
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    with jax.set_mesh(mesh):
        got = nnx.jit(f)(create_model(cfg, seed=2, mesh=mesh))
    np.testing.assert_allclose(float(got[0]), float(ref[0]), rtol=1e-6)
    for a, r in zip(jax.tree.leaves(nnx.state(got[1])), jax.tree.leaves(nnx.state(ref[1]))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=1e-6)


def test_default_chunk_size_is_on():
    assert LOGITS_CHUNK_SIZE > 0


def test_ties_are_not_counted_as_correct():
    """A collapsed model (every logit equal) predicts nothing: token accuracy 0, on the logits path and the chunked
    path; logits of small integers (many ties) count as the naive strict-maximum loop counts them."""
    rng = np.random.default_rng(0)
    batch = _sft_batch(rng, 3, 10, 7)
    n = float(target_weights(batch).sum())
    assert n > 0
    _, m = sft_loss(jnp.zeros((3, 10, 7)), batch)
    assert float(m["num_correct"]) == 0.0 and float(summarize_metrics(m)["mean_token_accuracy"]) == 0.0
    _, mc = chunked_sft_loss(jnp.zeros((3, 10, 5)), jnp.ones((7, 5)), batch, chunk_size=4)   # all logits equal
    assert float(mc["num_correct"]) == 0.0
    logits = rng.integers(0, 3, (3, 10, 7)).astype(np.float32)
    _, m = sft_loss(jnp.asarray(logits), batch)
    assert float(m["num_correct"]) == _naive(logits, batch)[1]


@pytest.mark.parametrize("chunk_size", [8, 16, 24])
def test_chunked_loss_counts_the_last_partial_chunk(chunk_size):
    """Every position counts when the positions do not fill the last chunk and that chunk holds loss tokens (one
    segment per row, no padding, every token a target): the chunked sums equal the naive loop's, for 2, 4 and 6
    positions a chunk of 4 rows over 15 positions: last chunks of 1, 3 and 3 positions."""
    rng = np.random.default_rng(1)
    B, L, D, V = 4, 16, 8, 11
    tokens = rng.integers(0, V, (B, L)).astype(np.int32)
    batch = {"tokens": tokens, "segment_ids": np.ones((B, L), np.int32), "loss_mask": np.ones((B, L), np.int32)}
    h = rng.normal(size=(B, L - 1, D)).astype(np.float32)
    w = rng.normal(size=(V, D)).astype(np.float32)
    loss, m = chunked_sft_loss(jnp.asarray(h), jnp.asarray(w), batch, chunk_size=chunk_size)
    ref, correct, count = _naive(h @ w.T, batch)
    assert count == B * (L - 1) and float(m["num_loss_tokens"]) == count
    np.testing.assert_allclose(float(loss), ref, rtol=1e-5)
    assert float(m["num_correct"]) == correct
