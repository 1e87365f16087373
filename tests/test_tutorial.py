"""The tutorial notebook (SFT -> GRPO -> GSPO on the embedded task) runs headlessly with papermill in its shortened
mode, and for GRPO and for GSPO the reward rises over the run (mean of the last quarter of steps above the first) while
the policy visibly changes (mean completion length moves by more than 20 %: a run whose updates did nothing keeps its
length, and its quarter means differ by a token or two of noise)."""
import json
from pathlib import Path

import numpy as np
import pytest
from maxpost.rundir import read_metrics

ROOT = Path(__file__).resolve().parent.parent


def test_tutorial_quick_run_reward_rises(tmp_path, monkeypatch):
    import papermill as pm
    # the kernel runs on one CPU device, as the notebook's first cell sets for a laptop, not on this test process's
    # eight virtual devices, whose collectives on two cores slow every step (this test alone: 122 s against 190 s)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    out = tmp_path / "tutorial-out.ipynb"
    pm.execute_notebook(str(ROOT / "nbs" / "tutorials" / "sft_grpo_gspo.ipynb"), str(out), cwd=str(tmp_path),
                        kernel_name="python3", parameters=dict(base_output_directory=str(tmp_path / "runs"), quick=True),
                        progress_bar=False)
    summary = json.loads((tmp_path / "runs" / "results.json").read_text())
    assert set(summary["results"]) == {"sft", "grpo", "gspo"}
    for algo in ("grpo", "gspo"):
        rec = read_metrics(tmp_path / "runs" / f"embedded-{algo}", "train")
        rewards, lengths = [r["reward"] for r in rec], [r["completions/mean_length"] for r in rec]
        q = max(len(rewards) // 4, 1)
        assert len(rewards) >= 8, rewards
        assert np.mean(rewards[-q:]) > np.mean(rewards[:q]), (algo, rewards)
        first, last = np.mean(lengths[:q]), np.mean(lengths[-q:])
        assert abs(last - first) > 0.2 * first, (algo, lengths)


def test_real_model_tutorial_shows_the_records_replies_and_checks_their_verdicts(tmp_path):
    """nbs/tutorials/real_model.ipynb trains nothing (seconds): it prints the replies of the bench record it is given,
    and it stops when a recorded verdict disagrees with the book's answer checker."""
    import papermill as pm
    rec = json.loads((ROOT / "bench" / "results" / "real_model.json").read_text())
    after = rec["seeds"]["0"]["full"]["after"]["completions"][0]
    after |= {"completion": "Planted reply: the answer is " + after["answer"] + ".", "correct": True}
    good = tmp_path / "good.json"; good.write_text(json.dumps(rec))
    out = tmp_path / "out.ipynb"
    pm.execute_notebook(str(ROOT / "nbs" / "tutorials" / "real_model.ipynb"), str(out), cwd=str(tmp_path),
                        kernel_name="python3", parameters=dict(record=str(good)), progress_bar=False)
    assert "Planted reply: the answer is" in out.read_text()
    after["correct"] = False                      # the checker says right, the record says wrong
    bad = tmp_path / "bad.json"; bad.write_text(json.dumps(rec))
    with pytest.raises(pm.PapermillExecutionError):
        pm.execute_notebook(str(ROOT / "nbs" / "tutorials" / "real_model.ipynb"), str(out), cwd=str(tmp_path),
                            kernel_name="python3", parameters=dict(record=str(bad)), progress_bar=False)
