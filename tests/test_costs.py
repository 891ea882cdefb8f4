"""tests/costs.py's counts (the README's cost table quotes them): a Python interpreter started counts, torchrun counts
its agent and its ranks, and other programs (inductor's g++, a shell) do not."""
from __future__ import annotations

import subprocess
import sys

import costs


def test_only_python_interpreters_and_torchruns_ranks_are_counted(monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", costs.CountingPopen)
    monkeypatch.setitem(costs.started, "interpreters", 0)
    subprocess.run(["true"], check=True)  # as inductor's g++: not an interpreter
    subprocess.run("true", shell=True, check=True)
    assert costs.started["interpreters"] == 0
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert costs.started["interpreters"] == 1
    # torchrun: its agent and --nproc_per_node ranks (the count reads argv[0]: here `true` runs under torchrun's name)
    proc = costs.CountingPopen(["torchrun", "--nproc_per_node", "3", "x.py"], executable="true")
    proc.wait()
    assert costs.started["interpreters"] == 1 + 4
