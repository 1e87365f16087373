"""maxpost.data: chat-template loss masks, formats, truncation, packing, the resumable iterator, local files."""
import json, re

import numpy as np
import pytest

from maxpost.config import ConfigError
from maxpost.data import (BatchIterator, Examples, check_examples, dataset_splits, detect_format, encode_chat,
                          encode_example, encode_prompt, load_dataset_split, load_tokenizer, make_rows,
                          make_sft_iterator, pack_best_fit, same_rows, tokenize_dataset)

END = "<|im_end|>"
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The same layout, but the assistant text is marked for return_assistant_tokens_mask (newline left out).
CHATML_GENERATION = ("{% for m in messages %}<|im_start|>{{ m.role }}{{ '\n' }}{% if m.role == 'assistant' %}"
                     "{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m.content }}<|im_end|>"
                     "{% endif %}{{ '\n' }}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{{ '\n' }}{% endif %}")
# Like Qwen 3: only the final assistant turn carries an (empty) think block, so earlier turns render differently
# once a later turn follows them; the incremental prefix test alone cannot find them.
CHATML_THINK = ("{% for m in messages %}<|im_start|>{{ m.role }}{{ '\n' }}{% if m.role == 'assistant' and loop.last %}"
                "{{ '<think>\n\n</think>\n\n' }}{% endif %}{{ m.content }}<|im_end|>{{ '\n' }}{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant{{ '\n' }}{% endif %}")

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name the capital of France."},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome, since 1871."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome."},
]
GSM8K = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                 "How much did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
               "$<<0.2*50=10>>10.\n#### 10"},
    {"question": "What is 3 + 4?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
]


def _build_tokenizer(directory, template):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [m["content"] for m in CONVERSATION] + [r["question"] + " " + r["answer"] for r in GSM8K]
    tk.train_from_iterator(corpus * 3, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=END, pad_token="<|endoftext|>",
                            chat_template=template).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return _build_tokenizer(tmp_path_factory.mktemp("tok"), CHATML)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def masked_runs(tokenizer, tokens, mask):
    "Decoded text of each maximal run of mask == 1 (an independent reading of the mask)."
    runs, cur = [], []
    for t, m in zip(list(tokens) + [None], list(mask) + [0]):
        if m: cur.append(int(t))
        elif cur: runs.append(tokenizer.decode(cur)); cur = []
    return runs


def unmasked_text(tokenizer, tokens, mask):
    return tokenizer.decode([int(t) for t, m in zip(tokens, mask) if not m])


# ---------------------------------------------------------------- tokenizer


def test_load_tokenizer_directory_file_and_template_override(tok_dir, tmp_path):
    t = load_tokenizer(tok_dir)
    assert t.chat_template == CHATML and t.eos_token == END
    assert load_tokenizer(f"{tok_dir}/tokenizer.json").chat_template == CHATML
    (tmp_path / "t.jinja").write_text(CHATML_GENERATION)
    assert load_tokenizer(tok_dir, chat_template=str(tmp_path / "t.jinja")).chat_template == CHATML_GENERATION
    assert load_tokenizer(tok_dir, chat_template=CHATML_THINK).chat_template == CHATML_THINK
    # the rendered text round-trips through the tokenizer
    text = t.apply_chat_template(CONVERSATION, tokenize=False)
    assert t.decode(t(text, add_special_tokens=False)["input_ids"]) == text


# ---------------------------------------------------------------- loss masks


def test_multi_turn_masks_every_assistant_turn_and_nothing_else(tok):
    ids, mask = encode_chat(tok, CONVERSATION)
    assert tok.decode(ids) == tok.apply_chat_template(CONVERSATION, tokenize=False)
    assistants = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert masked_runs(tok, ids, mask) == [a + END + "\n" for a in assistants]
    rest = unmasked_text(tok, ids, mask)
    for m in CONVERSATION:
        if m["role"] != "assistant": assert m["content"] in rest
    assert "Paris" not in rest and "Rome" not in rest and "welcome" not in rest
    # headers of every turn stay unmasked
    assert rest.count("<|im_start|>") == len(CONVERSATION)


def test_generation_markers_use_the_templates_own_mask(tok_dir):
    t = load_tokenizer(tok_dir, chat_template=CHATML_GENERATION)
    ids, mask = encode_chat(t, CONVERSATION)
    assistants = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert masked_runs(t, ids, mask) == [a + END for a in assistants]  # the template leaves "\n" out


def test_template_that_rerenders_earlier_turns(tok_dir):
    t = load_tokenizer(tok_dir, chat_template=CHATML_THINK)
    msgs = CONVERSATION[1:5]
    ids, mask = encode_chat(t, msgs)
    assert tok_decode_equal(t, ids, t.apply_chat_template(msgs, tokenize=False))
    assert masked_runs(t, ids, mask) == ["Paris." + END + "\n", "<think>\n\n</think>\n\nRome, since 1871." + END + "\n"]


def tok_decode_equal(t, ids, text):
    return t.decode(ids) == text


def test_completion_only_masks(tok):
    # question–answer through the chat template: the answer and its end-of-turn, nothing of the question
    ids, mask = encode_example(tok, GSM8K[0], "question_answer")
    assert masked_runs(tok, ids, mask) == [GSM8K[0]["answer"] + END + "\n"]
    assert GSM8K[0]["question"] in unmasked_text(tok, ids, mask)
    # plain prompt–completion strings: concatenated, completion + EOS trained
    ex = {"prompt": "Name the capital of France. ", "completion": "Paris."}
    ids, mask = encode_example(tok, ex, "prompt_completion")
    assert tok.decode(ids) == ex["prompt"] + ex["completion"] + END
    assert masked_runs(tok, ids, mask) == ["Paris." + END]
    # ... or through the template when asked
    ids, mask = encode_example(tok, ex, "prompt_completion", use_chat_template=True, system_prompt="Be terse.")
    assert masked_runs(tok, ids, mask) == ["Paris." + END + "\n"]
    assert "Be terse." in unmasked_text(tok, ids, mask)
    # conversational prompt–completion (lists of messages)
    ex = {"prompt": CONVERSATION[:4], "completion": [CONVERSATION[4]]}
    ids, mask = encode_example(tok, ex, "prompt_completion")
    assert masked_runs(tok, ids, mask) == ["Paris." + END + "\n", "Rome, since 1871." + END + "\n"]
    # question–answer without a template: "question\n" + answer + EOS
    plain = load_tokenizer(tok_dir_of(tok))
    plain.chat_template = None
    ids, mask = encode_example(plain, GSM8K[2], "question_answer")
    assert plain.decode(ids) == GSM8K[2]["question"] + "\n" + GSM8K[2]["answer"] + END
    assert masked_runs(plain, ids, mask) == [GSM8K[2]["answer"] + END]


def tok_dir_of(t):
    return t.name_or_path


def test_train_on_all_and_text(tok):
    for ex, fmt in [({"messages": CONVERSATION}, "messages"), (GSM8K[1], "question_answer"),
                    ({"text": "Paris is the capital."}, "text")]:
        ids, mask = encode_example(tok, ex, fmt, train_on="all")
        assert mask == [0] + [1] * (len(ids) - 1)  # every token but the first (nothing predicts it)
    ids, mask = encode_example(tok, {"text": "Paris is the capital."}, "text")
    assert tok.decode(ids) == "Paris is the capital." + END and mask == [0] + [1] * (len(ids) - 1)
    with pytest.raises(ValueError, match="train_on"):
        encode_example(tok, {"text": "x"}, "text", train_on="assistant_only")


def test_encode_prompt_is_the_unmasked_prefix(tok):
    for ex in [GSM8K[0], {"messages": CONVERSATION[:5]}]:
        p = encode_prompt(tok, ex)
        ids, mask = encode_example(tok, ex)
        if "messages" in ex:  # the prompt ends before the final assistant turn
            head = tok.apply_chat_template(CONVERSATION[:4], tokenize=False, add_generation_prompt=True)
            assert tok.decode(p) == head
        else:
            assert ids[:len(p)] == p and sum(mask[:len(p)]) == 0 and mask[len(p)] == 1
    with pytest.raises(ValueError, match="no prompts"):
        encode_prompt(tok, {"text": "x"})


# ---------------------------------------------------------------- columns, truncation, drops


def test_bad_columns_fail_with_the_columns_found(tok):
    with pytest.raises(ValueError, match=r"columns found: \['input', 'output'\]"):
        tokenize_dataset([{"input": "a", "output": "b"}], tok, max_target_length=32)
    with pytest.raises(ValueError, match=r"\['answer'\] missing; columns found: \['question', 'solution'\]"):
        tokenize_dataset([{"question": "a", "solution": "b"}], tok, max_target_length=32, data_format="question_answer")
    assert detect_format(["question", "solution"], answer_column="solution") == "question_answer"
    with pytest.raises(ValueError, match="unknown data_format"):
        detect_format(["text"], "jsonl")
    with pytest.raises(ValueError, match="example 1 .*list of"):  # a wrong value type names the example
        tokenize_dataset([{"messages": CONVERSATION}, {"messages": "hello"}], tok, max_target_length=64)


def test_truncation_and_empty_mask_drop(tok):
    long_prompt = {"question": "Name the capital of France. " * 20, "answer": "Paris."}
    L = 40
    qa = tokenize_dataset([GSM8K[2], long_prompt], tok, max_target_length=L)
    full = encode_example(tok, GSM8K[2], "question_answer")
    assert len(full[0]) <= L and len(encode_example(tok, long_prompt, "question_answer")[0]) > L
    assert (len(qa), qa.num_dropped, qa.num_truncated) == (1, 1, 1)
    assert qa[0][0].tolist() == full[0] and qa[0][1].tolist() == full[1]
    # a conversation cut inside its second assistant turn keeps the first and part of the second
    head = tok(tok.apply_chat_template(CONVERSATION[:4], tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]
    ids = tok(tok.apply_chat_template(CONVERSATION, tokenize=False), add_special_tokens=False)["input_ids"]
    Lc = len(head) + 2
    conv = tokenize_dataset([{"messages": CONVERSATION}], tok, max_target_length=Lc)
    assert conv.num_truncated == 1 and conv.num_dropped == 0 and conv.lengths.tolist() == [Lc]
    assert conv[0][0].tolist() == ids[:Lc]
    assert masked_runs(tok, *conv[0]) == ["Paris." + END + "\n", tok.decode(ids[len(head):Lc])]
    with pytest.raises(ValueError, match="all 1 examples have no training target"):
        tokenize_dataset([long_prompt], tok, max_target_length=L)
    with pytest.raises(ValueError, match="empty"):
        tokenize_dataset([], tok, max_target_length=L, data_format="text")


# ---------------------------------------------------------------- packing


def _unique_examples(rng, n, max_len):
    lengths = rng.integers(1, max_len + 1, n)
    tokens = [np.arange(n_i, dtype=np.int32) + 1000 * (i + 1) for i, n_i in enumerate(lengths)]
    masks = [np.r_[0, rng.integers(0, 2, n_i - 1)].astype(np.int32) for n_i in lengths]  # token 0 is never a target
    return Examples.from_lists(tokens, masks)


def check_rows(batch, examples, L):
    "Rows are well formed; returns the example ids found (each segment must be a whole example)."
    found = []
    for k in ("tokens", "segment_ids", "positions", "loss_mask"):
        assert batch[k].dtype == np.int32 and batch[k].shape[1] == L
    for r in range(batch["tokens"].shape[0]):
        seg, pos = batch["segment_ids"][r], batch["positions"][r]
        used = int((seg > 0).sum())
        assert (seg[used:] == 0).all() and (seg[:used] > 0).all()  # padding only at the end
        assert (batch["loss_mask"][r][used:] == 0).all()
        if used: assert seg[0] == 1 and set(np.diff(seg[:used]).tolist()) <= {0, 1}  # 1, 2, 3 ... contiguous
        for s in range(1, int(seg.max()) + 1):
            where = np.flatnonzero(seg == s)
            assert (pos[where] == np.arange(len(where))).all()  # positions restart at 0
            tokens = batch["tokens"][r][where]
            i = int(tokens[0]) // 1000 - 1
            t, m = examples[i]
            assert tokens.tolist() == t.tolist() and batch["loss_mask"][r][where].tolist() == m.tolist()
            found.append(i)
        # every target is countable by the SFT loss: same non-zero segment as the token before it
        tgt = np.flatnonzero(batch["loss_mask"][r])
        assert (tgt > 0).all() and (seg[tgt] == seg[tgt - 1]).all() and (seg[tgt] > 0).all()
    return found


@pytest.mark.parametrize("seed,n,L", [(0, 50, 16), (1, 200, 64), (2, 7, 8), (3, 300, 128)])
def test_packing_keeps_every_token_once(seed, n, L):
    rng = np.random.default_rng(seed)
    ex = _unique_examples(rng, n, L)
    bins = pack_best_fit(ex.lengths, L, rng.permutation(n))
    assert sorted(i for b in bins for i in b) == list(range(n))
    assert all(ex.lengths[b].sum() <= L for b in bins)
    assert len(bins) >= int(np.ceil(ex.lengths.sum() / L))
    # best fit leaves at most one row at most half full
    assert sum(ex.lengths[b].sum() <= L // 2 for b in bins) <= 1
    batch = make_rows(ex, bins, L)
    assert sorted(check_rows(batch, ex, L)) == list(range(n))
    assert int((batch["segment_ids"] > 0).sum()) == int(ex.lengths.sum())


def test_unpacked_pads_one_example_per_row():
    ex = _unique_examples(np.random.default_rng(5), 9, 12)
    it = BatchIterator(ex, global_batch_size=9, max_target_length=12, packing=False, shuffle=False,
                       process_index=0, process_count=1)
    b = next(it)
    assert check_rows(b, ex, 12) == list(range(9)) and b["segment_ids"].max() == 1


# ---------------------------------------------------------------- iterator


def _iter(ex, **kw):
    kw = {"global_batch_size": 4, "max_target_length": 16, "seed": 7, "process_index": 0, "process_count": 1, **kw}
    return BatchIterator(ex, **kw)


def _eq(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("shuffle", [True, False])
def test_iterator_deterministic_and_resumes_exactly(packing, shuffle):
    ex = _unique_examples(np.random.default_rng(11), 23, 16)
    total = 30  # crosses several epoch boundaries
    ref = [next(_iter(ex, packing=packing, shuffle=shuffle)) for _ in range(1)]
    run = _iter(ex, packing=packing, shuffle=shuffle)
    uninterrupted = [next(run) for _ in range(total)]
    assert _eq(uninterrupted[0], ref[0])
    for k in (0, 1, 5, 13, 29):
        it = _iter(ex, packing=packing, shuffle=shuffle)
        for _ in range(k): next(it)
        state = json.loads(json.dumps(it.state()))  # what a checkpoint stores
        assert set(state) == {"epoch", "position", "seed"}
        fresh = _iter(ex, packing=packing, shuffle=shuffle, seed=999).restore(state)
        for want in uninterrupted[k:]:
            assert _eq(next(fresh), want)
    # one epoch of rows covers every example exactly once
    it = _iter(ex, packing=packing, shuffle=shuffle)
    rows = it.plan(0)
    assert sorted(i for r in rows for i in r) == list(range(len(ex)))
    if shuffle:
        assert it.plan(0) != it.plan(1) and _iter(ex, seed=8).plan(0) != it.plan(0)
    # all batches are well formed
    for b in uninterrupted: check_rows(b, ex, 16)


def test_num_epochs_ends_with_padding_rows():
    ex = _unique_examples(np.random.default_rng(3), 10, 16)
    it = _iter(ex, packing=False, num_epochs=2, global_batch_size=3)
    batches = list(it)
    assert len(batches) == 7  # 20 rows in batches of 3
    found = [i for b in batches for i in check_rows(b, ex, 16)]
    assert sorted(found) == sorted(list(range(10)) * 2)
    assert (batches[-1]["segment_ids"][2:] == 0).all()
    with pytest.raises(StopIteration): next(it)


@pytest.mark.parametrize("process_count", [2, 4, 8])
def test_process_slices_partition_the_global_batch(process_count):
    ex = _unique_examples(np.random.default_rng(4), 37, 16)
    whole = _iter(ex, global_batch_size=8)
    parts = [_iter(ex, global_batch_size=8, process_index=p, process_count=process_count) for p in range(process_count)]
    for _ in range(12):
        want = next(whole)
        got = [next(p) for p in parts]
        assert all(g["tokens"].shape == (8 // process_count, 16) for g in got)
        assert _eq({k: np.concatenate([g[k] for g in got]) for k in want}, want)
    with pytest.raises(ValueError, match="divisible"):
        _iter(ex, global_batch_size=6, process_index=0, process_count=4)


def test_process_defaults_come_from_jax():
    ex = _unique_examples(np.random.default_rng(4), 5, 16)
    it = BatchIterator(ex, global_batch_size=2, max_target_length=16)
    assert (it.process_index, it.process_count) == (0, 1)


# ---------------------------------------------------------------- local files


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows: f.write(json.dumps(r) + "\n")
    return path


def test_jsonl_parquet_and_directory_load(tmp_path):
    import datasets
    rows = [{"messages": CONVERSATION[:3]}, {"messages": CONVERSATION[:5]}]
    _write_jsonl(tmp_path / "chat.jsonl", rows)
    ds = load_dataset_split(str(tmp_path / "chat.jsonl"))
    assert ds.column_names == ["messages"] and ds[1]["messages"] == CONVERSATION[:5]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "chat.parquet"))
    ds = load_dataset_split(tmp_path / "chat.parquet", "train")
    assert len(ds) == 2 and ds[0]["messages"] == CONVERSATION[:3]
    d = tmp_path / "dir"; d.mkdir()
    _write_jsonl(d / "train.jsonl", GSM8K); _write_jsonl(d / "test.jsonl", GSM8K[:1])
    assert len(load_dataset_split(d, "train")) == 3 and len(load_dataset_split(d, "test")) == 1
    assert load_dataset_split(d, "train[:2]")["question"] == [r["question"] for r in GSM8K[:2]]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(GSM8K)}).save_to_disk(str(tmp_path / "saved"))
    assert len(load_dataset_split(tmp_path / "saved", "train")) == 3
    assert load_dataset_split(tmp_path / "saved", "train[1:]")["question"] == [r["question"] for r in GSM8K[1:]]
    assert len(load_dataset_split("unused", "train", data_files=[str(d / "train.jsonl")])) == 3
    with pytest.raises(ValueError, match="file type"):
        load_dataset_split("x", data_files="data.bin")


def test_gsm8k_jsonl_trains_on_answers(tok, tmp_path):
    path = _write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)
    ds = load_dataset_split(str(path))
    assert detect_format(ds.column_names) == "question_answer"
    it = make_sft_iterator(tok, str(path), max_target_length=256, global_batch_size=2, process_index=0, process_count=1)
    assert len(it.examples) == 3 and it.examples.num_dropped == 0
    answers, questions = [], []
    for _ in range(2):  # two batches of two rows hold the three examples at least once
        b = next(it)
        for r in range(2):
            seg = b["segment_ids"][r]
            for s in range(1, int(seg.max()) + 1):
                w = seg == s
                answers += masked_runs(tok, b["tokens"][r][w], b["loss_mask"][r][w])
                questions.append(unmasked_text(tok, b["tokens"][r][w], b["loss_mask"][r][w]))
    assert {a for a in answers} == {r["answer"] + END + "\n" for r in GSM8K}
    assert all(any(r["question"] in q for r in GSM8K) for q in questions)
    # all tokens of a row share the padded pad id beyond the data
    assert b["tokens"].dtype == np.int32


# ---------------------------------------------------------------- splits that do not exist, unreadable files


def test_a_data_file_has_one_split_and_other_names_fail(tmp_path):
    import datasets
    path = _write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)
    assert dataset_splits(path) == ["train"]
    assert load_dataset_split(path, "train[:1]")["question"] == [GSM8K[0]["question"]]      # slices keep working
    assert load_dataset_split(path, "train[-2:]")["question"] == [r["question"] for r in GSM8K[1:]]
    for split in ("test", "validation_does_not_exist", "train+test"):                      # not the training rows again
        with pytest.raises(ConfigError, match=r"has no split '(test|validation_does_not_exist)'; its split\(s\): \['train'\]"
                                              r".*eval_dataset_name="):
            load_dataset_split(path, split)
    with pytest.raises(ConfigError, match="no split 'test'"):
        load_dataset_split("unused", "test", data_files=[str(path)])
    d = tmp_path / "dir"; d.mkdir()
    _write_jsonl(d / "train.jsonl", GSM8K); _write_jsonl(d / "test.jsonl", GSM8K[:1])
    assert sorted(dataset_splits(d)) == ["test", "train"]
    with pytest.raises(ConfigError, match=r"no split 'validation'; its split\(s\): \['(train|test)', '(train|test)'\]"):
        load_dataset_split(d, "validation")
    datasets.Dataset.from_list(GSM8K).save_to_disk(str(tmp_path / "one"))                  # save_to_disk of one Dataset
    assert dataset_splits(tmp_path / "one") == ["train"] and len(load_dataset_split(tmp_path / "one", "train[:2]")) == 2
    with pytest.raises(ConfigError, match="no split 'test'"):
        load_dataset_split(tmp_path / "one", "test")
    with pytest.raises(ConfigError, match="cannot read the split"):
        load_dataset_split(path, "train[:2")


def test_same_rows_compares_sources_and_slices(tmp_path):
    d = tmp_path / "dir"; d.mkdir()
    train, test = _write_jsonl(d / "train.jsonl", GSM8K), _write_jsonl(d / "test.jsonl", GSM8K[:1])
    assert same_rows((d, "train"), (train, "train"))                 # a directory's split and its file: the same rows
    assert same_rows((str(train), "train"), (tmp_path / "dir" / ".." / "dir" / "train.jsonl", "train[2:]"))
    assert not same_rows((d, "test"), (d, "train"))                  # another file (even with equal content)
    assert not same_rows((train, "train[:1]"), (train, "train[1:]"))
    assert not same_rows((train, "train[:67%]"), (train, "train[67%:]"))
    assert same_rows((train, "train[:2]"), (train, "train[-2:]"))     # 3 rows: row 1 is in both
    assert not same_rows((train, "train[:1]"), (train, "train[-2:]"))
    assert same_rows((d, "test+train[:1]"), (train, "train"))
    assert same_rows(("openai/gsm8k", "train", "main"), ("openai/gsm8k", "train", "main"))
    assert not same_rows(("openai/gsm8k", "train", "main"), ("openai/gsm8k", "test", "main"))
    assert not same_rows(("openai/gsm8k", "train", "main"), ("openai/gsm8k", "train", "socratic"))
    with pytest.raises(ConfigError, match="no split 'test'"):
        same_rows((train, "test"), (train, "train"))


def test_unreadable_files_are_named(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    latin1 = '{"question": "q", "answer": "caf\u00e9"}\n'
    (tmp_path / "latin1.jsonl").write_bytes(latin1.encode("latin-1"))
    (tmp_path / "broken.jsonl").write_text('{"question": "q", "answer": "a"}\n{"question": \n')
    (tmp_path / "empty.parquet").write_bytes(b"")
    cases = {"empty.jsonl": "empty.jsonl is empty", "blank.jsonl": "blank.jsonl has no rows",
             "latin1.jsonl": f"latin1.jsonl is not UTF-8 text: byte 0xe9 at offset {latin1.index(chr(0xe9))} (line 1)",
             "broken.jsonl": "broken.jsonl", "empty.parquet": "empty.parquet is empty", "missing.jsonl": "missing.jsonl does not exist"}
    for name, message in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_dataset_split(tmp_path / name)
    d = tmp_path / "dir"; d.mkdir()
    _write_jsonl(d / "train.jsonl", GSM8K); (d / "test.jsonl").write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="test.jsonl is not UTF-8"):
        load_dataset_split(d, "test")


# ---------------------------------------------------------------- dropped examples are reported


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    from maxpost import tasks
    return tasks.prepare_embedded(tmp_path_factory.mktemp("embedded"), n_train=64, n_test=8)


def test_check_examples_refuses_a_split_that_is_mostly_dropped(embedded):
    # the embedded SFT data at max_target_length=64: the prompt (system + question) alone is longer than that
    tok = load_tokenizer(embedded["tokenizer"])
    rows = list(load_dataset_split(embedded["sft_train"]))
    full = [encode_example(tok, r, "messages") for r in rows]
    L = 64
    want_dropped = sum(1 for _, m in full if not any(m[:L]))
    want_truncated = sum(len(t) > L for t, _ in full)
    assert want_dropped > len(rows) / 2                           # the reproduction: most are dropped
    it = make_sft_iterator(tok, embedded["sft_train"], max_target_length=L, global_batch_size=2, process_index=0, process_count=1)
    ex = it.examples                                               # the counts are reachable from the iterator
    assert (ex.num_dropped, ex.num_truncated, len(ex)) == (want_dropped, want_truncated, len(rows) - want_dropped)
    assert ex.max_length == max(len(t) for t, _ in full)
    with pytest.raises(ConfigError, match=rf"train split: {want_dropped} of {len(rows)} examples .* max_target_length={L} "
                                          rf".*max_dropped_share=0.5.*longest example has {ex.max_length} tokens"):
        check_examples(ex, max_target_length=L)
    assert check_examples(ex, max_target_length=L, max_dropped_share=1.0).startswith(f"train split: {len(rows)} examples")
    L = max(len(t) for t, _ in full)
    it = make_sft_iterator(tok, embedded["sft_train"], max_target_length=L, global_batch_size=2, process_index=0, process_count=1)
    tokens = sum(len(t) for t, _ in full); targets = sum(sum(m) for _, m in full)
    assert check_examples(it.examples, max_target_length=L, what="eval split") == (
        f"eval split: {len(rows)} examples, 0 truncated to max_target_length={L}, 0 dropped (no target left), "
        f"{len(rows)} kept with {tokens} tokens ({targets} targets)")


def test_a_chat_tokenizer_without_its_template_warns_in_one_line(tmp_path, capsys):
    """issue 43 item 5: an instruct model's tokenizer saved without its chat template is evaluated on plain text;
    loading it says so once (one line on stderr), and a tokenizer with its template says nothing."""
    import os
    from maxpost.data import load_tokenizer
    from maxpost.tasks import build_tokenizer
    build_tokenizer(tmp_path / "with")
    tok = load_tokenizer(tmp_path / "with")
    assert tok.chat_template and "<|im_end|>" in tok.get_vocab()
    capsys.readouterr()
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "without")
    for f in ("chat_template.jinja", "chat_template.json"):
        if (tmp_path / "without" / f).exists(): os.remove(tmp_path / "without" / f)
    plain = load_tokenizer(tmp_path / "without")
    err = capsys.readouterr().err.strip().splitlines()
    assert plain.chat_template is None
    assert len(err) == 1 and err[0].startswith("warning:") and "<|im_end|>" in err[0] and "no chat template" in err[0], err
    load_tokenizer(tmp_path / "with")
    assert capsys.readouterr().err == ""
