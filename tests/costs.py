"""Where the suite's time goes: `pytest --cost-report=FILE` (opt-in; tests/conftest.py's hooks call this).

Per test file: wall seconds, CPU seconds of the pytest process itself, CPU seconds of the processes it started
(launch scripts, torchrun's agents and ranks, pytest-in-pytest: every descendant that ended and was waited for,
from getrusage(RUSAGE_CHILDREN)) and of tests/jobs.py's forked ranks (they report their own), and how many processes
were started: interpreters (each imports torch: ~4 s of CPU on a 2-core EPYC) and forked job ranks (no import).
The table is what README's Tests section quotes (issue 41, item 1). Process starts inside a started process (the
ranks of a torchrun a pytest subprocess starts) are in its CPU, not in the counts. Under pytest-xdist (`make test
TEST_ARGS=--cost-report=FILE`) each worker measures its own files and hands its rows to the controller as it ends
(xdist's workeroutput); the controller, which writes the table, adds them up. Wall seconds are then each file's
own on its worker, and their sum is more than the run's wall time.
"""
from __future__ import annotations

import resource
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import jobs

COLUMNS = ("wall_s", "cpu_pytest_s", "cpu_children_s", "cpu_job_ranks_s", "interpreters", "job_ranks", "tests")
totals: dict[str, dict] = defaultdict(lambda: dict.fromkeys(COLUMNS, 0))
started = {"interpreters": 0}
_real_popen = subprocess.Popen


class CountingPopen(_real_popen):
    """subprocess.Popen that counts the Python interpreters it starts: 1, or torchrun's agent plus --nproc_per_node
    ranks. Other programs are not counted: inductor's C++ compiler (g++, a few per compiled graph), nvidia-smi."""

    def __init__(self, args, *rest, **kw):
        argv = [str(a) for a in (args if isinstance(args, (list, tuple)) else [args])]
        program = Path(argv[0].split()[0] if kw.get("shell") else argv[0]).name
        if program.startswith("python") or program == "torchrun":
            ranks = int(argv[argv.index("--nproc_per_node") + 1]) if "--nproc_per_node" in argv else 0
            started["interpreters"] += 1 + ranks
        super().__init__(args, *rest, **kw)


def enable() -> None:
    subprocess.Popen = CountingPopen


def _now() -> tuple:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return (time.perf_counter(), own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime,
            jobs.accounted["cpu_s"], started["interpreters"], jobs.accounted["ranks"])


def measure(item):
    """A hookwrapper's body around one test (its fixtures' set-up and teardown included)."""
    before = _now()
    yield
    after = _now()
    row = totals[item.nodeid.split("::")[0]]
    for column, b, a in zip(COLUMNS, before, after):
        row[column] += a - b
    row["tests"] += 1


def add(rows: dict) -> None:
    """An xdist worker's rows (its `totals`), added on the controller before write()."""
    for name, row in rows.items():
        for column, value in row.items():
            totals[name][column] += value


def write(path: Path, machine: str) -> str:
    rows = sorted(totals.items(), key=lambda kv: -(kv[1]["cpu_pytest_s"] + kv[1]["cpu_children_s"]
                                                    + kv[1]["cpu_job_ranks_s"]))
    whole = {c: sum(r[c] for _, r in rows) for c in COLUMNS}
    lines = [f"Measured {time.strftime('%Y-%m-%d')} on {machine}.", "",
             "| file | tests | wall s | CPU s: pytest | CPU s: started processes | CPU s: job ranks | "
             "interpreters started | job ranks forked |", "|---|---|---|---|---|---|---|---|"]
    for name, r in [*rows, ("all", whole)]:
        lines.append(f"| {name} | {r['tests']} | {r['wall_s']:.0f} | {r['cpu_pytest_s']:.0f} | "
                     f"{r['cpu_children_s']:.0f} | {r['cpu_job_ranks_s']:.0f} | {r['interpreters']} | "
                     f"{r['job_ranks']} |")
    text = "\n".join(lines) + "\n"
    Path(path).write_text(text)
    return text
