"""One trial: a short real training run of a candidate command in its own process, and what it measured.

A trial is the candidate's own command (python launch/single.py, or torchrun launch/ddp.py) with a short horizon
appended: --max-steps N, a log row every L steps, an evaluation every M steps on 2 batches, --no-progress, its own
--out-dir in a temporary folder. It is timed from its metrics.csv, by the wall clock (several processes share the
work, so CPU time would not say how long the user waits): the intervals between consecutive training rows, per step,
leaving out the first row (start-up, torch.compile, worker start-up) and every interval that spans an evaluation
(and the epoch-end checkpoint that follows it). Their median, per sample, is the steady time; an evaluation's time
is its val row's time_s minus the training row's at the same step.
"""
from __future__ import annotations

import csv
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from manual_train.tune.search import Setup, Trial, command

REPO = Path(__file__).resolve().parents[2]
WARMUP_STEPS, WARMUP_LOG_EVERY = 40, 5  # the first trial: start-up costs, and the step time the others are sized by
MIN_STEPS, MAX_STEPS = 16, 2000
VAL_BATCHES = 2
STOP_WAIT_S = 2.0  # a stopped trial's processes get this long to end on SIGTERM before SIGKILL
FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def machine(on_cuda: bool) -> dict:
    """The CPU (name, usable cores, the vector flags that matter), memory, GPUs, torch: what the result holds for."""
    import torch

    info = {"cpu": "unknown", "cpu_flags": [], "cores": len(os.sched_getaffinity(0)), "memory_bytes": None}
    try:
        text = Path("/proc/cpuinfo").read_text()
        info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")),
                           "unknown")
        flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))
        info["cpu_flags"] = [f for f in FLAGS_OF_INTEREST if f in flags]
        info["memory_bytes"] = next(int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()
                                    if ln.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        pass
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if on_cuda else []
    info.update(gpus=gpus, torch=torch.__version__, python=sys.version.split()[0], date=time.strftime("%Y-%m-%d"))
    if gpus:
        info["fast_bf16"] = torch.cuda.is_bf16_supported(including_emulation=False)
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    else:
        info["fast_bf16"] = bool({"avx512_bf16", "amx_bf16"} & set(info["cpu_flags"]))
    return info


def read_metrics(run_dir: Path, samples_per_step: int) -> dict:
    """The steady numbers of a finished run: sample_s (seconds per sample over the clean intervals, pooled, those
    over twice the median left out: another process took the core), noise (the intervals' spread, _spread),
    eval_s and eval_noise, compile_s, peak_mem_bytes. metrics.csv keeps time_s in ms; pooling
    keeps that rounding unbiased where one interval lasts a few ms."""
    with open(run_dir / "metrics.csv") as f:
        rows = [(int(r["step"]), r["split"], float(r["time_s"])) for r in csv.DictReader(f)]
    summary_path = run_dir / "summary.json"  # none when the trial was stopped at its time limit
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    train = [(step, t) for step, split, t in rows if split == "train"]
    vals = [(step, t) for step, split, t in rows if split == "val"]
    spans = [(t1 - t0, s1 - s0) for (s0, t0), (s1, t1) in zip(train, train[1:])
             if s1 > s0 and not any(s0 <= v < s1 for v, _ in vals)]
    evals = [tv - t for sv, tv in vals for s, t in train if s == sv]
    evals = evals[1:] if len(evals) > 1 else evals  # the first evaluation compiles (eval mode) and warms up
    out = {"compile_s": summary.get("compile_s") or 0.0, "peak_mem_bytes": summary.get("peak_mem_bytes")}
    per_step = [dt / ds for dt, ds in spans]
    if per_step:
        typical = statistics.median(per_step)
        kept = [(dt, ds) for dt, ds in spans if dt / ds <= 2 * typical] if typical > 0 else spans
        seconds, steps = sum(dt for dt, _ in kept), sum(ds for _, ds in kept)
        if seconds > 0:
            out.update(sample_s=seconds / steps / samples_per_step, noise=_spread(per_step))
    if evals:
        out.update(eval_s=statistics.median(evals), eval_noise=_spread(evals))
    return out


def _spread(values: list) -> float:
    """Half the interquartile range of the logarithms: a spread as a factor (0.05: about 5%) that a few very slow
    intervals (another process on the core) cannot blow up; 0 with fewer than 4 values."""
    logs = [math.log(v) for v in values if v > 0]
    if len(logs) < 4:
        return 0.0
    q1, _, q3 = statistics.quantiles(logs, n=4)
    return (q3 - q1) / 2


def _last_line(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    return (errors or lines or ["(no output)"])[-1][:300]


class Runner:
    """run(setup, timeout_s, lever) -> Trial for manual_train.tune.search: each trial in a fresh process group (its
    torchrun ranks with it), in the user's working directory and environment, OMP_NUM_THREADS set."""

    def __init__(self, user_argv: list, default_batch: int, work: Path, *, trial_s: float, accumulate: int,
                 steps_per_epoch: Callable[[Setup], int], on_wait: Callable[[], None] = lambda: None):
        self.user_argv, self.default_batch, self.work = list(user_argv), default_batch, work
        self.trial_s, self.accumulate, self.steps_per_epoch = trial_s, accumulate, steps_per_epoch
        self.on_wait = on_wait
        self.samples: Optional[float] = None  # training samples per trial, set by the warm-up
        self.count = 0

    def horizon(self, setup: Setup) -> list:
        """--max-steps, --log-every and --val-every-steps for this Setup: the same number of samples for every
        trial, log rows that leave clean intervals inside each epoch, and an evaluation about every third of it."""
        if self.samples is None:
            return ["--max-steps", str(WARMUP_STEPS), "--log-every", str(WARMUP_LOG_EVERY)]
        steps = round(self.samples / (setup.batch * setup.ranks * self.accumulate))
        steps = min(max(steps, MIN_STEPS), MAX_STEPS)
        log_every = max(1, min(steps // 10, self.steps_per_epoch(setup) // 3))
        val_every = log_every * max(1, round(steps / 3 / log_every))
        return ["--max-steps", str(steps), "--log-every", str(log_every), "--val-every-steps", str(val_every)]

    def argv(self, setup: Setup, out_dir: Path) -> list:
        """The trial's own command line: this interpreter, the script by its absolute path, the horizon appended
        (argparse keeps the last value of a flag, so these override the user's)."""
        cmd = command(setup, self.user_argv, self.default_batch)["argv"]
        at = next(i for i, a in enumerate(cmd) if a.endswith(".py"))
        head = [sys.executable] if setup.ranks == 1 else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={setup.ranks}"]
        return head + [str(REPO / cmd[at]), *cmd[at + 1:], *self.horizon(setup),
                       "--limit-val-batches", str(VAL_BATCHES), "--early-stop-patience", "0", "--summary-depth", "0",
                       "--save-on-signal", "none", "--no-progress", "--out-dir", str(out_dir)]

    def __call__(self, setup: Setup, timeout_s: float, lever: str) -> Trial:
        self.count += 1
        out_dir, log = self.work / f"trial-{self.count:03d}", self.work / f"trial-{self.count:03d}.log"
        cmd = command(setup, self.user_argv, self.default_batch)
        env = {**os.environ, **cmd["env"]}
        with open(log, "w") as f:
            proc = subprocess.Popen(self.argv(setup, out_dir), stdout=f, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)  # its own group: torchrun's ranks end with it
        deadline = time.monotonic() + timeout_s - STOP_WAIT_S / 2  # stopping it takes a moment too
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                self.on_wait()
                time.sleep(0.2)
        except BaseException:  # Ctrl-C: no trial outlives the tuner
            _stop(proc)
            raise
        stopped = proc.poll() is None
        if stopped:  # its time is up: what it logged so far still times it (a much slower candidate ends here)
            _stop(proc)
        elif proc.returncode != 0:
            return Trial(ok=False, error=f"exit {proc.returncode}: {_last_line(log)}", command=cmd)
        try:
            measured = read_metrics(out_dir, setup.batch * setup.ranks * self.accumulate)
        except (OSError, ValueError, KeyError) as e:
            measured = {"error": f"no metrics to read ({e})"}
        if lever == "warm-up" and measured.get("sample_s"):
            self.samples = self.trial_s / measured["sample_s"]
        ok = "sample_s" in measured
        error = f"stopped after {timeout_s:.0f} s (its time limit)" if stopped else "" if ok else "too few log rows"
        return Trial(ok=ok, timed_out=stopped, command=cmd, **{"error": error, **measured})


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the trial's process group: torchrun forwards it to its ranks (which run in sessions of their own),
    and --save-on-signal none lets every process die at once; SIGKILL if anything is left after STOP_WAIT_S."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(STOP_WAIT_S)
            return
        except subprocess.TimeoutExpired:
            continue
