"""`maxpost reward`, the fifth kind (issue 51): a reward model trained on DPO's pair data after a tiny SFT, its metrics
named as TRL's, recomputed from the exported Hugging Face sequence classifier scored by transformers; a resume that
continues the run exactly; bad inputs stopped in one line."""
import json, os, subprocess, sys
from pathlib import Path

import numpy as np, pytest

from maxpost import tasks
from maxpost.rundir import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_dpo import SFT_SMALL, _cli, _pairs_file, GOOD   # the cheap SFT start and DPO's pairs, reused

REWARD_SMALL = ["train_split=train[:128]", "eval_split=test[:24]", "global_batch_size=8", "eval_batches=3",
                "log_period=1", "checkpoint_period=2", "learning_rate=1e-3"]
TRL_TRAIN = {"loss", "accuracy", "margin", "min_reward", "mean_reward", "max_reward", "grad_norm"}


def _run(cmd, timeout=900):
    return subprocess.run(cmd, env=dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2"),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    "A 4-step `maxpost sft` on the embedded task (as test_dpo's), the start of every reward run here."
    base = tmp_path_factory.mktemp("reward_kind")
    r = _run(_cli("sft", base, "steps=4", *SFT_SMALL))
    assert r.returncode == 0, r.stderr[-3000:]
    return base


def _held_out_pairs(run: Path, n: int):
    "The first `n` held-out embedded pairs as the run tokenized them (DPO's encode_pair), and the run's tokenizer."
    from transformers import AutoTokenizer
    from maxpost.dpo import encode_pair
    tok = AutoTokenizer.from_pretrained(run / "tokenizer")
    rows = [json.loads(l) for l in open(next(run.parent.glob("**/dpo_test.jsonl")))][:n]
    return [encode_pair(tok, r, 96, 96) for r in rows], tok


def test_cli_reward_after_sft_metrics_as_trl_and_export_scores_as_transformers(sft):
    """3 steps of `maxpost reward` with no start given (the SFT run) and save_hf=true: TRL's metric names; the
    exported classifier loads in transformers (one label, pad token set) and scores each held-out pair as maxpost's
    own checkpoint does within 1e-4 (float32); the run's final eval_accuracy / eval_margin equal those recomputed
    from transformers' scores."""
    import torch
    from flax import nnx
    from transformers import AutoModelForSequenceClassification
    from maxpost.checkpoint import checkpoint_manager, restore_state
    from maxpost.model import Decoder
    from maxpost.policy import read_model_config
    from maxpost.reward import attach_head, score, reward_inputs
    r = _run(_cli("reward", sft, "run_name=rm", "steps=3", "save_hf=true", *REWARD_SMALL))
    assert r.returncode == 0, r.stderr[-3000:]
    run = sft / "rm"
    assert "held-out pair accuracy" in r.stdout and "eval_accuracy=" in r.stdout, r.stdout
    train, ev = read_metrics(run, "train"), read_metrics(run, "eval")
    assert [x["step"] for x in train] == [1, 2, 3] and TRL_TRAIN <= set(train[-1])
    assert [x["step"] for x in ev] == [0, 3] and {"eval_loss", "eval_accuracy", "eval_margin"} <= set(ev[-1])
    hf = AutoModelForSequenceClassification.from_pretrained(run / "hf", dtype=torch.float32).eval()
    assert hf.config.num_labels == 1 and hf.config.pad_token_id is not None
    pairs, tok = _held_out_pairs(run, 24)
    seqs = [p["prompt_ids"] + p[k] for p in pairs for k in ("chosen_ids", "rejected_ids")]
    x = reward_inputs(seqs, pad_id=hf.config.pad_token_id)
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(x[0]).long(), attention_mask=torch.tensor(x[2]).long()).logits[:, 0].numpy()
    model = attach_head(Decoder(read_model_config(run), rngs=nnx.Rngs(0)))
    params = restore_state(checkpoint_manager(run / "checkpoints"), nnx.state(model, nnx.Param))[0]
    nnx.update(model, params)
    ours = np.asarray(score(model, model.score, *x))
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
    c, rj = theirs[0::2], theirs[1::2]
    assert abs(ev[-1]["eval_accuracy"] - float((c > rj).mean())) < 1e-6
    assert abs(ev[-1]["eval_margin"] - float((c - rj).mean())) < 1e-4


def test_resumed_run_continues_exactly(sft):
    """steps=2 then the same command with steps=3 (a resume from checkpoint 2) logs the same step-3 metrics as
    one 3-step run: the head, the optimizer state and the data order are all in the checkpoint."""
    r = _run(_cli("reward", sft, "run_name=whole", "steps=3", *REWARD_SMALL))
    assert r.returncode == 0, r.stderr[-3000:]
    for steps in (2, 3):
        r = _run(_cli("reward", sft, "run_name=split", f"steps={steps}", *REWARD_SMALL))
        assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from step 2" in r.stderr
    a, b = read_metrics(sft / "whole", "train")[-1], read_metrics(sft / "split", "train")[-1]
    assert a["step"] == b["step"] == 3
    assert {k: a[k] for k in TRL_TRAIN} == {k: b[k] for k in TRL_TRAIN}


@pytest.mark.parametrize("case", ["no_chosen_column", "save_adapter", "classifier_as_start"])
def test_bad_inputs_exit_2_in_one_line(tmp_path, case):
    """A dataset without chosen / rejected columns; a peft adapter asked of a reward model; a reward model (a
    sequence classifier, no unembedding) given as the causal LM to start from: exit 2, one line, no step trained."""
    tasks.build_tokenizer().save_pretrained(tmp_path / "tok")
    common = ["load_parameters_path=", f"tokenizer_path={tmp_path / 'tok'}", "model_overrides={num_layers: 1}",
              "global_batch_size=2", "steps=1"]
    if case == "no_chosen_column":
        data = _pairs_file(tmp_path / "pairs.jsonl", [{"prompt": g["prompt"], "good": g["chosen"], "rejected": g["rejected"]}
                                                      for g in GOOD])
        args, want = [f"dataset_name={data}", "eval_split=train", "eval_on_train=true", *common], "no column(s) ['chosen']"
    elif case == "save_adapter":
        args, want = ["lora_rank=4", "save_adapter=true", *common], "save_adapter=true"
    else:
        from maxpost.model import create_model, get_model_config
        from maxpost.reward import create_head, save_reward_hf
        body = create_model(get_model_config("tiny", num_layers=1), seed=0)
        save_reward_hf(body, create_head(body.cfg.d_model), tmp_path / "rm", pad_token_id=0)
        args, want = [*common[3:], f"load_parameters_path={tmp_path / 'rm'}", f"tokenizer_path={tmp_path / 'tok'}"], "rm"
    r = _run(_cli("reward", tmp_path / "out", *args), timeout=600)
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert "Traceback" not in r.stderr and want in lines[-1], r.stderr[-3000:]
    assert not list((tmp_path / "out").glob("*/checkpoints/*"))


def test_papermill_reward_run_and_a_misspelt_parameter(tmp_path):
    """nbs/runs/reward.ipynb runs a few steps from its parameters and records TRL's metrics; `-p center_reward 0.1`
    stops it before training with the configuration's error naming the key it resembles."""
    import papermill as pm
    nb, runs = str(Path(__file__).resolve().parent.parent / "nbs" / "runs" / "reward.ipynb"), tmp_path / "runs"
    with pytest.raises(pm.PapermillExecutionError) as e:
        pm.execute_notebook(nb, str(tmp_path / "bad.ipynb"), cwd=str(tmp_path), kernel_name="python3", progress_bar=False,
                            parameters={"center_rewards_coeficient": 0.1, "base_output_directory": str(runs)})
    assert e.value.ename == "ConfigError" and "center_rewards_coefficient" in e.value.evalue, e.value.evalue
    assert not runs.exists()
    pm.execute_notebook(nb, str(tmp_path / "out.ipynb"), cwd=str(tmp_path), kernel_name="python3", progress_bar=False,
                        parameters=dict(base_output_directory=str(runs), run_name="pm", steps=2, load_parameters_path="",
                                        global_batch_size=4, eval_batches=1, center_rewards_coefficient=0.01,
                                        overrides=["train_split=train[:32]", "eval_split=test[:8]",
                                                   "model_overrides={num_layers: 2}"]))
    recs = read_metrics(runs / "pm", "train")
    assert [r["step"] for r in recs] == [1, 2] and {"accuracy", "margin"} <= set(recs[-1])
    assert "eval_accuracy" in read_metrics(runs / "pm", "eval")[-1]
