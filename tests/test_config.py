"""Config loading: a YAML base with overrides, errors for unknown keys, wrong types and missing values, the CLI."""
import subprocess, sys
from pathlib import Path
import pytest
from maxpost.config import load_config, ConfigError, SFTConfig, RLConfig, to_yaml, run_dir

ROOT = Path(__file__).resolve().parent.parent


def write(tmp_path, text):
    p = tmp_path / "base.yml"
    p.write_text(text)
    return p


def test_yaml_base_then_overrides(tmp_path):
    base = write(tmp_path, "run_name: a\nbase_output_directory: /x\nsteps: 5\nlearning_rate: 0.1\nmodel_name: qwen3-0.6b\n")
    cfg = load_config("sft", ["steps=200", "run_name=exp1"], base=base)
    assert isinstance(cfg, SFTConfig)
    assert (cfg.steps, cfg.run_name, cfg.learning_rate, cfg.model_name) == (200, "exp1", 0.1, "qwen3-0.6b")
    assert type(cfg.learning_rate) is float and type(cfg.steps) is int
    # a key neither in the base nor in the overrides keeps the dataclass default
    assert cfg.global_batch_size == SFTConfig.global_batch_size
    assert run_dir(cfg) == Path("/x/exp1")


def test_shipped_bases_load_and_interpolate():
    sft = load_config("sft")
    rl = load_config("rl", ["loss_algo=gspo", "base_output_directory=/o"])
    assert sft.run_name == "embedded-sft"
    # the RL base starts from the SFT run's output directory and names itself after the algorithm
    assert rl.load_parameters_path == "/o/embedded-sft" and rl.run_name == "embedded-gspo"


def test_unknown_key_suggests_close_match(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config("sft", ["run_name=a", "base_output_directory=/x", "learnig_rate=1e-3"], base=None)
    msg = str(e.value)
    assert "'learnig_rate'" in msg and "Did you mean 'learning_rate'" in msg and "global_batch_size" in msg
    base = write(tmp_path, "run_name: a\nbase_output_directory: /x\nnum_generation: 4\n")
    with pytest.raises(ConfigError, match="num_generations"):
        load_config("rl", [], base=base)


@pytest.mark.parametrize("override,needs", [("steps=ten", "int"), ("learning_rate=fast", "float"),
                                            ("packing=maybe", "bool"), ("steps=1.5", "int")])
def test_wrong_type_names_key_and_type(override, needs):
    with pytest.raises(ConfigError) as e:
        load_config("sft", ["run_name=a", "base_output_directory=/x", override], base=None)
    key = override.split("=")[0]
    assert f"{key}=" in str(e.value) and needs in str(e.value)


def test_missing_required_values_named(tmp_path):
    base = write(tmp_path, "steps: 3\n")
    with pytest.raises(ConfigError, match="missing required value.*run_name, base_output_directory"):
        load_config("sft", [], base=base)
    with pytest.raises(ConfigError, match="missing required value.*base_output_directory"):
        load_config("sft", ["run_name=x"], base=base)


@pytest.mark.parametrize("override,msg", [("loss_algo=ppo", "loss_algo='ppo' is not one of"),
                                          ("num_generations=5", "multiple of num_generations=5"),
                                          ("reward_weights=[1.0]", "one weight per function"),
                                          ("steps=0", "steps=0 must be > 0"),
                                          ("fsdp_parallelism=0", "fsdp_parallelism=0")])
def test_value_checks(override, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace("[", r"\[")):
        load_config("rl", ["run_name=a", "base_output_directory=/x", override], base=None)


def test_yaml_record_round_trips(tmp_path):
    cfg = load_config("rl", ["reward_functions=[correctness]", "reward_weights=[2.0]", "epsilon_high=null"])
    p = tmp_path / "rec.yml"
    p.write_text(to_yaml(cfg))
    assert load_config("rl", [], base=p) == cfg


def test_cli_help_and_config_command():
    r = subprocess.run([sys.executable, "-m", "maxpost", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "config" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-m", "maxpost", "config", "rl", "beta=0.04"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "beta: 0.04" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-m", "maxpost", "config", "rl", "betta=0.04"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "Did you mean 'beta'" in r.stderr
    r = subprocess.run([sys.executable, "-m", "maxpost", "frobnicate"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0 and "unknown command" in r.stderr
