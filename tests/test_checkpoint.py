"""Hugging Face parity: tiny random transformers models -> load_hf -> same logits; save_hf -> transformers loads it."""
import json

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from flax import nnx

import torch, transformers  # dev extra

from safetensors.numpy import save_file
from maxpost.checkpoint import (load_hf, save_hf, hf_config_to_model_config, model_config_to_hf_config,
                                hf_param_map, hf_state_dict)
from maxpost.model import init_cache
from maxpost.sharding import make_mesh

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=128, intermediate_size=96, max_position_embeddings=256)


def _llama():
    return transformers.LlamaConfig(**COMMON, rope_parameters=dict(
        rope_type="llama3", rope_theta=10_000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16), rms_norm_eps=1e-5, tie_word_embeddings=False)


def _qwen3():
    return transformers.Qwen3Config(**COMMON, rope_parameters=dict(rope_type="default", rope_theta=1e6),
                                    tie_word_embeddings=True)


def _gemma3():
    # window 4 < sequence length 24; 7 layers: 5 local, 1 global (layer 5), 1 local
    return transformers.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 7}, sliding_window=4,
                                         query_pre_attn_scalar=24, rope_parameters={
                                             "full_attention": dict(rope_type="linear", factor=4.0, rope_theta=1e6),
                                             "sliding_attention": dict(rope_type="default", rope_theta=1e4)})


CONFIGS = {"llama": (_llama, transformers.LlamaForCausalLM), "qwen3": (_qwen3, transformers.Qwen3ForCausalLM),
           "gemma3": (_gemma3, transformers.Gemma3ForCausalLM)}


def _hf_model(family, seed=0):
    make_cfg, cls = CONFIGS[family]
    torch.manual_seed(seed)
    model = cls(make_cfg()).eval().float()
    # random norm weights so that norms (and Gemma's 1+w) are really exercised
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name: p.normal_(0.0, 0.3)
    return model


def _hf_logits(model, tokens, attention_mask=None, position_ids=None):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(np.asarray(tokens)), attention_mask=attention_mask,
                    position_ids=position_ids)
    return out.logits.float().numpy()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved(request, tmp_path_factory):
    family = request.param
    path = tmp_path_factory.mktemp(family)
    hf = _hf_model(family)
    hf.config._attn_implementation = "eager"
    hf.save_pretrained(path, safe_serialization=True)
    return family, path, hf


def _tokens(seed=0, shape=(2, 24), vocab=128):
    return np.random.default_rng(seed).integers(0, vocab, shape)


def test_logits_match_transformers(saved):
    """load_hf of a tiny random HF model gives transformers' logits within 1e-4 (fp32)."""
    family, path, hf = saved
    model = load_hf(path)
    tokens = _tokens()
    diff = np.abs(np.asarray(model(jnp.asarray(tokens))) - _hf_logits(hf, tokens)).max()
    print(f"{family}: max |logits - transformers| = {diff:.2e}")
    assert diff < 1e-4


def test_config_mapping(saved):
    """The maxpost config reflects the HF switches (rope scaling, windows, layer pattern)."""
    family, path, _ = saved
    cfg = hf_config_to_model_config(json.loads((path / "config.json").read_text()))
    assert cfg.family == family
    if family == "llama":
        assert (cfg.rope_type, cfg.rope_factor, cfg.rope_original_max_len, cfg.tie_embeddings) == ("llama3", 8.0, 16, False)
    if family == "gemma3":
        assert [cfg.is_local(i) for i in range(7)] == [True] * 5 + [False, True]
        assert (cfg.sliding_window, cfg.rope_type, cfg.rope_factor, cfg.local_rope_theta) == (4, "linear", 4.0, 1e4)
        assert cfg.query_pre_attn_scalar == 24
    assert hf_config_to_model_config(model_config_to_hf_config(cfg)) == cfg


def test_save_hf_roundtrip(saved, tmp_path):
    """save_hf writes a directory that transformers loads and that gives the same logits."""
    family, path, hf = saved
    model = load_hf(path)
    save_hf(model, tmp_path / "export")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager").eval()
    assert type(back) is type(hf)
    tokens = _tokens(1)
    diff = np.abs(_hf_logits(back, tokens) - _hf_logits(hf, tokens)).max()
    assert diff < 1e-5
    assert np.abs(np.asarray(model(jnp.asarray(tokens))) - _hf_logits(back, tokens)).max() < 1e-4


def test_left_padded_matches_transformers(saved):
    """A left-padded batch (pads = segment 0, positions from 0 at the first real token) matches transformers with
    an attention mask and the same position ids."""
    family, path, hf = saved
    model = load_hf(path)
    tokens = _tokens(2, (2, 16))
    seg = np.ones((2, 16), np.int32); seg[0, :5] = 0
    pos = np.maximum(np.cumsum(seg, 1) - 1, 0)
    ours = np.asarray(model(jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg)))
    theirs = _hf_logits(hf, tokens, torch.tensor(seg), torch.tensor(pos))
    assert np.abs(ours[0, 5:] - theirs[0, 5:]).max() < 1e-4
    assert np.abs(ours[1] - theirs[1]).max() < 1e-4


def test_sharded_load_matches(saved):
    """Loading onto a 2x2x2 mesh places weights in shards and gives the same logits (jitted, mesh active)."""
    family, path, _ = saved
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    model, sharded = load_hf(path), load_hf(path, mesh=mesh)
    q = sharded.layers[0].attn.q_proj[...]
    assert q.sharding.spec == jax.P("fsdp", "tensor", None) and len(q.addressable_shards) == 8
    tokens = jnp.asarray(_tokens(3, (4, 16)))
    with jax.set_mesh(mesh):
        got = nnx.jit(lambda m, t: m(t))(sharded, tokens)
    assert np.abs(np.asarray(got) - np.asarray(model(tokens))).max() < 1e-4


def test_bf16_load_close(saved):
    """dtype=bfloat16 loads bf16 params, computes in bf16, returns fp32 logits loosely close to fp32."""
    family, path, hf = saved
    model = load_hf(path, dtype=jnp.bfloat16)
    assert model.layers[0].mlp.up_proj[...].dtype == jnp.bfloat16
    tokens = _tokens(4)
    logits = np.asarray(model(jnp.asarray(tokens)))
    assert logits.dtype == np.float32
    ref = _hf_logits(hf, tokens)
    assert np.abs(logits - ref).max() < 0.1 * np.abs(ref).max() + 0.05


def test_sharded_index_checkpoint(saved, tmp_path):
    """A checkpoint split over several files with model.safetensors.index.json loads the same."""
    family, path, _ = saved
    model = load_hf(path)
    tensors = hf_state_dict(model)
    names = sorted(tensors)
    out = tmp_path / "split"; out.mkdir()
    (out / "config.json").write_text((path / "config.json").read_text())
    weight_map = {}
    for i, chunk in enumerate([names[: len(names) // 2], names[len(names) // 2:]]):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in chunk}, str(out / fname), metadata={"format": "pt"})
        weight_map |= {k: fname for k in chunk}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    tokens = jnp.asarray(_tokens(5))
    assert np.abs(np.asarray(load_hf(out)(tokens)) - np.asarray(model(tokens))).max() == 0


def test_gemma3_conditional_generation_text_weights(tmp_path):
    """Text weights of a Gemma3ForConditionalGeneration checkpoint (model.language_model.* names) load."""
    text = _gemma3()
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4)
    torch.manual_seed(0)
    mm = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    mm.save_pretrained(tmp_path, safe_serialization=True)
    model = load_hf(tmp_path)
    tokens = _tokens(6, (1, 12))
    with torch.no_grad():
        ref = mm.model.language_model(input_ids=torch.tensor(tokens)).last_hidden_state
        ref = mm.lm_head(ref).float().numpy()
    assert np.abs(np.asarray(model(jnp.asarray(tokens))) - ref).max() < 1e-4


def _write(path, config, tensors):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_errors(saved, tmp_path):
    """Shape mismatches, missing tensors, unsupported architectures and features fail naming the culprit."""
    family, path, _ = saved
    config = json.loads((path / "config.json").read_text())
    tensors = hf_state_dict(load_hf(path))
    name = "model.layers.1.self_attn.k_proj.weight"
    bad = dict(tensors); bad[name] = np.zeros((8, 64), np.float32)
    _write(tmp_path / "shape", config, bad)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_hf(tmp_path / "shape")
    missing = {k: v for k, v in tensors.items() if k != name}
    _write(tmp_path / "missing", config, missing)
    with pytest.raises(KeyError, match=name.replace(".", r"\.")):
        load_hf(tmp_path / "missing")
    _write(tmp_path / "arch", {**config, "architectures": ["MistralForCausalLM"]}, tensors)
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_hf(tmp_path / "arch")
    extra = dict(tensors); extra["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
    _write(tmp_path / "extra", config, extra)
    with pytest.raises(ValueError, match="q_proj.bias"):
        load_hf(tmp_path / "extra")
    with pytest.raises(ValueError, match="attention_bias"):
        hf_config_to_model_config({**config, "attention_bias": True})


def test_param_map_covers_model(saved):
    """hf_param_map names every parameter exactly once and every HF tensor of the checkpoint."""
    family, path, hf = saved
    model = load_hf(path)
    paths = [e.path for e in hf_param_map(model.cfg)]
    assert sorted(map(str, paths)) == sorted(map(str, dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))))
    hf_names = {k for k in hf.state_dict() if "rotary" not in k}
    if model.cfg.tie_embeddings: hf_names.discard("lm_head.weight")
    assert {e.hf_name for e in hf_param_map(model.cfg)} == hf_names


def test_run_config_reaches_a_hugging_face_model(saved, tmp_path):
    """`dtype` (compute), `param_dtype` and `remat_policy` of a run apply to a model loaded from a Hugging Face
    directory: float32 weights computing in bfloat16 give logits other than float32 compute, close to them."""
    from maxpost.config import load_config
    from maxpost.train import load_policy
    family, path, hf = saved
    cfg = load_config("sft", [f"base_output_directory={tmp_path}", "run_name=x", f"load_parameters_path={path}",
                              "dtype=bfloat16", "param_dtype=float32", "remat_policy=full"])
    model = load_policy(cfg, None)
    assert (model.cfg.dtype, model.cfg.param_dtype, model.cfg.remat) == ("bfloat16", "float32", "full")
    assert model.layers[0].mlp.up_proj[...].dtype == jnp.float32
    tokens = jnp.asarray(_tokens(5))
    mixed, full = np.asarray(model(tokens)), np.asarray(load_hf(path)(tokens))
    assert 0 < np.abs(mixed - full).max() < 0.1 * np.abs(full).max() + 0.05
