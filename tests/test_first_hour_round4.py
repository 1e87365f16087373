"""Issue 49 ("The first hour, round 4"): the faults a fault probe found, each in its general form, and what a newcomer
reads first (`--help`, the configs' comments). Each test fails on the code before the fix."""
import json, math, os, subprocess, sys
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
