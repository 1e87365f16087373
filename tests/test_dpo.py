"""maxpost.dpo's preference data: a pair's prompt and replies are the conversation's own tokens, split where the
template's generation prompt ends; implicit prompts; truncation as TRL keeps it."""
import random

import numpy as np, pytest

from maxpost import tasks
from maxpost.dpo import encode_pair, embedded_pair, extract_prompt, preference_batch


@pytest.fixture(scope="module")
def tok():
    return tasks.build_tokenizer()


def test_prompt_plus_reply_is_the_whole_conversation_tokenized(tok):
    """For every embedded pair, prompt ids + reply ids equal the ids of the whole rendered conversation tokenized at
    once (no token is split or merged at the boundary), for the chosen and the rejected reply."""
    rng = random.Random(0)
    for row in tasks.generate_problems(40, seed=3):
        pair = embedded_pair(row, rng)
        e = encode_pair(tok, pair)
        for key, reply in (("chosen_ids", pair["chosen"]), ("rejected_ids", pair["rejected"])):
            whole = tok.apply_chat_template(pair["prompt"] + reply, tokenize=False)
            assert e["prompt_ids"] + e[key] == list(tok(whole, add_special_tokens=False)["input_ids"])


def test_string_pairs_end_with_eos_and_share_an_implicit_prompt(tok):
    e = encode_pair(tok, {"chosen": "Mia has 3 apples so 3", "rejected": "Mia has 3 apples so 4"})
    assert e["chosen_ids"][-1] == tok.eos_token_id == e["rejected_ids"][-1]
    assert tok.decode(e["prompt_ids"]).endswith("so ")
    assert extract_prompt("a b c", "a b d") == ("a b ", "c", "d")


def test_truncation_keeps_the_end_of_the_prompt_and_the_start_of_the_replies(tok):
    pair = embedded_pair(tasks.generate_problems(1, seed=1)[0], random.Random(1))
    full, short = encode_pair(tok, pair), encode_pair(tok, pair, max_prompt_length=5, max_completion_length=4)
    assert short["prompt_ids"] == full["prompt_ids"][-5:] and short["chosen_ids"] == full["chosen_ids"][:4]
    assert short["truncated"] and not full["truncated"]
    b = preference_batch([full, short], tok.pad_token_id, 128, 96)
    assert b["completion_mask"].sum(1).tolist() == [len(full["chosen_ids"]), len(full["rejected_ids"]), 4, 4]
    assert (b["prompt_mask"].sum(1) == [len(full["prompt_ids"])] * 2 + [5, 5]).all()
