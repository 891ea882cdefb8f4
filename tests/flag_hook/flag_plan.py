"""For testing only: the pytest plugin of tests/flag_mutants.py (`pytest -p flag_plan`), which runs many flag mutants
in ONE pytest process (the imports and the collection paid once, not once per flag).

FLAG_PLAN names a JSON file: [{"name", "spec", "tests": [node ids]}, ...]. For each entry, in order, the plugin sets
FLAG_MUTANT=spec (sitecustomize.py reads it at each parse, and every process a test starts inherits it) and runs the
entry's tests, like `pytest -x`: the first failure ends the entry. Every fixture is torn down between two entries, so
that no module-scoped result computed under one mutant is read under the next. One JSON line per entry is appended to
FLAG_RESULTS: {"name", "status": killed|survived|broken, "test", "how", "hits", "seconds", "ran"}; a test that
exceeds pytest-timeout's limit neither kills nor passes (recorded in "slow"), and the next test runs.
"""
import json
import os
import tempfile
import time

import pytest

_reports = []


def pytest_runtest_logreport(report):
    _reports.append(report)


def _message(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    return " ".join((crash.message if crash else str(report.longrepr)).split())[:200]


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    if "FLAG_PLAN" not in os.environ:
        return None
    with open(os.environ["FLAG_PLAN"]) as f:
        plan = json.load(f)
    by_node = {}
    for item in session.items:
        by_node.setdefault(item.nodeid.split("[")[0], []).append(item)
    deadline = float(os.environ.get("FLAG_DEADLINE") or 0)
    for entry in plan:
        if deadline and time.time() > deadline:  # the runner's --budget-s is spent: the rest are recorded, not run
            with open(os.environ["FLAG_RESULTS"], "a") as f:
                f.write(json.dumps(dict(name=entry["name"], status="not run", test="", how="--budget-s spent",
                                        hits=0, seconds=0.0, ran=[])) + "\n")
            continue
        items = [item for node in entry["tests"] for item in by_node.get(node, [])]
        hits = tempfile.mktemp(prefix="flag-hits-")
        os.environ.update(FLAG_MUTANT=entry["spec"], FLAG_MUTANT_HITS=hits)
        result = dict(name=entry["name"], status="survived", test="", how="the tests passed", hits=0, seconds=0.0,
                      ran=[], slow=[])
        start = time.perf_counter()
        for i, item in enumerate(items):
            _reports.clear()
            item.ihook.pytest_runtest_protocol(item=item, nextitem=items[i + 1] if i + 1 < len(items) else None)
            result["ran"].append(item.nodeid)
            failed = [r for r in _reports if r.failed]
            if not failed:
                continue
            message = _message(failed[0])
            if "Timeout" in message:
                result["slow"].append(item.nodeid)
                continue
            assertion = failed[0].when == "call" and message.startswith(("assert", "AssertionError", "Failed:"))
            result.update(status="killed", test=item.nodeid, how="assertion" if assertion else f"error: {message}")
            session._setupstate.teardown_exact(None)  # the entry's fixtures go with it
            break
        os.environ["FLAG_MUTANT"] = ""
        result["seconds"] = round(time.perf_counter() - start, 1)
        if os.path.exists(hits):
            with open(hits) as f:
                result["hits"] = len(f.read().splitlines())
            os.remove(hits)
        if result["status"] == "killed" and not result["hits"]:  # it failed without the mutant: proves nothing
            result.update(status="broken", how=f"failed with the mutant never active: {result['how']}")
        if result["status"] == "survived":
            if result["slow"] and len(result["slow"]) == len(items):
                result.update(status="broken", how=f"every test exceeded the time limit: {result['slow']}")
            elif not result["hits"]:
                result["how"] = "never active: no selected test gave the flag a value other than its default"
            elif result["slow"]:  # not "the tests passed": the one that might have seen it never finished
                result["how"] = f"the other tests passed; these exceeded the time limit: {result['slow']}"
        with open(os.environ["FLAG_RESULTS"], "a") as f:
            f.write(json.dumps(result) + "\n")
    return True
