"""`make mutants`: apply each mutant of the catalogue (tests/mutants/) to a temporary copy of the repository, run the
tests that must kill it, and write what happened: docs/mutants.md (the kill matrix) and docs/bug-gallery.md (what
each mistake costs, measured).

    python tests/run_mutants.py                  # every mutant, kill runs and gallery runs; writes both pages
    python tests/run_mutants.py --only ddp-      # mutants whose name starts with ddp- (nothing written)
    python tests/run_mutants.py --no-gallery     # the kill runs alone (nothing written)
    python tests/run_mutants.py --only ddp- --gallery-only   # their demos alone, their entries of docs/bug-gallery.md replaced

Exit status 0 when every mutant was killed, 1 when one survived or its kill run broke (an error that is not a
failed assertion: the kill proves nothing then), 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import csv
import difflib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from conftest import torchrun  # noqa: E402
from mutant_scores import write_scores  # noqa: E402
from mutants import TECHNIQUES, Mutant, catalogue  # noqa: E402

COPIED = ("manual_train", "launch", "tests", "setup.cfg", "setup.py")
KILL_TIMEOUT_S = 600  # a kill run is a few tests; a mutant that hangs is killed by the tests' own timeouts first
DEMO_TIMEOUT_S = 1200  # a demo trains until its task is learned: minutes on 2 loaded cores
DISTANCE = re.compile(r"max abs diff ([0-9.eE+-]+|inf|nan)")


@dataclass
class Outcome:
    name: str
    status: str  # killed, survived, broken
    test: str  # the test that failed first (killed), or ""
    message: str  # its failure line
    distance: str  # the max abs weight difference the failure reported, where it did
    seconds: float


def repo_copy(root: Path, mutant: Mutant | None) -> Path:
    """The repository's code and tests under root, with the mutant applied (None: unchanged)."""
    for name in COPIED:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, root / name)
    if mutant is not None:
        path = root / mutant.file
        text = path.read_text()
        path.write_text(text.replace(mutant.old, mutant.new))
    return root


def check(mutant: Mutant) -> None:
    """A mutant must apply exactly once and change something (else it mutates nothing)."""
    text = (REPO / mutant.file).read_text()
    count = text.count(mutant.old)
    assert count == 1, f"{mutant.name}: `old` occurs {count} times in {mutant.file}"
    assert mutant.old != mutant.new, f"{mutant.name}: `new` equals `old`"
    assert mutant.technique in TECHNIQUES, f"{mutant.name}: unknown technique {mutant.technique}"
    assert mutant.kill, f"{mutant.name}: no test named to kill it"


def diff_lines(mutant: Mutant) -> list[str]:
    """The mutant as a unified diff of its file (3 lines of context are too many for the gallery: 1)."""
    text = (REPO / mutant.file).read_text()
    before, after = text.splitlines(), text.replace(mutant.old, mutant.new).splitlines()
    return [line for line in difflib.unified_diff(before, after, f"a/{mutant.file}", f"b/{mutant.file}", n=1,
                                                  lineterm="")][2:]


def env_for(root: Path, extra: dict) -> dict:
    return {**os.environ, "PYTHONPATH": str(root), "PYTHONUNBUFFERED": "1", **extra}


def first_failure(report: Path) -> tuple[str, str, str] | None:
    """(test node id, tag, message) of the first failed or errored test in a junit XML report; None when none."""
    import xml.etree.ElementTree as ET

    for case in ET.parse(report).getroot().iter("testcase"):
        for child in case:
            if child.tag in ("failure", "error"):
                node = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
                return node, child.tag, (child.get("message") or "").strip()
    return None


def is_a_kill(tag: str, message: str) -> bool:
    """A failed assertion, pytest.fail or pytest-timeout's hang; not an exception of another kind, nor a fixture's
    error (a missing scenario, an import error: the test could not check anything)."""
    return tag == "failure" and message.startswith(("assert", "AssertionError", "Failed:"))


def kill(mutant: Mutant) -> Outcome:
    """Run mutant.kill in a mutated copy: killed (a test failed with an assertion), survived, or broken."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        root = repo_copy(Path(tmp), mutant)
        report = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
               *mutant.kill]
        try:
            proc = subprocess.run(cmd, cwd=root, env=env_for(root, mutant.env), capture_output=True, text=True,
                                  timeout=KILL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return Outcome(mutant.name, "broken", "", f"the kill run took more than {KILL_TIMEOUT_S} s", "",
                           time.perf_counter() - start)
        failure = first_failure(report) if report.exists() else None
    seconds = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    if proc.returncode == 0:
        return Outcome(mutant.name, "survived", "", "", "", seconds)
    if failure is None:
        tail = out.strip().splitlines()[-1:] or [""]
        return Outcome(mutant.name, "broken", "", f"pytest exit {proc.returncode}: {tail[0][:200]}", "", seconds)
    test, tag, message = failure
    distance = DISTANCE.search(message)  # the failing check's own (an earlier, passing check prints one too)
    status = "killed" if is_a_kill(tag, message) else "broken"
    return Outcome(mutant.name, status, test, " ".join(message.split())[:300], distance.group(1) if distance else "",
                   seconds)


def demo_run(root: Path, demo: tuple, out: Path, stop: int = 0) -> dict:
    """One gallery run in `root`: the launch script with its arguments; summary.json's numbers, or the error.
    stop > 0: the run stops after `stop` optimizer steps (--max-steps) and a second process resumes it to its end."""
    script, nproc, *argv = demo
    launcher = torchrun(nproc) if nproc else [sys.executable]
    cmd = [*launcher, str(root / "launch" / f"{script}.py"), *argv, "--out-dir", str(out), "--no-progress"]
    for extra in (["--max-steps", str(stop)], ["--resume", "auto"]) if stop else ([],):
        try:
            proc = subprocess.run([*cmd, *extra], cwd=root, env=env_for(root, {}), capture_output=True, text=True,
                                  timeout=DEMO_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {"error": f"hung: no end after {DEMO_TIMEOUT_S} s"}
        if proc.returncode != 0:
            lines = [line for line in proc.stderr.splitlines() if line.strip()]
            errors = [line for line in lines if ("Error" in line or line.startswith("error:"))
                      and "ChildFailedError" not in line]  # torchrun's own summary names no cause: the rank's does
            return {"error": f"exit {proc.returncode}: {(errors or lines or [''])[-1][:200]}"}
    summary = json.loads((out / "summary.json").read_text())
    with open(out / "metrics.csv", newline="") as f:  # what the log shows last: the train loss of the last window
        train = [row for row in csv.DictReader(f) if row["split"] == "train"]
    return {k: summary.get(k) for k in ("final_val_loss", "final_val_acc", "optimizer_steps", "samples_seen")} | \
        {"last_train_loss": float(train[-1]["loss"]) if train else None} | \
        ({"bits_per_byte": True} if demo_dataset(demo) == "pydoc" else {})


def gallery_runs(mutants: list[Mutant]) -> dict:
    """For each mutant with a demo: its run and the correct run of the same command (once per command)."""
    results, correct = {}, {}
    with tempfile.TemporaryDirectory(prefix="mutant-clean-") as tmp:
        clean = repo_copy(Path(tmp) / "repo", None)
        for mutant in mutants:
            if not mutant.demo:
                continue
            key = json.dumps([mutant.demo, mutant.demo_stop])
            if key not in correct:
                correct[key] = demo_run(clean, mutant.demo, Path(tmp) / f"correct{len(correct)}", mutant.demo_stop)
            with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as mtmp:
                root = repo_copy(Path(mtmp) / "repo", mutant)
                results[mutant.name] = {"correct": correct[key], "mutant": demo_run(root, mutant.demo,
                                                                                   Path(mtmp) / "out",
                                                                                   mutant.demo_stop)}
            print(f"  gallery {mutant.name}: {results[mutant.name]}", flush=True)
    return results


# ---------------------------------------------------------------------- the two pages
def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def kill_matrix(mutants: list[Mutant], outcomes: dict, when: str) -> str:
    lines = ["# The kill matrix", "",
             "Generated by `make mutants` (tests/run_mutants.py) from the catalogue in tests/mutants/: each mutant is a",
             "minimal edit of the technique's own code, applied to a temporary copy of the repository, and the tests",
             "named here ran against it (`pytest -x`). Killed: a test failed with an assertion. The distance is the",
             "max abs weight difference the failing parity check reported, where it reports one (64-true bound",
             "1e-9). What each mistake costs a user: docs/bug-gallery.md.", "",
             f"Measured {when}.", "",
             "| technique | mutant | the bug | killed by | distance | time |", "|---|---|---|---|---|---|"]
    for m in mutants:
        o = outcomes[m.name]
        test = f"`{o.test}`" if o.test else o.status.upper()
        lines.append(f"| {m.technique} | `{m.name}` | {_cell(m.says)} | {test} | {o.distance or '-'} | "
                     f"{o.seconds:.0f} s |")
    killed = sum(outcomes[m.name].status == "killed" for m in mutants)
    lines += ["", f"{killed} of {len(mutants)} killed.", ""]
    return "\n".join(lines)


def _run_cell(r: dict) -> str:
    if "error" in r:
        return r["error"]
    bpb = f" ({r['final_val_loss'] / math.log(2):.3f} bits per byte)" if r.get("bits_per_byte") else ""
    return f"val loss {r['final_val_loss']:.4f}{bpb}, val acc {r['final_val_acc']:.4f}"


# Where a demo's task counts as learned: a bug's cost shows only in a run that learns. Digits and the reverse task by
# validation accuracy; pydoc by validation bits per byte, within 10% of docs/gpt.md's 20-epoch run (final 1.980).
# Synthetic classification has none (its demos are there for their uneven sizes).
@dataclass(frozen=True)
class Target:
    what: str  # as the gallery prints it
    bound: float
    lower_is_better: bool = False

    def value(self, run: dict) -> float:
        return run["final_val_loss"] / math.log(2) if self.lower_is_better else run["final_val_acc"]

    def reached(self, run: dict) -> bool:
        return self.value(run) <= self.bound if self.lower_is_better else self.value(run) >= self.bound


TARGETS = {"digits": Target("val acc >= 0.95", 0.95), "reverse": Target("val acc >= 0.99", 0.99),
           "pydoc": Target("val bits per byte <= 2.18, docs/gpt.md's 1.980 plus 10%", 2.18, lower_is_better=True)}
DEFAULT_DATASET = {"model_parallel": "reverse", "hybrid": "reverse", "pipeline": "reverse", "tensor_parallel": "reverse"}


def demo_dataset(demo: tuple) -> str:
    script, _, *argv = demo
    return argv[argv.index("--dataset") + 1] if "--dataset" in argv else DEFAULT_DATASET.get(script, "digits")


def _close(a: float | None, b: float | None) -> bool:
    return a is None or b is None or abs(a - b) <= 0.01 * abs(a)


def reported_differences(correct: dict, mutant: dict) -> list[str]:
    """What else the run reports differently: the samples it says it trained on (summary.json), the train loss its log
    shows last (metrics.csv), beyond 1%: a bug of the bookkeeping shows there, not in the validation numbers."""
    if "error" in correct or "error" in mutant:
        return []
    out = []
    if correct.get("samples_seen") != mutant.get("samples_seen"):
        out.append(f"samples_seen {correct.get('samples_seen')} correct, {mutant.get('samples_seen')} with the bug")
    if not _close(correct.get("last_train_loss"), mutant.get("last_train_loss")):
        out.append(f"the last logged train loss {correct['last_train_loss']:.4f} correct, "
                   f"{mutant['last_train_loss']:.4f} with the bug")
    return out


def invisible(correct: dict, mutant: dict) -> bool:
    """The bug changes nothing a user reads off the run: the same accuracy to 0.5 points, the loss within 1%, and the
    same samples_seen and last logged train loss (within 1%)."""
    if "error" in correct or "error" in mutant:
        return False
    return abs(correct["final_val_acc"] - mutant["final_val_acc"]) < 0.005 and \
        _close(correct["final_val_loss"], mutant["final_val_loss"]) and not reported_differences(correct, mutant)


def gallery_entry(m: Mutant, o: Outcome, run: dict | None, when: str = "") -> list[str]:
    """One mutant's entry: the bug, its diff, the demo run against the correct one, and the test that catches it."""
    lines = [f"### `{m.name}`", "", m.says + (f" Mirrors: {m.report}." if m.report else ""), "",
             "```diff", *diff_lines(m), "```", ""]
    caught = f"`{o.test}`" + (f" (max abs diff {o.distance})" if o.distance else "") if o.test else o.status.upper()
    if run is not None:
        script, nproc, *argv = m.demo
        command = (f"torchrun --nproc_per_node={nproc} " if nproc else "python ") + f"launch/{script}.py {' '.join(argv)}"
        how = f"`{command}`" if not m.demo_stop else \
            f"`{command} --max-steps {m.demo_stop}`, then the same with `--resume auto`"
        correct, mutant = run["correct"], run["mutant"]
        target = TARGETS.get(demo_dataset(m.demo))
        reached = ""
        if target is not None and "error" not in correct:
            reached = (f" (the task's target, {target.what}, reached)" if target.reached(correct)
                       else f" (below the task's target, {target.what})")
        lines += [f"{how}: correct {_run_cell(correct)}{reached}; with the bug {_run_cell(mutant)}"
                  + (f" (measured {when})" if when else "") + ".", ""]
        differences = reported_differences(correct, mutant)
        if differences:
            lines += ["What the run reports differs too: " + "; ".join(differences) + ".", ""]
        if invisible(correct, mutant):
            lines += ["At this size the bug changes nothing a user sees: the same accuracy, the loss within 1%. "
                      + (f"The parity test sees it: max abs diff {o.distance} where 64-true allows 1e-9."
                         if o.distance else "Only its test, below, sees it."), ""]
    elif m.no_demo:
        lines += [f"No demo: {m.no_demo}", ""]
    lines += [f"Caught by {caught}.", ""]
    return lines


def target_counts(mutants: list[Mutant], runs: dict) -> tuple[int, int, int]:
    """How many demos' correct runs reached their task's target, stayed below it, and had none to reach (synthetic
    data, a text task, no demo, or a run that failed)."""
    reached = below = 0
    for m in mutants:
        run, target = runs.get(m.name), TARGETS.get(demo_dataset(m.demo)) if m.demo else None
        if run is None or target is None or "error" in run["correct"]:
            continue
        reached += target.reached(run["correct"])
        below += not target.reached(run["correct"])
    return reached, below, len(mutants) - reached - below


HEADER_COUNTS = "here {} did, {} stayed below, and {} have no target to reach"


def page_counts(page: str) -> tuple[int, int, int]:
    """What the entries of a gallery page say: correct runs that reached their target, stayed below, had none."""
    reached = len(re.findall(r"\(the task's target, [^()]*, reached\)", page))
    below = len(re.findall(r"\(below the task's target, [^()]*\)", page))
    return reached, below, len(re.findall(r"^### `", page, re.M)) - reached - below


def bug_gallery(mutants: list[Mutant], outcomes: dict, runs: dict, when: str) -> str:
    reached, below, none = target_counts(mutants, runs)
    lines = ["# The bug gallery: what each mistake costs, measured", "",
             "Each entry is one mutant of tests/mutants/ (the catalogue `make mutants` runs): the bug as a diff of",
             "this repository's code, what a user running it sees against the same command without the bug, and",
             "the test that catches it (docs/mutants.md: the kill matrix). A demo should run where its correct run",
             "learns the task (digits: val acc >= 0.95, reverse: >= 0.99, pydoc: within 10% of docs/gpt.md's bits",
             "per byte), so that what a bug costs shows, and where a bug changes nothing visible at that size, the",
             "parity distance shows it instead. Each entry says whether its correct run reached the target:",
             HEADER_COUNTS.format(reached, below, none),
             "(synthetic data, no demo). Generated by `make mutants`, measured",
             f"{when}; an entry rerun alone (`--gallery-only`) says where it ran.", ""]
    for technique, page in TECHNIQUES.items():
        group = [m for m in mutants if m.technique == technique]
        if not group:
            continue
        lines += [f"## {technique}", "", f"The technique: [{page.split('/')[-1]}]({page.split('/')[-1]}).", ""]
        for m in group:
            lines += gallery_entry(m, outcomes[m.name], runs.get(m.name))
    return "\n".join(lines)


def matrix_outcomes(mutants: list[Mutant]) -> dict:
    """The kill runs as docs/mutants.md recorded them (the gallery alone reruns no kill)."""
    rows = {}
    for line in (REPO / "docs" / "mutants.md").read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 6 and cells[1].startswith("`"):
            test = cells[3].strip("`")
            rows[cells[1].strip("`")] = Outcome(cells[1].strip("`"), "killed" if "::" in test else test.lower(),
                                                test if "::" in test else "", "",
                                                "" if cells[4] == "-" else cells[4], float(cells[5].split()[0]))
    return {m.name: rows[m.name] for m in mutants if m.name in rows}


def splice_gallery(text: str, entries: dict[str, list[str]]) -> str:
    """docs/bug-gallery.md with the named mutants' entries replaced (each runs from its heading to the next)."""
    out, skipping = [], False
    for line in text.splitlines():
        m = re.match(r"### `([^`]+)`$", line)
        if m or line.startswith("## "):
            skipping = False
        if m and m.group(1) in entries:
            out += entries[m.group(1)]
            skipping = True
            continue
        if not skipping:
            out.append(line)
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--only", default="", help="run the mutants whose name starts with this (or with one of a comma-separated list; nothing written)")
    parser.add_argument("--no-gallery", action="store_true", help="skip the gallery runs (nothing written)")
    parser.add_argument("--gallery-only", action="store_true", help="rerun the gallery's demos of the selected mutants "
                        "alone and replace their entries in docs/bug-gallery.md (kills as docs/mutants.md has them)")
    args = parser.parse_args(argv)
    mutants = catalogue()
    names = [m.name for m in mutants]
    if len(set(names)) != len(names):
        print(f"error: duplicate mutant names: {sorted({n for n in names if names.count(n) > 1})}", file=sys.stderr)
        return 2
    selected = [m for m in mutants if any(m.name.startswith(p) for p in args.only.split(","))]
    if not selected:
        print(f"error: --only {args.only!r} matches no mutant", file=sys.stderr)
        return 2
    for m in selected:
        check(m)
    if args.gallery_only:
        return gallery_only(selected)
    outcomes = {}
    started = time.perf_counter()
    for i, m in enumerate(selected, 1):
        o = outcomes[m.name] = kill(m)
        print(f"[{i}/{len(selected)}] {m.name}: {o.status.upper()} in {o.seconds:.0f} s"
              + (f" by {o.test}" if o.test else "") + (f" (distance {o.distance})" if o.distance else "")
              + (f"\n    {o.message}" if o.status != "survived" else ""), flush=True)
    runs = {} if args.no_gallery else gallery_runs(selected)
    bad = [o for o in outcomes.values() if o.status != "killed"]
    print(f"{len(selected) - len(bad)} of {len(selected)} killed in {time.perf_counter() - started:.0f} s"
          + "".join(f"\n  {o.status.upper()}: {o.name} {o.message}" for o in bad))
    if not args.only and not args.no_gallery:
        import torch

        from manual_train.bench.report import _cpu_model

        when = (f"{time.strftime('%Y-%m-%d')} on {os.cpu_count()} cores of {_cpu_model()}, ATen "
                f"{torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}")
        (REPO / "docs" / "mutants.md").write_text(kill_matrix(mutants, outcomes, when))
        (REPO / "docs" / "bug-gallery.md").write_text(bug_gallery(mutants, outcomes, runs, when))
        killed = len(selected) - len(bad)  # the catalogue's score beside the generated sets' (tests/mutant_scores.py)
        (REPO / "docs" / "mutants-catalogue.json").write_text(json.dumps(dict(
            date=time.strftime("%Y-%m-%d"), cpu=when.split(" on ", 1)[1], total=len(selected), killed=killed,
            equivalent=0, survived=len(bad), score=round(killed / len(selected), 4),
            wall_s=round(time.perf_counter() - started)), indent=1) + "\n")
        write_scores()
        print("wrote docs/mutants.md, docs/mutants-catalogue.json and docs/bug-gallery.md")
    return 1 if bad else 0


def gallery_only(selected: list[Mutant]) -> int:
    import torch

    from manual_train.bench.report import _cpu_model

    outcomes = matrix_outcomes(selected)
    missing = [m.name for m in selected if m.name not in outcomes]
    if missing:
        print(f"error: --gallery-only: docs/mutants.md has no row for {missing} (allowed: run make mutants first)",
              file=sys.stderr)
        return 2
    runs = gallery_runs(selected)
    when = (f"{time.strftime('%Y-%m-%d')} on {os.cpu_count()} cores of {_cpu_model()}, ATen "
            f"{torch.backends.cpu.get_cpu_capability()}")
    page = REPO / "docs" / "bug-gallery.md"
    text = splice_gallery(page.read_text(), {m.name: gallery_entry(m, outcomes[m.name], runs.get(m.name), when)
                                             for m in selected})
    # the header counts every entry, the ones not rerun too
    page.write_text(re.sub(HEADER_COUNTS.format(*[r"\d+"] * 3), HEADER_COUNTS.format(*page_counts(text)), text))
    print(f"wrote {len(selected)} entries of docs/bug-gallery.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
