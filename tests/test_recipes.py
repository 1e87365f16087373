"""The YAML recipes under `configs/recipes/`: each README result comes with one, `maxpost <command> RECIPE.yml`.

A recipe replaces the command's base config, so it must say everything the result depends on: the README real-model
run is `bench/real_model.py`'s `full` stage (its settings on top of `configs/rl.yml`), key for key, and its data
settings must describe splits that exist.
"""
import dataclasses, importlib.util
from pathlib import Path

import pytest

from maxpost.config import ConfigError, load_config
from maxpost.reasoning_gym import load_reasoning_gym, parse_options

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "configs" / "recipes"
COMMAND = {"smollm2_chain_sum.yml": "rl"}      # the command each recipe is the base of (README says which)


def test_every_recipe_loads_as_its_command_base():
    found = sorted(p.name for p in RECIPES.glob("*.yml"))
    assert found == sorted(COMMAND), f"recipes without a command here (or missing): {found}"
    for name, command in COMMAND.items():
        load_config(command, [], base=RECIPES / name)


def test_smollm2_recipe_is_the_readme_real_model_run():
    "Every key of the run equals what bench/real_model.py runs for its `full` stage (seed 0)."
    spec = importlib.util.spec_from_file_location("real_model", ROOT / "bench" / "real_model.py")
    rm = importlib.util.module_from_spec(spec); spec.loader.exec_module(rm)
    settings = {**rm.COMMON, **rm.RL, **rm.STAGES["full"], "load_parameters_path": ".cache/smollm2-135m-instruct",
                "seed": 0, "eval_num_prompts": rm.EVAL_NUM_PROMPTS, "base_output_directory": "maxpost_runs",
                "run_name": "smollm2-chain-sum"}
    settings["checkpoint_period"] = settings["steps"]
    bench = load_config("rl", rm.args_of(settings))
    recipe = load_config("rl", [], base=RECIPES / "smollm2_chain_sum.yml")
    differ = {f.name: (getattr(bench, f.name), getattr(recipe, f.name)) for f in dataclasses.fields(bench)
              if getattr(bench, f.name) != getattr(recipe, f.name)}
    assert not differ, differ


def test_smollm2_recipe_splits_exist():
    """chain_sum with 2-3 one-digit terms has ~4,200 distinct questions: the default split sizes (train 10,000 distinct
    questions besides test's 1,000) cannot be drawn, which stopped README's earlier pattern; the recipe's sizes can."""
    cfg = load_config("rl", [], base=RECIPES / "smollm2_chain_sum.yml")
    task = cfg.dataset_name.split(":", 1)[1]
    train = load_reasoning_gym(task, cfg.train_split, cfg.dataset_config)
    test = load_reasoning_gym(task, f"{cfg.eval_split}[:{cfg.eval_num_prompts}]", cfg.dataset_config)
    assert len(train) == parse_options(cfg.dataset_config)["train_size"] and len(test) == cfg.eval_num_prompts
    assert not set(train["question"]) & set(test["question"])
    sizes = ("train_size", "test_size")
    default_sizes = ",".join(f"{k}={v}" for k, v in parse_options(cfg.dataset_config).items() if k not in sizes)
    with pytest.raises(ConfigError, match="distinct train questions"):
        load_reasoning_gym(task, "train", default_sizes)
