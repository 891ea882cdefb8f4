"""The parity proofs do not depend on this CPU: the parity pairs again, under a lowered instruction set.

fp32 results depend on which kernels the CPU runs (AVX-512 and AVX2 kernels sum in other orders; training
amplifies the difference: the same accumulation pair differed by 3e-8 on one machine and 1.5e-4 on another).
oneDNN, MKL and ATen each take a variable that caps the instruction set they use, so one machine can compute
with another CPU's kernels. Those variables must be set before torch loads, so the pairs run in a fresh pytest
process here: the 64-true pairs must still agree within 1e-9 and the fp32 pairs within their measured floors.
`make test-isa` runs every parity test this way, at each level.

One interpreter is started, not three: this machine's own level is this process's (when ATEN_CPU_CAPABILITY does not
cap it), and the fresh pytest process reports the level it computes with before it runs the pairs (each start
imports torch: ~5 s of CPU on a 2-core EPYC).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO

# ATen's capability levels, highest first; the lowered run takes the next one below this machine's.
ATEN_LEVELS = ["AVX512", "AVX2", "DEFAULT"]
# Each pair computes in processes that import nothing the lowered run did not (this pytest, tests/jobs.py's forked
# ranks): a launch script or torchrun would add interpreter starts and prove nothing more about the kernels.
PAIRS = [
    "tests/test_accumulation.py::test_16_x_4_equals_64[2]",  # 64-true, two epochs
    "tests/test_accumulation.py::test_fp32_16_x_4_within_the_noise_floor_and_the_wrong_weighting_is_not",
    # 64-true, two epochs, 2 ranks on gloo (a tests/jobs.py job; JOB_SCENARIOS below: only this test's scenario)
    "tests/test_ddp_parity.py::test_n_ranks_with_batch_b_equal_one_process_with_batch_n_times_b[2-parity]",
    # two code paths with other memory layouts (FSDP2's parameters are views into its all-gather buffer): equal in
    # fp32 bit for bit with AVX-512 kernels, 2^-27 apart with AVX2 ones; 64-true within 1e-9 with any
    "tests/test_zero_cli.py::test_plain_python_is_a_group_of_one_equal_to_the_ddp_loop",
]
LOWERED_RUN_TIMEOUT_S = 900  # a few minutes quiet; generous for a loaded 2-core machine


def capability(env: dict) -> str:
    """The instruction set ATen dispatches to in a fresh process with this environment."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                         env=env, capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip().upper()


def lowered_env() -> tuple[dict, str, str]:
    """(environment, this machine's ATen level, the lowered level): every library capped one level lower."""
    native = torch.backends.cpu.get_cpu_capability().upper() if "ATEN_CPU_CAPABILITY" not in os.environ \
        else capability({k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"})
    lower = ATEN_LEVELS[min(ATEN_LEVELS.index(native) + 1, len(ATEN_LEVELS) - 1)] if native in ATEN_LEVELS \
        else "DEFAULT"
    onednn = {"AVX512": "AVX512_CORE", "AVX2": "AVX2", "DEFAULT": "SSE41"}[lower]
    mkl = {"AVX512": "AVX512", "AVX2": "AVX2", "DEFAULT": "SSE4_2"}[lower]
    env = {**os.environ, "ATEN_CPU_CAPABILITY": lower.lower(), "ONEDNN_MAX_CPU_ISA": onednn,
           "MKL_ENABLE_INSTRUCTIONS": mkl, "PYTHONUNBUFFERED": "1", "JOB_SCENARIOS": "parity"}
    return env, native, lower


@pytest.mark.slow
def test_parity_pairs_hold_under_a_lowered_instruction_set():
    env, native, lower = lowered_env()
    if native == "DEFAULT":
        pytest.skip("this CPU already runs ATen's lowest (non-vectorised) level: nothing lower to compare with")
    # pytest in a fresh interpreter that first says which level its ATen runs (the pairs run in that same process)
    lowered_pytest = ("import sys, pytest, torch; print('ATen capability:', "
                      "torch.backends.cpu.get_cpu_capability().upper(), flush=True); "
                      "sys.exit(pytest.main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", lowered_pytest, "-q", "-rP", "-p", "no:cacheprovider", *PAIRS],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=LOWERED_RUN_TIMEOUT_S)
    floors = [line for line in proc.stdout.splitlines() if "noise floor" in line]
    print(f"ATen {native} -> {lower}:", *floors, sep="\n")
    assert proc.stdout.startswith(f"ATen capability: {lower}\n"), \
        f"ATEN_CPU_CAPABILITY={lower.lower()} did not take effect: {proc.stdout[:200]!r}"
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert f"{len(PAIRS)} passed" in proc.stdout
