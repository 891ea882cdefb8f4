"""`make mutants-flags`: one generated mutant per user-facing flag, each run against the tests that name the flag.

A flag mutant ignores the user's value: after validation the parsed value is replaced by the default the script would
have used (for a boolean the user set, that is the opposite). The flags come from the parsers themselves, so a flag
added tomorrow is a mutant tomorrow:

- every field of every config dataclass in manual_train/ declared with config.arg() (Config, the launch scripts'
  subclasses DDPConfig, ZeroConfig, ..., and the tools' EvalArgs, GenerateArgs, FindConfig, TuneFlags): one mutant
  per field, named after the class that declares it, active in every script whose config inherits it (Config.lr
  ignores --lr in all nine launch scripts and in the tools that parse training flags);
- every option of the plain-argparse parsers that a module exposes as build_parser() (python -m manual_train.parity,
  python -m manual_train.bench).

The mutant is applied by tests/flag_hook/sitecustomize.py (FLAG_MUTANT=...), in the pytest process and in every
process it starts (launch scripts, torchrun ranks, forkserver ranks), on the repository itself: nothing is copied.
For each flag the runner selects the tests that name it (`--flag`, `field=`, `"field"` in the test function, its
decorators, or the module-level helpers, fixtures and constants it uses, two levels deep; not the tests of bad input
or --help, which stop at validation), those naming it themselves first, then tests/test_flags_observed.py's, then the
lightest, at most MAX_TESTS of them. One pytest process runs every mutant in turn (tests/flag_hook/flag_plan.py), each
like `pytest -x`, every fixture torn down between two mutants. Killed: a test failed while the mutant had changed a
value (which test, and whether by an assertion or an exception the wrong value caused). Survived: the tests passed;
"never active" when no selected test gave the flag a value other than its default (the hook counts each change).
Broken: every selected test ran past --test-timeout (a mutant that makes a run 10x longer). Equivalent: EQUIVALENT
below, each with its reason. Not run: --budget-s was spent first (the cheap mutants run first).

    python tests/flag_mutants.py                 # every flag; writes docs/mutants-flags.md, docs/mutants-flags.json
    python tests/flag_mutants.py --only Config.  # the mutants whose name starts with Config. (nothing written)
    python tests/flag_mutants.py --list          # the mutants and the tests each would run
    python tests/flag_mutants.py --only Config.seed --update   # rerun these, merged into the last run's pages

Exit status 0 when every flag mutant was killed or is declared equivalent, 1 otherwise, 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from mutant_scores import write_scores  # noqa: E402

TESTS = REPO / "tests"
HOOK = TESTS / "flag_hook"
MAX_TESTS = 3  # tests per flag: the cheapest that name it (-x stops at the first failure)
TEST_TIMEOUT_S = 150  # a test slower than this under a mutant neither kills it nor lets it survive: the next runs
# Heavy test code: a whole torchrun job, a compile, a sweep. Such tests run last for a flag, if at all.
HEAVY = ("torchrun(", "run_job", "jobs.", "nproc", "compile", "mark.slow", "fp32_noise_floor", "bench.", "tune.")
SKIP_MARKS = ("mark.gpu", "mark.stress", "needs_cuda", "cuda_devices")
# Tests of bad input and of --help name every flag but stop at validation, before any mutant applies
NOT_OBSERVING = re.compile(r"help|refus|bad_|hostile|one_line|rejected|invalid|error")
OBSERVED = "test_flags_observed.py"  # the tests written to observe a flag's value: tried first

# Flag mutants that no test can kill because the mutant computes exactly what the original computes. Each entry
# says why; a flag that only changes speed is not here: its observable effect (workers started, kernel chosen,
# bytes sent) is what a test must assert.
# "On a CPU-only host" entries are equivalent where no CUDA device exists (every CPU run, `make test`); on a GPU host
# they are not, and the gpu-marked tests are where they must be seen.
EQUIVALENT: dict[str, str] = {
    "Config.pin_memory": "on a CPU-only host: data.build_loader pins only for a CUDA device (pin and device.type == "
                         "'cuda'), so --pin-memory and its default both load unpinned batches",
    "Config.device": "on a CPU-only host: --device auto (the default) resolves to cpu, the only device there is",
    "EvalArgs.device": "on a CPU-only host: evaluate's --device auto resolves to cpu",
    "GenerateArgs.device": "on a CPU-only host: generate's --device auto resolves to cpu",
    "DataParallelConfig.output_device": "on a CPU-only host: every device of --devices cpu,cpu is the one cpu device, "
                                        "so the first of --devices (the default) is --output-device cpu",
    "DDPConfig.sync_bn": "on a CPU-only host: DDPConfig.validate refuses --sync-bn on the CPU (SyncBatchNorm needs "
                         "CUDA), so no run reaches the mutant",
    "ModelParallelConfig.devices": "on a CPU-only host: --devices auto is cpu,cpu, and any pair of CPU devices is "
                                   "the one cpu device twice",
    "PipelineConfig.dp": "PipelineConfig.validate accepts only --dp 1, the default (pipeline x data parallel is not "
                         "built)",
    "TensorParallelConfig.tp": "check_tp accepts --tp only as world size / --dp, which is what 0 (the default) "
                               "resolves to in mesh_shape, the one place that reads it",
    "PipelineConfig.stages": "PipelineConfig.validate accepts --stages only as the world size or 0 (the default), "
                             "and 0 means the world size: the same stages, one per rank; nothing else reads it",
    "DDPConfig.backend": "on a CPU-only host: --backend auto (the default) is gloo for the CPU, the one backend "
                         "there; nccl needs CUDA",
}


@dataclass
class FlagMutant:
    name: str  # Config.lr, parity.tol
    flag: str  # --lr
    spec: str  # FLAG_MUTANT's value
    field: str  # the dest / field name
    tool: str  # a module whose tests alone may name it ("" for the launch scripts' shared config)
    tests: list = dataclasses.field(default_factory=list)
    shared: bool = False  # another config class declares a field of this name (select_tests)


@dataclass
class Outcome:
    name: str
    status: str  # killed, survived, equivalent, broken
    test: str = ""
    how: str = ""  # assertion / the exception's type, or why it survived
    hits: int = 0
    seconds: float = 0.0
    ran: list = field(default_factory=list)


# ---------------------------------------------------------------------- the flags, from the parsers
def _modules():
    import manual_train

    for info in pkgutil.walk_packages(manual_train.__path__, "manual_train."):
        try:
            yield importlib.import_module(info.name)
        except Exception:  # an optional dependency (apex, matplotlib): its flags come from the classes it defines
            continue


# The tools' config classes: their tests are those that mention the tool's module (their field names are common words)
TOOL_CLASSES = {"EvalArgs": "evaluate", "GenerateArgs": "generate", "FindConfig": "find_batch_size",
                "TuneFlags": "tune"}


def flag_mutants() -> list[FlagMutant]:
    """Every flag of every config dataclass (fields declared with config.arg, by their declaring class) and of every
    module-level build_parser() in manual_train/."""
    from manual_train.config import _flag

    found: dict[str, FlagMutant] = {}
    for module in _modules():
        for obj in list(vars(module).values()):
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__.startswith("manual_train"):
                own = {f.name for f in dataclasses.fields(obj)} - {
                    f.name for base in obj.__mro__[1:] if dataclasses.is_dataclass(base)
                    for f in dataclasses.fields(base)}
                for f in dataclasses.fields(obj):
                    if f.name in own and "help" in f.metadata:
                        name = f"{obj.__name__}.{f.name}"
                        found.setdefault(name, FlagMutant(name, _flag(f.name), f"config:{obj.__name__}:{f.name}",
                                                          f.name, TOOL_CLASSES.get(obj.__name__, "")))
        build = vars(module).get("build_parser")
        # (config.build_parser builds the config classes' parsers, enumerated above from the classes themselves)
        if callable(build) and getattr(build, "__module__", "") == module.__name__ and module.__name__ != \
                "manual_train.config":
            parser = build()
            tool = module.__name__.split(".")[1]
            for action in parser._actions:
                if action.dest == "help" or not action.option_strings:
                    continue
                name = f"{tool}.{action.dest}"
                found.setdefault(name, FlagMutant(name, action.option_strings[-1],
                                                  f"argparse:{parser.prog}:{action.dest}", action.dest, tool))
    return sorted(found.values(), key=lambda m: m.name)


# ---------------------------------------------------------------------- the tests that name a flag
@dataclass
class TestText:
    node: str  # tests/test_x.py::test_y (or ::Class::test_y)
    file: str
    text: str  # the test, its decorators and the module-level code it uses
    own: str = ""  # the test and its decorators alone
    doc: str = ""  # its docstring: an observing test names there the flags whose values it checks


def _test_texts() -> list[TestText]:
    from manual_train.site import source_segments

    out = []
    for path in sorted(TESTS.glob("test_*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        segment = source_segments(source)
        top: dict[str, str] = {}

        def decorated(node) -> str:
            """A def or class with its decorators, one per line: text that parses again (used() reads its names;
            decorators glued to the `def` line made a SyntaxError, and a parametrized test or a fixture lost its
            helpers)."""
            return "\n".join([*(segment(d) or "" for d in node.decorator_list),
                              segment(node) or ""])

        for node in tree.body:
            seg = segment(node) or ""
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                top[node.name] = decorated(node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    for n in ast.walk(target):
                        if isinstance(n, ast.Name):
                            top[n.id] = seg

        def used(text: str, depth: int) -> str:
            if depth == 0:
                return ""
            try:
                names = {n.id for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Name)} | \
                    {a.arg for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef) for a in n.args.args}
            except SyntaxError:
                return ""
            return "".join(top[n] + used(top[n], depth - 1) for n in sorted(names) if n in top and top[n] != text)

        def add(fn, prefix: str, extra: str = "") -> None:
            text = decorated(fn) + extra
            out.append(TestText(f"tests/{path.name}::{prefix}{fn.name}", path.name, text + used(text, 2), text,
                                ast.get_docstring(fn) or ""))

        module_marks = "\n".join(segment(n) or "" for n in tree.body if isinstance(n, ast.Assign)
                                 and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets))
        if any(mark in module_marks for mark in SKIP_MARKS):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                add(node, "")
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test") and not any(
                    mark in (segment(node) or "") for mark in SKIP_MARKS):
                decorators = "".join("\n" + (segment(d) or "") for d in node.decorator_list)
                for fn in node.body:
                    if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test"):
                        add(fn, f"{node.name}::", decorators)
    return out


def names_flag(text: str, mutant: FlagMutant) -> bool:
    flag = re.escape(mutant.flag)
    no_flag = re.escape("--no-" + mutant.flag[2:])
    field_ = re.escape(mutant.field)
    return bool(re.search(rf"({flag}|{no_flag})(?![\w-])", text) or re.search(rf"\b{field_}\s*=(?!=)", text)
                or re.search(rf"[\"']{field_}[\"']", text))


def cost(t: TestText, m: FlagMutant) -> tuple:
    """A test of tests/test_flags_observed.py whose docstring names the flag (there a docstring says which flags'
    values the test checks) first; then one that names the flag
    itself before one whose helpers do; then, for a field that several config classes declare (--impl:
    DataParallelConfig's, HybridConfig's, ZeroConfig's), one that names the flag's own class; the observing tests,
    then the light ones. Without the first key, which of several tests passing `batch_size=` ran was decided by their
    lengths, and an edit elsewhere in a test file dropped --batch-size's observing test from its three."""
    owner = m.spec.split(":")[1] if m.spec.startswith("config:") and m.shared else ""
    says = t.file == OBSERVED and m.flag.startswith("--") and re.search(rf"{re.escape(m.flag)}(?![\w-])", t.doc)
    return (not says, not names_flag(t.own, m), not (owner and re.search(rf"\b{owner}\b", t.own)), t.file != OBSERVED,
            sum(h in t.text for h in HEAVY), len(t.text))


def select_tests(mutants: list[FlagMutant], max_tests: int = MAX_TESTS) -> None:
    texts = [t for t in _test_texts() if not any(s in t.text for s in SKIP_MARKS)
             and not NOT_OBSERVING.search(t.node.split("::")[-1]) and t.file != "test_hostile_flags.py"]
    def loop_class(m):  # a launch script's own config class (not the shared base Config, not a tool's)
        return m.spec.startswith("config:") and not m.tool and m.spec.split(":")[1] != "Config"

    fields = [m.field for m in mutants if loop_class(m)]
    for m in mutants:
        m.shared = loop_class(m) and fields.count(m.field) > 1
    for m in mutants:
        pool = [t for t in texts if not m.tool or m.tool in t.text or m.tool in t.file]
        chosen = sorted((t for t in pool if names_flag(t.text, m)), key=lambda t: cost(t, m))
        m.tests = [t.node for t in chosen[:max_tests]]


# ---------------------------------------------------------------------- running the mutants
def run_plan(mutants: list[FlagMutant], test_timeout_s: int, deadline: float) -> dict[str, Outcome]:
    """Every mutant in one pytest process (tests/flag_hook/flag_plan.py); a process that dies mid-plan (a crash of
    pytest itself) leaves its finished entries, the entry it was in is broken, and a new process takes the rest."""
    outcomes = {m.name: Outcome(m.name, "equivalent", how=EQUIVALENT[m.name]) for m in mutants if m.name in EQUIVALENT}
    outcomes.update({m.name: Outcome(m.name, "survived", how="no test names the flag") for m in mutants
                     if m.name not in outcomes and not m.tests})
    todo = sorted((m for m in mutants if m.name not in outcomes),  # the cheap ones first (a --budget-s may end it)
                  key=lambda m: (not all(OBSERVED in t for t in m.tests), len(m.tests)))
    with tempfile.TemporaryDirectory(prefix="flag-mutants-") as tmp:
        while todo:
            plan, results = Path(tmp) / "plan.json", Path(tmp) / "results.jsonl"
            plan.write_text(json.dumps([dict(name=m.name, spec=m.spec, tests=m.tests) for m in todo]))
            results.unlink(missing_ok=True)
            env = {**os.environ, "FLAG_MUTANT": "", "FLAG_PLAN": str(plan), "FLAG_DEADLINE": str(deadline), "FLAG_RESULTS": str(results),
                   "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([str(HOOK), str(REPO)])}
            nodes = list(dict.fromkeys(t for m in todo for t in m.tests))
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "flag_plan",
                   f"--timeout={test_timeout_s}", *nodes]
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
            done = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
            for r in done:
                r.pop("slow", None)
                outcomes[r["name"]] = Outcome(**r)
                o = outcomes[r["name"]]
                print(f"{o.name}: {o.status.upper()} in {o.seconds:.0f} s" + (f" by {o.test}" if o.test else "")
                      + f" ({o.how})", flush=True)
            rest = todo[len(done):]
            if rest:  # the process ended inside rest[0]
                tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
                outcomes[rest[0].name] = Outcome(rest[0].name, "broken", how=f"pytest ended (exit {proc.returncode}) "
                                                 f"inside this mutant's tests: {tail[0][:150]}", ran=rest[0].tests)
                print(f"{rest[0].name}: BROKEN ({outcomes[rest[0].name].how})", flush=True)
            todo = rest[1:]
    return outcomes


# ---------------------------------------------------------------------- the page and the score
def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def machine() -> dict:
    import torch

    from manual_train.bench.report import _cpu_model

    return {"date": time.strftime("%Y-%m-%d"), "cpu": f"{os.cpu_count()} cores of {_cpu_model()}, ATen "
            f"{torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}"}


def score(outcomes: list[Outcome], seconds: float) -> dict:
    count = {s: sum(o.status == s for o in outcomes) for s in ("killed", "equivalent", "survived", "broken", "not run")}
    total = len(outcomes)
    return {**machine(), "total": total, "killed": count["killed"], "equivalent": count["equivalent"],
            "survived": count["survived"] + count["broken"], "not_run": count["not run"],
            "score": round((count["killed"] + count["equivalent"]) / total, 4) if total else 0.0,
            "wall_s": round(seconds)}


def page(mutants: list[FlagMutant], outcomes: dict, result: dict) -> str:
    lines = ["# Flag mutants: is every flag's value observed?", "",
             "Generated by `make mutants-flags` (tests/flag_mutants.py). One mutant per user-facing flag, enumerated "
             "from the parsers", "themselves (every config.arg() field of every config class, every option of the "
             "tools' argparse parsers): the", "mutant ignores the user's value (after validation the value becomes "
             "the script's default; for a boolean the user", "set, its opposite), in every process the tests start "
             "(tests/flag_hook/sitecustomize.py). Each ran against the tests", f"that name the flag (at most "
             f"{MAX_TESTS}, `pytest -x` style). Killed by an assertion, or by an error the wrong value caused;",
             "survived when the tests passed (\"never active\": no selected test set the flag to another value than "
             "its", "default); broken when every selected test ran past the per-test time limit; equivalent: declared "
             "in", "tests/flag_mutants.py's EQUIVALENT, with the reason; not run: the run's --budget-s was spent "
             "first.", "",
             f"Measured {result['date']} on {result['cpu']}; {result['wall_s']} s of mutant runs (with --update: the "
             "runs merged, each mutant's own time).", "",
             f"**{result['killed']} killed, {result['equivalent']} equivalent, {result['survived']} survived, "
             f"{result['not_run']} not run (the --budget-s was spent first), of {result['total']} flags.**", "",
             "| mutant | flag | result | by | how |", "|---|---|---|---|---|"]
    for m in mutants:
        o = outcomes[m.name]
        lines.append(f"| `{m.name}` | `{m.flag}` | {o.status} | {f'`{o.test}`' if o.test else '-'} | "
                     f"{_cell(o.how) or '-'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--only", default="", help="the mutants whose name starts with this, or one of these (comma-separated; a "
                        "mutant's whole name selects it alone; nothing written unless --update)")
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests, run nothing")
    parser.add_argument("--update", action="store_true", help="with --only: merge these outcomes into the pages of "
                        "the last full run (docs/mutants-flags.json) and rewrite them")
    parser.add_argument("--test-timeout", type=int, default=TEST_TIMEOUT_S, help="seconds one test may take before "
                        "it counts as neither kill nor pass (default: %(default)s)")
    parser.add_argument("--budget-s", type=float, default=0, help="start no mutant after this many seconds; the "
                        "rest are 'not run' (default: no limit)")
    parser.add_argument("--merge-results", metavar="JSONL", help="with --update: also take the outcomes of a run that "
                        "was stopped, from the results file its flag_plan plugin wrote (FLAG_RESULTS)")
    parser.add_argument("--max-tests", type=int, default=MAX_TESTS, help="tests per flag (default: %(default)s)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    mutants = flag_mutants()
    stale = sorted(set(EQUIVALENT) - {m.name for m in mutants})
    if stale:
        print(f"error: EQUIVALENT names flags that do not exist: {stale}", file=sys.stderr)
        return 2
    select_tests(mutants, args.max_tests)
    wanted = args.only.split(",")
    exact = {m.name for m in mutants} & set(wanted)  # Config.loss is that one, not also Config.loss_scale_init
    selected = [m for m in mutants if m.name in exact or m.name.startswith(tuple(set(wanted) - exact))]
    if not selected:
        print(f"error: --only {args.only!r} matches no flag mutant", file=sys.stderr)
        return 2
    if args.list:
        for m in selected:
            print(f"{m.name:40} {m.flag:30} {'EQUIVALENT' if m.name in EQUIVALENT else len(m.tests)}")
            for t in m.tests:
                print(f"    {t}")
        print(f"{len(selected)} flag mutants")
        return 0
    started = time.perf_counter()
    outcomes = run_plan(selected, args.test_timeout, time.time() + args.budget_s if args.budget_s else 0)
    seconds = time.perf_counter() - started
    saved = REPO / "docs" / "mutants-flags.json"
    if args.update:  # the last run's outcomes (and a stopped run's), these replaced (their times summed anew)
        earlier = json.loads(saved.read_text())["mutants"] if saved.exists() else {}
        if args.merge_results:
            for line in Path(args.merge_results).read_text().splitlines():
                r = json.loads(line)
                r.pop("slow", None)
                if r["status"] != "not run" or r["name"] not in earlier:
                    earlier[r["name"]] = r
        kept = {n: Outcome(**o) for n, o in earlier.items() if n not in outcomes or
                (outcomes[n].status == "not run" and o["status"] != "not run")}
        seconds += sum(o.seconds for o in kept.values())
        outcomes = {**outcomes, **kept}
        outcomes.update({m.name: Outcome(m.name, "not run", how="not run yet") for m in mutants
                         if m.name not in outcomes})
        selected = mutants
    result = score(list(outcomes.values()), seconds)
    bad = [o for o in outcomes.values() if o.status not in ("killed", "equivalent")]  # (not run: not proven)
    print(f"{result['killed']} killed, {result['equivalent']} equivalent, {result['survived']} survived of "
          f"{len(outcomes)} in {seconds:.0f} s" + "".join(f"\n  {o.status.upper()}: {o.name}: {o.how}" for o in bad))
    if not args.only or args.update:
        result["mutants"] = {n: dataclasses.asdict(o) for n, o in sorted(outcomes.items())}
        (REPO / "docs" / "mutants-flags.md").write_text(page(selected, outcomes, result))
        saved.write_text(json.dumps(result, indent=1) + "\n")
        write_scores()
        print("wrote docs/mutants-flags.md, docs/mutants-flags.json and the scores in docs/mutants.md")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
