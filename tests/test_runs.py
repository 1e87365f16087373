"""The papermill run notebooks (nbs/runs/) refuse what `maxpost` refuses (issue 43)."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("kind", ["rl", "dpo"])
def test_papermill_refuses_a_misspelt_load_parameters_path(tmp_path, kind):
    """A load_parameters_path given with -p that does not exist stops before training with the CLI's error (it used
    to print one line and train from random weights with exit 0); only the notebook's own default falls back."""
    import papermill as pm
    runs = tmp_path / "runs"
    with pytest.raises(pm.PapermillExecutionError) as e:
        pm.execute_notebook(str(ROOT / "nbs" / "runs" / f"{kind}.ipynb"), str(tmp_path / "bad.ipynb"),
                            parameters={"load_parameters_path": str(tmp_path / "embeded-sft"),
                                        "base_output_directory": str(runs), "steps": 1},
                            cwd=str(tmp_path), kernel_name="python3", progress_bar=False)
    assert e.value.ename == "ConfigError", (e.value.ename, e.value.evalue)
    assert "embeded-sft" in e.value.evalue and "does not exist" in e.value.evalue
    assert not (runs / f"papermill-{kind}" / "checkpoints").exists()
