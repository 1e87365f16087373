"""Reward functions the RL tests import by path: a module without JAX, so reward worker processes start fast."""


def boom(prompts, completions, **kw):
    raise RuntimeError("a buggy reward")


def length_reward(prompts, completions, **kw):
    return [len(c) / 50 for c in completions]


def starts_with_seven(prompts, completions, **kw):
    return [float(c.strip().startswith("7")) for c in completions]


def slow_length_reward(prompts, completions, **kw):
    "length_reward after 0.3 s: a reward whose time shows in the step's `timing/rewards`."
    import time
    time.sleep(0.3)
    return [len(c) / 50 for c in completions]
