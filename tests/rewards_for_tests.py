"""Reward functions the RL tests import by path: a module without JAX, so reward worker processes start fast."""


def boom(prompts, completions, **kw):
    raise RuntimeError("a buggy reward")


def length_reward(prompts, completions, **kw):
    return [len(c) / 50 for c in completions]


def starts_with_seven(prompts, completions, **kw):
    return [float(c.strip().startswith("7")) for c in completions]
