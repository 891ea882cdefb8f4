"""Operator mutants over the library (issue 39, item 2): cosmic-ray's operators, a fixed seeded sample, fast tests.

    python tests/operator_mutants.py                 # the sample of tests/operator_mutants.toml, about 40 min on 2 cores
    python tests/operator_mutants.py --jobs 2        # two copies of the tree, two mutants at a time
    python tests/operator_mutants.py --list          # what would run (ids and diffs), nothing run
    python tests/operator_mutants.py --only ID ...   # these mutants only (ids as in docs/mutants-operators.md)

The catalogue of tests/mutants/ holds bugs a person wrote; these are generated. cosmic-ray (a maintained mutation
tool) finds every place one of its operators applies in the modules listed in tests/operator_mutants.toml, and
applies and reverts each one: comparison and boundary operators (< for <=, == for !=, ...), off-by-one constants
(NumberReplacer: n+1 and n-1), a dropped `not`, and/or swapped, True/False swapped, + for - and back, and one operator
of our own, SwapArguments (two adjacent positional arguments of a call exchanged). Each module has its own fast test
command (its unit tests: seconds, not the 30-minute suite), so a mutant costs a few seconds.

The mutants are far more than fit 40 minutes on 2 cores, so a fixed, seeded sample runs: every mutant has a stable id
(file, the text of the line it changes, the operator, its index among that operator's places on that line), and the
`sample` ids with the smallest sha256(seed + id) are taken. A change elsewhere in the code leaves the rest of the
sample where it was. Equivalent mutants (no test can tell them from the original) are listed in the toml by the same
id with one line why; a rerun keeps that triage. A survivor that is not equivalent is a missing test: the fix is a
test (tests/test_operator_kills.py), never an entry in the list.

The tree is copied (once per job) into a temporary folder and mutated there: the checkout is never touched. Writes
docs/mutants-operators.md and docs/mutants-operators.json (read by docs/mutants.md's table). Test-only code.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import fnmatch
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path

import parso
import cosmic_ray.plugins
from cosmic_ray.ast import ast_nodes, get_ast_from_path
from cosmic_ray.mutating import mutate_and_test, mutate_code
from cosmic_ray.operators.operator import Example, Operator
from cosmic_ray.work_item import MutationSpec, TestOutcome, WorkerOutcome

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "tests" / "operator_mutants.toml"
DOC = ROOT / "docs" / "mutants-operators.md"
SCORE = ROOT / "docs" / "mutants-operators.json"
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "runs", "bench-out", "gpu-check-out", "data", "__pycache__",
                                     "*.egg-info", ".pytest_cache", "build", "dist")


class SwapArguments(Operator):
    """Two adjacent positional arguments of a call exchanged: f(a, b) -> f(b, a) (none of cosmic-ray's own operators
    does it, and a call with its arguments the wrong way round is a bug people write)."""

    def mutation_positions(self, node):
        for i, j in self._pairs(node):
            yield node.children[i].start_pos, node.children[j].end_pos

    def mutate(self, node, index):
        i, j = list(self._pairs(node))[index]
        a, b = node.children[i], node.children[j]
        pa, pb = a.get_first_leaf().prefix, b.get_first_leaf().prefix
        ca, cb = a.get_code(include_prefix=False), b.get_code(include_prefix=False)
        node.children[i], node.children[j] = parso.parse(pa + cb), parso.parse(pb + ca)
        return node

    # Builtins whose arguments in the other order are a TypeError on every call (killed by any test that reaches
    # them, nothing learnt) or give the same result (max, min): not mutated.
    SKIP = {"isinstance", "issubclass", "getattr", "hasattr", "setattr", "max", "min"}

    @classmethod
    def _pairs(cls, node):
        if node.type != "arglist" or node.parent is None or node.parent.type != "trailer":
            return
        callee = node.parent.get_previous_sibling()
        if callee is not None and callee.type == "name" and callee.value in cls.SKIP:
            return
        args = [i for i, c in enumerate(node.children) if c.type != "operator"]
        positional = [i for i in args if not (node.children[i].type == "argument")]
        for i, j in zip(positional, positional[1:]):
            a, b = node.children[i], node.children[j]
            if args.index(j) == args.index(i) + 1 and a.get_code(False) != b.get_code(False):
                yield i, j

    @classmethod
    def examples(cls):
        return (Example("f(a, b)", "f(b, a)"),)


cosmic_ray.plugins.OPERATOR_PROVIDERS["manual_train"] = {"SwapArguments": SwapArguments}


def operator_names(patterns) -> list[str]:
    names = list(cosmic_ray.plugins.operator_names())  # cosmic-ray's and ours (registered above)
    chosen = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    for p in patterns:
        if not any(fnmatch.fnmatchcase(n, p) for n in names):
            raise SystemExit(f"operator_mutants: no operator matches {p!r}")
    return chosen


def enumerate_mutants(cfg: dict, root: Path) -> list[dict]:
    """Every mutant of every listed module: {"id", "file", "line", "lineno", "operator", "k", "occurrence"}."""
    ops = [(name, cosmic_ray.plugins.get_operator(name)()) for name in operator_names(cfg["operators"])]
    out = []
    for module in cfg["module"]:
        for rel in module["paths"]:
            path = root / rel
            tree = get_ast_from_path(path)
            lines = path.read_text().splitlines()
            for name, op in ops:
                positions = [start for node in ast_nodes(tree) for start, _ in op.mutation_positions(node)]
                seen: dict = {}
                for occurrence, (lineno, _col) in enumerate(positions):
                    text = lines[lineno - 1].strip()
                    k = seen[text] = seen.get(text, -1) + 1  # the k-th place of this operator on a line of this text
                    short = name.split("/", 1)[1]
                    ident = f"{rel}:{short}:{k}:{text}"
                    out.append({"id": ident, "file": rel, "line": text, "lineno": lineno, "operator": name, "k": k,
                                "occurrence": occurrence, "tests": module["tests"], "group": module["name"]})
    return out


def sample(mutants: list[dict], seed: int, n: int) -> list[dict]:
    key = lambda m: hashlib.sha256(f"{seed}|{m['id']}".encode()).hexdigest()
    return sorted(sorted(mutants, key=key)[:n], key=lambda m: (m["file"], m["lineno"], m["id"]))


def equivalents(cfg: dict) -> dict:
    return {f"{e['file']}:{e['operator']}:{e.get('k', 0)}:{e['line']}": e["why"] for e in cfg.get("equivalent", [])}


def test_command(copy: Path, tests: list[str]) -> str:
    pytest = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
              "-m", "not gpu and not stress", *tests]
    return "sh -c " + shlex.quote(f"cd {shlex.quote(str(copy))} && exec env PYTHONPATH={shlex.quote(str(copy))} "
                                  + shlex.join(pytest))


def diff_of(root: Path, m: dict) -> str:
    path = root / m["file"]
    code = path.read_text()
    mutated = mutate_code(code, cosmic_ray.plugins.get_operator(m["operator"])(), m["occurrence"])
    if mutated is None:
        return "(no mutation)"
    old, new = code.splitlines(), mutated.splitlines()
    return "\n".join([f"- {a.strip()}" for a, b in zip(old, new) if a != b] + [f"+ {b.strip()}" for a, b in
                                                                                zip(old, new) if a != b])


def run_one(copy: Path, m: dict, timeout_s: float) -> dict:
    spec = MutationSpec(module_path=str(copy / m["file"]), operator_name=m["operator"], operator_args={},
                        occurrence=m["occurrence"], start_pos=(m["lineno"], 0), end_pos=(m["lineno"], 1))
    t0 = time.monotonic()
    result = mutate_and_test([spec], test_command(copy, m["tests"]), timeout_s)
    wall = time.monotonic() - t0
    if result.worker_outcome == WorkerOutcome.NO_TEST:
        outcome = "no-mutation"
    elif result.worker_outcome != WorkerOutcome.NORMAL:
        outcome = "error"
    else:
        outcome = "killed" if result.test_outcome == TestOutcome.KILLED else "survived"
        if outcome == "killed" and result.output == "timeout":
            outcome = "killed (timeout)"
    tail = (result.output or "").strip().splitlines()[-1:] or [""]
    return {"outcome": outcome, "wall_s": round(wall, 1), "tail": tail[0][:200]}


def baseline(copies: list, groups: dict, timeout_s: float) -> dict:
    """Each group's tests on the unmutated copies: they must pass (else every mutant would look killed)."""
    def one(item):
        j, (name, tests) = item
        t0 = time.monotonic()
        cmd = test_command(copies[j % len(copies)], tests)
        proc = subprocess.run(shlex.split(cmd), capture_output=True, text=True, timeout=timeout_s)
        wall = time.monotonic() - t0
        if proc.returncode != 0:
            sys.exit(f"operator_mutants: the tests of {name} fail without a mutant:\n{proc.stdout[-3000:]}")
        print(f"baseline {name}: {wall:.1f} s ({proc.stdout.strip().splitlines()[-1]})", flush=True)
        return name, wall

    with concurrent.futures.ThreadPoolExecutor(len(copies)) as pool:
        return dict(pool.map(one, enumerate(groups.items())))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def write_reports(cfg, chosen, results, equiv, all_count, wall_s, jobs, timeouts) -> dict:
    for m in chosen:
        r = results[m["id"]]
        if (m["id"] in equiv or r["outcome"] == "survived") and "diff" not in r:
            r["diff"] = diff_of(ROOT, m)
    import cosmic_ray  # noqa: F401
    from importlib.metadata import version
    rows = [(m, results[m["id"]]) for m in chosen]
    eq = [(m, r) for m, r in rows if m["id"] in equiv]
    killed = [(m, r) for m, r in rows if m["id"] not in equiv and r["outcome"].startswith("killed")]
    not_run = [(m, r) for m, r in rows if m["id"] not in equiv and r["outcome"] == "not run"]
    survived = [(m, r) for m, r in rows if m["id"] not in equiv and not r["outcome"].startswith("killed")
                and r["outcome"] != "not run"]
    total = len(rows) - len(not_run)
    # --reuse keeps a kill while its module's source is unchanged; such kills say where they were measured
    mutant_s = sum(r.get("wall_s", 0) for _, r in rows if r["outcome"] in ("killed", "killed (timeout)", "survived"))
    kept = [r["outcome"] for _, r in killed if r["outcome"] not in ("killed", "killed (timeout)")]
    carried = (f"; {len(kept)} kills are kept from an earlier run on the same module source ({kept[0]}), not "
               f"counted in that time" if kept else "")
    score = len(killed) / max(1, total - len(eq))
    date = datetime.date.today().isoformat()
    summary = {"date": date, "cpu": cpu_name(), "total": total, "killed": len(killed), "equivalent": len(eq),
               "survived": len(survived), "score": round(score, 4), "generated": all_count,
               "tool": f"cosmic-ray {version('cosmic-ray')}", "seed": cfg["seed"], "wall_s": round(wall_s or mutant_s),
               "jobs": jobs, "not_run": len(not_run)}
    SCORE.write_text(json.dumps(summary, indent=1) + "\n")
    from mutant_scores import write_scores  # (tests/ is this script's folder: on sys.path)

    write_scores()  # the three sets side by side at the top of docs/mutants.md
    by_group: dict = {}
    for m, r in rows:
        g = by_group.setdefault(m["group"], [0, 0, 0, 0])
        if m["id"] not in equiv and r["outcome"] == "not run":
            continue
        g[0] += 1
        g[1 if m["id"] in equiv else 2 if r["outcome"].startswith("killed") else 3] += 1
    lines = [
        "# Operator mutants over the library",
        "",
        "Generated by `make mutants-operators` (`python tests/operator_mutants.py`); do not edit by hand. The mutants "
        "of [mutants.md](mutants.md) are bugs a person wrote, one per technique; these are generated by a mutation "
        "tool over the library outside the loops, to find the values no test observes.",
        "",
        f"**{len(killed)} of {total - len(eq)} killed ({100 * score:.1f}%)**, {len(eq)} equivalent, "
        f"{len(survived)} survived: a seeded sample of {len(rows)} of the {all_count} mutants the operators make"
        f"{f' ({len(not_run)} of them not run: the run was cut short)' if not_run else ''}. "
        f"{summary['tool']}, {date}, {summary['cpu']}"
        + (f", {jobs} job(s), {wall_s / 60:.0f} min of this run" if wall_s is not None else "")
        + f"; {mutant_s / 60:.0f} min of mutant runs behind these results (each mutant's own time, summed){carried}.",
        "",
        "Why cosmic-ray (and not mutmut 3): each module here has its own fast test command (its unit tests, seconds), "
        "and cosmic-ray takes a test command per session, names its operators (so the run applies exactly the "
        "comparison, boundary, off-by-one, `not`, and/or and argument-order mutants the issue asks for, not "
        "string mutants), and mutates one occurrence at a time on disk in a copy of the tree, with a fresh "
        "interpreter per mutant. mutmut 3 rewrites every function into a trampoline and picks tests from a stats run "
        "of the whole test directory (here 30 minutes), in a `mutants/` folder at the top level, and cannot leave "
        "out its string mutants. cosmic-ray has no argument-swap operator; SwapArguments, in "
        "tests/operator_mutants.py, is one (a 25-line cosmic-ray Operator).",
        "",
        "How it runs: tests/operator_mutants.toml lists the modules, each with its tests, the operators, the seed "
        "and the sample size. A mutant's id is `file:operator:k:line text` (k: its index among that operator's "
        "places on lines of that text), stable under edits elsewhere; the sample is the ids with the smallest "
        "sha256(seed|id). Each mutant is applied in a copy of the tree and the module's tests run with `pytest -x` "
        f"and a timeout ({timeouts}); a failing test or a timeout kills it.",
        "",
        "| module group | tests | sampled | equivalent | killed | survived |",
        "|---|---|---:|---:|---:|---:|",
    ]
    tests_of = {m["name"]: " ".join(m["tests"]) for m in cfg["module"]}
    for name, (n, e, k, s) in by_group.items():
        lines.append(f"| {name} | {tests_of[name]} | {n} | {e} | {k} | {s} |")
    lines += ["", "## Survivors", ""]
    if survived:
        lines += ["Each is a value no test observes: a test is owed (tests/test_operator_kills.py).", ""]
        for m, r in survived:
            lines += [f"- `{m['id']}` ({r['outcome']})", "", "  ```diff", *("  " + d for d in r["diff"].splitlines()),
                      "  ```"]
    else:
        lines.append("None: every mutant of the sample that a test can tell from the original is killed.")
    lines += ["", "## Equivalent mutants (no test can tell them from the original)", ""]
    for m, r in eq:
        lines += [f"- `{m['id']}`: {equiv[m['id']]}", "", "  ```diff", *("  " + d for d in r["diff"].splitlines()),
                  "  ```"]
    if not eq:
        lines.append("None in this sample.")
    unused = sorted(set(equiv) - {m["id"] for m in chosen})
    if unused:
        lines += ["", f"({len(unused)} equivalent entries of the toml are not in this sample: kept for other seeds.)"]
    DOC.write_text("\n".join(lines) + "\n")
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--jobs", type=int, default=1, help="copies of the tree mutated at once (default 1)")
    ap.add_argument("--sample", type=int, default=None, help="override the toml's sample size")
    ap.add_argument("--only", nargs="*", default=None, help="run these mutant ids only (no report written)")
    ap.add_argument("--list", action="store_true", help="print the sample with diffs; run nothing")
    ap.add_argument("--results", default=None, help="a JSON file of results: written as mutants finish")
    ap.add_argument("--reuse", action="store_true", help="keep --results' kills whose module is unchanged")
    ap.add_argument("--rerun-survivors", action="store_true", help="with --results: run again only the mutants that "
                    "survived there (after tests were added), keep its kills; the rest of the sample counts as not run")
    ap.add_argument("--report-only", action="store_true", help="write the reports from --results; run nothing "
                                                               "(mutants without a result count as not run)")
    args = ap.parse_args(argv)
    cfg = tomllib.loads(Path(args.config).read_text())
    mutants = enumerate_mutants(cfg, ROOT)
    chosen = sample(mutants, cfg["seed"], args.sample or cfg["sample"])
    if args.only is not None:
        chosen = [m for m in mutants if m["id"] in set(args.only)]
        missing = set(args.only) - {m["id"] for m in chosen}
        if missing:
            sys.exit(f"operator_mutants: no such mutant: {sorted(missing)[0]}")
    equiv = equivalents(cfg)
    stale = sorted(set(equiv) - {m["id"] for m in mutants})
    if stale:
        print(f"operator_mutants: {len(stale)} equivalent entries match no mutant (code changed?): {stale[0]}",
              file=sys.stderr)
    print(f"{len(mutants)} mutants generated, {len(chosen)} chosen (seed {cfg['seed']})", flush=True)
    if args.list:
        for m in chosen:
            print(f"{m['id']}{'  [equivalent]' if m['id'] in equiv else ''}\n{diff_of(ROOT, m)}")
        return 0
    src_hash = {m["file"]: hashlib.sha256((ROOT / m["file"]).read_bytes()).hexdigest() for m in chosen}
    if args.report_only:
        previous = json.loads(Path(args.results).read_text())
        results = {m["id"]: previous.get(m["id"], {"outcome": "not run"}) for m in chosen}
        timeouts = f"{cfg['timeout_factor']}x the unmutated tests' wall time, at least {cfg['min_timeout_s']} s"
        print(json.dumps(write_reports(cfg, chosen, results, equiv, len(mutants), None, args.jobs, timeouts)))
        return 0
    results: dict = {}
    results_path = Path(args.results) if args.results else None
    survivors = set()
    if args.rerun_survivors:
        previous = json.loads(Path(args.results).read_text())
        survivors = {i for i, r in previous.items() if i != "__baseline__" and r["outcome"] == "survived"}
        args.reuse = True
    if results_path and args.reuse and results_path.exists():
        for ident, r in json.loads(results_path.read_text()).items():
            if ident == "__baseline__" or r["outcome"].startswith("killed") and r.get("src") == src_hash.get(
                    r.get("file")):
                results[ident] = r
        print(f"reusing {sum(m['id'] in results for m in chosen)} kills from {results_path}", flush=True)
    groups = {}
    for m in cfg["module"]:
        groups[m["name"]] = m["tests"]
    t_start = time.monotonic()
    lock = threading.Lock()
    with tempfile.TemporaryDirectory(prefix="operator-mutants-") as tmp:
        copies = []
        for j in range(args.jobs):
            copy = Path(tmp) / f"tree{j}"
            shutil.copytree(ROOT, copy, ignore=COPY_IGNORE)
            copies.append(copy)
        todo = [m for m in chosen if m["id"] not in results and m["id"] not in equiv
                and (not args.rerun_survivors or m["id"] in survivors)]
        known = results.pop("__baseline__", {}) if args.reuse else {}
        results.pop("__baseline__", None)
        needed = {g: t for g, t in ((m["group"], groups[m["group"]]) for m in todo)
                  if known.get(g, {}).get("tests") != t}
        walls = {g: b["wall_s"] for g, b in known.items() if g not in needed}
        walls.update(baseline(copies, needed, cfg.get("baseline_timeout_s", 900)))
        results["__baseline__"] = {g: {"wall_s": w, "tests": groups[g]} for g, w in walls.items() if g in groups}
        todo.sort(key=lambda m: walls[m["group"]])  # the groups with the fastest tests first
        timeout_of = {g: max(cfg["min_timeout_s"], cfg["timeout_factor"] * w) for g, w in walls.items()}
        free = list(copies)
        done = [0]

        def work(m):
            with lock:
                copy = free.pop()
            try:
                r = run_one(copy, m, timeout_of[m["group"]])
            finally:
                with lock:
                    free.append(copy)
            r.update(file=m["file"], src=src_hash[m["file"]])
            if r["outcome"] == "survived":
                r["diff"] = diff_of(ROOT, m)  # (parso is slow: a diff only where the report shows one)
            with lock:
                results[m["id"]] = r
                done[0] += 1
                print(f"[{done[0]}/{len(todo)}] {r['outcome']:<16} {r['wall_s']:>6.1f}s  {m['id']}", flush=True)
                if results_path:
                    results_path.write_text(json.dumps(results, indent=1))
            return r

        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(work, todo))
    for m in chosen:  # equivalents are not run: the triage is the list
        results.setdefault(m["id"], {"outcome": "equivalent" if m["id"] in equiv else "not run"})
    wall_s = time.monotonic() - t_start
    if args.only is not None:
        for m in chosen:
            print(f"{results[m['id']]['outcome']:<16} {m['id']}")
        return 0
    timeouts = f"{cfg['timeout_factor']}x the unmutated tests' wall time, at least {cfg['min_timeout_s']} s"
    summary = write_reports(cfg, chosen, results, equiv, len(mutants), wall_s, args.jobs, timeouts)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
