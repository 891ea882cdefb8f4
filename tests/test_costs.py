"""tests/costs.py's counts (the README's cost table quotes them): a Python interpreter started counts, torchrun counts
its agent and its ranks, and other programs (inductor's g++, a shell) do not."""
from __future__ import annotations

import subprocess
from pathlib import Path
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
