"""The tuner's command line: every flag checked before the first trial, the search run, the table printed and
DIR/tune.json written. Exit status: 0 done, 1 the reference run itself failed, 2 bad input (one `error:` line,
nothing written), 130 interrupted.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import manual_train.tune as package
from manual_train.config import Config, UsageError, arg, build_parser, check_bounds, check_writable_dir, parse_config
from manual_train.tune.search import (LEVERS, Context, Setup, TuneFailed, command, flag_names, levers, search,
                                      shell_line)

MEASURE = ("steady wall seconds per training sample, pooled over the intervals between metrics.csv training rows, "
           "leaving out the first row (start-up, compile, workers starting) and every interval that spans an "
           "evaluation; eval-mode by seconds per evaluation")
# Training flags a trial cannot take: they resume, shorten, or slow every step with recording
REFUSED = {"--resume": "a trial starts from scratch", "--fast-dev-run": "one step cannot be timed",
           "--trace-dir": "records every step's weights: it would be timed too",
           "--profile": "profiles a window of steps: it would be timed too", "--profile-steps": "is --profile's"}
EPILOG = """\
Reading the table: each lever's candidates ran next to the current best (the reference with the levers kept so far),
in --rounds interleaved rounds; `speed` is the current best's time over the candidate's (1.20x: 20% faster),
the median over rounds; `noise` the largest of half the spread of those ratios, the step-to-step spread inside the
trials, how much the current best's own runs varied (shown on its line), and 3%. kept: faster by more than the noise
(and for --compile: its one-time compile pays back over your run's samples). A lever is skipped when it does not
apply, when you set its flag, or when the budget is spent."""


@dataclass
class TuneFlags:
    """The tuner's own flags; the others on the line are training flags (launch/single.py's)."""

    budget_s: float = arg(180.0, "wall seconds for all trials together; no trial starts that would end after it",
                          min=0, min_exclusive=True, max=86400)
    out: Optional[str] = arg(None, "write DIR/tune.json (default: runs/tune-<YYYYmmdd-HHMMSS>)", metavar="DIR")
    allow_changes: bool = arg(False, "also try the levers that change the optimisation (a larger global batch with "
                                     "--lr-scaling; bf16-mixed where the hardware has fast bf16), reported apart")
    rounds: int = arg(2, "interleaved rounds per lever: each candidate runs this often next to the current best",
                      min=1, max=10)
    trial_s: float = arg(2.0, "steady training seconds per trial (start-up and evaluations come on top)",
                         min=0, min_exclusive=True, max=3600)
    levers: Optional[str] = arg(None, "try only these levers (default: all): " + ",".join(LEVERS),
                                metavar="NAME,...")
    progress: bool = arg(True, "a tqdm bar over the budget (on a terminal)")


@dataclass
class Job:
    flags: TuneFlags
    cfg: Config
    user_argv: list
    out: Path
    machine: dict
    context: Context
    run_samples: float
    train_samples: int


def prepare(argv) -> Job:
    """Parse and check everything; raise UsageError. Nothing is written (the writability probes remove theirs)."""
    parser = build_parser(TuneFlags, prog="python -m manual_train.tune", description=package.__doc__)
    parser.epilog = EPILOG
    args, user_argv = parser.parse_known_args(argv)
    flags = TuneFlags(**vars(args))
    check_bounds(flags)
    for name in (flags.levers.split(",") if flags.levers is not None else []):
        if name not in LEVERS:
            raise UsageError("--levers", f"unknown lever {name!r}", ", ".join(LEVERS))
    for flag in sorted(flag_names(user_argv) & set(REFUSED)):
        raise UsageError(flag, f"not for the tuner: {REFUSED[flag]}", "the flags of a training run")
    cfg = parse_config(Config, user_argv, prog="launch/single.py")
    out = Path(flags.out or Path("runs") / f"tune-{time.strftime('%Y%m%d-%H%M%S')}")
    check_writable_dir(str(out), "--out")
    if (out / "tune.json").exists():
        raise UsageError("--out", f"{out} already holds a tune.json (nothing is overwritten)", "a new folder")

    import torch

    from manual_train import data

    on_cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    from manual_train.tune.trials import machine as read_machine

    machine = read_machine(on_cuda)
    train_samples = len(data.build_datasets(cfg)[0])
    gpus = len(machine["gpus"]) if cfg.device in ("auto", "cuda") else int(on_cuda)
    note = "" if machine["fast_bf16"] else (
        "this GPU has no fast bf16 kernels" if on_cuda else
        "no AVX512-BF16 or AMX in /proc/cpuinfo and no GPU: bf16 would run in emulated kernels, slower")
    ctx = Context(cores=machine["cores"], gpus=gpus, fast_bf16=machine["fast_bf16"], bf16_note=note,
                  accumulate=cfg.accumulate, train_samples=train_samples, optimizer=cfg.optimizer,
                  lr_scaling=cfg.lr_scaling, precision=cfg.precision)
    steps = cfg.max_steps or cfg.epochs * data.steps_per_epoch(data.limit_train(train_samples, cfg), cfg.batch_size,
                                                               cfg.accumulate)
    return Job(flags, cfg, list(user_argv), out, machine, ctx, steps * cfg.batch_size * cfg.accumulate, train_samples)


def checker(job: Job):
    """check(setup): why the script refuses the Setup's flags (a UsageError's line), or None."""
    from manual_train.distributed import DDPConfig

    scratch = str(Path(tempfile.gettempdir()) / f"tune-check-{os.getpid()}")  # never created

    def check(setup: Setup) -> Optional[str]:
        argv = command(setup, job.user_argv, job.cfg.batch_size)["argv"]
        at = next(i for i, a in enumerate(argv) if a.endswith(".py"))
        try:
            parse_config(DDPConfig if setup.ranks > 1 else Config, argv[at + 1:] + ["--out-dir", scratch], quiet=True)
        except UsageError as e:
            return str(e)
        except SystemExit:
            return "refused by the script's flag parser"
        return None

    return check


def run(job: Job):
    from tqdm import tqdm

    from manual_train import data
    from manual_train.tune.trials import Runner

    def steps_per_epoch(setup: Setup) -> int:
        micro = setup.batch * setup.ranks
        return data.steps_per_epoch(data.limit_train(job.train_samples, job.cfg, micro), micro, job.cfg.accumulate)

    reference = Setup(ranks=1, threads=job.context.cores, batch=job.cfg.batch_size)
    chosen = set((job.flags.levers or ",".join(LEVERS)).split(","))
    lever_list = [lever for lever in levers(job.context) if lever.name in chosen]
    t0 = time.monotonic()
    bar = tqdm(total=round(job.flags.budget_s), unit="s", disable=None if job.flags.progress else True,
               bar_format="{l_bar}{bar}| {n:.0f}/{total} s {postfix}")

    def tick() -> None:
        bar.n = min(round(time.monotonic() - t0), bar.total)
        bar.refresh()

    with tempfile.TemporaryDirectory(prefix="tune-") as work:
        runner = Runner(job.user_argv, job.cfg.batch_size, Path(work), trial_s=job.flags.trial_s,
                        accumulate=job.cfg.accumulate, steps_per_epoch=steps_per_epoch, on_wait=tick)
        try:
            return search(lever_list, reference, runner, budget_s=job.flags.budget_s, trial_s=job.flags.trial_s,
                          clock=time.monotonic, rounds=job.flags.rounds, allow_changes=job.flags.allow_changes,
                          given=flag_names(job.user_argv), check=checker(job), run_samples=job.run_samples,
                          progress=lambda text: (bar.set_postfix_str(text, refresh=False), tick()))
        finally:
            bar.close()


# ---------------------------------------------------------------------- the report
def _time(value: Optional[float], metric: str) -> str:
    if value is None:
        return ""
    return f"{value * 1e3:.3f} ms/sample" if metric == "train" else f"{value * 1e3:.1f} ms/eval"


def table(result) -> list:
    """The printed table: one line per candidate (or per skipped lever)."""
    lines = [f"{'lever':15} {'candidate':56} {'time':>16} {'speed':>7} {'noise':>6}  verdict"]
    for d in result.decisions:
        if d["status"] == "skipped":
            lines.append(f"{d['lever']:15} skipped: {d['reason']}")
            continue
        current = [t for t in result.trials if t.lever == d["lever"] and t.label == "current" and t.ok]
        value = statistics.median(t.value(d["metric"]) for t in current) if current else None
        varied = d.get("repeat_noise", 0)
        lines.append(f"{d['lever']:15} {'(current best)':56} {_time(value, d['metric']):>16} {'1.00x':>7} "
                     f"{varied * 100:>5.0f}%  its own runs varied this much" if varied > 0.1 else
                     f"{d['lever']:15} {'(current best)':56} {_time(value, d['metric']):>16} {'1.00x':>7}")
        for c in d["candidates"]:
            if c["verdict"] == "failed":
                lines.append(f"{'':15} {c['label'][:56]:56} {'':>16} {'':>7} {'':>6}  failed: {c['error'][:60]}")
                continue
            extra = f" (compile {c['one_time_s']:.0f} s, saves {c['saved_s']:.0f} s)" if "one_time_s" in c else ""
            lines.append(f"{'':15} {c['label'][:56]:56} {_time(c['value'], d['metric']):>16} {c['speed']:>6.2f}x "
                         f"{c['noise'] * 100:>5.0f}%  {c['verdict']}{extra}")
        for label in d.get("untried", []):
            lines.append(f"{'':15} {label[:56]:56} {'':>16} {'':>7} {'':>6}  not tried (budget)")
        for label, why in d.get("refused", {}).items():
            lines.append(f"{'':15} {label[:56]:56} {'':>16} {'':>7} {'':>6}  refused: {why[:70]}")
    return lines


def speedup(result) -> float:
    """The product of the kept training-time levers' speeds: an estimate (each was measured against its own current
    best), not a measurement of the final command."""
    return math.prod(next(c["speed"] for c in d["candidates"] if c["label"] == d["chosen"])
                     for d in result.decisions if d["status"] == "kept" and d["metric"] == "train")


def memory_note(result, machine: dict) -> str:
    warm = result.trials[0]
    total = machine.get("gpu_memory_bytes") or machine.get("memory_bytes")
    if not warm.peak_mem_bytes or not total:
        return "activation checkpointing: not tried (peak memory not measured)"
    used = f"peak {warm.peak_mem_bytes / 2**30:.2f} GiB of {total / 2**30:.1f} GiB"
    if warm.peak_mem_bytes < 0.8 * total:
        return (f"activation checkpointing: not tried: nothing binds ({used}); it recomputes activations to save "
                "memory, which only costs time when the run fits")
    return (f"activation checkpointing: memory binds ({used}): --activation-checkpointing full or selective (gpt, "
            "resnet18) saves memory for more time; not timed here")


def main(argv=None) -> int:
    try:
        job = prepare(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        result = run(job)
    except TuneFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    m = job.machine
    best = command(result.best, job.user_argv, job.cfg.batch_size)
    reference = command(result.reference, job.user_argv, job.cfg.batch_size)
    exact = [d for d in result.decisions if d["kind"] == "exact"]
    changes = [{**d, "applied": d["status"] == "kept"} for d in result.decisions if d["kind"] == "change"]
    changed = any(d["applied"] for d in changes)
    note = memory_note(result, m)
    doc = {"command": best, "shell": shell_line(best), "reference": reference, "exact_only": not changed,
           "estimated_speedup": speedup(result), "trials": [asdict(t) for t in result.trials], "exact": exact,
           "changes": changes, "machine": m, "measure": MEASURE, "activation_checkpointing": note,
           "budget_s": job.flags.budget_s, "elapsed_s": result.elapsed_s, "rounds": job.flags.rounds,
           "trial_s": job.flags.trial_s}
    job.out.mkdir(parents=True, exist_ok=True)
    tmp = job.out / "tune.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, job.out / "tune.json")
    flags = ", ".join(m["cpu_flags"]) or "no AVX2"
    print(f"machine: {m['cpu']}, {m['cores']} cores ({flags}), "
          f"{', '.join(m['gpus']) if m['gpus'] else 'no GPU'}; torch {m['torch']}; {m['date']}")
    print(f"measure: {MEASURE}")
    print(f"{len(result.trials)} trials in {result.elapsed_s:.0f} s (budget {job.flags.budget_s:.0f} s, "
          f"{job.flags.rounds} interleaved rounds per lever)\n")
    print("\n".join(table(result)))
    print(f"\n{note}")
    print(f"reference: {shell_line(reference)}")
    what = "it changes the optimisation: batch-size, precision above" if changed else \
        "exact: it trains the same model as the reference"
    print(f"results: {job.out / 'tune.json'}")
    print(f"fastest ({what}; about {speedup(result):.2f}x the reference's training speed):")
    print(shell_line(best))
    return 0
