"""Launch-environment mistakes are one line: torchrun's variables set only in part, a WORLD_SIZE without ranks
(which used to wait 30 minutes for ranks that never come), garbage values; and a process not started by a
launcher prints its errors whatever LOCAL_RANK a shell left behind. Real subprocesses, as a user starts them."""
from __future__ import annotations

import pytest
from conftest import TORCHRUN_VARS, run_script

LAUNCH_TIMEOUT_S = 300  # a hang (the old behaviour) fails here instead of after the 30-minute collective timeout

CASES = [
    ("ddp", {"WORLD_SIZE": "2"}, "error: WORLD_SIZE: is 2 but RANK is not set"),
    ("ddp", {"RANK": "0", "WORLD_SIZE": "1"}, "error: RANK: is set but LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, "
                                              "MASTER_PORT is not"),
    ("ddp", {"RANK": "3", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": "1"}, "error: RANK: RANK 3, LOCAL_RANK 0, WORLD_SIZE 2, LOCAL_WORLD_SIZE 2 do not fit"),
    ("zero", {"WORLD_SIZE": "two"}, "error: WORLD_SIZE: 'two' is not a whole number"),
]


@pytest.mark.parametrize("script, env, line", CASES, ids=["world-size-alone", "rank-without-the-rest",
                                                          "rank-past-world-size", "garbage"])
def test_a_partial_or_inconsistent_torchrun_environment_is_one_line(tmp_path, script, env, line):
    proc = run_script(script, "--out-dir", str(tmp_path / "run"), "--max-steps", "1", env=env,
                      timeout=LAUNCH_TIMEOUT_S, unset=[k for k in TORCHRUN_VARS if k not in env])
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and err[0].startswith(line), proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_a_lone_process_reports_its_errors_whatever_local_rank_says(tmp_path):
    proc = run_script("single", "--epochs", "0", "--out-dir", str(tmp_path / "run"), env={"LOCAL_RANK": "1"},
                      unset=[k for k in TORCHRUN_VARS if k != "LOCAL_RANK"])
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --epochs: 0 is out of range (allowed: >= 1)"
