"""Config loading: a YAML base with overrides, errors for unknown keys, wrong types and missing values, the CLI."""
import subprocess, sys
from pathlib import Path
import pytest
from maxpost.config import load_config, ConfigError, to_yaml, run_dir
from maxpost.sft import SFTConfig
from maxpost.rl import RLConfig

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
    assert msg == ("unknown key 'learnig_rate' in the overrides. Did you mean 'learning_rate'? (`maxpost sft --help` "
                   "lists every key)"), msg   # the close match only, not every key
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
    r = subprocess.run([sys.executable, "-m", "maxpost.cli", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "config" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-m", "maxpost.cli", "config", "rl", "beta=0.04"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "beta: 0.04" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-m", "maxpost.cli", "config", "rl", "betta=0.04"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "Did you mean 'beta'" in r.stderr
    r = subprocess.run([sys.executable, "-m", "maxpost.cli", "frobnicate"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0 and "unknown command" in r.stderr


# issue 21, item 5: values that used to fail late (or never), refused at config time with the key named
@pytest.mark.parametrize("override,msg", [
    ("num_generations=1", "num_generations=1 makes every group-relative advantage 0"),
    ("learning_rate=0", "learning_rate=0.0 must be > 0"), ("learning_rate=-1e-3", "learning_rate=-0.001 must be > 0"),
    ("epsilon_low=-0.1", "epsilon_low=-0.1 must be >= 0"), ("epsilon_high=-1", "epsilon_high=-1.0 must be >= 0"),
    ("adam_b1=1.0", r"adam_b1=1.0 must be in \[0, 1\)"), ("adam_b2=-0.5", "adam_b2=-0.5"),
    ("mini_batch_size=-8", "mini_batch_size=-8 must be >= 0"), ("temperature=-1", "temperature=-1.0 must be >= 0"),
    ("top_p=2", r"top_p=2.0 must be in \(0, 1\]"), ("top_p=0", "top_p=0.0"), ("top_k=-1", "top_k=-1 must be >= 0"),
    ("mini_batch_size=12", "whole groups"), ("gradient_accumulation_steps=3", "gradient_accumulation_steps=3 must divide"),
])
def test_rl_values_refused_at_config_time(override, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config("rl", ["run_name=a", "base_output_directory=/x", override], base=None)


# issue 21, item 15: a run name is a name
@pytest.mark.parametrize("name", ["../../x", "/abs/path", "a/b", "", "..", "."])
def test_run_name_must_be_a_name(name):
    with pytest.raises(ConfigError, match="is not a name"):
        load_config("sft", [f"run_name={name}", "base_output_directory=/x"], base=None)


def test_run_name_from_an_environment_interpolation_is_resolved_then_checked(monkeypatch):
    monkeypatch.setenv("MAXPOST_TEST_RUN", "../escape")
    with pytest.raises(ConfigError, match="is not a name"):
        load_config("sft", ["run_name=${oc.env:MAXPOST_TEST_RUN}", "base_output_directory=/x"], base=None)
    monkeypatch.setenv("MAXPOST_TEST_RUN", "fine")
    cfg = load_config("sft", ["run_name=${oc.env:MAXPOST_TEST_RUN}", "base_output_directory=/x"], base=None)
    assert cfg.run_name == "fine" and "run_name: fine" in to_yaml(cfg)   # the record holds the resolved value


# issue 21, item 16: a YAML base that is a list; greedy-only evaluation
def test_yaml_base_must_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config("sft", [], base=write(tmp_path, "- steps: 3\n- run_name: x\n"))


def test_greedy_only_evaluation_is_reachable():
    assert load_config("rl", ["eval_k=0"]).eval_k == 0
    assert load_config("eval", ["eval_k=0"]).eval_k == 0


def test_each_command_has_only_its_keys():
    from dataclasses import fields
    from maxpost.evaluate import EvalConfig
    names = lambda c: {f.name for f in fields(c)}
    assert not {"learning_rate", "steps", "save_hf", "gradient_accumulation_steps"} & names(EvalConfig)
    assert not {"num_generations", "temperature", "eval_k"} & names(SFTConfig)
    assert {"gradient_accumulation_steps", "save_hf", "temperature"} <= names(RLConfig)


def test_choice_lists_come_from_their_owners():
    from maxpost.config import choices
    from maxpost import policy_loss, advantages, rl, data, attention, model, config
    assert choices("loss_algo") == policy_loss.POLICY_LOSS_ALGOS and choices("kl_estimator") == policy_loss.KL_ESTIMATORS
    assert set(policy_loss.LOSS_AGG_MODES) <= set(choices("loss_agg_mode"))
    assert choices("advantage_scale") == advantages.SCALES and choices("rollout_engine") == tuple(rl.ROLLOUT_ENGINES)
    assert choices("data_format") == data.DATA_FORMATS and choices("train_on") == data.TRAIN_ON
    # the shared keys' words are the objects their chapters interpret
    assert choices("attention") is attention.ATTENTION_IMPLEMENTATIONS and choices("lr_schedule") is config.LR_SCHEDULES
    assert choices("remat_policy")[1:] == model.REMAT_POLICIES


def _old_run(tmp_path, cfg, steps=(2,)):
    d = tmp_path / cfg.run_name
    (d / "checkpoints").mkdir(parents=True)
    for s in steps: (d / "checkpoints" / str(s)).mkdir()
    (d / "config.yml").write_text(to_yaml(cfg))
    return d


def test_seed_is_not_resumable(tmp_path):
    """issue 31, item 13: a resume with another seed would draw other data and initial weights than the run it
    continues; it is refused by name, before and when the run restores."""
    from maxpost.train import check_resume, precheck_run_dir
    base = [f"base_output_directory={tmp_path}", "run_name=s"]
    d = _old_run(tmp_path, load_config("sft", base))
    for kind in ("sft", "rl"):
        with pytest.raises(ConfigError, match="seed: 0 -> 1"): check_resume(d, load_config(kind, [*base, "seed=1"]), 2)
    with pytest.raises(ConfigError, match="seed: 0 -> 1"): precheck_run_dir(load_config("sft", [*base, "seed=1"]))


def test_a_run_recorded_with_null_epsilons_still_resumes(tmp_path):
    """issue 31, item 9: config.yml now records the resolved epsilons and loss_agg_mode; a run whose record holds the
    older `null` (the same values, left to the algorithm) still resumes, and a real change is still refused."""
    import dataclasses, json
    from maxpost.train import check_resume, precheck_run_dir
    base = [f"base_output_directory={tmp_path}", "run_name=old", "loss_algo=gspo"]
    now = load_config("rl", base)
    assert (now.epsilon_low, now.epsilon_high, now.loss_agg_mode) == (3e-4, 4e-4, "sequence-mean-token-mean")
    d = _old_run(tmp_path, dataclasses.replace(now, epsilon_low=None, epsilon_high=None, loss_agg_mode=None), (5,))
    assert "epsilon_low: null" in (d / "config.yml").read_text()
    precheck_run_dir(now)                                     # no conflict before the run starts ...
    assert check_resume(d, dataclasses.replace(now, steps=now.steps + 5), 5) == {"steps": (now.steps, now.steps + 5)}
    assert [list(json.loads(l)["changed"]) for l in (d / "config_history.jsonl").read_text().splitlines()] == [["steps"]]
    with pytest.raises(ConfigError, match="epsilon_high: 0.0004 -> 0.5"):   # ... and a change is still a change
        precheck_run_dir(load_config("rl", [*base, "epsilon_high=0.5"]))


def test_a_batch_smaller_than_the_base_mini_batch_says_how_to_update_on_all_of_it():
    """configs/rl.yml updates in mini-batches of 32; a user who sets global_batch_size=8 is told which key clashes
    and the value that means "the whole batch" (it used to name only the clash)."""
    with pytest.raises(ConfigError) as e:
        load_config("rl", ["global_batch_size=8"])
    msg = str(e.value)
    assert "mini_batch_size=32" in msg and "global_batch_size=8" in msg and "mini_batch_size=0" in msg, msg
    load_config("rl", ["global_batch_size=8", "mini_batch_size=0"])        # which is then accepted
    with pytest.raises(ConfigError) as e:                                  # an indivisible batch names itself, once
        load_config("rl", ["global_batch_size=12", "num_generations=8", "mini_batch_size=0"])
    assert "global_batch_size=12 must be a multiple of num_generations=8" in str(e.value)
    assert "mini_batch_size" not in str(e.value), str(e.value)


def test_unknown_key_suggests_only_close_names():
    """Issue 43 item 8: `stpes=10` suggests `steps` (and no far name such as `seed`); the message ends with where every
    key is listed instead of listing them."""
    with pytest.raises(ConfigError) as e:
        load_config("sft", ["run_name=a", "base_output_directory=/x", "stpes=10"], base=None)
    assert str(e.value) == "unknown key 'stpes' in the overrides. Did you mean 'steps'? (`maxpost sft --help` lists every key)"
    with pytest.raises(ConfigError) as e:                                       # nothing close: no suggestion
        load_config("rl", ["run_name=a", "base_output_directory=/x", "zzqx=1"], base=None)
    assert str(e.value) == "unknown key 'zzqx' in the overrides. (`maxpost rl --help` lists every key)"


def test_close_names_against_a_naive_ranking():
    """Top 3 with ratio >= 0.6 and within 0.1 of the best, checked against difflib's ratios computed here."""
    import difflib
    from maxpost.config import close_names
    keys = [f.name for f in __import__("dataclasses").fields(RLConfig)]
    for word in ["stpes", "learnig_rate", "num_generation", "eval_interva", "temprature", "lora", "x", "max_tokens"]:
        r = {k: difflib.SequenceMatcher(None, word, k).ratio() for k in keys}
        best = max(r.values())
        want = sorted((k for k in keys if r[k] >= 0.6 and r[k] >= best - 0.1), key=lambda k: (-r[k], [-ord(c) for c in k]))[:3]
        assert close_names(word, keys) == want, (word, close_names(word, keys), want)


def test_dtype_auto_resolved_when_loaded(monkeypatch):
    """`dtype: auto` (the default) is float32 on this CPU and bfloat16 where JAX runs on a GPU or TPU, written into the
    config (and so into the run's config.yml); param_dtype stays float32."""
    import maxpost.config as mc
    cfg = load_config("sft", ["base_output_directory=/x"])
    assert (cfg.dtype, cfg.param_dtype) == ("float32", "float32") and "dtype: float32" in to_yaml(cfg).splitlines()
    for plat, want in [("gpu", "bfloat16"), ("tpu", "bfloat16"), ("cpu", "float32")]:
        monkeypatch.setattr(mc, "platform", lambda multi_process=False, p=plat: p)
        c = load_config("sft", ["base_output_directory=/x"])
        assert (c.dtype, c.param_dtype) == (want, "float32") and f"dtype: {want}" in to_yaml(c).splitlines()
        assert load_config("sft", ["base_output_directory=/x", "dtype=float32"]).dtype == "float32"   # named: kept
    with pytest.raises(ConfigError, match="dtype='half' is not one of auto, float32, bfloat16"):
        load_config("sft", ["base_output_directory=/x", "dtype=half"])


def test_dtype_auto_of_a_multi_process_run_starts_no_backend():
    """A multi-process run must call jax.distributed.initialize before JAX starts its backends: resolving `auto` for
    such a config reads the installed platform instead of asking JAX (which would start them)."""
    import os
    code = ("from jax._src import xla_bridge\nfrom maxpost.config import load_config\nimport maxpost.sft   # registers the kind sft\n"
            "c = load_config('sft', ['base_output_directory=/x', 'coordinator_address=localhost:1', 'num_processes=2'])\n"
            "print(c.dtype, xla_bridge.backends_are_initialized())")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["float32", "False"], r.stdout
