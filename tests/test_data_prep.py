"""Data preparation in batches, in worker processes and cached (issue 41): the examples are bit for bit what the
one-example-at-a-time loop gave (the code before the change, kept here as the reference), whatever the number of
processes, the kind of dataset or a reload from the cache; the cache is keyed by the data, the tokenizer and the
settings, and a second run reads it instead of tokenizing."""
import json, os, subprocess, sys
from pathlib import Path

import numpy as np
import pytest

import maxpost.data as D
from maxpost.config import ConfigError
from maxpost.data import assistant_spans, encode_example, load_dataset_split, load_tokenizer, tokenize_dataset

ROOT = Path(__file__).resolve().parent.parent
END = "<|im_end|>"
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_GENERATION = ("{% for m in messages %}<|im_start|>{{ m.role }}{{ '\n' }}{% if m.role == 'assistant' %}"
                     "{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m.content }}<|im_end|>"
                     "{% endif %}{{ '\n' }}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{{ '\n' }}{% endif %}")
WORDS = ("the capital of France is Paris and of Italy Rome since 1871 café naïve déjà vu 東京 는 😀 clips sold "
         "half as many in May altogether 48/2 = 24 #### 72 babysitting earns $12 an hour").split()


def _tokenizer(directory, template):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<|endoftext|>", "<|im_start|>", END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator([" ".join(WORDS)] * 5, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=END, pad_token="<|endoftext|>",
                            chat_template=template).save_pretrained(directory)
    return load_tokenizer(directory)


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    return {"spans": _tokenizer(d / "plain", CHATML), "markers": _tokenizer(d / "gen", CHATML_GENERATION)}


def _text(rng, n):
    return " ".join(rng.choice(WORDS, n))


def _conversations(n, seed=0):
    "Chats of 1-3 turns, some with a system prompt, some long (truncated) and some whose answer lies past the cut."
    rng, out = np.random.default_rng(seed), []
    for i in range(n):
        msgs = [{"role": "system", "content": _text(rng, 5)}] if i % 3 == 0 else []
        for _ in range(int(rng.integers(1, 4))):
            msgs += [{"role": "user", "content": _text(rng, int(rng.integers(1, 30)) * (20 if i % 17 == 0 else 1))},
                     {"role": "assistant", "content": _text(rng, int(rng.integers(1, 40)))}]
        out.append({"messages": msgs})
    return out


# ---- the reference: the loop and encode_chat as they were before batching (maxpost 4bcf363)

def _old_encode_chat(tokenizer, messages, chat_template_kwargs=None):
    if D._has_generation_markers(tokenizer):
        enc = tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, **(chat_template_kwargs or {}))
        return list(enc["input_ids"]), [int(x) for x in enc["assistant_masks"]]
    text, spans = assistant_spans(tokenizer, messages, chat_template_kwargs)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s < b and max(e, s + 1) > a for a, b in spans)) for s, e in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def _old_tokenize(dataset, tokenizer, max_target_length, fmt, monkeypatch, **kw):
    monkeypatch.setattr(D, "encode_chat", _old_encode_chat)
    toks, masks, dropped, truncated, longest = [], [], 0, 0, 0
    try:
        for ex in dataset:
            ids, mask = encode_example(tokenizer, ex, fmt, **kw)
            longest = max(longest, len(ids))
            if len(ids) > max_target_length: ids, mask, truncated = ids[:max_target_length], mask[:max_target_length], truncated + 1
            if not any(mask): dropped += 1; continue
            toks.append(ids); masks.append(mask)
    finally: monkeypatch.undo()
    return D.Examples.from_lists(toks, masks, num_dropped=dropped, num_truncated=truncated, max_length=longest)


def _same(a, b):
    for k in ("tokens", "loss_mask", "offsets"):
        x, y = np.asarray(getattr(a, k)), np.asarray(getattr(b, k))
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), k
    assert (a.num_dropped, a.num_truncated, a.max_length) == (b.num_dropped, b.num_truncated, b.max_length)


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n")
    return path


@pytest.mark.parametrize("template", ["spans", "markers"])
def test_conversations_are_bit_identical_in_batches_in_processes_and_from_the_cache(toks, template, tmp_path, monkeypatch):
    """600 chats (1-3 turns, unicode, truncated ones, dropped ones): one process and two, a list of dicts and a
    memory-mapped dataset, a train_on='all' run and a cache reload all give exactly the reference's arrays."""
    tok, rows = toks[template], _conversations(600)
    want = _old_tokenize(rows, tok, 96, "messages", monkeypatch)
    assert want.num_truncated > 20 and want.num_dropped > 0 and len(want) > 500     # the data exercise both
    ds = load_dataset_split(_write_jsonl(tmp_path / "chats.jsonl", rows), "train")
    for data, procs in ((rows, 1), (rows, 2), (ds, 1), (ds, 2)):
        _same(tokenize_dataset(data, tok, max_target_length=96, num_proc=procs, cache_dir=False), want)
    cache = tmp_path / "cache"
    _same(tokenize_dataset(ds, tok, max_target_length=96, num_proc=2, cache_dir=cache), want)      # written
    monkeypatch.setattr(D, "_encode_all", lambda *a, **k: pytest.fail("tokenized again instead of reading the cache"))
    _same(tokenize_dataset(ds, tok, max_target_length=96, cache_dir=cache), want)                  # read back
    monkeypatch.undo()
    everything = _old_tokenize(rows, tok, 96, "messages", monkeypatch, train_on="all")
    _same(tokenize_dataset(ds, tok, max_target_length=96, num_proc=2, train_on="all", cache_dir=False), everything)


@pytest.mark.parametrize("fmt, rows", [
    ("prompt_completion", [{"prompt": f"{i} " + " ".join(WORDS[i % 9:]), "completion": " ".join(WORDS[:i % 13 + 1])}
                           for i in range(300)]),
    ("prompt_completion", [{"prompt": [{"role": "user", "content": " ".join(WORDS[i % 5:i % 5 + 8])}],
                            "completion": [{"role": "assistant", "content": " ".join(WORDS[:i % 7 + 1])}]}
                           for i in range(300)]),
    ("question_answer", [{"question": " ".join(WORDS[i % 11:]), "answer": f"#### {i}"} for i in range(300)]),
    ("text", [{"text": " ".join(WORDS[i % 17:]) * (1 + i % 3)} for i in range(300)])])
def test_the_other_formats_are_bit_identical_in_processes(toks, fmt, rows, monkeypatch):
    tok = toks["spans"]
    want = _old_tokenize(rows, tok, 48, fmt, monkeypatch)
    for procs in (1, 2):
        _same(tokenize_dataset(rows, tok, max_target_length=48, num_proc=procs, cache_dir=False), want)


def test_a_bad_example_in_a_worker_is_named_by_its_place_in_the_dataset(toks):
    rows = _conversations(400)
    rows[333] = {"messages": [{"role": "human", "content": "2+2?"}, {"role": "gpt", "content": "4"}]}
    with pytest.raises(ConfigError, match=r"^example 333 \(messages format\): messages has a message with role 'human'"):
        tokenize_dataset(rows, toks["spans"], max_target_length=96, num_proc=2, cache_dir=False)


def test_the_cache_key_follows_the_data_the_tokenizer_and_the_settings(toks, tmp_path, monkeypatch):
    """Same data, tokenizer and settings: one entry, read back. A changed file, template, max_target_length, train_on
    or column: a new entry. The number of processes is not part of the key (the result is the same)."""
    cache, rows = tmp_path / "cache", _conversations(50)
    f = _write_jsonl(tmp_path / "c.jsonl", rows)
    run = lambda tok=toks["spans"], path=f, **kw: tokenize_dataset(load_dataset_split(path, "train"), tok,
                                                                      **{"max_target_length": 96, "cache_dir": cache, **kw})
    entries = lambda: sorted(p.name for p in cache.iterdir())
    first = run(num_proc=1)
    assert len(entries()) == 1
    run(num_proc=2)
    assert len(entries()) == 1
    rows[7]["messages"][1]["content"] += " changed"
    _write_jsonl(f, rows)
    assert not np.array_equal(run().tokens, first.tokens) and len(entries()) == 2
    run(tok=toks["markers"]); assert len(entries()) == 3
    run(max_target_length=64); assert len(entries()) == 4
    run(train_on="all"); assert len(entries()) == 5
    renamed = _write_jsonl(tmp_path / "r.jsonl", [{"chat": r["messages"]} for r in rows])
    run(path=renamed, messages_column="chat"); assert len(entries()) == 6
    _same(run(path=renamed, messages_column="chat"), run())                    # same rows under another column name
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name]               # no half-written entry left


def test_an_unwritable_cache_warns_and_the_examples_are_still_returned(toks, tmp_path, monkeypatch):
    rows = _conversations(30)
    want = tokenize_dataset(rows, toks["spans"], max_target_length=96, cache_dir=False)
    (tmp_path / "a-file").write_text("")                  # a cache directory that cannot be made, even by root
    with pytest.warns(UserWarning, match="could not cache the tokenized examples"):
        _same(tokenize_dataset(rows, toks["spans"], max_target_length=96, cache_dir=tmp_path / "a-file" / "c"), want)


def test_a_second_sft_run_reads_the_examples_from_the_cache(tmp_path):
    """`maxpost sft` twice on the embedded task with MAXPOST_CACHE_DIR set: the first run caches its train and eval
    examples there; the second reads them instead of tokenizing (seen by planting a count in the cached entry,
    which the second run's data line then reports)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", MAXPOST_CACHE_DIR=str(tmp_path / "cache"))
    cmd = lambda run: [sys.executable, "-m", "maxpost.cli", "sft", f"base_output_directory={tmp_path}", f"run_name={run}",
                       "steps=1", "model_name=tiny", "train_split=train[:256]", "eval_split=test[:16]",
                       "global_batch_size=8", "max_target_length=96", "eval_batches=1"]
    r = subprocess.run(cmd("a"), env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "train split: 256 examples, 100 truncated" in r.stderr, r.stderr[-3000:]
    entries = list((tmp_path / "cache" / "tokenized").iterdir())
    assert len(entries) == 2                                                   # train and eval
    for e in entries:
        counts = json.loads((e / "examples.json").read_text())
        if counts["num_truncated"] == 100: (e / "examples.json").write_text(json.dumps({**counts, "num_truncated": 99}))
    r = subprocess.run(cmd("b"), env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "train split: 256 examples, 99 truncated" in r.stderr, r.stderr[-3000:]


def test_a_script_without_a_main_guard_tokenizes_in_processes_and_runs_once(toks, tmp_path):
    """A user's script that calls maxpost at module level (no `if __name__ == "__main__":`) used to be imported again
    by each worker process, which started its own pool there and broke the run (BrokenProcessPool); the workers now
    leave `__main__` behind: the script runs once and the two processes give the one-process arrays."""
    rows, tok_dir = _conversations(120), tmp_path / "tok"
    toks["spans"].save_pretrained(tok_dir)
    _write_jsonl(tmp_path / "rows.jsonl", rows)
    script = tmp_path / "user_script.py"
    script.write_text(f"""
import json, numpy as np
from maxpost.data import load_tokenizer, tokenize_dataset
print("script body runs")
rows = [json.loads(l) for l in open({str(tmp_path / "rows.jsonl")!r})]
tok = load_tokenizer({str(tok_dir)!r})
two = tokenize_dataset(rows, tok, max_target_length=96, num_proc=2, cache_dir=False)
one = tokenize_dataset(rows, tok, max_target_length=96, num_proc=1, cache_dir=False)
assert np.array_equal(two.tokens, one.tokens) and np.array_equal(two.loss_mask, one.loss_mask)
assert np.array_equal(two.offsets, one.offsets) and len(one) > 100
print("same arrays")
""")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("script body runs") == 1 and "same arrays" in r.stdout, r.stdout


def test_a_tokenizer_without_a_class_of_its_own_loads_as_autotokenizer_would_without_importing_it(toks, tmp_path):
    """A directory whose tokenizer_config.json names the generic fast tokenizer (maxpost's embedded one, a GGUF
    conversion) loads as that class directly: importing AutoTokenizer reads every model family's configuration, seconds
    of every command's start. The tokenizer is AutoTokenizer's in every respect a run uses."""
    d = tmp_path / "tok"
    toks["spans"].save_pretrained(d)
    code = f"""
import sys
from maxpost.data import load_tokenizer
tok = load_tokenizer({str(d)!r})
print("auto imported" if "transformers.models.auto.tokenization_auto" in sys.modules else "auto not imported")
from transformers import AutoTokenizer
ref = AutoTokenizer.from_pretrained({str(d)!r})
chat = [{{"role": "user", "content": "café 東京 48/2 = 24"}}, {{"role": "assistant", "content": "#### 72"}}]
assert type(tok) is type(ref), (type(tok), type(ref))
assert tok.apply_chat_template(chat, tokenize=False) == ref.apply_chat_template(chat, tokenize=False)
assert tok("the capital 😀 of France")["input_ids"] == ref("the capital 😀 of France")["input_ids"]
assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id, tok.padding_side, tok.special_tokens_map) == \\
       (ref.eos_token_id, ref.pad_token_id, ref.bos_token_id, ref.padding_side, ref.special_tokens_map)
print("same tokenizer")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT)), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["auto", "not", "imported", "same", "tokenizer"], r.stdout


def test_the_tokenized_cache_drops_its_least_recently_used_entries_past_its_size(toks, tmp_path, monkeypatch):
    """Each new copy of the same files (the embedded task under a new base_output_directory) is a new cache entry; past
    `TOKENIZED_CACHE_GB` the entry used least recently goes when another is written: here a limit of about two
    entries, three settings written, the first read again before the third: the second goes."""
    rows = _conversations(40)
    one = lambda n: tokenize_dataset(rows, toks["spans"], max_target_length=n, cache_dir=tmp_path)
    one(96)
    entry = lambda: {p.name for p in tmp_path.iterdir()}
    first = entry()
    size = sum(f.stat().st_size for p in tmp_path.iterdir() for f in p.iterdir())
    monkeypatch.setattr(D, "TOKENIZED_CACHE_GB", 2.5 * size / 2**30)
    one(80)
    second = entry() - first
    os.utime(tmp_path / next(iter(first)) / "examples.json", (1, 1))    # both written long ago, the first before
    os.utime(tmp_path / next(iter(second)) / "examples.json", (2, 2))
    one(96)                                                          # the first: read back, used now
    one(64)                                                          # a third written: the second goes
    names = entry()
    assert first <= names and not (second & names) and len(names) == 2
