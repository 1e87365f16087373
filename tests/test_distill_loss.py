"""The distillation losses (`maxpost.distill_loss`) against references that share no code with them: a per-token
divergence over the full vocabulary written here in NumPy (float64), TRL's `GKDTrainer.generalized_jsd_loss`
(values, and gradients through torch's autograd), Tunix's `LogitStrategy` (forward KL with temperature, full and
top-k), MaxText's offline top-k formula written in NumPy. The offline top-k path equals the online one at k = V;
top-1 agreement against NumPy; the chunked gradient against the whole-logits one, and its memory from XLA's analysis.
"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from maxpost.distill_loss import (TOPK_TAILS, chunked_distill_loss, chunked_topk_distill_loss, completion_distill_loss,
                                  completion_hidden, completion_topk_logps, distill_loss, reverse_kl_advantages,
                                  summarize_distill_metrics, teacher_topk_logps, topk_distill_loss)
from maxpost.model import create_model, get_model_config

with warnings.catch_warnings():
    warnings.simplefilter("ignore")                        # TRL warns that its experimental package may change
    from trl.experimental.gkd import GKDTrainer

BETAS = (0.0, 0.5, 1.0)
JSD_BETAS = (0.0, 0.3, 0.5, 1.0)     # 0.5 alone cannot tell the mixture's weights apart: 0.3 can
TEMPERATURES = (1.0, 0.7, 2.0)


def case(seed=0, B=3, T=7, V=13, D_s=5, D_t=8, scale=1.0):
    "Hidden states and heads of a student and a (wider) teacher, and a completion mask with a fully masked row."
    r = np.random.default_rng(seed)
    f = lambda *s: r.normal(size=s).astype(np.float32) * scale
    mask = (r.random((B, T)) < 0.7).astype(np.float32)
    mask[-1] = 0
    return f(B, T, D_s), f(V, D_s), f(B, T, D_t), f(V, D_t), mask


def logits(h, w): return np.einsum("btd,vd->btv", np.asarray(h, np.float64), np.asarray(w, np.float64))


def np_log_softmax(z, temperature=1.0):
    z = np.asarray(z, np.float64) / temperature
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def np_kl(a, b):
    "KL(a || b) over the last axis, from float64 log-probs."
    return (np.exp(a) * (a - b)).sum(-1)


def np_jsd(s, t, beta):
    "The generalized JSD of GKD, TRL's convention (0 forward KL, 1 reverse KL), per position."
    if beta == 0: return np_kl(t, s)
    if beta == 1: return np_kl(s, t)
    m = np.log(beta * np.exp(t) + (1 - beta) * np.exp(s))
    return beta * np_kl(t, m) + (1 - beta) * np_kl(s, m)


def np_token_mean(per_token, mask, num_tokens=None):
    n = mask.sum() if num_tokens is None else num_tokens
    return (per_token * (mask > 0)).sum() / max(n, 1)


def trl_loss(student_logits, teacher_logits, mask, beta, temperature, num_items=None):
    labels = torch.where(torch.as_tensor(mask) > 0, 1, -100)
    return GKDTrainer.generalized_jsd_loss(torch.as_tensor(student_logits), torch.as_tensor(teacher_logits), labels=labels,
                                           beta=beta, temperature=temperature, num_items_in_batch=num_items)


chunked = jax.jit(chunked_distill_loss, static_argnames=("beta", "chunk_size"))
chunked_topk = jax.jit(chunked_topk_distill_loss, static_argnames=("beta", "tail", "chunk_size"))


# ---- the on-policy (reverse KL) loss against a naive per-token KL over the full vocabulary

@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_on_policy_reverse_kl_equals_naive_full_vocabulary_kl(temperature):
    h_s, w_s, h_t, w_t, mask = case(1)
    s, t = np_log_softmax(logits(h_s, w_s), temperature), np_log_softmax(logits(h_t, w_t), temperature)
    naive = np_token_mean(np_kl(s, t), mask)                                    # KL(student || teacher), every token
    for chunk_size in (6, 4096):                                               # 2 positions a chunk; one chunk
        loss, m = chunked(h_s, w_s, h_t, w_t, mask, beta=1.0, temperature=temperature, chunk_size=chunk_size)
        np.testing.assert_allclose(loss, naive, rtol=2e-5)
        np.testing.assert_allclose(summarize_distill_metrics(m)["reverse_kl"], naive, rtol=2e-5)
        np.testing.assert_allclose(summarize_distill_metrics(m)["forward_kl"], np_token_mean(np_kl(t, s), mask), rtol=2e-5)
    np.testing.assert_allclose(distill_loss(logits(h_s, w_s), logits(h_t, w_t), mask, beta=1.0, temperature=temperature)[0],
                               naive, rtol=2e-5)


# ---- the generalized JSD against TRL's GKDTrainer.generalized_jsd_loss

@pytest.mark.parametrize("beta", JSD_BETAS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_generalized_jsd_matches_trl(beta, temperature):
    h_s, w_s, h_t, w_t, mask = case(2, scale=1.5)
    z_s, z_t = logits(h_s, w_s).astype(np.float32), logits(h_t, w_t).astype(np.float32)
    ref = trl_loss(z_s, z_t, mask, beta, temperature).item()
    np.testing.assert_allclose(distill_loss(z_s, z_t, mask, beta=beta, temperature=temperature)[0], ref, rtol=2e-5)
    np.testing.assert_allclose(chunked(h_s, w_s, h_t, w_t, mask, beta=beta, temperature=temperature, chunk_size=6)[0],
                               ref, rtol=2e-5)
    np.testing.assert_allclose(np_token_mean(np_jsd(np_log_softmax(z_s, temperature), np_log_softmax(z_t, temperature),
                                                    beta), mask), ref, rtol=2e-5)
    # TRL's num_items_in_batch (a global token count for gradient accumulation) is maxpost's num_tokens
    ref_n = trl_loss(z_s, z_t, mask, beta, temperature, num_items=40).item()
    np.testing.assert_allclose(chunked(h_s, w_s, h_t, w_t, mask, beta=beta, temperature=temperature, num_tokens=40,
                                       chunk_size=6)[0], ref_n, rtol=2e-5)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", (1.0, 0.7))
def test_gradients_match_trl_autograd_and_the_whole_logits(beta, temperature):
    "d loss / d (student hidden, student head): chunked = jax.grad of the whole-logits loss = torch autograd of TRL's."
    h_s, w_s, h_t, w_t, mask = case(3, scale=1.2)
    th, tw = torch.tensor(h_s, requires_grad=True), torch.tensor(w_s, requires_grad=True)
    trl_loss(th @ tw.T, logits(h_t, w_t).astype(np.float32), mask, beta, temperature).backward()
    g_chunked = jax.jit(jax.grad(lambda h, w: chunked_distill_loss(h, w, h_t, w_t, mask, beta=beta, temperature=temperature,
                                                                   chunk_size=6)[0], (0, 1)))(h_s, w_s)
    g_whole = jax.jit(jax.grad(lambda h, w: distill_loss(jnp.einsum("btd,vd->btv", h, w), logits(h_t, w_t), mask, beta=beta,
                                                         temperature=temperature)[0], (0, 1)))(h_s, w_s)
    for g, g_ref, g_torch in zip(g_chunked, g_whole, (th.grad.numpy(), tw.grad.numpy())):
        np.testing.assert_allclose(g, g_torch, atol=2e-6, rtol=1e-4)
        np.testing.assert_allclose(g, g_ref, atol=1e-6, rtol=1e-5)


def test_gradient_scales_with_the_cotangent_and_adds_over_micro_batches():
    "The backward multiplies by the cotangent (3 x loss has 3 x the gradient); micro-batches with the step's count add up."
    h_s, w_s, h_t, w_t, mask = case(4)
    mask[-1] = 1
    grad = jax.grad(lambda h, w, c: c * chunked_distill_loss(h, w, h_t, w_t, mask, chunk_size=6)[0], (0, 1))
    g1, g3 = grad(h_s, w_s, 1.0), grad(h_s, w_s, 3.0)
    for a, b in zip(g1, g3): np.testing.assert_allclose(3 * np.asarray(a), b, rtol=1e-5, atol=1e-7)
    n = mask.sum()
    big = jax.value_and_grad(lambda h, w: chunked_distill_loss(h, w, h_t, w_t, mask, num_tokens=n, chunk_size=6)[0], (0, 1))(h_s, w_s)
    parts = [jax.value_and_grad(lambda h, w: chunked_distill_loss(h, w, h_t[s], w_t, mask[s], num_tokens=n, chunk_size=6)[0],
                                (0, 1))(h_s[s], w_s) for s in (slice(0, 1), slice(1, 3))]
    np.testing.assert_allclose(parts[0][0] + parts[1][0], big[0], rtol=1e-6)
    np.testing.assert_allclose(np.concatenate([parts[0][1][0], parts[1][1][0]]), big[1][0], atol=1e-7)
    np.testing.assert_allclose(parts[0][1][1] + parts[1][1][1], big[1][1], atol=1e-6)


def test_the_teacher_gets_no_gradient():
    h_s, w_s, h_t, w_t, mask = case(5)
    g = jax.grad(lambda h, w: chunked_distill_loss(h_s, w_s, h, w, mask, chunk_size=6)[0], (0, 1))(h_t, w_t)
    assert all(float(jnp.abs(x).max()) == 0.0 for x in g)
    g = jax.grad(lambda z: distill_loss(logits(h_s, w_s), z, mask)[0])(jnp.asarray(logits(h_t, w_t), jnp.float32))
    assert float(jnp.abs(g).max()) == 0.0


def test_another_vocabulary_is_refused():
    h_s, w_s, h_t, w_t, mask = case(6)
    with pytest.raises(ValueError, match="student's vocabulary has 13 tokens and the teacher's 12"):
        chunked_distill_loss(h_s, w_s, h_t, w_t[:12], mask)


# ---- top-1 agreement

def test_top1_agreement_against_numpy():
    h_s, w_s, h_t, w_t, mask = case(7)
    z_s, z_t = logits(h_s, w_s).astype(np.float32), logits(h_t, w_t).astype(np.float32)
    z_t[0, :3] = z_s[0, :3] * 2.0                                              # some positions that agree
    z_s[1, 0, :2] = z_t[1, 0, :2] = 50.0                                       # a tie on both sides: first index wins
    ref = ((z_s.argmax(-1) == z_t.argmax(-1)) * (mask > 0)).sum() / mask.sum()
    assert 0 < ref < 1
    np.testing.assert_allclose(summarize_distill_metrics(distill_loss(z_s, z_t, mask)[1])["top1_agreement"], ref, rtol=1e-6)
    lp, ids = jax.lax.top_k(jax.nn.log_softmax(jnp.asarray(z_t)), 4)
    ref_topk = ((z_s.argmax(-1) == np.asarray(ids)[..., 0]) * (mask > 0)).sum() / mask.sum()
    m = topk_distill_loss(z_s, lp, ids, mask)[1]
    np.testing.assert_allclose(summarize_distill_metrics(m)["top1_agreement"], ref_topk, rtol=1e-6)
    m = chunked(h_s, w_s, h_t, w_t, mask, beta=0.5, chunk_size=6)[1]           # the chunked path, on its own logits
    ref = ((logits(h_s, w_s).argmax(-1) == logits(h_t, w_t).argmax(-1)) * (mask > 0)).sum() / mask.sum()
    np.testing.assert_allclose(summarize_distill_metrics(m)["top1_agreement"], ref, rtol=1e-6)


# ---- offline: the teacher's top-k

@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("tail", TOPK_TAILS)
@pytest.mark.parametrize("temperature", (1.0, 0.7))
def test_offline_topk_equals_online_at_full_vocabulary(beta, tail, temperature):
    h_s, w_s, h_t, w_t, mask = case(8, scale=1.5)
    V = w_s.shape[0]
    lp, ids = teacher_topk_logps(h_t, w_t, V, temperature, chunk_size=6)       # what the offline writer stores, k = V
    online_loss, online_m = chunked(h_s, w_s, h_t, w_t, mask, beta=beta, temperature=temperature, chunk_size=6)
    loss, m = chunked_topk(h_s, w_s, lp, ids, mask, beta=beta, temperature=temperature, tail=tail, chunk_size=6)
    np.testing.assert_allclose(loss, online_loss, rtol=1e-5)
    for k in online_m: np.testing.assert_allclose(m[k], online_m[k], rtol=1e-4, atol=1e-6)
    g_on = jax.grad(lambda h: chunked_distill_loss(h, w_s, h_t, w_t, mask, beta=beta, temperature=temperature,
                                                   chunk_size=6)[0])(h_s)
    g_off = jax.grad(lambda h: chunked_topk_distill_loss(h, w_s, lp, ids, mask, beta=beta, temperature=temperature,
                                                         tail=tail, chunk_size=6)[0])(h_s)
    np.testing.assert_allclose(g_off, g_on, atol=1e-5, rtol=1e-4)          # float32: the renormalized log-probs round


def np_topk_bucket(s_full, t_k, ids, beta):
    "Per position: the divergence between the k+1 bins (the k tokens and 'any other token') of student and teacher."
    s_k = np.take_along_axis(s_full, ids, -1)
    s_bins = np.concatenate([s_k, np.log1p(-np.exp(s_k).sum(-1, keepdims=True))], -1)
    t_bins = np.concatenate([t_k, np.log1p(-np.exp(t_k).sum(-1, keepdims=True))], -1)
    return np_jsd(s_bins, t_bins, beta)


def np_maxtext_offline(s_logits, t_topk, ids, temperature):
    "MaxText's offline KL (distillation_utils.py): softmax of teacher and student over the saved top-k, KL(T || S)."
    s_k = np.take_along_axis(np.asarray(s_logits, np.float64), ids, -1)
    return np_kl(np_log_softmax(t_topk, temperature), np_log_softmax(s_k, temperature))


@pytest.mark.parametrize("beta", BETAS)
def test_topk_bucket_against_numpy(beta):
    h_s, w_s, h_t, w_t, mask = case(9, V=40, scale=1.5)
    lp, ids = teacher_topk_logps(h_t, w_t, 5)
    s_full = np_log_softmax(logits(h_s, w_s))
    ref = np_token_mean(np_topk_bucket(s_full, np.asarray(lp, np.float64), np.asarray(ids), beta), mask)
    loss = chunked_topk(h_s, w_s, lp, ids, mask, beta=beta, tail="bucket", chunk_size=6)[0]
    np.testing.assert_allclose(loss, ref, rtol=1e-4)
    full = np_token_mean(np_jsd(s_full, np_log_softmax(logits(h_t, w_t)), beta), mask)
    assert loss < full                                        # merging tokens into one bin lowers an f-divergence


@pytest.mark.parametrize("temperature", (1.0, 2.0))
def test_topk_renormalize_against_maxtext_formula(temperature):
    "MaxText stores the top-k raw logits; maxpost stores top-k log-probs written at the temperature: the same loss."
    h_s, w_s, h_t, w_t, mask = case(10, V=40, scale=1.5)
    z_t = logits(h_t, w_t)
    ids = np.argsort(-z_t, -1, kind="stable")[..., :5]
    ref = np_token_mean(np_maxtext_offline(logits(h_s, w_s), np.take_along_axis(z_t, ids, -1), ids, temperature), mask)
    lp, ids_written = teacher_topk_logps(h_t, w_t, 5, temperature)
    np.testing.assert_array_equal(ids_written, ids)
    loss = chunked_topk(h_s, w_s, lp, ids_written, mask, beta=0.0, temperature=temperature, tail="renormalize", chunk_size=6)[0]
    np.testing.assert_allclose(loss, ref, rtol=1e-4)


@pytest.mark.parametrize("top_k", (0, 5))
@pytest.mark.parametrize("temperature", (1.0, 2.0))
def test_forward_kl_matches_tunix_logit_strategy(top_k, temperature):
    """Tunix's LogitStrategy (alpha=1: the soft loss alone) is KL(teacher || student) with temperature, multiplied by
    temperature^2 and averaged over every position; with distill_top_k it renormalizes both over the teacher's top-k."""
    from tunix.distillation.strategies.logit import LogitStrategy
    h_s, w_s, h_t, w_t, _ = case(11, V=40, scale=1.5)
    mask = np.ones(h_s.shape[:2], np.float32)
    z_s, z_t = (jnp.asarray(logits(h, w), jnp.float32) for h, w in ((h_s, w_s), (h_t, w_t)))
    strategy = LogitStrategy(lambda *a: None, lambda *a: None, lambda *a: None, temperature=temperature, alpha=1.0,
                             distill_top_k=top_k)
    labels = jax.nn.one_hot(jnp.zeros(z_s.shape[:2], jnp.int32), z_s.shape[-1])
    ref = float(strategy.compute_loss(z_s, z_t, labels)[0]) / temperature ** 2
    if top_k:
        lp, ids = teacher_topk_logps(h_t, w_t, top_k, temperature)
        loss = topk_distill_loss(z_s, lp, ids, mask, beta=0.0, temperature=temperature, tail="renormalize")[0]
    else: loss = distill_loss(z_s, z_t, mask, beta=0.0, temperature=temperature)[0]
    np.testing.assert_allclose(loss, ref, rtol=1e-5)


def test_topk_writer_against_numpy_and_refuses_a_tail_it_does_not_know():
    h_s, w_s, h_t, w_t, mask = case(12, V=40)
    lp, ids = teacher_topk_logps(h_t, w_t, 7, 0.7, chunk_size=6)
    ref = np_log_softmax(logits(h_t, w_t), 0.7)
    np.testing.assert_array_equal(ids, np.argsort(-ref, -1, kind="stable")[..., :7])
    np.testing.assert_allclose(lp, np.take_along_axis(ref, np.asarray(ids), -1), atol=2e-6)
    with pytest.raises(ValueError, match="unknown tail 'drop'; valid: bucket, renormalize"):
        chunked_topk_distill_loss(h_s, w_s, lp, ids, mask, tail="drop")


# ---- the dense per-token advantage

def test_reverse_kl_advantages_give_the_reverse_kl_gradient_in_expectation():
    """The policy gradient with advantages log p_teacher - log p_student, taken in exact expectation over each
    position's vocabulary, is the gradient of the full-vocabulary reverse KL loss (beta=1)."""
    _, _, _, _, mask = case(13)
    r = np.random.default_rng(13)
    z_s, z_t = jnp.asarray(r.normal(size=(3, 7, 13)), jnp.float32), jnp.asarray(r.normal(size=(3, 7, 13)), jnp.float32)
    def surrogate(z):
        lp = jax.nn.log_softmax(z)
        adv = reverse_kl_advantages(lp, jax.nn.log_softmax(z_t), jnp.broadcast_to(mask[..., None], lp.shape))
        return -(jax.lax.stop_gradient(jnp.exp(lp)) * adv * lp).sum() / mask.sum()
    g_pg = jax.grad(surrogate)(z_s)
    g_kl = jax.grad(lambda z: distill_loss(z, z_t, mask, beta=1.0)[0])(z_s)
    np.testing.assert_allclose(g_pg, g_kl, atol=1e-6)
    a = reverse_kl_advantages(jnp.array([[-1.0, -2.0]]), jnp.array([[-0.5, -3.0]]), jnp.array([[1, 0]]))
    np.testing.assert_array_equal(a, [[0.5, 0.0]])


# ---- from the models

@pytest.fixture(scope="module")
def models():
    student = create_model(get_model_config("tiny", num_layers=1, tie_embeddings=False), seed=0)
    teacher = create_model(get_model_config("tiny", num_layers=1, d_model=96, mlp_dim=256), seed=1)
    r = np.random.default_rng(14)
    prompt_ids = np.repeat(r.integers(1, 512, (2, 5)), 2, 0); prompt_mask = np.ones_like(prompt_ids); prompt_mask[2:, :2] = 0
    completion_ids = r.integers(1, 512, (4, 6)); completion_mask = np.ones_like(completion_ids); completion_mask[1, 4:] = 0
    return student, teacher, (prompt_ids, prompt_mask, completion_ids, completion_mask)


def test_model_loss_and_gradient_chunked_with_shared_prompts_equal_the_logits_path(models):
    "A wider teacher; the student's gradient through the model, chunked with each group's prompt once = from the logits."
    student, teacher, args = models
    @nnx.jit(static_argnames=("g", "chunk_size"))
    def loss_and_grad(student, teacher, args, g, chunk_size):
        f = lambda m: completion_distill_loss(m, teacher, *args, beta=0.5, temperature=0.8, num_generations=g,
                                              chunk_size=chunk_size)[0]
        return nnx.value_and_grad(f)(student)
    (l_ref, g_ref), (l, g) = loss_and_grad(student, teacher, args, 1, None), loss_and_grad(student, teacher, args, 2, 8)
    np.testing.assert_allclose(l, l_ref, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(nnx.state(g)), jax.tree.leaves(nnx.state(g_ref))):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4)
    # and against the naive divergence over the teacher-forced logits
    z = [np.asarray(nnx.jit(lambda m, a: m.logits(completion_hidden(m, *a)))(m, args[:3])) for m in (student, teacher)]
    ref = np_token_mean(np_jsd(np_log_softmax(z[0], 0.8), np_log_softmax(z[1], 0.8), 0.5), args[3])
    np.testing.assert_allclose(l, ref, rtol=2e-5)


def test_model_topk_writer_feeds_the_offline_loss(models):
    "The teacher's top-V (chunked, each group's prompt once) = from its logits; the offline loss from it = the online one."
    student, teacher, args = models
    @nnx.jit
    def run(student, teacher, args):
        V = student.output_weights().shape[0]
        lp, ids = completion_topk_logps(teacher, *args[:3], V, 0.8, num_generations=2, chunk_size=8)
        by_logits = completion_topk_logps(teacher, *args[:3], V, 0.8, chunk_size=None)
        h = completion_hidden(student, *args[:3])
        offline = chunked_topk_distill_loss(h, student.output_weights(), lp, ids, args[3], temperature=0.8)[0]
        return (lp, ids), by_logits, offline, completion_distill_loss(student, teacher, *args, temperature=0.8)[0]
    (lp, ids), (lp_logits, ids_logits), offline, online = run(student, teacher, args)
    by_token = lambda lp, ids: np.take_along_axis(np.asarray(lp), np.argsort(np.asarray(ids), -1), -1)   # near-ties may swap
    np.testing.assert_allclose(by_token(lp, ids), by_token(lp_logits, ids_logits), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(ids)[..., :8], np.asarray(ids_logits)[..., :8])
    np.testing.assert_allclose(offline, online, rtol=1e-5)


# ---- memory

def test_chunked_gradient_never_builds_the_logits():
    """XLA's memory analysis of the compiled gradient (nothing allocated): the chunked loss's temporaries stay below one
    model's [B,T,V] float32 logits and do not grow with the sequence (beyond [B,T,D] and the head's gradient), while
    the whole-logits loss holds several [B,T,V] arrays."""
    def temp(loss_fn, T, B=2, D=64, V=32_768):
        f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
        g = jax.jit(jax.grad(lambda hs, ws, ht, wt, m: loss_fn(hs, ws, ht, wt, m)[0], (0, 1)))
        return g.lower(f32(B, T, D), f32(V, D), f32(B, T, D), f32(V, D), f32(B, T)).compile().memory_analysis().temp_size_in_bytes
    chunked_fn = lambda *a: chunked_distill_loss(*a, beta=0.5, chunk_size=256)
    logits_bytes = 2 * 2048 * 32_768 * 4
    t1, t2 = temp(chunked_fn, 1024), temp(chunked_fn, 2048)
    assert t2 < logits_bytes / 2, (t2, logits_bytes)
    assert t2 - t1 < 0.1 * t1, (t1, t2)
    whole = temp(lambda hs, ws, ht, wt, m: distill_loss(jnp.einsum("btd,vd->btv", hs, ws), jnp.einsum("btd,vd->btv", ht, wt),
                                                        m, beta=0.5), 2048)
    assert whole > 2 * logits_bytes, whole
