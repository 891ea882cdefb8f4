"""A hung job fails within its own deadline, naming its ranks and where each waited (tests/jobs.py's watcher):
never by the collective timeout (--dist-timeout-s, 1800 s by default) nor by pytest-timeout's limit for the suite.

The hang is the bug class that once cost 952 s before a test failed: one rank acting alone (on a preemption notice
only it received) while the other waits in a collective. Here rank 1 skips the all_reduce rank 0 enters, and waits
for a message rank 0 never sends. Each test's own pytest-timeout (far below the collective timeout) is the proof
that the watcher, not a timeout, ended it.
"""
from __future__ import annotations

import pytest
from conftest import run_script, torchrun
from jobs import JobHung, run_job

from manual_train import distributed

IDLE_S = 4  # this test's idle window (a hung job: each process ~1% of a core); the suite's jobs use jobs.IDLE_S


def _one_rank_alone(name, world_size, rank, out):
    import torch
    import torch.distributed as dist

    env = distributed.read_env()
    distributed.setup(env, torch.device("cpu"), "gloo", timeout_s=1800)
    t = torch.ones(4)
    if rank == 0:
        dist.all_reduce(t)  # waits for rank 1's part, which never comes
    else:
        dist.recv(t, src=0)  # rank 1 went its own way: waits for a message rank 0 never sends
    return {}


@pytest.mark.timeout(120)
def test_a_hung_two_rank_job_fails_within_its_deadline_naming_each_rank_and_collective(tmp_path):
    with pytest.raises(JobHung) as failure:
        run_job(_one_rank_alone, 2, tmp_path / "job", ["alone"], ["manual_train.distributed"], idle_s=IDLE_S)
    message = str(failure.value)
    print(message)
    assert "hung: its processes used" in message
    lines = message.splitlines()
    rank0 = next(line for line in lines if line.strip().startswith("rank 0 (pid"))
    rank1 = next(line for line in lines if line.strip().startswith("rank 1 (pid"))
    assert "scenario 'alone'" in rank0 and "in torch.distributed all_reduce" in rank0 and "_one_rank_alone" in rank0
    assert "scenario 'alone'" in rank1 and "in torch.distributed recv" in rank1 and "_one_rank_alone" in rank1


@pytest.mark.timeout(240)
def test_a_hung_torchrun_job_fails_within_its_deadline_naming_each_rank(tmp_path):
    """The same under real torchrun (conftest.run_script): rank 1 goes its own way after 3 steps of launch/ddp.py."""
    with pytest.raises(JobHung) as failure:
        run_script("tests/faulty_ddp", "--fail-at-step", "3", "--fail-rank", "1", "--fail-mode", "alone",
                   "--max-steps", "40", "--out-dir", str(tmp_path / "run"), "--no-progress", launcher=torchrun(2),
                   idle_s=IDLE_S)
    message = str(failure.value)
    print(message)
    assert "tests/faulty_ddp.py" in message and "hung: its processes used" in message
    lines = message.splitlines()
    rank1 = next(line for line in lines if line.strip().startswith("rank 1 (pid"))
    assert "in torch.distributed recv" in rank1 and "faults.py" in rank1, rank1
    rank0 = next(line for line in lines if line.strip().startswith("rank 0 (pid"))
    assert "(no stack dumped)" not in rank0, rank0
    assert "torch.distributed.run" in message  # torchrun's agent, ended with its ranks


@pytest.mark.timeout(60)
def test_a_rank_that_ends_first_keeps_its_cpu_so_the_job_is_not_read_as_hung():
    """The watcher sums CPU over the job's processes; a rank that finishes before the others leaves /proc. Its CPU
    must stay in the sum, or the job's use over the window goes negative and a working job is ended as hung (CI,
    2026-12-04: "used -80.26 s of CPU in the last 63 s", both ranks done). A job that then truly waits is still hung."""
    import subprocess
    import sys
    import time

    from jobs import Watch

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.5: pass"
    burner = subprocess.Popen([sys.executable, "-c", burn])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(40)"])
    try:
        watch = Watch([burner.pid, sleeper.pid], deadline_s=None, idle_s=2)
        while burner.poll() is None:
            assert watch.check() is None  # burning: not hung
            time.sleep(0.2)
        burner.wait()  # reaped: gone from /proc, as a finished rank is
        why = None
        for _ in range(60):  # the sleeper alone: hung once 2 s pass without CPU, within 12 s
            why = watch.check()
            if why:
                break
            time.sleep(0.2)
        cpu = [c for _, c in watch.samples]
        assert cpu == sorted(cpu), f"the job's CPU went down when a process ended: {cpu}"
        assert max(cpu) >= 1.0, cpu  # the burner's 1.5 s are still counted
        assert why and why.startswith("hung") and "used 0." in why and "-" not in why.split("used")[1][:3], why
    finally:
        sleeper.kill()
        burner.kill()
