"""Compile-only memory: XLA's analysis of the SFT loss + gradient and of the RL log-probs' gradient, lowered from
shapes (nothing is allocated).

`sft_grad_temp_bytes` and `rl_logps_grad_temp_bytes` are the measurements (bench/memory.py can import them); the
tests assert how the temporaries grow with the sequence and the vocabulary, and that the remat policies keep what
they promise, so a regression fails CI.
"""
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from maxpost.model import Decoder, get_model_config, REMAT_POLICIES
from maxpost.sampling import completion_logps
from maxpost.model import LOGITS_CHUNK_SIZE
from maxpost.sft_loss import model_sft_loss


def sft_grad_temp_bytes(cfg, batch: int, seq: int, *, chunk_size: int | None = LOGITS_CHUNK_SIZE) -> int:
    """Temporary bytes of the compiled SFT loss + gradient (w.r.t. the parameters) of a `cfg` decoder on a packed
    [batch, seq] batch: `compiled.memory_analysis().temp_size_in_bytes`, lowered from `jax.ShapeDtypeStruct`s."""
    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
    def loss(params, rest, b):
        return model_sft_loss(nnx.merge(graphdef, params, rest), b, chunk_size=chunk_size)[0]
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    b = dict(tokens=ids, positions=ids, segment_ids=ids, loss_mask=ids)
    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, rest, b).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def rl_logps_grad_temp_bytes(cfg, rows: int, prompt: int, completion: int, num_generations: int = 1, *,
                             chunk_size: int | None = LOGITS_CHUNK_SIZE) -> int:
    """Temporary bytes of the compiled gradient of a weighted sum of `completion_logps` (what the RL update
    differentiates) for `rows` rows of `prompt` + `completion` tokens, G = `num_generations` rows per prompt."""
    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
    def loss(params, rest, b):
        lp = completion_logps(nnx.merge(graphdef, params, rest), b["prompt_ids"], b["prompt_mask"], b["completion_ids"],
                              b["completion_mask"], 1.0, num_generations, chunk_size=chunk_size)
        return (lp * b["advantages"]).sum()
    ids = lambda t: jax.ShapeDtypeStruct((rows, t), jnp.int32)
    b = dict(prompt_ids=ids(prompt), prompt_mask=ids(prompt), completion_ids=ids(completion),
             completion_mask=ids(completion), advantages=jax.ShapeDtypeStruct((rows, completion), jnp.float32))
    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, rest, b).compile()
    return compiled.memory_analysis().temp_size_in_bytes


SMALL = dict(vocab_size=8192, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=384)


@pytest.fixture(scope="module")
def small():
    return get_model_config("tiny", **SMALL)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_doubling_the_sequence_at_most_doubles_the_temporaries(small, remat):
    """Attention keeps O(T) for the backward and never builds a [B,T,S] mask; the loss never builds [B,T,V]: so twice
    the tokens take at most twice the temporaries (+10 %), 1024 -> 2048 (the growth of the whole step; before the
    blockwise attention and the chunked loss it was 2.64x without remat, 2.24x with)."""
    cfg = dataclasses.replace(small, remat=remat)
    temps = {t: sft_grad_temp_bytes(cfg, 1, t) for t in (1024, 2048)}
    assert temps[2048] <= 2.2 * temps[1024], (remat, temps)


def test_vocabulary_adds_its_gradient_and_one_chunk(small):
    """Vocabulary 8k -> 131k adds at most the head's own gradient (float32) and one chunk: that chunk's float32 logits
    and their gradient. The [B,T,V] logits are never built (remat full, T = 2048 = two chunks of 1024 tokens)."""
    cfg = dataclasses.replace(small, remat="full")
    small_v, big_v = 8192, 131_072
    temps = {v: sft_grad_temp_bytes(dataclasses.replace(cfg, vocab_size=v), 1, 2 * LOGITS_CHUNK_SIZE)
             for v in (small_v, big_v)}
    grad_bytes = (big_v - small_v) * cfg.d_model * 4
    chunk_bytes = 2 * LOGITS_CHUNK_SIZE * (big_v - small_v) * 4          # logits and their gradient, one chunk
    assert temps[big_v] - temps[small_v] <= 1.1 * (grad_bytes + chunk_bytes), temps


def test_remat_policies_in_order_of_memory(small):
    """REMAT_POLICIES is ordered by memory: each keeps less than the one before it (T = 1024, 4 layers, a small
    vocabulary so that the layers' activations dominate)."""
    cfg = dataclasses.replace(small, num_layers=4, vocab_size=512)
    temps = [sft_grad_temp_bytes(dataclasses.replace(cfg, remat=r), 1, 1024) for r in REMAT_POLICIES]
    assert temps[1] < 0.9 * temps[0] and temps[2] < 0.8 * temps[1], dict(zip(REMAT_POLICIES, temps))


def test_rl_logps_doubling_the_completion_at_most_doubles_the_temporaries(small):
    """The RL log-prob pass through the shared-prompt path (each prompt once into a KV cache, G = 4 completions
    against it: the cached attention and the chunked log-probs) grows linearly too: completion 512 -> 1024."""
    temps = {t: rl_logps_grad_temp_bytes(small, 4, 128, t, 4) for t in (512, 1024)}
    assert temps[1024] <= 2.2 * temps[512], temps


# --- remat_policy=auto on a device whose compile refuses (a TPU raises RESOURCE_EXHAUSTED from `.compile()`) ---

TPU_SAYS = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm.\n"
            "HLO temporaries (16.74G) exceeds available HBM (15.75G)\n\nProgram hbm requirement 16.74G")


def _sft_refusing(tmp_path, monkeypatch, refuse, *extra):
    """An SFT trainer (tiny model, 2 steps) whose step compiles raise the TPU's RESOURCE_EXHAUSTED, as jaxlib's error
    type does, while its remat policy is in `refuse`; returns the trainer and the policies each compile was tried at."""
    from maxpost.config import load_config
    from maxpost.commands import start_trainer
    from maxpost.sft import SFTTrainer
    cfg = load_config("sft", [f"base_output_directory={tmp_path}", "run_name=r", "model_name=tiny", "steps=2",
                              "train_split=train[:64]", "eval_split=test[:8]", "global_batch_size=8",
                              "max_target_length=96", "eval_batches=1", *extra])
    import maxpost.train as train_mod
    tried, real, now = [], jax.stages.Lowered.compile, {"remat": "none"}     # the policy the model is built with
    def set_options(model, **kw):                                            # each policy `auto` moves the model to
        now["remat"] = kw.get("remat", now["remat"])
        return set_model(model, **kw)
    set_model = train_mod.set_model_options
    import maxpost.sft as sft_mod                # SFT's step from shapes (`early_programs`) picks its policy there
    for mod in (train_mod, sft_mod): monkeypatch.setattr(mod, "set_model_options", set_options)
    def compile(self, *a, **k):          # the training step's compiles (ahead, on a thread, or at the first step)
        if getattr(self._lowering, "_name", "") == "jit(step)":
            tried.append(now["remat"])
            if now["remat"] in refuse: raise jax.errors.JaxRuntimeError(TPU_SAYS)
        return real(self, *a, **k)
    monkeypatch.setattr(jax.stages.Lowered, "compile", compile)
    return start_trainer(SFTTrainer, cfg), tried


def test_auto_moves_past_a_compile_that_raises_resource_exhausted(tmp_path, monkeypatch, capsys):
    """issue 47 item 4: on the TPU `auto` died in XLA's compile at `none`; the error now counts as "does not fit",
    and the run trains at `full`."""
    monkeypatch.setenv("MAXPOST_DEVICE_MEMORY", str(64 << 30))      # the estimate starts at `none`
    tr, tried = _sft_refusing(tmp_path, monkeypatch, ("none", "minimal"))
    out = tr.fit(progress=True)
    assert out["step"] == 2 and tr.model_cfg.remat == "full", (out, tr.model_cfg.remat)
    assert tried[:3] == ["none", "minimal", "full"], tried
    err = capsys.readouterr().err
    assert "remat 'none' does not fit" in err and "trying 'full'" in err, err[-2000:]


def test_auto_with_every_compile_refused_is_one_line(tmp_path, monkeypatch):
    """When no policy compiles: the `MemoryShortfall` (a ConfigError, exit 2 from the CLI) in one line with XLA's
    numbers and the knobs, not a traceback from jaxlib."""
    from maxpost.memory import MemoryShortfall
    from maxpost.config import ConfigError
    monkeypatch.setenv("MAXPOST_DEVICE_MEMORY", str(64 << 30))
    tr, tried = _sft_refusing(tmp_path, monkeypatch, REMAT_POLICIES)
    with pytest.raises(MemoryShortfall) as e:
        tr.fit(progress=False)
    msg = str(e.value)
    assert isinstance(e.value, ConfigError) and "\n" not in msg, msg
    assert "16.74G" in msg and "15.75G" in msg and "gradient_accumulation_steps" in msg, msg
    assert tried == list(REMAT_POLICIES), tried


def test_auto_does_not_compile_a_policy_estimated_not_to_fit(tmp_path, monkeypatch, capsys):
    """The activation estimate (`remat_to_start`) skips what clearly cannot fit: with room for `full`'s estimate but
    not `minimal`'s, the first step program compiled is `full`'s."""
    from maxpost.memory import activation_bytes
    cfg = get_model_config("tiny")
    n = jax.device_count()                                           # the batch is split over the devices
    est = {p: activation_bytes(cfg, 8 * 96 // n, p) for p in REMAT_POLICIES}
    grads = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), nnx.Param))) // n
    monkeypatch.setenv("MAXPOST_DEVICE_MEMORY", str((est["full"] + est["minimal"]) // 2 + grads))
    tr, tried = _sft_refusing(tmp_path, monkeypatch, (), "check_memory=false")
    assert tr.fit(progress=True)["step"] == 2
    assert tried and tried[0] == "full" and "minimal" not in tried and "none" not in tried, tried
    assert "remat_policy=auto starts at 'full'" in capsys.readouterr().err
