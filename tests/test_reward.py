"""Reward models and Hugging Face: a tiny random `*ForSequenceClassification` of each family (num_labels=1, the pad
token set) built here with transformers, saved, imported by `load_reward_hf`: maxpost's `score` equals transformers'
logits within 1e-4 (float32, right and left padding); `save_reward_hf` writes back the same tensors bit for bit, which
transformers loads as the same class with the same scores; a causal LM given as a reward model is refused in one line
(exit code 2 on the command line)."""
import json

import numpy as np
import pytest
import jax.numpy as jnp
from safetensors import safe_open

torch = pytest.importorskip("torch")
import transformers  # noqa: E402

from maxpost.cli import exit_code
from maxpost.config import ConfigError
from maxpost.reward import load_reward_hf, reward_inputs, save_reward_hf, score

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=128, intermediate_size=96, max_position_embeddings=256, initializer_range=0.25, pad_token_id=0)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, rope_parameters=dict(
        rope_type="llama3", rope_theta=10_000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16), rms_norm_eps=1e-5, tie_word_embeddings=False, num_labels=1),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, rope_parameters=dict(rope_type="default", rope_theta=1e6),
                                              num_labels=1),
    "gemma3": lambda: transformers.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 7}, sliding_window=4,
                                                    query_pre_attn_scalar=24, num_labels=1, rope_parameters={
                                                        "full_attention": dict(rope_type="linear", factor=4.0, rope_theta=1e6),
                                                        "sliding_attention": dict(rope_type="default", rope_theta=1e4)}),
}
CLASSES = {"llama": "LlamaForSequenceClassification", "qwen3": "Qwen3ForSequenceClassification",
           "gemma3": "Gemma3TextForSequenceClassification"}
SEQS = [[5, 17, 99, 3, 42, 8, 77, 64, 12, 9, 33], [7, 7, 21], [100, 2, 54, 88, 31, 6, 19, 120]]   # 0 is the pad


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved(request, tmp_path_factory):
    family = request.param
    torch.manual_seed(0)
    hf = getattr(transformers, CLASSES[family])(CONFIGS[family]()).eval().float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name: p.normal_(0.0, 0.3)     # random norms: Gemma's 1 + w is exercised
    hf.config._attn_implementation = "eager"
    path = tmp_path_factory.mktemp(family)
    hf.save_pretrained(path, safe_serialization=True)
    return family, path, hf


def _hf_scores(hf, tokens, segment_ids, positions=None):
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(segment_ids),
                 position_ids=None if positions is None else torch.tensor(positions, dtype=torch.long))
    return out.logits[:, 0].float().numpy()


def _tensors(path):
    with safe_open(path / "model.safetensors", framework="numpy") as f: return {k: f.get_tensor(k) for k in f.keys()}


def test_scores_match_transformers(saved):
    """Right-padded (transformers reads the last non-pad token) and left-padded (positions from 0 at the first real
    token, given to transformers as position_ids): maxpost's score equals transformers' within 1e-4 in float32."""
    family, path, hf = saved
    body, head = load_reward_hf(path)
    for side in ("right", "left"):
        tokens, positions, segment_ids = reward_inputs(SEQS, pad_id=0, side=side)
        ours = np.asarray(score(body, head, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segment_ids)))
        theirs = _hf_scores(hf, tokens, segment_ids, positions if side == "left" else None)
        print(f"{family} {side}: max |score - transformers| = {np.abs(ours - theirs).max():.2e}, scores {theirs}")
        assert np.abs(theirs).max() > 0.05                      # a head that really reads something
        np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_export_round_trips_bit_exact(saved, tmp_path):
    """transformers' reward model -> maxpost -> save_reward_hf: the same tensors bit for bit (no unembedding added),
    a config transformers loads as the same one-label class with the pad token, and the same scores; imported again,
    the same parameters."""
    family, path, hf = saved
    body, head = load_reward_hf(path)
    out = save_reward_hf(body, head, tmp_path / "rm", pad_token_id=0)
    original, written = _tensors(path), _tensors(out)
    assert sorted(written) == sorted(original)
    for k, v in original.items():
        assert written[k].dtype == v.dtype and written[k].shape == v.shape and np.array_equal(written[k], v), k
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["architectures"], cfg["pad_token_id"], len(cfg["id2label"])) == ([CLASSES[family]], 0, 1)
    back = transformers.AutoModelForSequenceClassification.from_pretrained(out, attn_implementation="eager").eval()
    assert type(back) is type(hf) and back.config.num_labels == 1
    tokens, _, segment_ids = reward_inputs(SEQS, pad_id=0)
    np.testing.assert_array_equal(_hf_scores(back, tokens, segment_ids), _hf_scores(hf, tokens, segment_ids))
    body2, head2 = load_reward_hf(out)
    assert np.array_equal(np.asarray(head2.weight[...]), np.asarray(head.weight[...]))
    again = save_reward_hf(body2, head2, tmp_path / "again", pad_token_id=0)
    assert all(np.array_equal(v, written[k]) for k, v in _tensors(again).items())


def test_a_causal_lm_is_refused_in_one_line_with_exit_code_2(tmp_path):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(CONFIGS["llama"]()).save_pretrained(tmp_path / "lm", safe_serialization=True)
    with pytest.raises(ConfigError) as e: load_reward_hf(tmp_path / "lm")
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and "causal language model (LlamaForCausalLM) with no score head" in msg, msg
    assert "num_labels=1" in msg and exit_code(e.value) == 2


def test_a_classifier_of_two_labels_is_refused(tmp_path):
    torch.manual_seed(0)
    cfg = CONFIGS["qwen3"](); cfg.num_labels = 2
    transformers.Qwen3ForSequenceClassification(cfg).save_pretrained(tmp_path / "two", safe_serialization=True)
    with pytest.raises(ConfigError, match=r"score.weight has shape \[2, 64\].*num_labels=1"): load_reward_hf(tmp_path / "two")


def test_an_unsupported_architecture_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForSequenceClassification"]}))
    with pytest.raises(ConfigError) as e: load_reward_hf(tmp_path)
    assert len(str(e.value).splitlines()) == 1 and "BertForSequenceClassification, not a reward model" in str(e.value)
