"""The tuner's decisions, without running anything: which levers to try, which candidate wins, what fits the budget.

A Setup is one way to launch the same training (processes, threads, per-process batch, flags added to the user's).
`search` walks the levers in order, exact ones first: it runs the current best Setup and each candidate side by side
(A B C A B C), and keeps a candidate only when it is faster than the current best by more than the measured noise
(`decide`). `run(setup, timeout_s, lever)` and `clock()` are given, so the tests drive it with a fake cost model.
"""
from __future__ import annotations

import math
import shlex
import statistics
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

MIN_NOISE = 0.03  # a kept lever must be at least 3% faster, whatever the trials' spread: less is not worth a flag
COMPILE_GUESS_S = 60.0  # a compile trial's extra wall time before one was seen (17-58 s on a 2-core CPU)
TRIAL_LIMIT = 3.0  # a trial is stopped at this many times its estimated wall time
MIN_ONCE_S = 10.0  # no run that trains for less than this can pay back a compile (tens of seconds on CPU and GPU)


@dataclass(frozen=True)
class Setup:
    """One launch of the user's training: `ranks` processes (1: python launch/single.py, more: torchrun
    launch/ddp.py), OMP_NUM_THREADS=`threads` each, --batch-size `batch` per process, and `flags` set on top of the
    user's flags ((flag, value) pairs; value None for a switch such as --static-graph)."""

    ranks: int
    threads: int
    batch: int
    flags: tuple = ()

    def with_flags(self, *pairs) -> "Setup":
        names = {flag for flag, _ in pairs}
        return replace(self, flags=tuple(p for p in self.flags if p[0] not in names) + tuple(pairs))

    def flag(self, name: str, default=None):
        return next((value for flag, value in self.flags if flag == name), default)


def flag_names(argv) -> set:
    """The flags a user's argv sets, as --name (--no-name counts as --name; --name=value as --name)."""
    names = set()
    for token in argv:
        if token.startswith("--"):
            name = token.split("=", 1)[0]
            names.add("--" + name[5:] if name.startswith("--no-") else name)
    return names


def _set(argv: list, flag: str, value) -> list:
    """argv with `flag` set to value: replaced where the user gave it, else appended (a switch is appended once)."""
    out, i, found = [], 0, False
    while i < len(argv):
        token = argv[i]
        if value is not None and token == flag and i + 1 < len(argv):
            out += [flag, str(value)]
            i, found = i + 2, True
            continue
        if value is not None and token.startswith(flag + "="):
            out.append(f"{flag}={value}")
            found = True
        else:
            out.append(token)
        i += 1
    if value is None:
        return out if flag in out else out + [flag]
    return out if found else out + [flag, str(value)]


def command(setup: Setup, user_argv: list, default_batch: int) -> dict:
    """{"env": {...}, "argv": [...]}: the Setup as a command run from the repository root. The user's flags stay, in
    their order; --batch-size is rewritten to the per-process value where it differs from what they get unasked
    (`default_batch`: their --batch-size, or the baseline's default); the lever flags follow."""
    argv = list(user_argv)
    if setup.ranks > 1 or setup.batch != default_batch or "--batch-size" in flag_names(user_argv):
        argv = _set(argv, "--batch-size", setup.batch)  # launch/ddp.py's own default (8) is never relied on
    for flag, value in setup.flags:
        argv = _set(argv, flag, value)
    head = ["python", "launch/single.py"] if setup.ranks == 1 else \
        ["torchrun", f"--nproc_per_node={setup.ranks}", "launch/ddp.py"]
    return {"env": {"OMP_NUM_THREADS": str(setup.threads)}, "argv": head + argv}


def shell_line(cmd: dict) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in cmd["env"].items())
    return f"{env} {shlex.join(cmd['argv'])}".strip()


def describe(setup: Setup, reference: Setup) -> str:
    """What a Setup changes against the reference, for the table: '2 ranks x 1 thread --num-workers 1'."""
    parts = []
    if (setup.ranks, setup.threads) != (reference.ranks, reference.threads):
        parts.append(f"{setup.ranks} rank{'s' * (setup.ranks > 1)} x {setup.threads} thread{'s' * (setup.threads > 1)}")
    if setup.batch * setup.ranks != reference.batch * reference.ranks:
        parts.append(f"global batch x{setup.batch * setup.ranks // (reference.batch * reference.ranks)}")
    parts += [flag if value is None else f"{flag} {value}" for flag, value in setup.flags
              if (flag, value) not in reference.flags]
    return " ".join(parts) or "(as the reference)"


# ---------------------------------------------------------------------- the levers
@dataclass
class Context:
    """What the levers depend on: the machine and the user's run."""

    cores: int
    gpus: int = 0  # CUDA devices the run would use (0: it trains on the CPU)
    fast_bf16: bool = False  # AVX512-BF16/AMX in the CPU flags, or a GPU
    bf16_note: str = ""  # why bf16 is not tried, when it is not
    accumulate: int = 1  # the user's run: --accumulate, the training set's size, --optimizer, ...
    train_samples: int = 1500
    optimizer: str = "sgd"
    lr_scaling: str = "none"
    precision: str = "32-true"


@dataclass
class Lever:
    """A family of alternatives. `options(current)` gives (candidates, why none) for the current best Setup;
    `metric`: "train" (steady seconds per training sample) or "eval" (seconds per evaluation); `kind`: "exact"
    (trains the same model) or "change" (changes the optimisation: used only with --allow-changes)."""

    name: str
    kind: str
    owns: tuple  # its flags: a user who set one of them fixed it
    options: Callable
    metric: str = "train"
    pays_once: bool = False  # a one-time cost (compile_s) that the run's samples must pay back


def levers(ctx: Context) -> list:
    """Every lever, in the order tried: exact ones first, the cheap before the costly, then the changes."""
    def layouts(cur: Setup):
        micro = cur.batch * cur.ranks  # samples per micro-step over all ranks: kept equal
        ranks = sorted({1, ctx.gpus} if ctx.gpus else {r for r in (1, 2, 4) if r <= ctx.cores})
        pairs = [(r, max(1, ctx.cores // r)) for r in ranks]
        if not ctx.gpus and ctx.cores >= 2:
            pairs.append((1, ctx.cores // 2))  # fewer threads: OpenMP's spinning threads lose on a busy machine
        found = [Setup(r, t, micro // r, cur.flags) for r, t in dict.fromkeys(pairs) if micro % r == 0]
        why = ("one GPU: one process" if ctx.gpus else "one core: nothing to split") if len(pairs) == 1 else \
            f"the global micro-batch {micro} does not split over {' or '.join(str(r) for r in ranks if r > 1)} ranks"
        return [s for s in found if (s.ranks, s.threads) != (cur.ranks, cur.threads)], why

    def workers(cur):
        counts = [1, 2] + ([4] if ctx.cores // cur.ranks >= 8 else [])
        return [cur.with_flags(("--num-workers", str(n)), ("--persistent-workers", None)) for n in counts], ""

    def prefetch(cur):
        if cur.flag("--num-workers", "0") == "0":
            return [], "needs worker processes (none chosen)"
        return [cur.with_flags(("--prefetch-factor", "4"))], ""

    def pinning(cur):
        if not ctx.gpus:
            return [], "no GPU: pinned memory only speeds host-to-GPU copies"
        return [cur.with_flags(("--no-pin-memory", None))], ""  # pinned is the default on CUDA

    def impl(cur):
        return [cur.with_flags(("--optimizer-impl", name)) for name in ("foreach", "for-loop")], ""

    def ddp_knobs(cur):
        if cur.ranks == 1:
            return [], "DDP's knobs: DDP was not chosen"
        view, static = ("--gradient-as-bucket-view", None), ("--static-graph", None)
        return [cur.with_flags(view), cur.with_flags(static), cur.with_flags(view, static)], ""

    def eval_mode(cur):
        return [cur.with_flags(("--eval-mode", "inference"))], ""

    def compile_(cur):
        return [cur.with_flags(("--compile", mode)) for mode in ("model", "blocks")], ""

    def batch(cur):
        lr = () if ctx.lr_scaling != "none" else (
            ("--lr-scaling", "linear" if ctx.optimizer == "sgd" else "sqrt"),
            ("--base-batch-size", str(cur.batch * cur.ranks * ctx.accumulate)))  # --lr stays the LR at today's batch
        found = [replace(cur.with_flags(*lr), batch=cur.batch * f) for f in (2, 4)
                 if cur.batch * f * cur.ranks <= ctx.train_samples]
        return found, "a larger batch would exceed the training set"

    def precision(cur):
        if ctx.precision != "32-true":
            return [], f"--precision {ctx.precision} given"
        if not ctx.fast_bf16:
            return [], ctx.bf16_note or "no fast bf16 kernels here"
        return [cur.with_flags(("--precision", "bf16-mixed"))], ""

    return [
        Lever("layout", "exact", (), layouts),
        Lever("loader", "exact", ("--num-workers", "--persistent-workers"), workers),
        Lever("prefetch", "exact", ("--prefetch-factor",), prefetch),
        Lever("pin-memory", "exact", ("--pin-memory",), pinning),
        Lever("optimizer-impl", "exact", ("--optimizer-impl",), impl),
        Lever("ddp-knobs", "exact", ("--gradient-as-bucket-view", "--static-graph"), ddp_knobs),
        Lever("eval-mode", "exact", ("--eval-mode",), eval_mode, metric="eval"),
        Lever("compile", "exact", ("--compile",), compile_, pays_once=True),
        Lever("batch-size", "change", (), batch),
        Lever("precision", "change", ("--precision",), precision),
    ]


LEVERS = tuple(lever.name for lever in levers(Context(cores=1)))


# ---------------------------------------------------------------------- one trial, and the decision
@dataclass
class Trial:
    """What one short training run measured (wall seconds; None where it has no such number)."""

    ok: bool
    sample_s: Optional[float] = None  # steady seconds per training sample (trials.read_metrics)
    noise: float = 0.0  # the spread of those intervals: half the interquartile range of their logarithms
    eval_s: Optional[float] = None  # seconds per evaluation (the median after the first)
    eval_noise: float = 0.0
    compile_s: float = 0.0  # summary.json's compile_s: the first row's excess over the steady rate
    peak_mem_bytes: Optional[int] = None
    error: str = ""
    timed_out: bool = False  # stopped at its time limit (ok if the rows it wrote still time it)
    lever: str = ""
    label: str = ""
    round: int = 0
    wall_s: float = 0.0
    command: dict = field(default_factory=dict)

    def value(self, metric: str) -> Optional[float]:
        return (self.sample_s if metric == "train" else self.eval_s) if self.ok else None

    def spread(self, metric: str) -> float:
        return self.noise if metric == "train" else self.eval_noise


def repeat_noise(trials: list, metric: str = "train") -> float:
    """How much one command's time varied between its runs: half the range of the logarithms (0 with one run)."""
    logs = [math.log(t.value(metric)) for t in trials if t.value(metric)]
    return (max(logs) - min(logs)) / 2 if len(logs) > 1 else 0.0


def decide(reference: list, candidates: dict, metric: str = "train", *, pays_once: bool = False,
           run_samples: Optional[float] = None, floor: float = MIN_NOISE, repeat: float = 0.0) -> tuple:
    """The winner among `candidates` ({label: [Trial per round]}) against `reference` ([Trial per round], run next to
    it in each round), or None. Times compare as logarithms (a ratio's noise is a factor either way): a candidate's
    effect is the median over rounds of log(its time / the reference's); its noise the largest of half the range of
    those logs, the step-to-step spread inside its trials and inside the reference's (Trial.noise), `repeat` (how
    much the reference's own time varied between all its runs: repeat_noise) and log(1 / (1 - floor)). It is faster
    when effect < -noise; one that `pays_once` (compile) is kept only if the time it saves over the run's
    `run_samples` exceeds its one-time cost. Returns (label or None, {label: verdict}); a verdict's `speed` is the
    reference's time over the candidate's (1.25: 25% faster), `noise` a fraction (0.05: 5%)."""
    verdicts, best = {}, None
    for label, trials in candidates.items():
        pairs = [(r, c) for r, c in zip(reference, trials) if r.value(metric) and c.value(metric)]
        if not pairs:
            error = next((t.error for t in [*trials, *reference] if not t.ok), "") or f"no {metric} time measured"
            verdicts[label] = {"verdict": "failed", "error": error}
            continue
        logs = [math.log(c.value(metric) / r.value(metric)) for r, c in pairs]
        effect = statistics.median(logs)
        noise = max((max(logs) - min(logs)) / 2, -math.log(1 - floor), repeat,
                    *(statistics.median(t.spread(metric) for t in side) for side in zip(*pairs)))
        verdict = {"speed": math.exp(-effect), "noise": math.exp(noise) - 1, "rounds": len(pairs),
                   "value": statistics.median(c.value(metric) for _, c in pairs)}
        verdict["verdict"] = "slower" if effect > noise else "within noise" if effect >= -noise else "faster"
        if verdict["verdict"] == "faster" and pays_once and run_samples:
            once = statistics.median(c.compile_s for _, c in pairs)
            saved = statistics.median(r.value(metric) - c.value(metric) for r, c in pairs) * run_samples
            verdict.update(one_time_s=once, saved_s=saved)
            if saved <= once:
                verdict["verdict"] = "does not pay back"
        if verdict["verdict"] == "faster" and (best is None or verdict["speed"] > verdicts[best]["speed"]):
            best = label
        verdicts[label] = verdict
    if best:
        verdicts[best]["verdict"] = "kept"
    return best, verdicts


# ---------------------------------------------------------------------- the search
def fit_budget(reference_s: float, option_s: list, remaining_s: float, rounds: int) -> tuple:
    """(rounds, options) that fit: every option if possible, then as many rounds as fit; (0, 0) when not even the
    reference and one option fit once."""
    for k in range(len(option_s), 0, -1):
        for r in range(rounds, 0, -1):
            if r * (reference_s + sum(option_s[:k])) <= remaining_s:
                return r, k
    return 0, 0


@dataclass
class Result:
    reference: Setup
    best: Setup
    decisions: list  # one dict per lever: name, kind, status (kept, not kept, skipped), reason, candidates
    trials: list
    elapsed_s: float


class TuneFailed(Exception):
    """The reference itself could not be measured."""


def search(lever_list: list, reference: Setup, run: Callable, *, budget_s: float, trial_s: float,
           clock: Callable, rounds: int = 2, allow_changes: bool = False, given: set = frozenset(),
           check: Callable = lambda setup: None, run_samples: Optional[float] = None,
           progress: Callable = lambda text: None) -> Result:
    """Try each lever on top of the best Setup so far; `run(setup, timeout_s, lever) -> Trial` measures one
    (`lever` "warm-up" for the first, which fixes the trial length and is not compared), `check(setup)` says why a
    Setup is refused (or None). No trial starts that its estimate says would end after budget_s, and each is given
    the time left as its limit (a candidate at most TRIAL_LIMIT times its estimate), so the search ends within
    budget_s on `clock`."""
    state = _Search(run, clock, budget_s, trial_s, progress)
    warm = state.measure(reference, "warm-up", "reference", 0)
    if warm.timed_out and not warm.ok:  # nothing measured: the reference stands, every lever untried
        decisions = [{"lever": lever.name, "kind": lever.kind, "metric": lever.metric, "candidates": [],
                      "status": "skipped", "reason": "budget: the reference's first run did not end within it"}
                     for lever in lever_list]
        return Result(reference, reference, decisions, state.trials, state.elapsed())
    if not warm.ok:
        raise TuneFailed(f"the reference run failed: {warm.error}")
    best, decisions = reference, []
    for lever in lever_list:
        record = {"lever": lever.name, "kind": lever.kind, "metric": lever.metric, "candidates": []}
        decisions.append(record)
        fixed = sorted(set(lever.owns) & set(given))
        whole = state.run_time(best, run_samples)
        if lever.kind == "change" and not allow_changes:
            record.update(status="skipped", reason="changes the optimisation: tried only with --allow-changes")
        elif fixed:
            record.update(status="skipped", reason=f"fixed by your {', '.join(fixed)}")
        elif lever.pays_once and whole is not None and whole < MIN_ONCE_S:
            record.update(status="skipped", reason=f"your run trains ~{whole:.0f} s in all; a compile alone takes "
                                                   f"more than {MIN_ONCE_S:.0f} s, so it cannot pay back")
        else:
            best = state.try_lever(lever, best, record, rounds=rounds, check=check, run_samples=run_samples)
    return Result(reference, best, decisions, state.trials, state.elapsed())


class _Search:
    """The search's state: the clock and budget, every trial so far, and each Setup's runs (for the estimates and the
    between-runs noise)."""

    def __init__(self, run: Callable, clock: Callable, budget_s: float, trial_s: float, progress: Callable):
        self.run, self.clock, self.budget_s, self.trial_s, self.progress = run, clock, budget_s, trial_s, progress
        self.t0, self.trials, self.walls, self.runs = clock(), [], {}, {}

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def measure(self, setup: Setup, lever: str, label: str, round_: int) -> Trial:
        self.progress(f"{lever}: {label}")
        start, limit = self.clock(), max(self.left(), 0.0)
        if lever != "warm-up":  # a candidate far slower than planned is stopped and timed from what it logged
            limit = min(limit, TRIAL_LIMIT * self.estimate(setup))
        trial = self.run(setup, limit, lever)
        trial.lever, trial.label, trial.round, trial.wall_s = lever, label, round_, self.clock() - start
        if lever != "warm-up":
            self.walls.setdefault(_cost_key(setup), []).append(trial.wall_s)
        self.runs.setdefault(setup, []).append(trial)
        self.trials.append(trial)
        return trial

    def estimate(self, setup: Setup) -> float:
        """The wall time of this kind of Setup's last trial, else a guess from the single-process ones (the warm-up
        trains less than trial_s): more for more processes (each starts torch), more for a compile."""
        seen = self.walls.get(_cost_key(setup))
        if seen:
            return seen[-1]
        one = self.walls.get((1, "none"), [self.trials[0].wall_s + self.trial_s])[-1]
        guess = one * (1 + 0.5 * (setup.ranks - 1))
        return guess + (COMPILE_GUESS_S if setup.flag("--compile", "none") != "none" else 0.0)

    def run_time(self, setup: Setup, run_samples: Optional[float]) -> Optional[float]:
        """How long the user's whole run would train at this Setup's last measured speed."""
        done = [t.sample_s for t in self.runs.get(setup, []) if t.value("train")]
        return done[-1] * run_samples if done and run_samples else None

    def try_lever(self, lever: Lever, best: Setup, record: dict, *, rounds: int, check: Callable,
                  run_samples: Optional[float]) -> Setup:
        """One lever: its candidates checked, fitted to the budget, run interleaved with the current best, decided;
        fills `record` and returns the new best."""
        options, why_none = lever.options(best)
        checked = [(s, check(s)) for s in options]
        options = [s for s, why in checked if why is None]
        refused = {describe(s, best): why for s, why in checked if why is not None}
        if refused:
            record["refused"] = refused
        if not options:
            record.update(status="skipped", reason="; ".join(sorted(set(refused.values()))) or why_none)
            return best
        n_rounds, k = fit_budget(self.estimate(best), [self.estimate(s) for s in options], self.left(), rounds)
        if k == 0:
            record.update(status="skipped", reason=f"budget: {max(self.left(), 0):.0f} s left, one round needs "
                                                   f"~{self.estimate(best) + self.estimate(options[0]):.0f} s")
            return best
        labels = {describe(s, best): s for s in options[:k]}
        measured = {"current": [], **{label: [] for label in labels}}
        for round_ in range(1, n_rounds + 1):  # interleaved: current, A, B, current, A, B, ...
            for label, setup in [("current", best), *labels.items()]:
                if round_ > 1 and self.estimate(setup) > self.left():  # slower than planned: the round is cut
                    record["cut"] = "budget"
                    break
                measured[label].append(self.measure(setup, lever.name, label, round_))
        current = measured.pop("current")
        repeat = repeat_noise(self.runs[best], lever.metric)  # every run of the current best, warm-up included
        winner, verdicts = decide(current, measured, lever.metric, pays_once=lever.pays_once,
                                  run_samples=run_samples, repeat=repeat)
        record.update(rounds=n_rounds, repeat_noise=math.exp(repeat) - 1,
                      candidates=[{"label": label, **verdicts[label]} for label in labels])
        if len(labels) < len(options):
            record["untried"] = [describe(s, best) for s in options[k:]]
        if not winner:
            record.update(status="not kept", reason="no candidate beat the current setup by more than the noise")
            return best
        record.update(status="kept", chosen=winner, flags=_added(labels[winner], best))
        return labels[winner]


def _cost_key(setup: Setup) -> tuple:
    return setup.ranks, setup.flag("--compile", "none")  # a larger batch trains as many samples: as long


def _added(setup: Setup, reference: Setup) -> list:
    return [flag if value is None else f"{flag} {value}" for flag, value in setup.flags
            if (flag, value) not in reference.flags]
