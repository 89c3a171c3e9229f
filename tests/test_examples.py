"""The examples run as a user would run them."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def run_example(*args: str) -> str:
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "train_minimal.py"), *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_train_minimal_saves_and_resumes(tmp_path):
    ckpt = str(tmp_path / "run")
    first = run_example("--checkpoint-dir", ckpt, "--steps", "20", "--save-every", "10")
    assert "starting from scratch" in first and "committed steps: [10, 20]" in first
    second = run_example("--checkpoint-dir", ckpt, "--steps", "50", "--save-every", "10")
    # keep_last=3: the oldest steps are deleted as newer ones commit.
    assert "resumed from step 20" in second and "committed steps: [30, 40, 50]" in second
