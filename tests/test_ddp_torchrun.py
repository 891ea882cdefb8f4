"""launch/ddp.py under real torchrun (a subprocess, as a user starts it): parity, outputs, bad input, faults.

torchrun is started as the `torchrun` command starts it (conftest's TORCHRUN_AGENT), with `--standalone` (a free
rendezvous port per job, so runs never collide). Every job costs torchrun's own import plus one per worker (~4-5 s
each on this CPU), so each test starts one job, the uninterrupted 2-rank run (conftest's ddp_torchrun_uninterrupted: the mlp, 64-true) is shared
by the CLI parity and the restart tests here and tests/test_preemption.py's signal test, and the 4-rank outputs
contract is checked on the 4-rank job of tests/test_ddp_parity.py (the same loop and files).
"""
from __future__ import annotations

import csv

import pytest
from conftest import (DDP_TORCHRUN_FLAGS, PARITY_TOL_64, assert_same_path_bitwise, load_model_state, max_param_diff,
                      run_script, torchrun)


FAULTY = "tests/faulty_ddp"  # launch/ddp.py with --fail-at-step/--fail-rank/--fail-mode (tests/faults.py)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


@pytest.mark.slow
def test_torchrun_two_ranks_batch_16_equals_single_process_batch_32(ddp_torchrun_uninterrupted, reference):
    """torchrun --nproc_per_node=2 launch/ddp.py --model mlp --batch-size 16 --epochs 2 --precision 64-true."""
    a, proc_a = ddp_torchrun_uninterrupted
    # The single-device loop at batch 32, two epochs, 64-true, run in this process once per pytest run
    # (conftest.reference): launch/single.py is this call without the interpreter start, and a 64-true bound lets
    # the two sides be two kinds of process.
    b, _ = reference(model="mlp", batch_size=32, accumulate=1, epochs=2, precision="64-true")
    diff = max_param_diff(load_model_state(a), b)
    assert diff <= PARITY_TOL_64, f"A/last.pt vs batch 32 in one process: max abs diff {diff:.3g}"
    assert "global batch 32 = batch 16 x accumulate 1 x world size 2" in proc_a.stdout
    # Only rank 0 prints: one banner, one line per epoch, not one per rank.
    assert proc_a.stdout.count("global batch 32") == 1 and proc_a.stdout.count("epoch 2/2") == 1


def test_bad_input_under_torchrun_is_one_line_from_rank_0(tmp_path):
    proc = run_script("ddp", "--sync-bn", "--out-dir", str(tmp_path / "run"), launcher=torchrun(2), timeout=120)
    assert proc.returncode != 0  # torchrun's own status: 1 whatever its workers returned
    assert error_lines(proc.stderr) == [
        "error: --sync-bn: SyncBatchNorm runs on CUDA devices only; this run uses the CPU "
        "(allowed: --no-sync-bn, or --device cuda)"]
    assert "[rank" not in proc.stderr, "no worker traceback"
    # What torchrun adds after it: its ChildFailedError report, naming the exit status 2.
    assert "ChildFailedError" in proc.stderr and "exitcode  : 2" in proc.stderr
    assert not (tmp_path / "run").exists(), "validation runs before any directory is created"


def test_an_exception_on_one_rank_ends_the_whole_job_promptly(tmp_path):
    # The collective timeout (1800 s) is far above this test's limit (SUBPROCESS_TIMEOUT_S, 900 s): ending in time
    # means the failure ended the job (torchrun saw a worker exit and stopped the others), not a timeout.
    proc = run_script(FAULTY, "--fail-at-step", "5", "--fail-rank", "1", "--dist-timeout-s", "1800", "--max-steps",
                      "40", "--out-dir", str(tmp_path / "run"), "--no-progress", launcher=torchrun(2))
    assert proc.returncode != 0
    assert "RuntimeError: injected failure on rank 1 after 5 optimizer steps (--fail-at-step)" in proc.stderr
    assert "ChildFailedError" in proc.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.slow
def test_a_killed_worker_restarts_from_last_pt_and_ends_with_the_uninterrupted_weights(ddp_torchrun_uninterrupted,
                                                                                      tmp_path):
    """Rank 1 is SIGKILLed after 60 steps (mid-epoch 2; last.pt holds epoch 1's end, step 47); torchrun
    restarts the group once, every rank loads last.pt, and the run ends where the uninterrupted one did."""
    a, _ = ddp_torchrun_uninterrupted
    out = tmp_path / "X"
    proc = run_script(FAULTY, *DDP_TORCHRUN_FLAGS, "--out-dir", str(out), "--resume", "auto", "--fail-at-step", "60",
                      "--fail-rank", "1", "--fail-mode", "kill", launcher=torchrun(2, "--max-restarts", "1"),
                      timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exitcode: -9" in proc.stderr  # torchrun saw the SIGKILL ...
    assert f"resuming {out / 'last.pt'} at step 47, in epoch 2" in proc.stdout  # ... and the restart resumed
    # Equal, not just close: the same samples in the same order from the same saved state (optimizer
    # momentum included, which only a load on every rank restores: DDP broadcasts weights, not the optimizer).
    assert_same_path_bitwise(load_model_state(out), load_model_state(a), "restarted job vs uninterrupted")
    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows if r["split"] == "val"] == [1, 2]  # the lost steps 48-60 left no rows
    train_steps = [int(r["step"]) for r in rows if r["split"] == "train"]
    assert train_steps == sorted(set(train_steps)) and train_steps[-1] == 94
