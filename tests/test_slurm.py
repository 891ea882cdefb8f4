"""Preemption under a real Slurm: launch/slurm_train.sbatch, run as shipped on a one-node cluster (tests/local_slurm.py),
is signalled, saves, requeues itself and resumes, and ends bit for bit where an uninterrupted run ends.

The sbatch command line sets only what a user sets: the launch script's path (SCRIPT; tests/slurm_ddp.py is
launch/ddp.py with a notice timed by the test), OUT, NPROC=2, no GPUs, the run's flags, and --time where the time limit
is the point. Every job's runs are checked against one uninterrupted torchrun job of the same flags (32-true, one code
path): final weights bit for bit, metrics.csv's rows (every step once, the same losses), and every resumed attempt's
banner names the step the attempt before it saved, so a rerun from scratch cannot pass.

Slurm holds a requeued job until its begin time, the credential lifetime after the requeue (AuthInfo's cred_expire:
120 s by default, 30 s on the test cluster); moving it earlier (`scontrol update StartTime=now`) gets the job killed
("Job credential revoked": the node still refuses the previous attempt's credential), so the tests wait. Skipped, with the missing part named, where Slurm or munge is
not installed (.ci/run installs them) or the user is not root; `make test-slurm` runs this file alone.
"""
from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, assert_same_path_bitwise, final_weights, run_script, torchrun
from local_slurm import LocalSlurm, _free_port, missing

ASKED = os.environ.get("RUN_SLURM_TESTS") == "1"  # `make test-slurm`: these tests must run, not skip
pytestmark = [pytest.mark.slurm, pytest.mark.skipif(not ASKED and missing() is not None, reason=missing() or ""),
              pytest.mark.skipif(not ASKED,
                                 reason="the Slurm tests take minutes: `make test-slurm` runs them (RUN_SLURM_TESTS=1)")]

SBATCH = REPO / "launch" / "slurm_train.sbatch"
# 6 epochs of the mlp on digits at 2 ranks x batch 32: 24 optimizer steps an epoch, 144 in all. A train row every
# step: a row's loss is the mean over the steps since the run's previous row, so with --log-every N the first row after
# a resume from a step between two log steps averages fewer steps than the uninterrupted run's (the weights do not
# differ); one step a row makes every row comparable.
RUN = ["--model", "mlp", "--epochs", "6", "--batch-size", "32", "--log-every", "1", "--no-progress", "--device", "cpu"]
STEPS_PER_EPOCH, TOTAL_STEPS = 24, 144
JOB_TIMEOUT_S = 900  # a hung job fails the test; the jobs take 20-120 s on 2 loaded cores


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """The cluster, for this module's tests; its daemons (and any job left running) stopped at the end, pass or fail.
    Asked for (`make test-slurm`) on a machine that cannot run it: each test fails with the missing part's line, so a
    CI without Slurm cannot pass by skipping them all."""
    if missing() is not None:
        pytest.fail(f"RUN_SLURM_TESTS=1 but {missing()}", pytrace=False)
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: the same flags, 2 ranks under torchrun, no Slurm."""
    out = tmp_path_factory.mktemp("reference") / "run"
    proc = run_script("ddp", *RUN, "--out-dir", str(out), launcher=torchrun(2), env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


class Job:
    """One sbatch job of the shipped script: its id, output file and out dir."""

    def __init__(self, slurm: LocalSlurm, tmp_path: Path, *sbatch: str, args=(), env=None, script=SBATCH):
        self.slurm, self.out, self.log = slurm, tmp_path / "run", tmp_path / "job.out"
        tmp_path.mkdir(parents=True, exist_ok=True)
        job_env = {**slurm.env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO),
                   "OMP_NUM_THREADS": "1", "NPROC": "2", "OUT": str(self.out), "RDZV_PORT": str(_free_port()),
                   "SCRIPT": "tests/slurm_ddp.py", **(env or {})}
        cmd = ["sbatch", "--parsable", "--gpus-per-node=0", f"--chdir={REPO}", f"--output={self.log}", *sbatch,
               str(script), *RUN, *args]
        proc = subprocess.run(cmd, env=job_env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        self.id = proc.stdout.strip().split(";")[0]

    def info(self) -> dict:
        proc = subprocess.run(["scontrol", "show", "job", "-o", self.id], env=self.slurm.env, capture_output=True,
                              text=True, timeout=60)
        return dict(re.findall(r"(\w+)=(\S*)", proc.stdout))

    def state(self) -> str:
        return self.info().get("JobState", "?")

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_until(self, predicate, what: str, timeout_s: float = JOB_TIMEOUT_S) -> None:
        """Poll until predicate() holds."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            info = self.info()
            assert time.monotonic() < deadline, f"job {self.id}: no {what} after {timeout_s} s ({info.get('JobState')})" \
                                                f"\n{self.text()[-4000:]}\n{self.slurm.logs()}"
            time.sleep(0.5)

    def finish(self) -> str:
        self.wait_until(lambda: self.state() in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), "end")
        return self.state()

    def train_rows(self) -> int:
        path = self.out / "metrics.csv"
        return sum(1 for line in path.read_text().splitlines() if ",train," in line) if path.exists() else 0

    def attempts(self) -> list[dict]:
        """What each attempt of the job printed: its banner's resume step (None: a fresh run; missing: no banner),
        the step its stop line saved after, and the batch script's verdict line."""
        found, current = [], {}
        for line in self.text().splitlines():
            if line.startswith("global batch "):
                m = re.search(r"resuming .* at step (\d+),", line)
                current["resumed_at"] = int(m.group(1)) if m else None
            m = re.match(r"stopped by (SIG\w+) after step (\d+): ", line)
            if m:
                current["signal"], current["saved_step"] = m.group(1), int(m.group(2))
            if line.removeprefix("error: ").startswith(f"slurm_train: job {self.id} attempt "):
                current["verdict"] = line.removeprefix("error: ").split(": ", 2)[2]
                found.append(current)
                current = {}
        return found


def rows(path: Path) -> list[dict]:
    """metrics.csv without its timing columns."""
    with open(path, newline="") as f:
        return [{k: v for k, v in r.items() if k not in ("samples_per_s", "time_s")} for r in csv.DictReader(f)]


def check_ended_as_uninterrupted(job: Job, reference: Path, min_attempts: int) -> list[dict]:
    """The job COMPLETED after at least min_attempts attempts; each resumed attempt started at the step the last saving
    attempt saved after; the final weights equal the reference's bit for bit; metrics.csv has each step once, as the
    uninterrupted run logged it."""
    state = job.finish()
    attempts = job.attempts()
    print(f"job {job.id}: {state}; attempts: {attempts}")
    assert state == "COMPLETED", f"{state}\n{job.text()[-4000:]}"
    assert len(attempts) >= min_attempts, attempts
    saved = None
    for i, attempt in enumerate(attempts):
        if "resumed_at" in attempt:  # this attempt's run started: fresh, or at the step saved before it
            assert attempt["resumed_at"] == saved, (i + 1, attempts)
        if "saved_step" in attempt:
            assert 0 < attempt["saved_step"] < TOTAL_STEPS and attempt["verdict"].endswith("checkpoint saved; requeued")
            saved = attempt["saved_step"]
        elif i < len(attempts) - 1:
            assert attempt["verdict"].endswith("requeued"), (i + 1, attempts)
    assert attempts[-1]["verdict"].startswith("finished"), attempts
    summary = json.loads((job.out / "summary.json").read_text())
    assert summary["optimizer_steps"] == TOTAL_STEPS and not summary["stop_reason"] and "signal" not in summary
    assert_same_path_bitwise(final_weights(reference), final_weights(job.out), f"job {job.id} vs uninterrupted")
    got, want = rows(job.out / "metrics.csv"), rows(reference / "metrics.csv")
    steps = [(r["split"], r["step"]) for r in got]
    assert len(steps) == len(set(steps)), "a step logged twice"
    assert got == want
    return attempts


def test_a_time_limit_notice_saves_requeues_and_resumes_bitwise(slurm, reference, tmp_path):
    """(a) The time limit: --signal=B:USR1@90 with --time=00:03:00 comes 60-90 s into every attempt (Slurm may send it
    up to 60 s early); the first attempt's optimizer steps sleep 1 s each, so the notice finds the run training (or,
    on a loaded machine, still setting up: then it trains one step first). Every rank stops after the same step and
    saves; the job requeues itself; the requeued attempt resumes from the saved step (and may get its own notice)."""
    job = Job(slurm, tmp_path, "--time=00:03:00", env={"SLURM_STEP_SLEEP_S": "1"})
    attempts = check_ended_as_uninterrupted(job, reference, min_attempts=2)
    assert attempts[0].get("resumed_at") is None and attempts[0]["verdict"].startswith("SIGUSR1, "), attempts
    assert {a["signal"] for a in attempts if "signal" in a} == {"SIGUSR1"}, attempts


MID_EPOCH_SLEEP_S = "0.5"  # the first attempt's steps: 12 s from step 12's row to the epoch's end, for the notice


@pytest.mark.parametrize("how", ["scontrol requeue", "scancel --signal=TERM"])
def test_b_a_preemption_mid_epoch_saves_and_resumes_bitwise(slurm, reference, tmp_path, how):
    """(b) The job is preempted mid-epoch (after step 12's row, its first attempt's steps slowed so the notice lands
    before step 24, the epoch's end). `scontrol requeue`: Slurm sends SIGTERM to every process of the job, the batch
    shell included (it passes it on and prints its verdict within KillWait), and requeues the job itself; `scancel
    --signal=TERM`: the step's torchrun agent gets SIGTERM, the workers save and exit 75, and the batch script requeues
    the job."""
    job = Job(slurm, tmp_path, env={"SLURM_STEP_SLEEP_S": MID_EPOCH_SLEEP_S})
    job.wait_until(lambda: job.train_rows() >= 12, "step 12's train row")  # mid-epoch, in epoch 1
    cmd = ["scontrol", "requeue", job.id] if how == "scontrol requeue" else ["scancel", "--signal=TERM", job.id]
    assert subprocess.run(cmd, env=slurm.env, capture_output=True, timeout=60).returncode == 0
    attempts = check_ended_as_uninterrupted(job, reference, min_attempts=2)
    first = attempts[0]
    assert first["signal"] == "SIGTERM" and 12 <= first["saved_step"] < STEPS_PER_EPOCH, attempts


def test_c_d_notices_during_setup_load_and_start_requeue_three_times_in_a_row(slurm, reference, tmp_path):
    """(c) and (d): attempt 1 gets its notice while the model is built (set-up), attempt 2 while it loads attempt 1's
    checkpoint, attempt 3 before its workers have imported torch (no handler yet: they die of it, nothing saved). Each
    is requeued all the same (the batch shell got the notice itself); attempts 1 and 2 train one step and save after
    it; attempt 4 resumes from attempt 2's step and ends equal to the uninterrupted run."""
    job = Job(slurm, tmp_path, env={"SLURM_NOTICE": "setup,load,start"})
    attempts = check_ended_as_uninterrupted(job, reference, min_attempts=4)
    assert len(attempts) == 4, attempts
    assert [a.get("saved_step") for a in attempts] == [1, 2, None, None], attempts
    assert [a.get("resumed_at", "no banner") for a in attempts] == [None, 1, "no banner", 2], attempts
    assert "saved nothing; requeued" in attempts[2]["verdict"], attempts
    for i, when in ((1, "setup"), (2, "load")):
        assert f"slurm_ddp: attempt {i}: SIGUSR1 arrived during {when}" in job.text()


def test_e_two_agents_over_c10d_signalled_requeued_and_equal(slurm, reference, tmp_path):
    """(e) srun --ntasks=2: two torchrun agents, one worker each, rendezvous over c10d as two nodes (--nnodes=2 from
    SLURM_NTASKS). The time-limit notice's path by hand (scancel --batch --signal=USR1) mid-epoch: the shell passes it
    to srun, srun to both agents, each to its worker; both stop after the same step, save, requeue, resume, equal."""
    job = Job(slurm, tmp_path, "--ntasks=2", "--ntasks-per-node=2",
              env={"NPROC": "1", "SLURM_STEP_SLEEP_S": MID_EPOCH_SLEEP_S})
    job.wait_until(lambda: job.train_rows() >= 12, "step 12's train row")
    assert subprocess.run(["scancel", "--batch", "--signal=USR1", job.id], env=slurm.env,
                          capture_output=True, timeout=60).returncode == 0
    attempts = check_ended_as_uninterrupted(job, reference, min_attempts=2)
    assert attempts[0]["signal"] == "SIGUSR1" and 12 <= attempts[0]["saved_step"] < STEPS_PER_EPOCH, attempts


def test_bad_setups_are_one_line(slurm, tmp_path):
    """(4) A job Slurm will not requeue (no --requeue, on this cluster whose JobRequeue is 0), a --save-on-signal
    signal that torchrun does not pass on, and a --time too short to save before the notice (two attempts in a row
    stopped before they saved anything; here their notices come while the workers import torch): one line each, the
    job FAILED, not requeued again."""
    no_requeue = tmp_path / "no_requeue.sbatch"
    no_requeue.write_text(SBATCH.read_text().replace("#SBATCH --requeue ", "#SBATCH "))
    job = Job(slurm, tmp_path / "a", args=(), script=no_requeue)
    assert job.finish() == "FAILED"
    errors = [line for line in job.text().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "cannot be requeued" in errors[0] and "--requeue" in errors[0], job.text()
    assert not (job.out / "metrics.csv").exists()
    job = Job(slurm, tmp_path / "b", args=("--save-on-signal", "TERM,USR1,USR2"))
    assert job.finish() == "FAILED"
    errors = [line for line in job.text().splitlines() if line.startswith("error:")]
    assert "[rank" not in job.text(), job.text()  # no worker's traceback (torchrun's own report follows the line)
    assert errors == ["error: --save-on-signal: torchrun passes SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 to its workers, "
                      "not SIGUSR2: in this Slurm job a SIGUSR2 notice would end the torchrun agent, and its workers "
                      "with it, before they save (torchrun --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,"
                      "SIGUSR2, as launch/slurm_train.sbatch does; or --save-on-signal without SIGUSR2)"], job.text()
    assert not (job.out / "metrics.csv").exists()
    job = Job(slurm, tmp_path / "c", env={"SLURM_NOTICE": "start,start,start"})
    assert job.finish() == "FAILED"
    attempts = job.attempts()
    assert len(attempts) == 2 and "saved nothing; requeued" in attempts[0]["verdict"], attempts
    errors = [line for line in job.text().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "before this attempt saved anything, as did the attempt before: --time" in errors[0], errors
    assert "not requeued" in errors[0] and not (job.out / "last.pt").exists()
