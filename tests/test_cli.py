"""What a new user meets at the command line (issues 31 and 32): inputs that do not exist named first, every input
error one line with exit 2, the resume-conflict message, YAML errors with their place, plain log lines in a file,
no lock file left behind, the resolved RL config."""
import json, os, subprocess, sys
from pathlib import Path

import pytest

from maxpost.config import load_config, to_yaml

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")


def cli(*args, cwd=None, env=None, block_torch=False, timeout=600):
    "Run `maxpost ARGS` in a fresh process (optionally one where torch cannot be imported); stdout, stderr, code."
    pre = ("import importlib.util as u; _f = u.find_spec\n"   # what transformers asks to decide that torch is there
           "u.find_spec = lambda n, *a, **k: None if n.split('.')[0] == 'torch' else _f(n, *a, **k)\n") if block_torch else ""
    code = pre + "import sys\nfrom maxpost.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=env or ENV, timeout=timeout)


def one_line_error(r, code=2):
    "The one line a refused command printed (asserting that it is one line and that the exit code is `code`)."
    lines = [l for l in r.stderr.strip().splitlines() if not l.startswith("start: ")]   # issue 43 item 3: the start line
    assert r.returncode == code and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-3000:])
    return lines[0]


def old_run(tmp_path, name="r", steps=(250, 500), **changes):
    "A run directory as an earlier `maxpost sft` left it: its config.yml (with `changes`) and checkpoint steps."
    d = tmp_path / name
    (d / "checkpoints").mkdir(parents=True)
    cfg = load_config("sft", [f"base_output_directory={tmp_path}", f"run_name={name}",
                              *(f"{k}={v}" for k, v in changes.items())])
    (d / "config.yml").write_text(to_yaml(cfg))
    for s in steps: (d / "checkpoints" / str(s)).mkdir()
    return d


@pytest.mark.parametrize("command,key", [("sft", "dataset_name"), ("sft", "tokenizer_path"), ("rl", "eval_dataset_name"),
                                         ("rl", "load_parameters_path"), ("eval", "load_parameters_path"),
                                         ("sft", "load_adapter_path")])
def test_an_input_that_does_not_exist_is_named_first(tmp_path, command, key):
    """issue 31, item 1: a missing path is the first thing said, not a resume conflict with the run of the same name
    (whose config differs), a tokenizer search or a split error."""
    old_run(tmp_path, "r", dataset_name=str(tmp_path / "old.jsonl"))
    extra = ["lora_rank=4"] if key == "load_adapter_path" else []
    line = one_line_error(cli(command, f"base_output_directory={tmp_path}", "run_name=r", *extra,
                              f"{key}={tmp_path}/nonexistent.jsonl"))
    # (rl's default load_parameters_path, the embedded SFT run, does not exist here either: it is named next)
    assert line.startswith(f"maxpost {command}: configuration error: {key}='{tmp_path}/nonexistent.jsonl' does not "
                           "exist"), line
    assert line.endswith(f": give an existing path (a typo? a relative path is taken from {ROOT})"), line


def test_the_resume_conflict_names_the_key_the_newest_step_and_a_fresh_start(tmp_path):
    "issue 31, items 1 and 12: the step is the run's newest checkpoint (not -1); a new run_name starts fresh."
    old_run(tmp_path, "r", train_split="train[:256]")
    line = one_line_error(cli("sft", f"base_output_directory={tmp_path}", "run_name=r", "train_split=train[:128]"))
    # the step, not -1 (looked for outside the run's path: pytest's own tmp directories are named pytest-1, -10, ...)
    assert "checkpoints up to step 500" in line and "-1" not in line.replace(str(tmp_path), "<tmp>"), line
    assert "this key differs" in line and "train_split: 'train[:256]' -> 'train[:128]'" in line, line
    assert "pass a new run_name (e.g. run_name=r-2): a new run_name starts fresh" in line, line


def tiny_hf_dir(tmp_path, name="hf"):
    import torch, transformers
    from maxpost.tasks import build_tokenizer
    hf_cfg = transformers.Qwen3Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      tie_word_embeddings=True, max_position_embeddings=256)
    torch.manual_seed(0)
    d = tmp_path / name
    transformers.Qwen3ForCausalLM(hf_cfg).save_pretrained(d)
    build_tokenizer(d)
    return d


def test_unsupported_or_truncated_weights_are_one_line_exit_2(tmp_path):
    """issue 31, item 2: an architecture maxpost does not implement (Mixtral's config.json) and a model.safetensors
    cut short are input errors of load_parameters_path, through sft and rl."""
    hf = tiny_hf_dir(tmp_path)
    mixtral = tmp_path / "mixtral"
    mixtral.mkdir()
    (mixtral / "config.json").write_text(json.dumps({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}))
    (mixtral / "model.safetensors").write_bytes((hf / "model.safetensors").read_bytes())
    for command in ("sft", "rl"):
        line = one_line_error(cli(command, f"base_output_directory={tmp_path}", f"load_parameters_path={mixtral}",
                                  f"tokenizer_path={hf}"))
        assert f"load_parameters_path='{mixtral}': unsupported architecture ['MixtralForCausalLM']" in line, line
    w = hf / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    line = one_line_error(cli("sft", f"base_output_directory={tmp_path}", f"load_parameters_path={hf}"))
    assert f"load_parameters_path='{hf}'" in line and "it may be truncated" in line, line


def test_no_room_for_the_embedded_task_is_one_line_exit_2(tmp_path):
    """A disk too full for the embedded task (~15 MB, written on a run's first start): here a 1 MB limit on file size
    (RLIMIT_FSIZE, so a write fails with EFBIG as on a full disk it fails with ENOSPC). sft and dpo (whose pairs sit
    beside it) print one line that names the directory and the fix, exit 2, no traceback (it was a 34-line OSError traceback and exit 1)."""
    import resource, signal
    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    code = "import sys\nfrom maxpost.cli import main\nsys.exit(main(sys.argv[1:]))"
    for command, *extra in (("sft",), ("dpo", "load_parameters_path=")):   # dpo from a random start: no SFT run needed
        out = tmp_path / command
        r = subprocess.run([sys.executable, "-c", code, command, f"base_output_directory={out}", *extra], capture_output=True,
                           text=True, cwd=ROOT, env=ENV, timeout=600, preexec_fn=limited)
        line = one_line_error(r)
        assert f"could not write the embedded task (about 15 MB) into {out / 'embedded_task'}" in line, line
        assert "set base_output_directory=" in line, line


def test_a_truncated_adapter_is_one_line_exit_2(tmp_path):
    "issue 31, item 2: a peft adapter whose safetensors stops half-way, through load_adapter_path."
    from maxpost.model import create_model, get_model_config
    from maxpost.lora import add_lora, save_adapter
    d = save_adapter(add_lora(create_model(get_model_config("tiny")), rank=4, alpha=32.0), tmp_path / "adapter", "tiny")
    f = d / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    line = one_line_error(cli("sft", f"base_output_directory={tmp_path}", "lora_rank=4", f"load_adapter_path={d}"))
    assert f"load_adapter_path='{d}'" in line and "it may be truncated" in line, line


@pytest.mark.parametrize("text,override,says", [
    ("global_batch_size: [4\n", None,
     "is not valid YAML: did not find expected ',' or ']' at line 2, column 1, while parsing a flow sequence opened at "
     "line 1, column 20"),
    (None, "model_overrides={d_model: 64", "the value is not valid YAML: did not find expected ',' or '}' at column 13"),
    (None, "model_overrides=[1,2]", "model_overrides=[1, 2] (from the overrides) is not a valid dict[str, Any]"),
])
def test_malformed_yaml_is_one_line_exit_2_with_its_place(tmp_path, text, override, says):
    "issue 32, item 3: a YAML base or an override that does not parse, or has the wrong shape."
    args = [f"base_output_directory={tmp_path}"]
    if text is not None:
        (tmp_path / "bad.yml").write_text(text)
        args.insert(0, tmp_path / "bad.yml")
    else: args.append(override)
    for command in ("sft", "config"):
        line = one_line_error(cli(command, *(["sft"] if command == "config" else []), *args))
        assert says in line, line


def test_a_run_logs_plain_lines_to_a_file_and_leaves_no_lock(tmp_path):
    """issue 31, items 6 and 8: with stderr a pipe, one plain line per logged step (no bar with carriage returns), the
    memory line on its own line, no "Generating train split" from datasets and no "PyTorch was not found" from
    transformers (torch made unimportable); a clean exit removes the run's .lock."""
    rows = [{"question": f"{a} + {b}", "answer": str(a + b)} for a in range(12) for b in range(12)]
    data = tmp_path / "add.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = tmp_path / "tok"
    from maxpost.tasks import build_tokenizer
    build_tokenizer(tok)
    env = dict(ENV, HF_DATASETS_CACHE=str(tmp_path / "hf-datasets"), USE_TORCH="0")   # datasets: no torch either
    r = cli("sft", f"base_output_directory={tmp_path}", "run_name=plain", f"dataset_name={data}",
            f"tokenizer_path={tok}", "eval_split=train[:8]", "eval_on_train=true", "train_split=train",
            "steps=4", "log_period=2", "global_batch_size=4", "max_target_length=32", "eval_batches=1",
            "eval_interval=0", "checkpoint_period=4", "warmup_steps=0", env=env, block_torch=True)
    assert r.returncode == 0, r.stderr[-3000:]
    err = r.stderr
    assert "\r" not in err and "%|" not in err, err[-2000:]
    steps = [l for l in err.splitlines() if l.startswith("sft plain: step ")]
    assert [l.split()[3] for l in steps] == ["2/4", "4/4", "4/4"], err[-2000:]   # two train lines, the final eval
    assert all(" loss=" in l for l in steps[:2]), steps
    assert any(l.startswith("memory: ") for l in err.splitlines()), err[-2000:]
    assert "Generating train split" not in err and "PyTorch was not found" not in err, err[-2000:]
    assert not (tmp_path / "plain" / ".lock").exists()
    # issue 31, item 7: the data has answers, so SFT ends with greedy pass@1 of its final policy; a separate
    # `maxpost eval` of the last checkpoint, named by its step, gives the same numbers
    rec = json.loads((tmp_path / "eval-plain" / "eval.json").read_text())
    assert Path(rec["load_parameters_path"]) == tmp_path / "plain" and rec["step"] == 4 and rec["metrics"]["num_prompts"] == 8
    m = rec["metrics"]
    assert r.stdout.splitlines()[-2] == (f"held-out (8 problems) after SFT: pass@1 {100 * m['pass@1']:.1f} %, "
                                         f"format rate {100 * m['format_rate']:.1f} %"), r.stdout[-1000:]
    e = cli("eval", f"base_output_directory={tmp_path}", "run_name=by-step", f"tokenizer_path={tok}",
            f"load_parameters_path={tmp_path / 'plain' / 'checkpoints' / '4'}", f"dataset_name={data}",
            "eval_split=train[:8]", "eval_k=0", env=env)
    assert e.returncode == 0, e.stderr[-3000:]
    again = json.loads((tmp_path / "by-step" / "eval.json").read_text())
    assert again["step"] == 4 and again["metrics"] == m
    assert [c["completion"] for c in again["completions"]] == [c["completion"] for c in rec["completions"]]


def test_sft_on_chat_data_says_why_there_is_no_pass_at_1(tmp_path):
    """issue 31, item 7: held-out rows without a question and an answer (chat messages) cannot be scored; the run
    finishes (exit 0) and says so in one line, with the key that turns the check off."""
    rows = [{"messages": [{"role": "user", "content": f"{a} + {b}"}, {"role": "assistant", "content": str(a + b)}]}
            for a in range(8) for b in range(8)]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = tmp_path / "tok"
    from maxpost.tasks import build_tokenizer
    build_tokenizer(tok)
    r = cli("sft", f"base_output_directory={tmp_path}", "run_name=chat", f"dataset_name={data}", f"tokenizer_path={tok}",
            "eval_split=train[:8]", "eval_on_train=true", "steps=2", "global_batch_size=4", "max_target_length=32",
            "eval_batches=1", "eval_interval=0", "checkpoint_period=2", "warmup_steps=0",
            env=dict(ENV, HF_DATASETS_CACHE=str(tmp_path / "hf-datasets")))
    assert r.returncode == 0, r.stderr[-3000:]
    said = [l for l in r.stderr.splitlines() if l.startswith("no held-out pass@1 after SFT")]
    assert len(said) == 1 and "question" in said[0] and "eval_num_prompts=0" in said[0], r.stderr[-2000:]
    assert "held_out_pass@1" not in r.stdout and not (tmp_path / "eval-chat").exists()


def test_every_training_kind_is_one_shape_registered_where_it_lives():
    "Issue #48: each kind registers in the module of its config (rl in maxpost.rl, not the async chapter), every training kind's `main` is `train_command`, and `maxpost rl max_staleness=K` runs the asynchronous trainer."
    from maxpost.cli import KIND_MODULES, load_kinds
    from maxpost.rl import RLConfig, RLTrainer
    from maxpost.async_rl import AsyncRLTrainer
    kinds = load_kinds()
    for name, k in kinds.items():
        assert k.main.__module__ == KIND_MODULES[name][0], name
        if k.trainer is not None:   # eval trains nothing: its config is the evaluation library's (14_evaluate)
            assert k.config.__module__ == k.trainer.__module__ == k.main.__module__, name
            assert "train_command" in k.main.__code__.co_names, name
    cfg = lambda k: load_config("rl", ["base_output_directory=/x", f"max_staleness={k}"])
    assert (kinds["rl"].trainer_for(cfg(0)), kinds["rl"].trainer_for(cfg(2))) == (RLTrainer, AsyncRLTrainer)


def test_config_shows_the_values_an_rl_run_uses():
    "issue 31, item 9: epsilons and loss_agg_mode resolved from loss_algo, in `maxpost config` and so in config.yml."
    from maxpost.rl import loss_options
    import dataclasses
    r = cli("config", "rl", "loss_algo=gspo")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [l.split("  # ")[0] for l in r.stdout.splitlines()]   # without the help comments
    assert {"epsilon_low: 0.0003", "epsilon_high: 0.0004", "loss_agg_mode: sequence-mean-token-mean"} <= set(lines)
    # what the config says is what rl.py would use for the same config with the values left to the algorithm
    for algo in ("grpo", "gspo", "gspo-token"):
        cfg = load_config("rl", [f"loss_algo={algo}"])
        unresolved = dataclasses.replace(cfg, epsilon_low=None, epsilon_high=None, loss_agg_mode=None)
        assert loss_options(cfg) == loss_options(unresolved), algo
        assert load_config("rl", [f"loss_algo={algo}", "epsilon_high=0.9"]).epsilon_high == 0.9   # a set value stays


def test_each_command_lists_its_keys_with_type_default_and_help():
    """issue 31, items 10 and 11: `maxpost sft --help` (rl, eval, config) lists every key of the command's config class
    with its type, default and one line; `maxpost config` says the same as comments; `maxpost --help` reads 128+N."""
    from dataclasses import fields
    from maxpost.config import KINDS
    for command, cls in ((k.name, k.config) for k in KINDS.values()):
        for args in ([command, "--help"], *([["config", command, "-h"]] if command == "rl" else [])):
            r = cli(*args)
            assert r.returncode == 0, r.stderr[-2000:]
            lines = {l.split(" (", 1)[0].strip(): l for l in r.stdout.splitlines() if l.startswith("  ")}
            for f in fields(cls):
                line = lines[f.name]
                assert line.split("): ", 1)[1].strip(), line          # a help text
                assert (f"default {f.default}" if isinstance(f.default, int) and not isinstance(f.default, bool)
                        else "(") in line.replace("without a base: ", "default "), line   # the class's, beside the base's
        assert (f"  steps (int, default 500 (the base YAML's; without a base: 100), resumable): optimizer steps of the run"
                in cli("sft", "--help").stdout)
    r = cli("config", "rl", "loss_algo=gspo")
    top = [l for l in r.stdout.splitlines() if l and not l.startswith((" ", "-"))]
    assert top and all("  # " in l for l in top), [l for l in top if "  # " not in l]
    r = cli("--help")
    assert "128+N stopped by signal N" in r.stdout and "128 128" not in r.stdout, r.stdout


def test_mismatched_config_and_unknown_chat_role_are_refused(tmp_path):
    """issue 32, item 5: config.json whose model_type (mixtral) contradicts its architectures (Qwen3ForCausalLM), and
    SFT data with a role chat templates do not know (ShareGPT's human/gpt), are refused in one line naming them."""
    hf = tiny_hf_dir(tmp_path)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "model_type": "mixtral"}))
    line = one_line_error(cli("sft", f"base_output_directory={tmp_path}", f"load_parameters_path={hf}", "steps=2"))
    assert "architectures ['Qwen3ForCausalLM'] but model_type 'mixtral'" in line, line
    from maxpost.tasks import build_tokenizer
    build_tokenizer(tmp_path / "tok")
    rows = [[{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}],
            [{"role": "human", "content": "2+2?"}, {"role": "gpt", "content": "4"}]]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    line = one_line_error(cli("sft", f"base_output_directory={tmp_path}", f"dataset_name={tmp_path / 'chat.jsonl'}",
                              f"tokenizer_path={tmp_path / 'tok'}", "train_split=train", "eval_split=train",
                              "eval_on_train=true", "steps=2"))
    assert "example 1 (messages format): messages has a message with role 'human'" in line, line


def test_convert_keeps_a_maxtext_tokenizer_and_clears_what_a_killed_convert_left(tmp_path):
    """issue 31, item 5 and issue 32, item 5: `maxpost convert <maxtext> DST --to hf` keeps the tokenizer the MaxText
    directory holds (and --help no longer says it has none); `.DST.convert-PID` left by a killed convert is removed."""
    hf = tiny_hf_dir(tmp_path)
    r = cli("convert", hf, tmp_path / "mt", "--to", "maxtext")
    assert r.returncode == 0 and (tmp_path / "mt" / "tokenizer" / "tokenizer.json").exists(), r.stderr[-2000:]
    stale = tmp_path / ".back.convert-4194999"          # a PID above Linux's pid_max: its process is gone
    stale.mkdir()
    r = cli("convert", tmp_path / "mt", tmp_path / "back", "--to", "hf", "--model-name", "qwen3")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    assert not stale.exists() and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    assert "MaxText SRC has none" not in cli("convert", "--help").stdout


def test_an_adapter_names_a_base_peft_loads_from_anywhere(tmp_path):
    """issue 31, item 5: `adapter_base(cfg)` is the base a run's adapter should name: the Hugging Face directory given
    as an absolute path (it was the relative path of a run directory before), so that peft loads base + adapter from
    another working directory, with maxpost's logits; the README says how."""
    import numpy as np, jax, jax.numpy as jnp, torch
    from flax import nnx
    from maxpost.checkpoint import load_hf
    from maxpost.lora import add_lora, save_adapter
    from maxpost.policy import adapter_base
    hf = tiny_hf_dir(tmp_path)
    cfg = load_config("sft", [f"load_parameters_path={os.path.relpath(hf)}", "lora_rank=4"])
    model = add_lora(load_hf(hf), rank=4, alpha=8.0, seed=1)
    for v in jax.tree.leaves(nnx.state(model, nnx.LoRAParam), is_leaf=lambda v: isinstance(v, nnx.Variable)):
        v.set_value(v.get_value() + 0.05)
    base = adapter_base(cfg)
    d = save_adapter(model, tmp_path / "run" / "adapter", base, source=cfg.load_parameters_path)
    assert f"from_pretrained({str(hf)!r})" in (d / "README.md").read_text()
    script = ("import sys, json, torch\nfrom peft import AutoPeftModelForCausalLM\n"
              "m = AutoPeftModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
              "print(json.dumps(m(torch.arange(6)[None]).logits[0].tolist()))")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = subprocess.run([sys.executable, "-c", script, str(d)], capture_output=True, text=True, cwd=elsewhere,
                       timeout=600, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    np.testing.assert_allclose(np.array(json.loads(r.stdout)), np.asarray(model(jnp.arange(6)[None]))[0],
                               rtol=1e-4, atol=1e-4)


def test_maxposts_warnings_are_one_line_on_the_terminal():
    "A warning raised from one of maxpost's modules during a command (as `generate` warns from its caller, evaluate.py or rl.py, about prompts cut to max_prompt_length) reaches stderr as one `warning: ...` line, without Python's path, category and source line; another module's warning keeps Python's format."
    import subprocess, sys
    code = ("import warnings, maxpost.evaluate as ev; from maxpost.cli import one_line_warnings; one_line_warnings()\n"
            "warnings.warn_explicit('2 of 3 prompts (67%) are longer than max_prompt_length=8', UserWarning, ev.__file__, 142)\n"
            "warnings.warn('from elsewhere')\n")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}).stderr
    lines = [l for l in err.splitlines() if l.strip()]
    assert lines[0] == "warning: 2 of 3 prompts (67%) are longer than max_prompt_length=8", err
    assert len(lines) == 2 and lines[1].endswith("UserWarning: from elsewhere"), err   # Python's format: where, category
