"""Issue 49 ("The first hour, round 4"), the environment faults: an environment whose factory, `reset` or `step` never
returns stalled the run forever with no output, and a 10 MB environment message was tokenized whole before the
episode's budget cut it. Each test fails on the code before the fix."""
import json, logging, os, subprocess, sys, time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 2.0          # environment_timeout_s of these tests: short, so that a hang costs seconds


class _Talks:
    "Two model turns, each answered by a user message; reward 1 at the end."
    def reset(self, example): self.left = 2; return [{"role": "user", "content": example["question"]}]
    def step(self, text):
        self.left -= 1
        return [{"role": "user", "content": "More."}], float(self.left == 0), self.left == 0


class _HangsInReset(_Talks):
    def reset(self, example): time.sleep(3600)


class _HangsInStep(_Talks):
    def step(self, text): time.sleep(3600)


_MADE = []     # in the environment's worker process: the environments its factory made


def _hangs_in_factory():
    "Makes one environment, then never returns (the first make of a fresh worker may take START_S: its imports)."
    if _MADE: time.sleep(3600)
    _MADE.append(1)
    return _Talks()


HANGS = {"factory": _hangs_in_factory, "reset": _HangsInReset, "step": _HangsInStep}
NAMES = {"factory": "the environment factory", "reset": "the environment's reset", "step": "the environment's step"}


def _play(factory, n=4, **kw):
    from maxpost.environments import ScriptedEngine, make_environments, rollout_episodes
    from maxpost.tasks import build_tokenizer
    tok = build_tokenizer()
    envs = make_environments(factory, n, **kw)
    return rollout_episodes(ScriptedEngine(tok, lambda c: "Hello"), tok, envs, [{"question": f"Q{i}"} for i in range(n)],
                            max_turns=3, max_episode_tokens=64, max_prompt_length=32)


@pytest.mark.parametrize("method", sorted(HANGS))
def test_a_hanging_environment_ends_its_episodes_within_the_limit_in_one_line(method, caplog):
    """A factory, `reset` or `step` that never returns: the rollout ends (one time limit for the whole batch, not one
    per episode), every episode is an environment error that names the method and the limit, and the warning is one
    line. A good environment then plays normally in this process."""
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="maxpost.environments"):
        ep = _play(HANGS[method], timeout_s=LIMIT)
    assert time.perf_counter() - t0 < 300, "the rollout waited far past the limit"    # a hang guard (they sleep an hour)
    assert all(e is not None for e in ep.env_errors) and ep.completion_mask.sum() == 0 and ep.rewards.sum() == 0
    assert f"{NAMES[method]} ran past {LIMIT:g} s (environment_timeout_s)" in ep.env_errors[0], ep.env_errors
    assert all(f"ran past {LIMIT:g} s" in e for e in ep.env_errors), ep.env_errors
    lines = [r.getMessage() for r in caplog.records if r.name == "maxpost.environments"]
    assert len(lines) == 1 and "\n" not in lines[0] and NAMES[method] in lines[0] and "2 s" in lines[0], lines
    assert ep.metrics()["episodes/env_errors"] == 4
    good = _play(_Talks, timeout_s=LIMIT)
    assert good.env_errors == [None] * 4 and good.rewards.tolist() == [1.0] * 4


def test_a_run_with_a_hanging_step_stops_with_one_line(tmp_path):
    """`maxpost rl environment=module:factory` whose step never returns: before, the run stalled forever; now each
    rollout ends within environment_timeout_s and the max_failed_steps-th such step stops the run (exit 2) with one
    line naming the step and the limit."""
    from maxpost.commands import start_trainer
    from maxpost.config import ConfigError, load_config
    from maxpost.rl import RLTrainer
    from test_agentic import SMALL, _Replay
    cfg = load_config("rl", [f"base_output_directory={tmp_path}", "run_name=h", "steps=3", "eval_num_prompts=2", *SMALL,
                             f"environment=test_first_hour_round5:_HangsInStep", f"environment_timeout_s={LIMIT}",
                             "max_failed_steps=2"])
    with pytest.raises(ConfigError) as e:
        start_trainer(RLTrainer, cfg, engine=_Replay()).fit(progress=False)
    msg = str(e.value)
    assert msg.startswith("steps 1-2: every item of each step failed") and "\n" not in msg, msg
    assert "the environment's step ran past 2 s (environment_timeout_s)" in msg, msg


def test_environment_timeout_s_is_a_key_with_a_default():
    from maxpost.config import ConfigError, load_config
    assert load_config("rl", []).environment_timeout_s == 60.0
    assert load_config("rl", ["environment_timeout_s=5"]).environment_timeout_s == 5.0
    with pytest.raises(ConfigError): load_config("rl", ["environment_timeout_s=0"])


# --- the calculator plays the same episodes in its worker process ---------------------------------------------------

def test_the_calculator_environment_plays_the_same_episodes_in_a_worker_as_inline():
    """The embedded calculator environment, made in a worker process (the default) or in the trainer: token for
    token the same episodes, tool calls and rewards (results unchanged by the isolation)."""
    from maxpost.environments import ScriptedEngine, calculator_environment, make_environments, rollout_episodes
    from maxpost.tasks import build_calculator_tokenizer
    tok = build_calculator_tokenizer()
    turns = {0: '<tool_call>calculator("5 + 3")</tool_call>', 1: '<tool_call>calculator("2 **")</tool_call>',
             2: "<answer>8</answer>"}
    respond = lambda context: turns[min(context.count("<|im_start|>assistant") - 1, 2)]    # the turn's number
    out = []
    for isolation in ("process", "inline"):
        envs = make_environments(calculator_environment, 3, isolation=isolation)
        out.append(rollout_episodes(ScriptedEngine(tok, respond), tok, envs, [{"question": f"What is {i} + 5?"} for i in range(3)],
                                    max_turns=4, max_episode_tokens=256, max_prompt_length=256))
    a, b = out
    for name in ("prompt_ids", "completion_ids", "completion_mask", "turn_ids", "rewards", "turns", "tool_calls",
                 "tool_errors", "truncated"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    assert a.messages == b.messages and a.env_errors == b.env_errors == [None] * 3
    assert a.tool_calls.sum() > 0 and a.tool_errors.sum() > 0     # the tools ran, and a bad call was answered


# --- a huge environment message is cut before it is tokenized -------------------------------------------------------

HUGE = 10 * 2**20


class _Floods(_Talks):
    "Answers each turn with a user message of $FLOOD_CHARS characters (10 MB unless set; read where the environment runs)."
    def step(self, text):
        self.left -= 1
        return [{"role": "user", "content": "x" * int(os.environ.get("FLOOD_CHARS", HUGE))}], 0.0, self.left == 0


class _FloodsInReset(_Talks):
    def reset(self, example): self.left = 2; return [{"role": "user", "content": "y" * HUGE + example["question"]}]


class _Spy:
    "A tokenizer that records the longest text it was asked to tokenize."
    def __init__(self, tok): self.tok, self.longest = tok, 0
    def __getattr__(self, name): return getattr(self.tok, name)
    def __call__(self, text, **kw):
        self.longest = max(self.longest, len(text)); return self.tok(text, **kw)


@pytest.mark.parametrize("where", ["step", "reset"])
def test_a_huge_environment_message_is_cut_before_it_is_tokenized(where, caplog):
    """A 10 MB message from `step` (or in `reset`'s first prompt): what reaches the tokenizer is at most 8 characters
    per token of the room left (plus the template's own text), never the whole message;
    the message's start (the first prompt's end) is kept; episodes/cut_messages counts it and a warning says so."""
    from maxpost import environments
    from maxpost.environments import MAX_CHARS_PER_TOKEN, ScriptedEngine, make_environments, rollout_episodes
    from maxpost.tasks import build_tokenizer
    environments._WARNED.clear()                      # the warning comes once per process
    tok = build_tokenizer()
    spy = _Spy(tok)
    T, P = 64, 32
    factory = _Floods if where == "step" else _FloodsInReset
    with caplog.at_level(logging.WARNING, logger="maxpost.environments"):
        ep = rollout_episodes(ScriptedEngine(tok, lambda c: "Hi"), spy, make_environments(factory, 2, isolation="inline"),
                              [{"question": "Q"}] * 2, max_turns=3, max_episode_tokens=T, max_prompt_length=P)
    cap = MAX_CHARS_PER_TOKEN * (T if where == "step" else P)
    assert 0 < spy.longest <= cap + 200, spy.longest
    assert ep.env_errors == [None, None] and ep.metrics()["episodes/cut_messages"] == 2
    if where == "step":     # cut to 8 characters per token of the room left after the first turn
        room = T - int((ep.turn_ids[0] == 0).sum())
        assert MAX_CHARS_PER_TOKEN * room <= spy.longest <= MAX_CHARS_PER_TOKEN * room + 200, (spy.longest, room)
        assert ep.truncated.all()        # still more than the room: the episode ends on its budget, as before
    else:                   # the first prompt keeps its end, as it is cut from the left
        assert ep.messages[0][0]["content"] == ("y" * HUGE + "Q")[-cap:]
    assert any("cut" in r.getMessage() and "cut_messages" in r.getMessage() for r in caplog.records), caplog.records


def test_a_huge_message_costs_no_more_memory_than_a_small_one(tmp_path):
    """Two episodes whose environment answers with a 10 MB message, in the environment's worker process as a run
    plays them: the trainer's peak memory is within 200 MB of the same episodes with a 10-character message (before,
    the whole message was tokenized: gigabytes), and it ends well within its time guard."""
    script = (
        "import resource, sys, time\n"
        "sys.path[:0] = [%r, %r]\n"
        "import test_first_hour_round5 as t\n"
        "ep = t._play(t._Floods, n=2)\n"
        "assert ep.env_errors == [None, None], ep.env_errors\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)\n" % (str(ROOT), str(ROOT / "tests")))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    rss = {}
    for size in (10, HUGE):
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env={**env, "FLOOD_CHARS": str(size)},
                           timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert ("cut_messages" in r.stderr) == (size == HUGE), r.stderr[-2000:]
        rss[size] = int(r.stdout.split()[-1])
    assert rss[HUGE] - rss[10] < 200, rss


def test_evaluation_honours_environment_timeout_s():
    """`maxpost eval environment=...` accepted environment_timeout_s but played its episodes under the default 60 s:
    a hanging step cost a minute per batch whatever the key said. Now the evaluation's episodes end within the key's
    limit, each an environment error."""
    from maxpost.environments import ScriptedEngine
    from maxpost.evaluate import evaluate_episodes
    from maxpost.tasks import build_tokenizer
    tok = build_tokenizer()
    t0 = time.perf_counter()
    out = evaluate_episodes(ScriptedEngine(tok, lambda c: "Hello"), tok, [{"question": f"Q{i}", "answer": "1"} for i in range(2)],
                            _HangsInStep, k=0, max_turns=3, max_episode_tokens=64, max_prompt_length=32,
                            environment_timeout_s=LIMIT)
    assert time.perf_counter() - t0 < 40, "the evaluation waited for the default limit (60 s), not environment_timeout_s"
    assert out["env_errors"] == 2 and out["pass@1"] == 0.0
