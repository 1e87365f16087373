"""A trained reward model as an RL reward (issue 51 item 3): `maxpost rl reward_models=[...]` scores each rollout with the
reward model as the reward trainer scores the same replies, logs it per model, runs with async rollouts, and refuses
a path that is no reward model in one line."""
import os, subprocess, sys
from pathlib import Path

import numpy as np, pytest

import maxpost.reward   # noqa: F401  (registers the reward-model loader RL calls, as the `maxpost` command does)
from maxpost.config import ConfigError, load_config, run_dir
from maxpost.commands import start_trainer
from maxpost.rl import RLTrainer
from maxpost.rundir import read_metrics

TINY = ["load_parameters_path=", "model_name=tiny", "model_overrides={num_layers: 2, d_model: 64, mlp_dim: 128}"]
RL_SMALL = ["global_batch_size=8", "num_generations=4", "mini_batch_size=0", "max_prompt_length=96",
            "max_completion_length=24", "eval_interval=0", "eval_num_prompts=4", "eval_k=2", "train_split=train[:64]",
            "learning_rate=1e-3", "log_period=1", "temperature=1.0", "beta=0", "checkpoint_period=2"]


def _cli(kind, base, *args, timeout=900):
    cmd = [sys.executable, "-m", "maxpost.cli", kind, f"base_output_directory={base}", *args]
    return subprocess.run(cmd, env=dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2"),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def rm(tmp_path_factory):
    "A 3-step `maxpost reward` run on a tiny random body (full weights, no export): the reward model of every test here."
    from maxpost.reward import train_reward
    base = tmp_path_factory.mktemp("reward_rl")
    cfg = load_config("reward", [f"base_output_directory={base}", "run_name=rm", *TINY, "global_batch_size=8", "steps=3",
                                 "max_prompt_length=96", "max_completion_length=96", "train_split=train[:64]",
                                 "eval_split=test[:16]", "eval_batches=2", "learning_rate=1e-3", "warmup_steps=0"], base=None)
    train_reward(cfg, progress=False)
    return run_dir(cfg)


def _trainer_scores(run: Path, prompts, replies):
    """The reward trainer's own scoring of each reply (messages) to its prompt (messages) as the chosen reply of a pair:
    DPO's pair encoding (`PairData`), the held-out scoring program (`make_score_step`), the run's checkpoint restored
    as the trainer's."""
    import jax
    from flax import nnx
    from maxpost.checkpoint import checkpoint_manager, restore_state
    from maxpost.data import load_tokenizer
    from maxpost.dpo import PairData
    from maxpost.model import Decoder
    from maxpost.policy import read_model_config
    from maxpost.reward import attach_head, make_score_step
    model = attach_head(Decoder(read_model_config(run), rngs=nnx.Rngs(0)))
    nnx.update(model, restore_state(checkpoint_manager(run / "checkpoints"), nnx.state(model, nnx.Param))[0])
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rows = [{"prompt": p, "chosen": r, "rejected": r[:-1] + [{"role": "assistant", "content": r[-1]["content"] + " no"}]}
            for p, r in zip(prompts, replies)]
    data = PairData(rows, load_tokenizer(run / "tokenizer"), 96, 96)   # the reward run's lengths
    b = data.batch(range(len(rows))); b.pop("truncated")
    return np.asarray(jax.device_get(make_score_step(graphdef)(params, rest, b)))[0::2]


class Coach:
    "An environment for the embedded task's tokenizer: the task's prompt, then 'Check it once more.' after the first turn; done after two turns."
    def reset(self, example):
        from maxpost.tasks import prompt_messages
        self.turns = 0
        return prompt_messages(example["question"])
    def step(self, text):
        self.turns += 1
        return [{"role": "user", "content": "Check it once more."}], 0.0, self.turns == 2


def test_the_rl_reward_is_the_reward_trainers_score(rm, tmp_path):
    """A rollout of `reward_functions=[] reward_models=[rm] reward_weights=[2.0]`: each completion's reward is twice the
    score the reward trainer's held-out program gives it as a pair's reply (mean, spread and per item), logged as
    rewards/rm/mean; the advantages are those of the reward model's scores."""
    from maxpost.advantages import group_advantages
    cfg = load_config("rl", [f"base_output_directory={tmp_path}", "run_name=t", *TINY, *RL_SMALL, "steps=1",
                             "reward_functions=[]", f"reward_models=[{rm}]", "reward_weights=[2.0]"])
    tr = start_trainer(RLTrainer, cfg)
    assert [(s.name, s.weight) for s in tr.rewards] == [("rm", 2.0)]
    ro = tr.rollout()
    G = cfg.num_generations
    questions = [e["question"] for e in ro["examples"] for _ in range(G)]
    keep = [i for i, t in enumerate(ro["text"]) if t.strip()]            # a pair's reply is never empty
    assert len(keep) >= 4
    from maxpost.tasks import prompt_messages
    theirs = _trainer_scores(rm, [prompt_messages(questions[i]) for i in keep],
                             [[{"role": "assistant", "content": ro["text"][i]}] for i in keep])
    ours = np.asarray(tr.rewards[0].fn(questions, ro["text"]))
    np.testing.assert_allclose(ours[keep], theirs, atol=1e-4)
    assert ours.std() > 0                                                 # different texts, different scores
    assert abs(ro["info"]["rewards/rm/mean"] - ours.mean()) < 1e-5 and abs(ro["info"]["reward"] - 2 * ours.mean()) < 1e-4
    np.testing.assert_allclose(ro["batch"]["advantages"], np.asarray(group_advantages(2 * ours.astype(np.float32), G)), atol=1e-4)


def test_cli_rl_with_a_reward_model_logs_it_sync_and_async(rm, tmp_path):
    """2 steps of `maxpost rl` with the reward model beside the correctness function (weights 1.0 then 0.5), and
    2 steps with max_staleness=1 and the reward model alone: each step logs rewards/rm/mean, and the total reward is
    the weighted sum of the logged means."""
    r = _cli("rl", tmp_path, "run_name=sync", "steps=2", *TINY, *RL_SMALL, "reward_functions=[correctness]",
             f"reward_models=[{rm}]", "reward_weights=[1.0, 0.5]")
    assert r.returncode == 0, r.stderr[-3000:]
    train = read_metrics(tmp_path / "sync", "train")
    assert [m["step"] for m in train] == [1, 2]
    for m in train:
        assert abs(m["reward"] - (m["rewards/correctness/mean"] + 0.5 * m["rewards/rm/mean"])) < 1e-4
        assert m["rewards/rm/failures"] == 0 and m["rewards/rm/mean"] != 0
    r = _cli("rl", tmp_path, "run_name=async", "steps=2", *TINY, *RL_SMALL, "reward_functions=[]",
             f"reward_models=[{rm}]", "reward_weights=[]", "max_staleness=1")
    assert r.returncode == 0, r.stderr[-3000:]
    train = read_metrics(tmp_path / "async", "train")
    assert [m["step"] for m in train] == [1, 2] and all("async/staleness" in m for m in train)
    for m in train: assert abs(m["reward"] - m["rewards/rm/mean"]) < 1e-4 and m["rewards/rm/failures"] == 0


def test_an_environment_episode_is_scored_whole(rm, tmp_path):
    """With an environment the reward model reads the whole episode: the RL reward of each episode equals the reward
    trainer's score of its turns after the first prompt (both model turns and the user's turn between them) as a pair's
    reply, and differs from the score of the model's text alone."""
    cfg = load_config("rl", [f"base_output_directory={tmp_path}", "run_name=e", *TINY, *RL_SMALL, "steps=1",
                             "environment=test_reward_rl:Coach", "max_turns=2", "max_turn_tokens=16",
                             "max_episode_tokens=64", "reward_functions=[]", f"reward_models=[{rm}]", "reward_weights=[1.0]"])
    tr = start_trainer(RLTrainer, cfg)
    ro = tr.rollout()
    whole = [(m[:2], m[2:]) for m in ro["messages"]]
    scored = [i for i, (p, r) in enumerate(whole) if r and all(x["content"].strip() for x in r)]   # a pair's reply is never empty
    multi = [i for i in scored if len(whole[i][1]) == 3]      # assistant, the user's "Check it once more.", assistant
    assert len(scored) >= 2 and multi, [len(r) for _, r in whole]
    ours = np.asarray(tr.rewards[0].fn(["-"] * len(whole), ro["text"], episode_messages=ro["messages"]))
    assert abs(ro["info"]["rewards/rm/mean"] - ours.mean()) < 1e-5
    theirs = _trainer_scores(rm, [whole[i][0] for i in scored], [whole[i][1] for i in scored])
    np.testing.assert_allclose(ours[scored], theirs, atol=1e-4)
    alone = _trainer_scores(rm, [whole[i][0] for i in multi], [[{"role": "assistant", "content": ro["text"][i]}] for i in multi])
    assert np.abs(alone - ours[multi]).max() > 1e-3


@pytest.mark.parametrize("what", ["sft_run", "missing", "tokenizer"])
def test_a_path_that_is_no_reward_model_is_refused_in_one_line(rm, tmp_path, what):
    """`maxpost rl reward_models=[PATH]` exits 2 in one line, before any step, for a causal LM without a reward head
    (an SFT run), a path that does not exist, and a reward model whose tokenizer is not the policy's."""
    import shutil
    from maxpost.data import load_tokenizer
    if what == "sft_run":   # an SFT run directory: a causal LM, no score head
        r0 = _cli("sft", tmp_path, "run_name=s", "steps=1", *TINY, "train_split=train[:16]", "eval_split=test[:8]",
                  "global_batch_size=8", "eval_batches=1", "max_target_length=160")
        assert r0.returncode == 0, r0.stderr[-2000:]
        path, says = tmp_path / "s", "causal language model with no score head"
    elif what == "missing": path, says = tmp_path / "nowhere", "does not exist"
    else:                   # the same weights with another tokenizer
        path = tmp_path / "other"
        shutil.copytree(rm, path)
        tok = load_tokenizer(path / "tokenizer"); tok.add_tokens(["<another>"]); tok.save_pretrained(path / "tokenizer")
        says = "another tokenizer than the policy"
    r = _cli("rl", tmp_path, "run_name=x", "steps=1", *TINY, *RL_SMALL, "reward_functions=[]", f"reward_models=[{path}]",
             "reward_weights=[1.0]", timeout=600)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and says in lines[-1] and lines[-1].startswith("maxpost rl: configuration error"), r.stderr[-2000:]
    assert not (tmp_path / "x" / "checkpoints").exists()
    assert sum("configuration error" in l for l in lines) == 1


def test_weights_of_reward_models_follow_the_functions(tmp_path):
    "reward_weights lists the functions' weights, then the models' (or only the functions': the models weigh 1.0)."
    base = [f"base_output_directory={tmp_path}", "run_name=w", "reward_functions=[correctness]", f"reward_models=[{tmp_path}]"]
    assert load_config("rl", [*base, "reward_weights=[1.0]"]).reward_models == [str(tmp_path)]
    with pytest.raises(ConfigError, match="give one weight per function, then one per reward model"):
        load_config("rl", [*base, "reward_weights=[1.0, 2.0, 3.0]"])
