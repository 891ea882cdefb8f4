"""The suite's own time machinery: tests/costs.py's counts (the README's cost table quotes them: a Python interpreter
started counts, torchrun counts its agent and its ranks, other programs do not), the workers' rows added up, the
dearest files handed out first, and a shared set-up made once per run across xdist workers (tests/conftest.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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


def test_the_dearest_files_go_first_and_each_named_file_exists():
    """conftest's DEAREST_FIRST orders the collection (xdist hands the files out in that order): its files first,
    in its order, then the rest as collected; a renamed or deleted file in the list would silently lose its place."""
    from types import SimpleNamespace

    import conftest

    tests = Path(conftest.__file__).parent
    assert [name for name in conftest.DEAREST_FIRST if not (tests / name).is_file()] == []
    first, second = conftest.DEAREST_FIRST[:2]
    items = [SimpleNamespace(path=tests / name, n=i) for i, name in
             enumerate(["test_a.py", second, "test_b.py", first, second, "test_a.py"])]
    assert [(item.path.name, item.n) for item in conftest.dearest_first(items)] == \
        [(first, 3), (second, 1), (second, 4), ("test_a.py", 0), ("test_b.py", 2), ("test_a.py", 5)]


def test_the_workers_rows_add_up_on_the_controller(monkeypatch):
    """Under xdist each worker measures its own files: the controller's table is the sum of their rows, a file two
    workers share (never, with --dist loadfile, but not assumed) added column by column."""
    from collections import defaultdict

    monkeypatch.setattr(costs, "totals", defaultdict(lambda: dict.fromkeys(costs.COLUMNS, 0)))
    row = dict(zip(costs.COLUMNS, (10.0, 1.0, 2.0, 3.0, 4, 5, 6)))
    costs.add({"tests/test_a.py": row, "tests/test_b.py": row})
    costs.add({"tests/test_a.py": row})
    assert costs.totals["tests/test_a.py"] == {column: 2 * value for column, value in row.items()}
    assert costs.totals["tests/test_b.py"] == row


def test_a_set_up_runs_once_per_run_across_xdist_workers(tmp_path, monkeypatch):
    """conftest.once_per_run: two workers (threads here, each with its own basetemp under the run's folder, as xdist
    lays them out) ask for the same set-up while the first is still making it: it is made once, and both get its
    folder and result; a make that fails leaves nothing, and the next one to ask makes it again in a new folder."""
    import threading
    import time
    from types import SimpleNamespace

    import conftest

    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    made, got = [], {}

    def make(out):
        made.append(out)
        time.sleep(0.5)  # the second worker asks meanwhile
        (out / "weights").write_text("w")
        return {"summary": 1}

    def worker(name):
        (tmp_path / name).mkdir()
        factory = SimpleNamespace(getbasetemp=lambda: tmp_path / name)
        got[name] = conftest.once_per_run(factory, "job", make)

    threads = [threading.Thread(target=worker, args=(name,)) for name in ("popen-gw0", "popen-gw1")]
    threads[0].start()
    time.sleep(0.1)
    threads[1].start()
    for thread in threads:
        thread.join()
    assert len(made) == 1 and got["popen-gw0"] == got["popen-gw1"] == (made[0], {"summary": 1})
    assert made[0].parent == tmp_path and (made[0] / "weights").read_text() == "w"

    def failing(out):
        made.append(out)
        raise AssertionError("the job failed")

    factory = SimpleNamespace(getbasetemp=lambda: tmp_path / "popen-gw0")
    with pytest.raises(AssertionError, match="the job failed"):
        conftest.once_per_run(factory, "broken", failing)
    out, result = conftest.once_per_run(factory, "broken", make)
    assert result == {"summary": 1} and out == made[-1] != made[-2]
