"""The tutorial notebook (SFT -> GRPO -> GSPO on the embedded task) runs headlessly with papermill in its shortened
mode, and the GRPO reward rises over the run: the mean reward of the last quarter of steps exceeds that of the first."""
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
        rewards = [r["reward"] for r in read_metrics(tmp_path / "runs" / f"embedded-{algo}", "train")]
        q = max(len(rewards) // 4, 1)
        assert len(rewards) >= 8, rewards
        assert np.mean(rewards[-q:]) > np.mean(rewards[:q]), (algo, rewards)
