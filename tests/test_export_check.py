"""`.ci/check-export` (run by `.ci/run`) fails when a notebook is edited without `nbdev_export`, and passes again
once the package is exported and committed."""
import json, os, shutil, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(cmd, cwd, env):
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs a git checkout of maxpost")
def test_unexported_notebook_edit_fails_ci(tmp_path):
    repo = tmp_path / "repo"
    # a copy of the committed tree (no venv, no untracked files)
    subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
    # bring the clone to an exported, committed state first (the working tree under test may be mid-edit)
    run(["nbdev_clean"], repo, env); run(["nbdev_export"], repo, env)
    run(["git", "add", "-A"], repo, env); run(["git", "commit", "-qm", "sync", "--allow-empty"], repo, env)
    assert run(["bash", ".ci/check-export"], repo, env).returncode == 0

    nb_path = repo / "nbs" / "00_config.ipynb"
    nb = json.loads(nb_path.read_text())
    cell = next(c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).startswith("#| export"))
    cell["source"] = "".join(cell["source"]) + "\n\ndef added_without_export(): return 1\n"
    nb_path.write_text(json.dumps(nb, indent=1))
    subprocess.run(["git", "commit", "-qam", "edit a notebook, forget nbdev_export"], cwd=repo, env=env, check=True)

    r = run(["bash", ".ci/check-export"], repo, env)
    assert r.returncode != 0 and "maxpost/config.py" in r.stderr, r.stdout + r.stderr

    run(["git", "add", "-A"], repo, env); run(["git", "commit", "-qm", "export"], repo, env)
    assert run(["bash", ".ci/check-export"], repo, env).returncode == 0
