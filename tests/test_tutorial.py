"""The tutorial notebook (SFT -> GRPO -> GSPO on the embedded task) runs headlessly with papermill in its shortened
mode, and for GRPO and for GSPO the reward rises over the run (mean of the last quarter of steps above the first) while
the policy visibly changes (mean completion length moves by more than 20 %: a run whose updates did nothing keeps its
length, and its quarter means differ by a token or two of noise)."""
import json
from pathlib import Path

import numpy as np
from maxpost.train import read_metrics

ROOT = Path(__file__).resolve().parent.parent


def test_tutorial_quick_run_reward_rises(tmp_path):
    import papermill as pm
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
