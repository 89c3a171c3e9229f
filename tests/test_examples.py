"""The examples run as a user would run them; each takes seconds on a laptop CPU."""

import signal
import subprocess
import sys
from pathlib import Path

from object_store_servers import TEST_KEY, TEST_SECRET

ROOT = Path(__file__).parent.parent


def run_example(*args: str, script: str = "train_minimal.py") -> str:
    done = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_train_minimal_saves_and_resumes(tmp_path):
    ckpt = str(tmp_path / "run")
    first = run_example("--checkpoint-dir", ckpt)  # as the README says: run it twice
    assert "starting from scratch, training to step 30" in first and "committed steps: [10, 20, 30]" in first
    second = run_example("--checkpoint-dir", ckpt)
    # keep_last=3: the oldest steps are deleted as newer ones commit.
    assert "resumed from step 30: training to step 60" in second and "step 40: loss" in second
    assert "committed steps: [40, 50, 60]" in second


def test_train_minimal_resumes_after_being_killed(tmp_path):
    ckpt = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "train_minimal.py"), "--checkpoint-dir", ckpt,
                             "--steps", "100000", "--save-every", "5"], stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # let it save a few times, then kill it mid-run
            if line.startswith("step 15:"):
                break
    finally:
        proc.kill()  # SIGKILL: no cleanup, the manager's lease and any save in flight left behind
        proc.wait()
    out = run_example("--checkpoint-dir", ckpt, "--steps", "10", "--save-every", "5")
    resumed = int(out.split("resumed from step ")[1].split(":")[0])
    assert resumed >= 10 and resumed % 5 == 0, out
    assert f"done at step {resumed + 10}" in out


def test_train_minimal_stops_at_a_sigterm_with_that_step_saved(tmp_path):
    """What a scheduler does before preempting a job: the loop saves the step it is at,
    stops, and exits 0; the next run resumes from that step, none lost."""
    ckpt = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "train_minimal.py"), "--checkpoint-dir", ckpt,
                             "--steps", "1000000", "--save-every", "10"], stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # the loop has asked reached_preemption: SIGTERM is a notice from then on
            if line.startswith("step 10:"):
                break
        proc.send_signal(signal.SIGTERM)
        out = proc.stdout.read()
        assert proc.wait(timeout=120) == 0, out
    finally:
        proc.kill()
    stopped = int(out.split("preempted: step ")[1].split(" ")[0])
    assert f"committed steps: [{stopped}]" in out or f", {stopped}]" in out, out
    again = run_example("--checkpoint-dir", ckpt, "--steps", "3")
    assert f"resumed from step {stopped}: training to step {stopped + 3}" in again


def test_restore_other_mesh(tmp_path):
    out = run_example("--checkpoint", str(tmp_path / "c"), script="restore_other_mesh.py")
    assert "restored on 4 devices: params.embed (64, 32) as 4 shards of (32, 16)" in out
    assert "restored on a 2x4 mesh" in out and "every restored value matches the saved state" in out


def test_object_store(s3_server):
    url = f"s3://{s3_server.new_bucket()}/run"
    options = ["-o", f"endpoint_url={s3_server.endpoint}", "-o", f"key={TEST_KEY}", "-o", f"secret={TEST_SECRET}"]
    out = run_example(url, *options, "--steps", "20", script="object_store.py")
    assert f"committed steps in {url}: [10, 20]" in out
    assert f"verify {url}/0000000020: OK" in out


def test_multihost(tmp_path):
    out = run_example("--checkpoint-dir", str(tmp_path / "run"), script="multihost.py")
    for pid in (0, 1):
        assert f"[process {pid}] restored step 20: this process's 4 devices match the trained state" in out, out
