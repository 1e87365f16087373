"""Issue 47 (the 1B RL update on a 16 GiB TPU): an update that runs each group's prompt once (RL's G completions,
DPO's two replies) differentiates two passes over the layers, so it holds the prompt pass's weight gradients beside
the completions' (at 1B in bf16, a second 2.3 GiB set). Without sharing it is the same update with one set. The
trainers stop sharing when the estimate with two sets does not fit, or when the compiled update does not."""
import jax, jax.numpy as jnp, numpy as np, optax, pytest
from flax import nnx

from maxpost.commands import start_trainer
from maxpost.config import load_config
from maxpost.model import create_model, get_model_config, Decoder
from maxpost.policy_loss import policy_loss
from maxpost.rl import RLTrainer, make_rl_step
from maxpost.dpo import make_dpo_step, preference_options

from rewards_for_tests import length_reward

KW = dict(loss_algo="grpo", epsilon_low=0.2, epsilon_high=0.28, beta=0.0, kl_estimator="k3", loss_agg_mode="token-mean")
TINY = dict(num_layers=2, d_model=64, mlp_dim=128, vocab_size=64, num_heads=2, num_kv_heads=1)


def _groups(rng, groups=3, G=4, P=7, T=9, vocab=64):
    "Whole groups sharing a left-padded prompt; completions of different lengths."
    B = groups * G
    prompt = np.repeat(rng.integers(1, vocab, (groups, P)), G, axis=0).astype(np.int32)
    pmask = np.ones((B, P), np.int32)
    pmask[:G, :2] = 0                                                 # the first group's prompt is shorter
    lengths = rng.integers(1, T + 1, B)
    return {"prompt_ids": prompt, "prompt_mask": pmask, "completion_ids": rng.integers(1, vocab, (B, T)).astype(np.int32),
            "completion_mask": (np.arange(T)[None] < lengths[:, None]).astype(np.int32),
            "advantages": rng.normal(size=B).astype(np.float32),
            "old_per_token_logps": (rng.normal(size=(B, T)) * 0.1 - 4.2).astype(np.float32)}


def _naive_logps(model, b):
    "Log-probs of each completion token from the whole sequence (prompt then completion, padding masked) through the model's logits: NumPy log-softmax."
    from maxpost.sampling import _teacher_forced_inputs
    P, T = b["prompt_ids"].shape[1], b["completion_ids"].shape[1]
    logits = model(*_teacher_forced_inputs(jnp.asarray(b["prompt_ids"]), jnp.asarray(b["prompt_mask"]),
                                           jnp.asarray(b["completion_ids"])))[:, P - 1:P + T - 1].astype(jnp.float32)
    logp = logits - jax.nn.logsumexp(logits, -1, keepdims=True)
    picked = jnp.take_along_axis(logp, jnp.asarray(b["completion_ids"])[..., None], -1)[..., 0]
    return jnp.where(jnp.asarray(b["completion_mask"]) > 0, picked, 0.0)


@pytest.mark.parametrize("chunk", [None, 16])
def test_the_update_moves_the_weights_the_same_with_and_without_shared_prompts(chunk):
    """One SGD(1) step of `make_rl_step` with each group's prompt run once and with it run per completion: both move
    the weights by the gradient of the policy loss on log-probs from the plain forward (float32, 1e-5)."""
    model = create_model(get_model_config("tiny", **TINY), seed=0)
    gd, p0, rest = nnx.split(model, nnx.Param, ...)
    b = _groups(np.random.default_rng(0))
    def loss(p):
        logps = _naive_logps(nnx.merge(gd, p, rest), b)
        return policy_loss(logps, b["old_per_token_logps"], None, b["advantages"], b["completion_mask"], **KW)[0]
    want = jax.tree.map(lambda p, g: p - g, p0, jax.grad(loss)(p0))
    tx = optax.sgd(1.0)
    for share in (True, False):
        step = make_rl_step(gd, tx, KW, 1.0, num_generations=4, chunk_size=chunk, share_prompts=share)
        p, _, m = step(jax.tree.map(jnp.copy, p0), rest, tx.init(p0), b)
        for a, w in zip(jax.tree.leaves(p), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, w, atol=2e-6, rtol=1e-5, err_msg=f"share_prompts={share}")
        np.testing.assert_allclose(m["loss"], loss(p0), rtol=1e-5, atol=1e-7)


def test_the_dpo_step_is_the_same_with_and_without_shared_prompts():
    "DPO's step (pairs: rows 2i and 2i+1 share a prompt) moves the weights the same way either way (float32, 1e-5)."
    model = create_model(get_model_config("tiny", **TINY), seed=1)
    gd, p0, rest = nnx.split(model, nnx.Param, ...)
    b = {k: v for k, v in _groups(np.random.default_rng(1), groups=3, G=2).items() if k.startswith(("prompt", "completion"))}
    opts = preference_options(load_config("dpo", []))
    out = []
    for share in (True, False):
        tx = optax.sgd(1.0)
        b2 = {**b, "ref_logps": np.random.default_rng(2).normal(size=6).astype(np.float32) - 20}
        step = make_dpo_step(gd, tx, opts, chunk_size=16, share_prompts=share)
        out.append(step(jax.tree.map(jnp.copy, p0), rest, tx.init(p0), b2))
    moved = max(float(jnp.abs(a - c).max()) for a, c in zip(jax.tree.leaves(out[0][0]), jax.tree.leaves(p0)))
    assert moved > 1e-4
    for a, c in zip(jax.tree.leaves(out[0][0]), jax.tree.leaves(out[1][0])):
        np.testing.assert_allclose(a, c, atol=2e-6, rtol=1e-5)


def _update_temporaries(share: bool) -> tuple[int, int]:
    "(temporary bytes of the compiled RL update, bytes of its weights) at a shape where the weights outweigh the activations."
    cfg = get_model_config("tiny", vocab_size=8192, d_model=256, num_layers=4, num_heads=4, num_kv_heads=2,
                           head_dim=64, mlp_dim=1024, remat="full")
    gd, params, rest = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
    tx = optax.sgd(1e-3)
    ids = lambda t: jax.ShapeDtypeStruct((8, t), jnp.int32)
    b = dict(prompt_ids=ids(32), prompt_mask=ids(32), completion_ids=ids(32), completion_mask=ids(32),
             advantages=jax.ShapeDtypeStruct((8,), jnp.float32), old_per_token_logps=jax.ShapeDtypeStruct((8, 32), jnp.float32))
    step = make_rl_step(gd, tx, KW, 1.0, num_generations=4, share_prompts=share)
    grads = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    return step.lower(params, rest, jax.eval_shape(tx.init, params), b).compile().memory_analysis().temp_size_in_bytes, grads


def test_without_shared_prompts_the_update_holds_one_set_of_gradients_not_two():
    "Compile-only, where the weights outweigh the activations: the unshared update needs at least half a gradient set less."
    (shared, grads), (alone, _) = _update_temporaries(True), _update_temporaries(False)
    assert shared - alone > grads // 2, (shared, alone, grads)


def _rl(tmp_path, *extra):
    cfg = load_config("rl", [f"base_output_directory={tmp_path}", "run_name=t", "load_parameters_path=", "model_name=tiny",
                             "global_batch_size=8", "num_generations=4", "mini_batch_size=0", "max_prompt_length=96", "max_completion_length=8",
                             "eval_interval=0", "eval_num_prompts=0", "train_split=train[:32]", "log_period=1",
                             "steps=1", *extra])
    return start_trainer(RLTrainer, cfg, reward_fns=[(length_reward, 1.0, "length")])


def test_rl_stops_sharing_prompts_when_two_sets_of_gradients_are_estimated_not_to_fit(tmp_path, monkeypatch, capsys):
    """The estimate at the start (`_start_remat`): room for remat `full`'s activations and one set of gradients but
    not two: the update runs unshared from its first compile, says so on stderr, and trains."""
    from maxpost.memory import activation_bytes
    n = jax.device_count()                                             # rows and weights split over the devices
    cfg = get_model_config("tiny", remat="full")
    grads = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(nnx.eval_shape(
        lambda: Decoder(cfg, rngs=nnx.Rngs(0))), nnx.Param))) // n
    act = activation_bytes(cfg, 8 * (96 + 8) // n, "full")            # 8 rows of a 96-token prompt and 8 tokens
    monkeypatch.setenv("MAXPOST_DEVICE_MEMORY", str(act + grads + grads // 2))
    tr = _rl(tmp_path / "run", "remat_policy=full", "check_memory=false")
    assert tr.fit(progress=False)["step"] == 1
    assert not tr.shared_prompts
    err = capsys.readouterr().err
    assert "two sets of gradients are estimated at" in err and "each prompt with each of its completions" in err, err[-1500:]


def test_dpo_s_memory_estimate_counts_both_rows_of_a_pair():
    """A DPO step of B pairs runs 2B sequences: the estimate behind `remat_policy=auto` (and the shared-prompt choice)
    counts them, so a 1B DPO step no longer starts at a policy XLA then refuses (two failed compiles on a TPU)."""
    from maxpost.train import _step_tokens
    dpo = load_config("dpo", ["global_batch_size=16", "max_prompt_length=64", "max_completion_length=256"])
    assert _step_tokens(dpo) == 2 * 16 * (64 + 256)
    assert _step_tokens(load_config("sft", ["global_batch_size=8", "max_target_length=1024"])) == 8 * 1024


def test_dpo_s_shared_prompt_estimate_counts_the_reference_copy_and_the_logits(tmp_path, monkeypatch, capsys):
    """DPO's reference is a copy of the weights made after the update's estimate (its compile starts first): the
    estimate counts that copy (`pending_bytes`) and the logits' chunk. On a device whose free memory drops by the copy
    once it is made (faked here: a budget less what each `ReferencePolicy` holds), room for two sets of gradients
    before the copy but not after it means the update is built unshared from the start: the shared one is never
    compiled (the 1B DPO on a TPU compiled it, was refused by XLA, then compiled the unshared one)."""
    import maxpost.train as train_mod
    from maxpost.dpo import DPOTrainer
    from maxpost.memory import activation_bytes, logits_bytes
    from maxpost.step import ReferencePolicy
    n, held, real = jax.device_count(), [], ReferencePolicy.__init__
    def made(self, *a, **k): real(self, *a, **k); held.append(self.nbytes() // n)
    monkeypatch.setattr(ReferencePolicy, "__init__", made)
    cfg = get_model_config("tiny", remat="full")
    grads = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(nnx.eval_shape(
        lambda: Decoder(cfg, rngs=nnx.Rngs(0))), nnx.Param))) // n
    tokens = 2 * 8 * (32 + 16) // n                                     # 8 pairs: 16 rows of 32 + 16 tokens
    need = activation_bytes(cfg, tokens, "full") + logits_bytes(cfg.vocab_size, tokens, 1024) + 2 * grads
    budget = need + grads // 2                                         # two sets fit; less the copy (one set) they do not
    monkeypatch.setattr(train_mod, "device_memory", lambda: (budget - sum(held), "free memory of a fake device"))
    dcfg = load_config("dpo", [f"base_output_directory={tmp_path}", "run_name=t", "load_parameters_path=", "model_name=tiny",
                               "global_batch_size=8", "max_prompt_length=32", "max_completion_length=16", "steps=1",
                               "remat_policy=full", "check_memory=false", "eval_num_prompts=0", "eval_interval=0",
                               "logits_chunk_size=1024", "train_split=train[:64]", "eval_split=test[:8]", "eval_batches=1"],
                      base=None)
    tr = start_trainer(DPOTrainer, dcfg, progress=False)
    assert held and not tr.shared_prompts and tr.pending_bytes() == 0       # the copy made: nothing pending any more
    assert "two sets of gradients are estimated at" in capsys.readouterr().err
    assert tr.fit(progress=False)["step"] == 1


def test_a_compiled_update_that_does_not_fit_is_tried_again_unshared(tmp_path, monkeypatch, capsys):
    """remat `full` and the update's compile refused (a TPU's RESOURCE_EXHAUSTED) while it shares prompts: the trainer
    rebuilds the update without sharing and trains; refused both ways, the one-line `MemoryShortfall`."""
    import maxpost.rl as rl_mod
    from test_memory import TPU_SAYS
    from maxpost.memory import MemoryShortfall
    real, tried, refuse = rl_mod.make_rl_step, [], {"all": False}
    class Refusing:                                 # the update's jitted function whose compile the TPU refuses
        def __init__(self, f, share): self.f, self.share = f, share
        def __getattr__(self, name): return getattr(self.f, name)
        def lower(self, *a):
            lowered = self.f.lower(*a)
            def compile():
                tried.append(self.share)
                if self.share or refuse["all"]: raise jax.errors.JaxRuntimeError(TPU_SAYS)
                return lowered.compile()
            return type("L", (), {"compile": staticmethod(compile)})()
    monkeypatch.setattr(rl_mod, "make_rl_step", lambda *a, share_prompts=True, **k:
                        Refusing(real(*a, share_prompts=share_prompts, **k), share_prompts))
    tr = _rl(tmp_path / "a", "remat_policy=full")
    assert tr.fit(progress=False)["step"] == 1 and not tr.shared_prompts
    assert tried[:2] == [True, False], tried
    assert "each prompt with each of its completions" in capsys.readouterr().err
    refuse["all"] = True
    with pytest.raises(MemoryShortfall) as e:
        _rl(tmp_path / "b", "remat_policy=full").fit(progress=False)
    assert "\n" not in str(e.value) and "16.74G" in str(e.value)


def test_a_bf16_unembedding_gets_its_gradient_summed_in_bf16_close_to_float32():
    """The chunked log-prob backward sums the unembedding's gradient over chunks in a bf16 weight's own dtype (1 GB
    less at 1B than a float32 sum): within bf16's precision of the float32 gradient of the same bf16 weight."""
    from maxpost.sampling import chunked_logps
    rng = np.random.default_rng(3)
    h = jnp.asarray(rng.normal(size=(4, 24, 32)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(96, 32)) * 0.3, jnp.bfloat16)
    tok = jnp.asarray(rng.integers(0, 96, (4, 24)), jnp.int32)
    g = jnp.asarray(rng.normal(size=(4, 24)), jnp.float32)
    def f(w, dtype, chunk):
        return (chunked_logps(h.astype(dtype), w.astype(dtype), tok, chunk_size=chunk) * g).sum()
    got = jax.grad(f)(w, jnp.bfloat16, 16)                              # 6 chunks of 4 rows x 4 positions
    want = jax.grad(f)(w.astype(jnp.float32), jnp.float32, 96)      # float32 throughout, one chunk
    assert got.dtype == jnp.bfloat16
    err = float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))
    assert err < 2e-2, err
    def arrays(jaxpr):                                                  # every value the backward makes, loops included
        for e in jaxpr.eqns:
            yield from (v.aval for v in e.outvars)
            for sub in jax.core.jaxprs_in_params(e.params): yield from arrays(sub)
    made = list(arrays(jax.make_jaxpr(jax.grad(f), static_argnums=(1, 2))(w, jnp.bfloat16, 16).jaxpr))
    dw = [a for a in made if getattr(a, "shape", None) in ((32, 96), (96, 32)) and jnp.issubdtype(a.dtype, jnp.floating)]
    assert dw and all(a.dtype == jnp.bfloat16 for a in dw), sorted({str(a) for a in dw})   # no float32 [D,V] made
