"""How the benchmark measures: fresh processes, interleaved repeats, peak memory, paired ratios.

Nothing here imports torch at module level: the orchestrating process (`python -m manual_train.bench`)
never runs a tensor op. Every measurement runs in a child process forked from a *forkserver* that has
imported torch and torchvision and done nothing else, so each child starts with a clean allocator, its
own peak-RSS counter and no OpenMP thread pool, in ~0.1 s instead of the ~7 s a `python` start with
torch and torchvision takes on this machine. Children write their stdout/stderr (training banners,
warnings, tracebacks) to the entry's log file under <out>/logs/.

Peak memory on the CPU is the process's resident set (Linux /proc/self/status VmRSS / VmHWM). Two
things make RSS deltas mean "bytes of live tensors":
  * glibc's malloc is told to serve every block >= 64 KiB with its own mmap (M_MMAP_THRESHOLD, which
    also turns off glibc's adaptive threshold) and to give freed heap tops back (M_TRIM_THRESHOLD).
    Otherwise freed activations stay in the heap and a second measurement reuses them unseen.
  * the high-water mark is reset (`echo 5 > /proc/self/clear_refs`) right before the measured part,
    after a warm-up pass has paid for lazy initialisation (kernel code pages, thread pools, caches).
On CUDA the caching allocator's own counters are exact and are used instead.
"""
from __future__ import annotations

import ctypes
import gc
import math
import multiprocessing
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

# Imported once by the forkserver; every child inherits them already loaded. torch._dynamo is imported by
# the first torch.optim.Optimizer constructed in a process (~5 s here), so it is loaded up front too.
PRELOAD = ["torch", "torch._dynamo", "torchvision", "manual_train.loops.single", "manual_train.bench.harness"]


# ---------------------------------------------------------------------- results
@dataclass
class Goal:
    """A target the project set, e.g. Goal("<=", 1.05). Reported whether or not it is met."""

    op: str  # "<=" or ">="
    value: float

    def met(self, measured: float) -> Optional[bool]:
        if measured is None or not math.isfinite(measured):
            return None
        return measured <= self.value if self.op == "<=" else measured >= self.value

    def __str__(self) -> str:
        return f"{self.op} {self.value:g}"


@dataclass
class Row:
    """One line of the results table: a variant measured against its baseline.

    kind "ratio": `values` are per-repeat variant/baseline ratios, paired by repeat (A_i and B_i ran
    next to each other). kind "value": `values` are the variant's own measurements (e.g. MB of growth,
    syncs per step), for metrics where a ratio to a near-zero baseline means nothing.
    """

    entry: str
    baseline: str
    variant: str
    metric: str
    values: list
    kind: str = "ratio"
    better: str = "lower"  # which direction is an improvement: "lower" (time, memory) or "higher" (throughput)
    unit: str = ""
    claim: str = ""
    goal: Optional[Goal] = None
    baseline_values: list = field(default_factory=list)
    variant_values: list = field(default_factory=list)
    note: str = ""

    @property
    def median(self) -> float:
        finite = [v for v in self.values if v is not None and math.isfinite(v)]
        return statistics.median(finite) if finite else math.nan

    @property
    def spread(self) -> tuple:
        finite = [v for v in self.values if v is not None and math.isfinite(v)]
        return (min(finite), max(finite)) if finite else (math.nan, math.nan)

    @property
    def met(self) -> Optional[bool]:
        return self.goal.met(self.median) if self.goal else None

    def as_dict(self) -> dict:
        lo, hi = self.spread
        return {"entry": self.entry, "baseline": self.baseline, "variant": self.variant, "metric": self.metric,
                "kind": self.kind, "better": self.better, "unit": self.unit, "median": self.median, "min": lo,
                "max": hi, "n": len(self.values), "values": list(self.values),
                "baseline_values": list(self.baseline_values),
                "variant_values": list(self.variant_values), "claim": self.claim,
                "goal": {"op": self.goal.op, "value": self.goal.value} if self.goal else None,
                "met": self.met, "note": self.note}


def ratio_row(entry: str, baseline: str, variant: str, metric: str, baseline_values: list, variant_values: list,
              **kwargs) -> Row:
    """variant/baseline per repeat; repeat i of each ran back to back, so each ratio shares its conditions."""
    ratios = [v / b if b else math.nan for b, v in zip(baseline_values, variant_values)]
    return Row(entry, baseline, variant, metric, ratios, kind="ratio", baseline_values=list(baseline_values),
               variant_values=list(variant_values), **kwargs)


def value_row(entry: str, baseline: str, variant: str, metric: str, values: list, **kwargs) -> Row:
    return Row(entry, baseline, variant, metric, list(values), kind="value", variant_values=list(values), **kwargs)


@dataclass
class Outcome:
    """What an entry hands back: table rows, the raw numbers behind them, and notes for the reader."""

    rows: list = field(default_factory=list)
    raw: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)


# ---------------------------------------------------------------------- interleaving
def interleave(variants: dict, repeats: int, warmup: int = 1) -> dict:
    """Call each variant's measurement in turn, A B C A B C ..., `warmup` rounds discarded.

    Interleaving spreads slow drifts of the machine (another process starting, thermal state, the page
    cache) over every variant alike, which back-to-back blocks (A A A B B B) would not.
    Each callable returns one number (seconds, bytes, ...); the result maps name -> list of numbers.
    """
    results = {name: [] for name in variants}
    for round_index in range(warmup + repeats):
        for name, measure in variants.items():
            value = measure()
            if round_index >= warmup:
                results[name].append(value)
    return results


# ---------------------------------------------------------------------- CPU memory (Linux)
def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"{key} missing from /proc/self/status (not Linux?)")


def rss_bytes() -> int:
    """Resident set size now."""
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """Largest resident set since the process started or since reset_peak_rss()."""
    return _status_bytes("VmHWM")


def reset_peak_rss() -> bool:
    """Set the high-water mark to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_delta(fn: Callable) -> tuple:
    """(fn(), the most RSS it added above what was resident when it started)."""
    gc.collect()
    if not reset_peak_rss():
        raise RuntimeError("cannot reset the peak-RSS counter (/proc/self/clear_refs is not writable)")
    before = rss_bytes()
    result = fn()
    return result, peak_rss_bytes() - before


def tune_malloc() -> None:
    """glibc: big blocks from mmap (returned to the OS on free), freed heap tops trimmed. No-op elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    libc.mallopt(m_mmap_threshold, 64 * 1024)
    libc.mallopt(m_trim_threshold, 128 * 1024)


# ---------------------------------------------------------------------- fresh processes
class ChildFailed(RuntimeError):
    """A measurement process raised, crashed or timed out; the message says which, the log says why."""


_context = None


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def fresh_process(fn: Callable, kwargs: dict, *, log_path: Path, timeout_s: float, threads: Optional[int]):
    """Run fn(**kwargs) in a new process forked from the clean forkserver; return its (picklable) result.

    threads: torch intra-op threads in the child (None keeps torch's default). A child that outlives
    timeout_s is killed, so a hung DataLoader worker or deadlock cannot stall the whole benchmark.
    """
    ctx = _forkserver()
    receiver, sender = ctx.Pipe(duplex=False)
    # The child would inherit "forkserver" as its default start method, and DataLoader workers would then
    # start through the server (unpickling the dataset, seconds per worker): give it this process's default.
    start_method = multiprocessing.get_start_method()
    proc = ctx.Process(target=_child_main, args=(sender, fn, kwargs, str(log_path), threads, start_method))
    proc.start()
    sender.close()
    try:
        if not receiver.poll(timeout_s):
            raise ChildFailed(f"{fn.__name__} timed out after {timeout_s:.0f} s (killed); log: {log_path}")
        status, payload = receiver.recv()
    except EOFError:
        proc.join(5)
        how = f"killed by signal {-proc.exitcode}" if (proc.exitcode or 0) < 0 else f"exit code {proc.exitcode}"
        raise ChildFailed(f"{fn.__name__} died ({how}; out of memory?) before reporting; log: {log_path}")
    finally:
        if proc.is_alive():
            proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
        receiver.close()
    if status != "ok":
        raise ChildFailed(f"{fn.__name__} failed: {payload}; log: {log_path}")
    return payload


def spawn_ranks(fn: Callable, nprocs: int, *args, start_method: str = "spawn") -> dict:
    """fn(rank, *args, out) in nprocs processes (torch.multiprocessing's start_processes: "spawn", fresh interpreters
    as the benchmark's; "forkserver" forks them from a warm server, a test's way to skip an import of torch per rank),
    the distributed entries' ranks: each puts its results into `out`, a Manager's dict shared by all of them; returns
    what they put there."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        shared = manager.dict()
        mp.start_processes(fn, args=(*args, shared), nprocs=nprocs, start_method=start_method)
        return dict(shared)


def _child_main(conn, fn: Callable, kwargs: dict, log_path: str, threads: Optional[int], start_method: str) -> None:
    # Everything the measured code prints goes to the entry's log, not over the progress bar.
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(log_fd, 1), os.dup2(log_fd, 2)
    os.close(log_fd)
    print(f"--- {fn.__module__}.{fn.__name__}({kwargs}) pid {os.getpid()} at {time.strftime('%H:%M:%S')}",
          flush=True)
    multiprocessing.set_start_method(start_method, force=True)
    tune_malloc()
    try:
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        result = fn(**kwargs)
        conn.send(("ok", result))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which decides
        traceback.print_exc()
        conn.send(("error", f"{type(e).__name__}: {e}".splitlines()[0][:300]))
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        conn.close()


@dataclass
class Bench:
    """What an entry function is given: the mode, and a way to run measurements in fresh processes."""

    suite: str
    quick: bool
    threads: Optional[int]  # torch intra-op threads in CPU-suite children
    log_dir: Path
    device_info: dict = field(default_factory=dict)  # gpu.cuda_info() of this machine
    repeats_override: Optional[int] = None  # --repeats
    entry: str = ""

    def child(self, fn: Callable, *, timeout_s: float = 600, **kwargs):
        """fn(**kwargs) in a fresh process; its output is appended to logs/<entry>.log."""
        return fresh_process(fn, kwargs, log_path=self.log_dir / f"{self.entry}.log", timeout_s=timeout_s,
                             threads=self.threads)

    def pick(self, quick, full):
        """A size for --quick or a full run."""
        return quick if self.quick else full

    def repeats(self, quick: int, full: int) -> int:
        """How many measured repeats (after the warm-up): --repeats if given, else by --quick."""
        return self.repeats_override or self.pick(quick, full)


# ---------------------------------------------------------------------- small helpers for children
def seconds_per_step(step, n: int, device) -> float:
    """Mean seconds per step() over n calls: CUDA events on GPUs (GPU time), the host clock on the CPU."""
    import torch

    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        return (time.perf_counter() - t0) / n
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / n  # elapsed_time is in milliseconds


class StepClock:
    """Seconds per optimizer step between steps `first` and `last` of the next run, read by a global
    optimizer-step hook (the same few instructions in every loop timed): the fastest of its blocks of `block`
    steps. On a shared machine the noise only adds (another process takes the core or evicts the caches), so, as
    timeit does, the fastest block is the best estimate of the loop's own cost; every loop is read the same way.
    `clock`: time.process_time (the process's CPU time) or time.perf_counter (wall)."""

    def __init__(self, first: int, last: int, block: int, clock=time.process_time):
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.first, self.last, self.block, self.clock, self.steps, self.marks = first, last, block, clock, 0, []
        self.handle = register_optimizer_step_post_hook(self._hook)

    def _hook(self, optimizer, args, kwargs) -> None:
        self.steps += 1
        if self.first <= self.steps <= self.last and (self.steps - self.first) % self.block == 0:
            self.marks.append(self.clock())

    def per_step_s(self) -> float:
        self.handle.remove()
        if len(self.marks) < 2:
            raise RuntimeError(f"the run ended after {self.steps} steps, before step {self.last}")
        return min(b - a for a, b in zip(self.marks, self.marks[1:])) / self.block


def single_config(*argv: str):
    """A validated config of the baseline loop, built exactly as launch/single.py builds it."""
    from manual_train.config import Config, parse_config

    return parse_config(Config, list(argv))


def train_single(run_dir: Path, *argv: str) -> dict:
    """loops.single.train with these flags, writing into run_dir (which must not exist yet)."""
    from manual_train.loops.single import train

    return train(single_config(*argv, "--no-progress", "--out-dir", str(run_dir)))


def median(values) -> float:
    return statistics.median(values)


def mib(nbytes: float) -> float:
    return nbytes / 2 ** 20
