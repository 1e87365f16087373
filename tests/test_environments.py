"""Multi-turn episodes (chapter 13b): the trainer's one forward pass over a conversation gives the sampler's log-probs
turn by turn; environment tokens carry no loss and no gradient (against a naive turn-by-turn loss); templates that
rewrite history and tokenizations that differ from the sampled ids never reach the trainer; every fault of a tool
or an environment costs at most its episode; the limits; the calculator variant's SFT data are its rollouts."""
import copy, json, math
import numpy as np
import pytest
import jax, jax.numpy as jnp
from flax import nnx

from maxpost import tasks
from maxpost.data import encode_chat
from maxpost.environments import (Environment, ScriptedEngine, ToolCall, ToolEnvironment, Toolbox, as_engine, calculator,
                                  continuation_ids, format_tool_call, parse_tool_calls, rollout_episodes, tool_call_format)
from maxpost.model import create_model, get_model_config
from maxpost.policy_loss import policy_loss
from maxpost.sampling import Rollout, completion_logps, left_pad

import tools_for_tests as tt

STOPS = list(range(0, 512, 8))    # a random model never says <|im_end|>: in these tests every id divisible by 8 ends a turn


@pytest.fixture(scope="module")
def tok(): return tasks.build_tokenizer()


@pytest.fixture(scope="module")
def ctok(): return tasks.build_calculator_tokenizer()


@pytest.fixture(scope="module")
def model(): return create_model(get_model_config("tiny", num_layers=2), seed=0)


class Chatty:
    "Answers every model turn with a user message; done after `n` turns, reward 1 then."
    def __init__(self, n): self.n = n
    def reset(self, example): self.left = self.n; return [{"role": "user", "content": example["question"]}]
    def step(self, text):
        self.left -= 1
        return [{"role": "user", "content": "Go on."}], float(self.left == 0), self.left == 0


class Spy:
    "An engine that records every turn's contexts and sampled ids."
    def __init__(self, engine): self.engine, self.calls = as_engine(engine), []
    def generate(self, prompt_ids, **kw):
        r = self.engine.generate(prompt_ids, **kw)
        self.calls.append(([list(map(int, p)) for p in prompt_ids],
                           [list(map(int, c[m > 0])) for c, m in zip(r.completion_ids, r.completion_mask)],
                           [np.asarray(l[m > 0]) for l, m in zip(r.per_token_logps, r.completion_mask)]))
        return r


EXAMPLES = [{"question": q} for q in ["Mia has 3 apples.", "Count to five.", "Say hi.", "Ben has 4 cards.", "Go."]]


def sampled_episodes(model, tok, temperature=1.0, top_k=0, top_p=1.0, turns=(1, 2, 3, 3, 2), seed=0):
    spy = Spy(model)
    ep = rollout_episodes(spy, tok, [Chatty(n) for n in turns], EXAMPLES[:len(turns)], max_turns=3, max_turn_tokens=24,
                          max_episode_tokens=128, max_prompt_length=64, temperature=temperature, top_k=top_k, top_p=top_p,
                          eos_ids=STOPS, seed=seed)
    return ep, spy


def per_turn(ep, spy):
    "[(episode, context the sampler saw, the ids it kept, its log-probs)] for every turn of every episode, in order."
    out, seen = [], {}
    for contexts, samples, lps in spy.calls:
        for ctx, ids, lp in zip(contexts, samples, lps):
            for b in range(len(ep.rewards)):
                prompt = ep.prompt_ids[b][ep.prompt_mask[b] > 0].tolist()
                n = len(ctx) - len(prompt)
                if ctx[:len(prompt)] == prompt and n >= 0 and ep.completion_ids[b][:n].tolist() == ctx[len(prompt):] \
                        and (b, n) not in seen and ep.turn_ids[b][n] >= 0:
                    seen[(b, n)] = True; out.append((b, ctx, ids, lp)); break
    return out


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def filtered_log_softmax(z, top_k, top_p):
    "NumPy: the distribution the sampler draws from: keep the top_k (0: all), then the nucleus, renormalise."
    srt = -np.sort(-z, -1)
    rank = np.arange(z.shape[-1])
    keep = (top_k <= 0) | (rank < top_k)
    ps = np.exp(log_softmax(np.where(keep, srt, -np.inf)))
    keep = keep & ((top_p >= 1) | (np.cumsum(ps, -1) - ps < top_p) | (rank == 0))
    smallest = np.take_along_axis(srt, keep.sum(-1, keepdims=True) - 1, -1)
    return log_softmax(np.where(z >= smallest, z, -np.inf))


_forward = nnx.jit(lambda m, x: m(x))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 20, 0.9)])
def test_one_forward_pass_gives_the_sampler_logps_turn_by_turn(model, tok, temperature, top_k, top_p):
    ep, spy = sampled_episodes(model, tok, temperature, top_k, top_p)
    done = ~ep.truncated                                      # a turn can reach max_turn_tokens without a stop id
    assert (ep.turns[done] == np.array([1, 2, 3, 3, 2])[done]).all() and (ep.rewards == done).all()
    assert done.sum() >= 3 and (ep.turns >= 2).sum() >= 2
    trainer = np.asarray(completion_logps(model, ep.prompt_ids, ep.prompt_mask, ep.completion_ids, ep.completion_mask,
                                          temperature))
    turns = per_turn(ep, spy)
    assert len(turns) == sum(ep.turns)                       # every turn found, each continuing its episode's exact ids
    for b, ctx, ids, lp in turns:
        n = len(ctx) - int(ep.prompt_mask[b].sum())
        span = slice(n, n + len(ids))
        assert ep.completion_ids[b][span].tolist() == ids     # the tokens trained on are the tokens sampled
        assert (ep.completion_mask[b][span] == 1).all()
        # the sampler's log-probs equal an independent NumPy log-softmax of a full forward of the unpadded
        # conversation, under the distribution it drew from (top-k/top-p renormalised: issue 43 item 6)
        seq = ctx + ids
        x = np.zeros((1, 192), np.int32); x[0, :len(seq)] = seq
        logits = np.asarray(_forward(model, jnp.asarray(x))[0, len(ctx) - 1:len(seq) - 1], np.float64)
        full = np.take_along_axis(log_softmax(logits / temperature), np.array(ids)[:, None], -1)[:, 0]
        drawn = np.take_along_axis(filtered_log_softmax(logits / temperature, top_k, top_p), np.array(ids)[:, None],
                                   -1)[:, 0]
        np.testing.assert_allclose(drawn, lp, atol=1e-4)
        # the trainer's one forward pass over the whole episode gives the full-softmax log-probs of the same tokens,
        # this turn (== the sampler's when nothing is filtered)
        np.testing.assert_allclose(trainer[b][span], full, atol=1e-4)
        if top_k == 0 and top_p >= 1: np.testing.assert_allclose(trainer[b][span], lp, atol=1e-4)
    assert (ep.completion_mask == (ep.turn_ids >= 0)).all() and (ep.per_token_logps[ep.completion_mask == 0] == 0).all()


def test_environment_tokens_carry_no_loss_and_no_gradient(model, tok):
    "The GRPO loss's gradient over the multi-turn batch == a naive loss summed turn by turn over the sampled tokens only."
    ep, spy = sampled_episodes(model, tok, seed=1)
    adv = jnp.asarray(np.random.default_rng(0).normal(size=len(ep.rewards)), jnp.float32)
    graphdef, state = nnx.split(model)
    old = jnp.asarray(ep.per_token_logps)

    @jax.jit
    @jax.grad
    def loss(state, mask):
        lp = completion_logps(nnx.merge(graphdef, state), ep.prompt_ids, ep.prompt_mask, ep.completion_ids, mask)
        return policy_loss(lp, old, None, adv, mask, loss_algo="grpo", loss_agg_mode="token-mean")[0]

    turns = per_turn(ep, spy)
    n_tokens = sum(len(ids) for _, _, ids, _ in turns)
    assert n_tokens == ep.completion_mask.sum() and (ep.completion_mask == 0).sum() > 0

    @jax.jit
    @jax.grad
    def naive_turn(state, tokens, weights, lp_old):   # one turn on its own: the sampler's context, then its sampled tokens
        logits = nnx.merge(graphdef, state)(tokens[None])[0, :-1].astype(jnp.float32)
        lp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tokens[1:, None], -1)[:, 0]
        return (weights[1:] * jnp.exp(lp - lp_old[1:])).sum()

    want = None
    for b, ctx, ids, lp_old in turns:          # the naive loss: -sum_b A_b sum_(its sampled tokens) ratio / N, turn by turn
        W = 192                                 # right padding: causal attention keeps it from the turn's tokens
        tokens, weights, olds = np.zeros(W, np.int32), np.zeros(W, np.float32), np.zeros(W, np.float32)
        tokens[:len(ctx) + len(ids)] = ctx + ids
        weights[len(ctx):len(ctx) + len(ids)] = -float(adv[b]) / n_tokens
        olds[len(ctx):len(ctx) + len(ids)] = lp_old
        g = naive_turn(state, jnp.asarray(tokens), jnp.asarray(weights), jnp.asarray(olds))
        want = g if want is None else jax.tree.map(jnp.add, want, g)

    got = loss(state, jnp.asarray(ep.completion_mask))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-3, atol=2e-6)
    # the planted bug: a mask over every token after the prompt (tool/user turns included) trains something else
    everything = jnp.asarray((np.arange(ep.completion_ids.shape[1]) < (ep.turn_ids >= 0).cumsum(1).argmax(1)[:, None] + 1)
                             .astype(np.int32))
    assert (np.asarray(everything) != ep.completion_mask).any()
    wrong = loss(state, everything)
    assert any(not np.allclose(np.asarray(g), np.asarray(w), rtol=2e-3, atol=2e-6)
               for g, w in zip(jax.tree.leaves(wrong), jax.tree.leaves(want)))
    # and the loss has no gradient through the log-prob of any environment token
    d_lp = jax.grad(lambda lp: policy_loss(lp, old, None, adv, jnp.asarray(ep.completion_mask))[0])(old)
    assert (np.asarray(d_lp)[ep.completion_mask == 0] == 0).all() and (np.asarray(d_lp)[ep.completion_mask > 0] != 0).any()


class Guess:
    "A user who answers 'Lower.' until the model has played `n` turns."
    def __init__(self, n=2): self.n = n
    def reset(self, example): self.k = 0; return [{"role": "user", "content": "Guess."}]
    def step(self, text): self.k += 1; return [{"role": "user", "content": "Lower."}], float(self.k == self.n), self.k == self.n


FORGETFUL = tasks.CHAT_TEMPLATE.replace(       # drops the reasoning of every assistant turn but the last, as Qwen3 does <think>
    "message['content'] + '<|im_end|>'",
    "(message['content'] if loop.last else message['content'].split('</reasoning>')[-1]) + '<|im_end|>'")
LAST_THINKS = tasks.CHAT_TEMPLATE.replace(     # an empty reasoning block on the last assistant turn only (Qwen3's template)
    "message['content'] + '<|im_end|>'",
    "('<reasoning></reasoning>' if loop.last else '') + message['content'] + '<|im_end|>'")


@pytest.mark.parametrize("template", [FORGETFUL, LAST_THINKS], ids=["drops-history", "marks-last"])
def test_template_that_rewrites_history_never_reaches_the_trainer(tok, template):
    t = copy.deepcopy(tok); t.chat_template = template
    replies = ["<reasoning>5 + 3 = 8</reasoning>guess 8", "<reasoning>8 - 1 = 7</reasoning>guess 7"]
    spy = Spy(ScriptedEngine(t, lambda ctx: replies[ctx.count("<|im_start|>assistant") - 1]))
    ep = rollout_episodes(spy, t, [Guess(2)], [{}], max_turns=3, max_episode_tokens=128, max_prompt_length=32)
    assert ep.turns.tolist() == [2] and not ep.truncated[0] and ep.env_errors == [None]
    n = int((ep.turn_ids[0] >= 0).nonzero()[0].max()) + 1
    episode = ep.prompt_ids[0][ep.prompt_mask[0] > 0].tolist() + ep.completion_ids[0][:n].tolist()
    sampled = [ids for _, samples, _ in spy.calls for ids in samples]
    # the trained tokens are exactly the sampled ones, turn by turn
    assert [ep.completion_ids[0][ep.turn_ids[0] == k].tolist() for k in range(2)] == sampled
    # the environment's span is continuation_ids of its message, rendered without the history
    env_span = ep.completion_ids[0][:n][ep.turn_ids[0][:n] < 0].tolist()
    assert env_span == continuation_ids(t, [{"role": "user", "content": "Lower."}], "<|im_end|>")
    assert t.decode(env_span) == "\n<|im_start|>user\nLower.<|im_end|>\n<|im_start|>assistant\n"
    # the naive way, re-rendering the conversation, is not the sequence that was sampled
    msgs = [{"role": "user", "content": "Guess."}, {"role": "assistant", "content": replies[0]},
            {"role": "user", "content": "Lower."}, {"role": "assistant", "content": replies[1]}]
    rerendered = t(t.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"]
    assert rerendered[:len(episode)] != episode
    assert ep.messages[0][1:] == msgs[1:]


def test_a_tokenization_the_tokenizer_would_not_make_is_kept(tok):
    "A sampled turn spelled in single characters decodes to text that re-tokenizes to other ids; the episode keeps the sampled ids."
    chars = [tok.convert_tokens_to_ids(c) for c in "apples"] + [tok.eos_token_id]

    class Characters:
        def generate(self, prompt_ids, *, max_completion_length, pad_id=0, **_):
            ids = np.full((len(prompt_ids), max_completion_length), pad_id, np.int32); ids[:, :len(chars)] = chars
            mask = (np.arange(max_completion_length) < len(chars)).astype(np.int32)[None].repeat(len(prompt_ids), 0)
            p, pm, _ = left_pad(prompt_ids, max(map(len, prompt_ids)), pad_id)
            return Rollout(p, pm, ids, mask, np.full(ids.shape, -0.5, np.float32) * mask)

    ep = rollout_episodes(Characters(), tok, [Chatty(2)], [{"question": "x"}], max_turns=2, max_episode_tokens=64)
    assert tok("apples", add_special_tokens=False)["input_ids"] != chars[:-1]
    for k in range(2):
        assert ep.completion_ids[0][ep.turn_ids[0] == k].tolist() == chars
        assert (ep.per_token_logps[0][ep.turn_ids[0] == k] == -0.5).all()
    assert ep.text[0] == "applesapples"


def scripted(turns):
    "An engine replaying `turns` (a list of texts) by the number of assistant turns so far."
    return lambda tokenizer: ScriptedEngine(tokenizer, lambda ctx: turns[min(ctx.count("<|im_start|>assistant"), len(turns)) - 1])


def test_every_tool_fault_is_an_observation_and_the_episode_goes_on(tok):
    box = Toolbox([tt.add, tt.boom, tt.exits, tt.hangs, tt.number, tt.flood, tt.dies], timeout_s=1.5)
    try:
        faults = {"boom(1)": "tool 'boom' raised RuntimeError: a buggy tool",
                  "exits(1)": "tool 'exits' raised SystemExit: 3",
                  "hangs(1)": "tool 'hangs' ran past 1.5 s and was stopped",
                  "number(1)": "tool 'number' returned a int, not a string",
                  "flood(50_000_000)": "tool 'flood' returned 50,000,000 characters, more than the limit of 4,096",
                  "dies(1)": "tool 'dies' ended its worker process (exit code",
                  "nope(1)": "unknown tool 'nope'; the tools are add, boom, exits, hangs, number, flood, dies",
                  "add(1)": "tool 'add' raised TypeError: add() missing 1 required positional argument: 'b'",
                  "add(x)": "the tool call could not be read: every argument must be a literal (a string, a number, a list, ...)",
                  '{"name": "add", "arguments": {"a": 1': "the tool call could not be read: the call is not valid JSON"}
        for call, why in faults.items():
            env = ToolEnvironment(box, system_prompt=None)
            turns = [f"<tool_call>{call}</tool_call>", format_tool_call("add", {"a": 2, "b": 3}), "It is 5."]
            ep = rollout_episodes(scripted(turns)(tok), tok, [env], [{"question": "q"}], max_turns=4, max_episode_tokens=256)
            tool_msgs = [m["content"] for m in ep.messages[0] if m["role"] == "tool"]
            assert tool_msgs[0].startswith("Error: " + why), (call, tool_msgs[0])
            assert tool_msgs[1] == "5", call                  # the next call works: the worker was restarted if it had to be
            assert ep.turns.tolist() == [3] and not ep.truncated[0] and ep.env_errors == [None], call
            assert ep.tool_calls.tolist() == [2] and ep.tool_errors.tolist() == [1], call
            assert ep.completion_mask.sum() > 0
        # an unclosed call and too many calls in a turn
        env = ToolEnvironment(box, max_calls_per_turn=2)
        ep = rollout_episodes(scripted(["<tool_call>add(1, 1)</tool_call>" * 3, "<tool_call>add(1, 1)", "done"])(tok), tok,
                              [env], [{"question": "q"}], max_turns=4, max_episode_tokens=256)
        assert [m["content"] for m in ep.messages[0] if m["role"] == "tool"] == [
            "2", "2", "Error: more than 2 tool calls in one turn; this one was not run",
            "Error: the tool call could not be read: <tool_call> without </tool_call>"]
        assert (ep.tool_calls.tolist(), ep.tool_errors.tolist(), ep.turns.tolist()) == ([4], [2], [3])
    finally:
        box.close()


class Crashes:
    "An environment that fails at `where` (reset, step, or by returning `value` from step)."
    def __init__(self, where, value=None): self.where, self.value = where, value
    def reset(self, example):
        if self.where == "reset": raise KeyError("question")
        return [{"role": "user", "content": "hi"}]
    def step(self, text):
        if self.where == "step": raise RuntimeError("the environment crashed")
        return self.value


@pytest.mark.parametrize("env,why", [
    (Crashes("reset"), "reset failed: KeyError: 'question'"),
    (Crashes("step"), "step failed: RuntimeError: the environment crashed"),
    (Crashes("value", None), "step failed: ValueError: step returned NoneType, not (messages, reward, done)"),
    (Crashes("value", ([], float("nan"), True)), "step failed: ValueError: step returned the reward nan"),
    (Crashes("value", (["hi"], 0.0, False)), "step failed: ValueError: step's messages must be dicts"),
    (Crashes("value", ([{"role": "user", "content": None}], 0.0, False)), "step failed: ValueError: step's messages must be dicts"),
    (Crashes("value", ([], "one", True)), "step failed: ValueError: could not convert string to float: 'one'"),
], ids=["reset-raises", "step-raises", "returns-none", "nan-reward", "not-a-message", "no-content", "reward-not-a-number"])
def test_a_crashing_environment_costs_only_its_episode(tok, env, why):
    ep = rollout_episodes(scripted(["hello", "done"])(tok), tok, [Chatty(2), env, Chatty(2)], [{"question": "q"}] * 3,
                          max_turns=3, max_episode_tokens=128)
    assert ep.env_errors[1].startswith(why), ep.env_errors[1]
    assert ep.rewards.tolist() == [1.0, 0.0, 1.0] and ep.turns[[0, 2]].tolist() == [2, 2]
    assert ep.completion_mask[1].sum() == 0 and ep.completion_mask[[0, 2]].sum() > 0     # the failed episode trains nothing
    assert ep.env_errors[0] is None and ep.env_errors[2] is None and ep.metrics()["episodes/env_errors"] == 1


def test_limits(tok):
    long = "one two three four five six seven eight nine ten " * 4
    # max_turns: an environment that never ends
    ep = rollout_episodes(scripted(["hi"] * 9)(tok), tok, [Chatty(99)], [{"question": "q"}], max_turns=3, max_episode_tokens=256)
    assert ep.turns.tolist() == [3] and ep.truncated.tolist() == [True] and ep.turn_ids[0].max() == 2
    assert ep.turn_ids[0][ep.completion_ids[0] != tok.pad_token_id].tolist()[-1] == 2     # nothing appended after the last turn
    # max_turn_tokens: a turn without a stop token ends the episode
    ep = rollout_episodes(scripted([long])(tok), tok, [Chatty(3)], [{"question": "q"}], max_turn_tokens=10, max_episode_tokens=256)
    assert ep.turns.tolist() == [1] and ep.truncated.tolist() == [True] and ep.completion_mask.sum() == 10
    want = tok(long, add_special_tokens=False)["input_ids"][:10]
    assert ep.completion_ids[0][:10].tolist() == want
    # max_episode_tokens: the second turn is cut at the budget, a prefix of what was sampled
    spy = Spy(scripted(["hi", long])(tok))
    ep = rollout_episodes(spy, tok, [Chatty(3)], [{"question": "q"}], max_turn_tokens=64, max_episode_tokens=30)
    assert ep.completion_ids.shape[1] == 30 and ep.truncated.tolist() == [True] and ep.turns.tolist() == [2]
    kept = ep.completion_ids[0][ep.turn_ids[0] == 1].tolist()
    assert kept == spy.calls[1][1][0][:len(kept)] and (ep.turn_ids[0] >= 0).nonzero()[0].max() == 29
    # an environment answer that leaves no room to sample ends the episode without being appended
    ep = rollout_episodes(scripted(["hi"] * 3)(tok), tok, [Chatty(3)], [{"question": "q"}], max_episode_tokens=4)
    k = int((ep.turn_ids[0] >= 0).sum())
    assert ep.turns.tolist() == [1] and ep.truncated.tolist() == [True] and (ep.turn_ids[0][k:] == -1).all()
    assert (ep.completion_ids[0][k:] == tok.pad_token_id).all()
    # the first prompt is cut from the left to max_prompt_length and counted
    ep = rollout_episodes(scripted(["hi"])(tok), tok, [Chatty(1)], [{"question": long}], max_prompt_length=16)
    assert ep.prompt_mask.sum() == 16 and ep.num_truncated_prompts == 1


def test_batches_pad_rows_to_powers_of_two(tok):
    "Episodes that finish one by one do not give the engine a new batch size each turn: 3 running rows go as 4."
    spy = Spy(ScriptedEngine(tok, lambda ctx: "hi"))
    ep = rollout_episodes(spy, tok, [Chatty(n) for n in (1, 2, 2, 3, 1, 1)], EXAMPLES + EXAMPLES[:1], max_turns=4)
    assert [len(c[0]) for c in spy.calls] == [6, 4, 1]
    assert spy.calls[1][0][3] == spy.calls[1][0][0]           # the extra row repeats a running episode and is dropped
    assert ep.turns.tolist() == [1, 2, 2, 3, 1, 1] and ep.rewards.tolist() == [1.0] * 6


HERMES = (   # a ChatML template with Hermes tool calls, as Qwen2.5's (shortened): tools in the system turn, tool turns as user turns
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}{% for t in tools %}{{ '\\n' + (t | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\nCall a function with <tool_call>{\\\"name\\\": <name>, \\\"arguments\\\": <args>}</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def test_hermes_json_tool_calls(tok):
    t = copy.deepcopy(tok); t.chat_template = HERMES
    assert tool_call_format(t) == "json" and tool_call_format(tok) == "plain"
    env = ToolEnvironment([calculator], system_prompt=None, isolation="inline")
    calls = format_tool_call("calculator", {"expression": "5 + 3"}) + format_tool_call("calculator", {"expression": "5 *"})
    ep = rollout_episodes(scripted([calls, "It is 8."])(t), t, [env], [{"question": "5 + 3?"}], max_turns=3,
                          max_prompt_length=512, max_turn_tokens=256, max_episode_tokens=512)
    prompt = t.decode(ep.prompt_ids[0][ep.prompt_mask[0] > 0])
    assert '"name": "calculator"' in prompt and "<tools>" in prompt                 # the schema is in the first prompt
    assert ep.turns.tolist() == [2] and not ep.truncated[0]
    env_text = t.decode(ep.completion_ids[0][(ep.turn_ids[0] < 0) & (np.cumsum(ep.turn_ids[0] == 1) == 0)])
    assert env_text.startswith("\n<|im_start|>user\n<tool_response>\n8\n</tool_response>\n<tool_response>\nError: tool "), env_text
    assert env_text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert (ep.tool_calls.tolist(), ep.tool_errors.tolist(), ep.turns.tolist()) == ([2], [1], [2])


def test_parse_tool_calls_forms():
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": {"a": [1, 2]}}</tool_call>') == [ToolCall("f", (), {"a": [1, 2]})]
    assert parse_tool_calls('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>') == [ToolCall("f", (), {"a": 1})]
    assert parse_tool_calls("<tool_call>\nf(1, b='x')\n</tool_call>") == [ToolCall("f", (1,), {"b": "x"})]
    assert parse_tool_calls("<tool_call>f()</tool_call>") == [ToolCall("f")]
    for bad in ["f(*a)", "f(**k)", "a.b(1)", "f(1)(2)", "[1]", '{"name": "f", "arguments": 3}', '{"name": "f", "arguments": "{"}']:
        assert parse_tool_calls(f"<tool_call>{bad}</tool_call>")[0].error, bad


def test_calculator_rejects_what_is_not_integer_arithmetic():
    assert [calculator(e) for e in ["1+2*3", "(1+2)*3", "-(3-5)", "0 * 99"]] == ["7", "9", "2", "0"]
    for bad in ["2**3", "1/2", "1//2", "1%2", "abs(1)", "[1]", "1 if 1 else 2", "9" * 16, "'a' * 3", "(" * 300 + "1" + ")" * 300]:
        with pytest.raises(Exception): calculator(bad)


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_calculator_demonstrations_are_their_rollouts(ctok, steps):
    """Replaying a calculator SFT demonstration through the ToolEnvironment gives the SFT example's token ids and its
    assistant mask as the loss mask: SFT teaches exactly what the RL rollouts produce and train on."""
    problems = tasks.generate_problems(12, seed=3, split="test", difficulty=tasks.Difficulty(min_steps=steps, max_steps=steps))
    box = Toolbox([calculator])             # in a worker process, as a run would
    try:
        for p in problems:
            demo = tasks.calculator_messages(p)
            replies = [m["content"] for m in demo if m["role"] == "assistant"]
            engine = ScriptedEngine(ctok, lambda ctx, r=replies: r[ctx.count("<|im_start|>assistant") - 1])
            ep = rollout_episodes(engine, ctok, [ToolEnvironment(box)], [p], max_turns=steps + 1, max_episode_tokens=320,
                                  max_prompt_length=128)
            n = int((ep.turn_ids[0] >= 0).nonzero()[0].max()) + 1
            ids, mask = encode_chat(ctok, demo)
            assert ep.prompt_ids[0][ep.prompt_mask[0] > 0].tolist() + ep.completion_ids[0][:n].tolist() == ids[:-1]
            assert ep.completion_mask[0][:n].tolist() == mask[len(ids) - 1 - n:-1]
            assert (ep.turns[0], ep.tool_calls[0], ep.tool_errors[0], ep.truncated[0]) == (steps + 1, steps, 0, False)
            assert [m for m in ep.messages[0] if m["role"] == "tool"] == [
                {"role": "tool", "name": "calculator", "content": m["content"]} for m in demo if m["role"] == "tool"]
    finally:
        box.close()
