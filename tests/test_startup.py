"""Every launch script starts without garbage collections while torch imports, then freezes what the imports made
and turns the collector back on (docs/levers.md, "Start-up"): ~1 s of CPU less per process, and a collector that
is on for the run (left off, every reference cycle a run makes would stay in memory until the process ends).

Checked two ways: each script's statements in order (parsed, not run), and one real start of launch/single.py's
imports in a fresh interpreter, whose collections are counted by a gc callback.
"""
from __future__ import annotations

import ast
import subprocess
import sys

import pytest
from conftest import REPO

SCRIPTS = sorted([*(REPO / "launch").glob("*.py"), *(REPO / "tests").glob("faulty_*.py")])


def _call(node: ast.stmt) -> str | None:
    """'gc.disable' for the statement `gc.disable()`, else None."""
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute):
        func = node.value.func
        return f"{func.value.id}.{func.attr}" if isinstance(func.value, ast.Name) else None
    return None


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_the_collector_is_off_for_the_imports_and_on_for_the_run(script):
    body = ast.parse(script.read_text()).body
    calls = [_call(node) for node in body]
    imports = [i for i, node in enumerate(body) if isinstance(node, ast.ImportFrom)]  # the package's imports
    assert imports and calls.count("gc.disable") == 1 and calls.count("gc.freeze") == 1, script.name
    assert calls.count("gc.enable") == 1, script.name
    disable, freeze, enable = calls.index("gc.disable"), calls.index("gc.freeze"), calls.index("gc.enable")
    assert disable < imports[0] and imports[-1] < freeze < enable, script.name
    main = next(i for i, node in enumerate(body) if isinstance(node, ast.If))  # `if __name__ == "__main__":`
    assert enable < main, script.name  # on, whether the script runs or is imported


def test_a_real_start_makes_no_collection_until_the_imports_are_done():
    probe = ("import gc, runpy, sys\n"
             "seen = []\n"
             "gc.callbacks.append(lambda phase, info: seen.append((gc.get_freeze_count(), 'torch' in sys.modules)) if phase == 'start' else 0)\n"
             f"runpy.run_path({str(REPO / 'launch' / 'single.py')!r}, run_name='imported')\n"
             "print(seen.count((0, True)), gc.isenabled(), gc.get_freeze_count() > 100_000, len(sys.modules) > 1000)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    # torch and the package imported (over 1000 modules) with not one collection from torch's first import to the
    # freeze (before it: runpy reading the script; after it: the freeze count is above 0); the collector on; the
    # imports' objects frozen
    assert out.stdout.split() == ["0", "True", "True", "True"], out.stdout
