"""`maxpost rl environment=...` and `maxpost eval environment=...` end to end (issue 42): the CLI trains on episodes
(metrics of turns, tool calls and failures; a held-out evaluation of episodes that `maxpost eval` reproduces), and an
environment that crashes in its factory, its reset or its step costs its episodes, never the run."""
import json, os, subprocess, sys
from pathlib import Path

import numpy as np
import pytest

from maxpost.config import ConfigError, load_config
from maxpost.commands import start_trainer
from maxpost.rl import RLTrainer
from maxpost.rundir import read_metrics

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["load_parameters_path=", "model_name=tiny", "model_overrides={num_layers: 1}", "global_batch_size=8",
         "num_generations=4", "mini_batch_size=0", "max_prompt_length=96", "max_completion_length=12",
         "eval_interval=0", "eval_num_prompts=4", "eval_k=0", "train_split=train[:64]", "learning_rate=1e-3",
         "log_period=1", "max_turns=3", "max_turn_tokens=8", "max_episode_tokens=40"]


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
            "JAX_PLATFORMS": "cpu"}


def test_cli_rl_with_the_calculator_then_eval_of_the_same_episodes(tmp_path):
    "`maxpost rl environment=calculator steps=2` trains on episodes; `maxpost eval environment=calculator` of its checkpoint gives its final held-out numbers."
    run = [sys.executable, "-m", "maxpost.cli", "rl", f"base_output_directory={tmp_path}", "run_name=agent", "steps=2",
           "environment=calculator", *SMALL]
    r = subprocess.run(run, env=_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    train = [m for m in read_metrics(tmp_path / "agent", "train")]
    assert [m["step"] for m in train] == [1, 2]
    for m in train:
        assert m["episodes/env_errors"] == 0 and 1 <= m["episodes/turns"] <= 3 and np.isfinite(m["loss"])
        # each episode's sampled tokens are at most what its turns may hold: the mask is the model's tokens only
        assert 0 < m["episodes/sampled_tokens"] <= 3 * 8
        assert {"episodes/tool_calls", "episodes/tool_errors", "episodes/tool_use", "episodes/truncated"} <= set(m)
    evals = read_metrics(tmp_path / "agent", "eval")
    assert len(evals) == 2 and all("tool_use" in e and "turns" in e for e in evals)   # held-out episodes, not completions
    ev = [sys.executable, "-m", "maxpost.cli", "eval", f"base_output_directory={tmp_path}", "run_name=ev",
          f"load_parameters_path={tmp_path / 'agent'}", "environment=calculator", "eval_num_prompts=4", "eval_k=0",
          "max_prompt_length=96", "max_completion_length=12", "max_turns=3", "max_turn_tokens=8", "max_episode_tokens=40"]
    r = subprocess.run(ev, env=_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    record = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert record["settings"]["environment"] == "calculator" and record["settings"]["max_episode_tokens"] == 40
    assert len(record["completions"]) == 4 and all("messages" in c for c in record["completions"])
    for k in ("pass@1", "format_rate", "tool_use", "turns", "truncation_rate"):   # the same greedy episodes as the run's last evaluation
        assert record["metrics"][k] == pytest.approx(evals[-1][k]), k


def test_cli_refuses_an_unknown_environment_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "maxpost.cli", "rl", f"base_output_directory={tmp_path}", "run_name=x",
                        "environment=calculater", *SMALL], env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "calculater" in r.stderr and "Traceback" not in r.stderr


class _Echo:
    "Answers every turn with a user message for two turns, reward 1 at the end."
    def reset(self, example): self.left = 2; return [{"role": "user", "content": example["question"]}]
    def step(self, text):
        self.left -= 1
        return [{"role": "user", "content": "More."}], float(self.left == 0), self.left == 0


class _ResetCrashes(_Echo):
    def reset(self, example): raise RuntimeError("reset crashed")


class _StepCrashes(_Echo):
    def step(self, text): raise RuntimeError("step crashed")


class _StepReturnsGarbage(_Echo):
    def step(self, text): return "not a triple"


def factory_raises(): raise OSError("no environment left")
def reset_crashes(): return _ResetCrashes()
def step_crashes(): return _StepCrashes()
def step_returns_garbage(): return _StepReturnsGarbage()


class _Replay:
    "Every turn is 'Hello' and a stop id (a scripted engine): every episode reaches its environment's step."
    def __init__(self):
        from maxpost.environments import ScriptedEngine
        from maxpost.tasks import build_tokenizer
        self.inner = ScriptedEngine(build_tokenizer(), lambda context: "Hello")
    def generate(self, prompt_ids, **kw): return self.inner.generate(prompt_ids, **kw)
    def sync_weights(self, model): return 0.0


def test_the_replayed_episodes_reach_the_environment(tmp_path):
    cfg = load_config("rl", [f"base_output_directory={tmp_path}", "run_name=e", "steps=1", "eval_num_prompts=2",
                             "environment=test_agentic:_Echo", *SMALL])
    tr = start_trainer(RLTrainer, cfg, engine=_Replay())
    info = tr.update(tr.rollout())
    assert info["episodes/turns"] == 2 and info["episodes/env_errors"] == 0 and info["rewards/environment/mean"] == 1.0


@pytest.mark.parametrize("factory", ["factory_raises", "reset_crashes", "step_crashes", "step_returns_garbage"])
def test_a_crashing_environment_never_stops_the_run(tmp_path, factory):
    "Every episode's environment fails: each scores 0 and trains nothing, the failures are counted, and the run finishes."
    cfg = load_config("rl", [f"base_output_directory={tmp_path}", "run_name=c", "steps=2", "eval_num_prompts=2",
                             f"environment=test_agentic:{factory}", *SMALL])
    out = start_trainer(RLTrainer, cfg, engine=_Replay()).fit(progress=False)
    assert out["step"] == 2
    train = read_metrics(tmp_path / "c", "train")
    assert len(train) == 2
    for m in train:
        assert m["reward"] == 0.0 and m["episodes/env_errors"] == 8 and m["episodes/sampled_tokens"] == 0


def test_an_environment_that_is_not_a_factory_is_refused(tmp_path):
    cfg = load_config("rl", [f"base_output_directory={tmp_path}", "run_name=n", "environment=test_agentic:SMALL", *SMALL])
    with pytest.raises(ConfigError, match="not a factory"): start_trainer(RLTrainer, cfg)


def test_tutorial_quick_mode_shows_an_episode_before_and_after_rl(tmp_path, monkeypatch):
    "nbs/tutorials/agentic_calculator.ipynb in its quick mode: SFT on the calculator variant, two RL steps in the environment, a greedy held-out episode of each checkpoint."
    import papermill as pm
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")   # the kernel's one device, as the notebook sets
    out = tmp_path / "agentic.ipynb"
    pm.execute_notebook(str(ROOT / "nbs" / "tutorials" / "agentic_calculator.ipynb"), str(out), cwd=str(tmp_path),
                        kernel_name="python3", parameters=dict(base_output_directory=str(tmp_path / "runs")),
                        progress_bar=False)
    train = read_metrics(tmp_path / "runs" / "calc-grpo", "train")
    assert [m["step"] for m in train] == [1, 2] and all(m["episodes/env_errors"] == 0 for m in train)
    evals = read_metrics(tmp_path / "runs" / "calc-grpo", "eval")
    assert len(evals) == 2 and all("tool_use" in e for e in evals)
    texts = [o.get("text", "") for c in json.loads(out.read_text())["cells"] for o in c.get("outputs", [])]
    text = "".join(t if isinstance(t, str) else "".join(t) for t in texts)
    assert "--- after SFT" in text and "--- after RL" in text and "Q: " in text


@pytest.mark.parametrize("extra", [["loss_algo=gspo"], ["lora_rank=4", "lora_alpha=8"], ["max_staleness=1"]],
                         ids=["gspo", "lora", "max_staleness"])
def test_episodes_under_gspo_lora_and_stale_rollouts(tmp_path, extra):
    "The episode rollout feeds GSPO, LoRA and the asynchronous loop unchanged: two-turn episodes every step, rewarded by the environment, a finite loss."
    from maxpost.async_rl import AsyncRLTrainer
    cfg = load_config("rl", [f"base_output_directory={tmp_path}", "run_name=u", "steps=2", "eval_num_prompts=2",
                             "environment=test_agentic:_Echo", *SMALL, *extra])
    tr = start_trainer(AsyncRLTrainer, cfg, engine=_Replay())
    assert tr.fit(progress=False)["step"] == 2
    train = read_metrics(tmp_path / "u", "train")
    assert [m["step"] for m in train] == [1, 2]
    for m in train:
        assert m["episodes/turns"] == 2 and m["rewards/environment/mean"] == 1.0 and np.isfinite(m["loss"])
        assert m["episodes/sampled_tokens"] == m["completions/mean_length"] > 0   # the loss mask: the model's tokens only
