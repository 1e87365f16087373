"""Issue 43, items 3 and 5: what a newcomer's first commands say before they work. A run on your own data does not
quietly start from the embedded task's toy checkpoint; every command names where it starts (the checkpoint, its
size on disk, the run directory); an output directory that cannot be written is one line with exit 2."""
import json, os, shlex, subprocess, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")


def cli(*args, cwd=None):
    code = "import sys\nfrom maxpost.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=ENV, timeout=600)


def one_line_error(r, code=2):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-3000:])
    return lines[0]


def own_data(tmp_path) -> Path:
    p = tmp_path / "mine.jsonl"
    p.write_text("".join(json.dumps({"question": f"{i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(8)))
    return p


def files_bytes(path) -> int:
    "Bytes of every file under `path`, counted with os.walk (not the code under test)."
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


@pytest.mark.parametrize("kind", ["rl", "dpo", "eval"])
def test_own_data_with_the_default_toy_checkpoint_is_refused(tmp_path, kind):
    """`maxpost rl dataset_name=mine.jsonl` (and dpo, eval) with the base config's load_parameters_path (the
    embedded SFT run, here present) is one line naming the key, exit 2; nothing is written."""
    (tmp_path / "embedded-sft").mkdir()
    line = one_line_error(cli(kind, f"base_output_directory={tmp_path}", f"dataset_name={own_data(tmp_path)}"))
    assert "is not the embedded task" in line and "load_parameters_path was not given" in line, line
    assert f"load_parameters_path={tmp_path}/embedded-sft" in line, line      # the way to insist on it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["embedded-sft", "mine.jsonl"]


def test_an_explicit_start_is_accepted_on_the_command_line_or_in_a_base(tmp_path):
    from maxpost.commands import command_config
    from maxpost.config import ConfigError
    (tmp_path / "embedded-sft").mkdir()
    args = [f"base_output_directory={tmp_path}", f"dataset_name={own_data(tmp_path)}"]
    with pytest.raises(ConfigError, match="load_parameters_path was not given"): command_config("rl", args)
    assert command_config("rl", [*args, f"load_parameters_path={tmp_path}/embedded-sft"]).dataset_name.endswith("mine.jsonl")
    base = tmp_path / "mine.yml"
    rl = [l for l in (ROOT / "configs" / "rl.yml").read_text().splitlines() if not l.startswith("load_parameters_path:")]
    base.write_text("\n".join(rl) + f"\nload_parameters_path: {tmp_path}/embedded-sft\n")   # a user's own base
    assert command_config("rl", [str(base), *args]).load_parameters_path == f"{tmp_path}/embedded-sft"
    assert command_config("rl", [f"base_output_directory={tmp_path}"]).dataset_name == ""   # the embedded task: fine


def test_every_command_names_its_starting_checkpoint_its_size_and_the_run_directory(tmp_path, capsys):
    """A command's setup prints one start line: the checkpoint path, its size on disk (the bytes of its files,
    counted here with os.walk), the parameter count and the run directory; a config not made by a command (a
    notebook's, a test's) prints nothing."""
    import jax
    from flax import nnx
    from maxpost.checkpoint import save_hf
    from maxpost.model import create_model, get_model_config
    from maxpost.policy import setup_run
    from maxpost.commands import command_config
    from maxpost.tasks import build_tokenizer
    from maxpost.config import load_config
    hf = tmp_path / "hf"
    model = create_model(get_model_config("tiny", num_layers=1), seed=0)
    save_hf(model, hf); build_tokenizer(hf)
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    args = [f"base_output_directory={tmp_path}", "run_name=mine", f"load_parameters_path={hf}"]
    capsys.readouterr()
    setup_run(command_config("sft", args), announce=True)   # what a command's setup prints
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("start:")]
    size = files_bytes(hf) / 2**20
    assert err == [f"start: checkpoint {hf} ({size:.1f} MiB on disk), {n / 1e6:.2f} M parameters; "
                   f"run directory {tmp_path / 'mine'}"], err
    setup_run(load_config("sft", args))
    assert "start:" not in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["sft", "eval"])
def test_an_output_directory_that_cannot_be_written_is_one_line(tmp_path, kind):
    """base_output_directory under a file (the one unwritable place a root user meets too) with your own data, and
    for `maxpost eval`: one line naming the key and the fix, exit 2, not an OSError's traceback."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    (tmp_path / "ckpt").mkdir()
    from maxpost.tasks import build_tokenizer
    build_tokenizer(tmp_path / "tok")      # with a tokenizer, SFT on own data gets as far as its first write
    extra = ([f"load_parameters_path={tmp_path / 'ckpt'}"] if kind == "eval" else
             [f"tokenizer_path={tmp_path / 'tok'}", "model_overrides={num_layers: 1}", "steps=1", "eval_split=train",
              "eval_on_train=true", "eval_num_prompts=0"])
    line = one_line_error(cli(kind, f"base_output_directory={blocker}/runs", f"dataset_name={own_data(tmp_path)}",
                              *extra))
    assert f"base_output_directory='{blocker}/runs' cannot be written" in line, line
    assert "give base_output_directory= a directory you can write to" in line, line


def test_a_resume_names_its_step_and_a_finished_run_is_not_redone(tmp_path):
    """Issue 43 items 5 and 8: a resumed run says "resuming from step N of M"; starting a finished run again trains and
    evaluates nothing (its metrics and held-out records are untouched) and says how to evaluate it again; the end line
    gives the newest checkpoint's size on disk."""
    tiny = [f"base_output_directory={tmp_path}", "run_name=r", "train_split=train[:64]", "eval_split=test[:16]",
            "global_batch_size=8", "max_target_length=96", "eval_batches=1", "eval_num_prompts=4", "log_period=1"]
    first = cli("sft", *tiny, "steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    run = tmp_path / "r"
    size = files_bytes(run / "checkpoints" / "2") / 2**20
    assert f"run directory: {run} (its newest checkpoint: {size:.1f} MiB on disk)" in first.stdout, first.stdout
    records = (run / "metrics.jsonl").read_text()
    held_out = sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "eval-r").rglob("*") if p.is_file())
    again = cli("sft", *tiny, "steps=2")
    assert again.returncode == 0 and "is already finished (step 2 of 2): nothing to do" in again.stderr, again.stderr[-2000:]
    assert f"maxpost eval load_parameters_path={run}" in again.stderr
    assert (run / "metrics.jsonl").read_text() == records                                  # nothing trained or logged
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "eval-r").rglob("*") if p.is_file()) == held_out
    assert "already_finished" not in again.stdout and "step=2" in again.stdout
    more = cli("sft", *tiny, "steps=3")
    assert more.returncode == 0 and f"resuming from step 2 of 3 ({run / 'checkpoints' / '2'})" in more.stderr, more.stderr[-2000:]
    assert "already finished" not in more.stderr


def readme_block(marker: str) -> list[str]:
    "The indented command lines right after `<!-- marker -->` in README.md (comments after `#` dropped)."
    lines = (ROOT / "README.md").read_text().split(f"<!-- {marker} -->\n", 1)[1].splitlines()
    block = [l for l in lines[:next((i for i, l in enumerate(lines) if l and not l.startswith("    ")), len(lines))] if l]
    return [shlex.split(l, comments=True) for l in block]


def test_readme_real_model_lines_make_smollm2_ready_and_run_five_steps():
    """Issue 43's Done-when: the README's real-model lines, pasted in the main job's venv, install the extras that
    exist, run the setup script that writes the recipe's model directory, and run the recipe for 5 steps (a first
    look) under its own run name, so the table's run (the recipe alone) starts fresh, not from the look's step 5."""
    import configparser, importlib.util
    from maxpost.config import load_config, split_base
    setup_line, *runs = readme_block("real-model")
    extras = setup_line[setup_line.index("install") + 2].removeprefix("-e").strip()
    assert setup_line[:2] == [".venv/bin/pip", "install"] and extras.startswith(".[") and extras.endswith("]"), setup_line
    ini = configparser.ConfigParser(); ini.read(ROOT / "settings.ini")
    for extra in extras[2:-1].split(","):
        assert ini["DEFAULT"].get(f"{extra.replace('-', '_')}_requirements"), f"README names extra {extra!r}: not in settings.ini"
    script = setup_line[setup_line.index("&&") + 2]
    assert setup_line[setup_line.index("&&") + 1] == ".venv/bin/python" and (ROOT / script).exists(), setup_line
    spec = importlib.util.spec_from_file_location("real_model_setup", ROOT / script)
    setup = importlib.util.module_from_spec(spec); spec.loader.exec_module(setup)
    assert [r[:2] for r in runs] == [[".venv/bin/maxpost", "rl"]], runs      # one run: pasting the block is the look
    base, overrides = split_base(runs[0][2:])
    look, full = load_config("rl", overrides, base=ROOT / base), load_config("rl", [], base=ROOT / base)
    assert look.steps == 5 and look.run_name != full.run_name, (look.steps, look.run_name)
    assert ROOT / look.load_parameters_path == setup.DEFAULT_DEST                # what the setup writes is what runs
    assert look.eval_num_prompts == full.eval_num_prompts == 128                # the look evaluates as the table does
