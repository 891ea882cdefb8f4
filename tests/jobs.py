"""Real multi-process jobs for tests: N ranks on gloo, torchrun's environment set by hand; and the watcher that ends
a hung job (these ranks, or a launch script under torchrun: tests/conftest.py's run_script) within its own deadline.

The ranks meet at TCPStores the test process hosts, as torchrun's agent hosts one
(TORCHELASTIC_USE_AGENT_STORE; manual_train/distributed.py, restart_safe_store): one store per scenario of
the job, each on a port the OS chose and held open for the whole job, so no port picked in advance can be
taken by another process on a shared machine, and no scenario's group meets the previous one's keys.
The ranks come from a forkserver that imported torch once, so a job costs its training time rather than
N imports of torch (~4 s each here).

A hung job fails fast, naming its ranks. Ranks waiting on each other (a collective one rank never joins, a rank
that acted alone) use almost no CPU, so a job whose processes together used under IDLE_CPU_SHARE of one core over
IDLE_S seconds is hung, however loaded the machine is (a loaded machine slows a working job, it does not stop it);
a job past its deadline (run_script's timeout) is too. Either way the watcher has every live process dump its stacks (faulthandler, on STACK_SIGNAL),
kills them all, and fails with each rank's pid, scenario and the collective it was in, not after the collective
timeout (--dist-timeout-s, 1800 s by default) or pytest-timeout's 30 minutes.
"""
from __future__ import annotations

import faulthandler
import gc
import json
import multiprocessing
import os
import re
import resource
import signal
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.multiprocessing as tmp_mp

STACK_SIGNAL = signal.SIGRTMIN + 3  # tests/stackdump/sitecustomize.py: a signal no launch script or torchrun handles
# Hung: the job's processes, all together, used under IDLE_CPU_SHARE of one core over the last IDLE_S seconds.
# Measured (2026-12-04, 2-core EPYC): a 2-rank torchrun job whose ranks wait in a collective uses 1% of a core, its
# ranks' gloo threads and torchrun's agent polling them; a training rank on 2 cores at load 10 still gets ~20%.
IDLE_S = 60
IDLE_CPU_SHARE = 0.05
_CLK_TCK = os.sysconf("SC_CLK_TCK")
accounted = {"ranks": 0, "cpu_s": 0.0}  # forked ranks and their CPU seconds, for tests/costs.py


class JobHung(pytest.fail.Exception):
    """A job the watcher ended: the test fails ("Failed: ..."; `make mutants` counts it a kill: the ranks disagreed),
    and the message names each live process, its rank and where it waited."""


def _proc_table() -> dict[int, tuple[int, float, int]]:
    """{pid: (parent pid, CPU seconds of it and its reaped children, start time in clock ticks)} for every process
    now (pid and start time name a process even after its pid is reused)."""
    table = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:  # ended meanwhile
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
            table[int(entry.name)] = (int(fields[1]), sum(int(f) for f in fields[11:15]) / _CLK_TCK, int(fields[19]))
    return table


def _tree(roots: list[int], table: dict) -> list[int]:
    """roots and all their live descendants (torchrun starts its ranks in sessions of their own: not one group)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [p for p in roots if p in table]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def _describe(pid: int) -> str:
    """'rank R (pid P)' from the process's own environment, or its command line when it has no RANK."""
    try:
        environ = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
        cmd = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
    except OSError:
        return f"pid {pid}"
    if "RANK" in environ:
        return f"rank {environ['RANK']} (pid {pid})"
    return f"pid {pid} ({cmd[:100]})"


def _where(stacks: str) -> str:
    """From a faulthandler dump (most recent call first): the torch.distributed call and its caller, else the top of
    the thread that was running Python code."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", stacks.strip())
    frames = [re.findall(r'File "(.+?)", line (\d+) in (\S+)', b) for b in blocks]
    for block in frames:
        for i, (path, line, fn) in enumerate(block):
            if path.endswith("torch/distributed/distributed_c10d.py") and i + 1 < len(block):
                caller = next(((p, l, f) for p, l, f in block[i:] if "torch/" not in p), block[-1])
                return f"in torch.distributed {fn} ({Path(path).name}:{line}), called from {caller[0]}:{caller[1]} " \
                       f"in {caller[2]}"
    main = next((b for b in frames if any(f == "<module>" for _, _, f in b)), frames[0] if frames else [])
    return "at " + "; ".join(f"{Path(p).name}:{l} in {f}" for p, l, f in main[:4]) if main else "(no stack dumped)"


def end_hung(roots: list[int], stack_dir: Path, why: str, names: dict | None = None) -> str:
    """Have every live process under roots dump its stacks into stack_dir/<pid>.txt, kill them all, and return the
    failure's text: `why`, then one line per process saying what it is (names[pid], else from its environment) and
    where it waited, then the stacks."""
    pids = _tree(roots, _proc_table())
    names = {pid: (names or {}).get(pid) or _describe(pid) for pid in pids}
    for pid in pids:
        try:
            os.kill(pid, STACK_SIGNAL)
        except ProcessLookupError:
            pass
    time.sleep(2)  # faulthandler writes from the signal handler at once; 2 s for a loaded machine to schedule it
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    lines, dumps = [why, "still alive when it was ended:"], []
    for pid in sorted(pids, key=lambda p: names[p]):  # rank 0, rank 1, ..., then the others
        path = stack_dir / f"{pid}.txt"
        stacks = path.read_text() if path.exists() else ""
        lines.append(f"  {names[pid]}: {_where(stacks) if stacks.strip() else '(no stack dumped)'}")
        if stacks.strip():
            dumps.append(f"--- {names[pid]}\n{stacks.strip()}")
    return "\n".join(lines + dumps)


class Watch:
    """Polled while a job runs: is it hung (IDLE_S seconds with under IDLE_CPU_SHARE of a core in all its processes)
    or past its deadline? check() returns why, or None."""

    def __init__(self, roots: list[int], deadline_s: float | None, idle_s: float | None = IDLE_S):
        self.roots, self.deadline_s, self.idle_s = roots, deadline_s, idle_s
        self.start = time.monotonic()
        self.samples: list[tuple[float, float]] = []  # (time, CPU seconds the tree has used so far)
        self.seen: dict[tuple[int, int], float] = {}  # (pid, start time): its CPU seconds when last seen

    def check(self) -> str | None:
        now = time.monotonic()
        table = _proc_table()
        for pid in _tree(self.roots, table):
            self.seen[pid, table[pid][2]] = table[pid][1]
        # A process that ended keeps the CPU it used: a rank that finishes first (its CPU gone from /proc) must not
        # make the job's use negative, so read as hung (CI, 2026-12-04: "used -80.26 s of CPU in the last 63 s").
        self.samples.append((now, sum(self.seen.values())))
        if self.deadline_s is not None and now - self.start > self.deadline_s:
            return f"past its deadline of {self.deadline_s:g} s"
        if self.idle_s is None:
            return None
        self.samples = [s for s in self.samples if s[0] >= now - self.idle_s - 5]
        then, cpu_then = self.samples[0]
        used = self.samples[-1][1] - cpu_then
        if now - then >= self.idle_s and used < IDLE_CPU_SHARE * (now - then):
            return (f"hung: its processes used {used:.2f} s of CPU in the last {now - then:.0f} s (under "
                    f"{IDLE_CPU_SHARE:.0%} of one core: waiting on each other)")
        return None


def _rank_entry(rank: int, scenario_fn: Callable, world_size: int, store_ports: list, out_dir: str,
                scenarios: list) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    torch.set_num_threads(1)  # as torchrun sets OMP_NUM_THREADS=1: several ranks share 2 cores
    stack_file = open(Path(out_dir) / "stacks" / f"{os.getpid()}.txt", "w")
    faulthandler.register(STACK_SIGNAL, file=stack_file, all_threads=True)  # the watcher's dump of a hung job
    faulthandler.enable(file=stack_file, all_threads=True)  # a crash (SIGSEGV, SIGABRT) leaves its stacks there too
    # What the forkserver imported (torch, the loops) is not garbage: gc.freeze moves it out of the collector's reach,
    # so the full collection teardown() makes at the end of each scenario scans only what this rank made since.
    # Measured: that collection cost ~0.11 s of CPU per rank and scenario on the whole heap (2026-12-06, 2-core Xeon),
    # half of a small scenario's. Once, here, not before each scenario: the last scenario's loop objects become
    # garbage only after its teardown (they are reference cycles holding gloo groups); frozen, their gloo threads
    # would outlive the group and abort the rank (seen: SIGABRT in the next scenario).
    gc.freeze()
    results = {}
    for name, port in zip(scenarios, store_ports):
        os.environ["MASTER_PORT"] = str(port)
        (Path(out_dir) / f"rank{rank}.at").write_text(name)  # which scenario a hung rank was in
        results[name] = scenario_fn(name, world_size, rank, Path(out_dir))
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))
    usage = resource.getrusage(resource.RUSAGE_SELF)  # (a forked rank's CPU never reaches the test's RUSAGE_CHILDREN)
    (Path(out_dir) / f"rank{rank}.cpu").write_text(str(usage.ru_utime + usage.ru_stime))


def _joined(context, out_dir: Path, world_size: int) -> bool:
    """context.join(timeout=2); a rank that died of a signal (a crash, not a Python exception: SIGSEGV, SIGABRT)
    fails the job with the scenario it was in and the stacks faulthandler wrote as it died."""
    try:
        return context.join(timeout=2)
    except tmp_mp.ProcessExitedException as died:
        rank, pid = died.error_index, died.error_pid
        at = out_dir / f"rank{rank}.at"
        done = (out_dir / f"rank{rank}.json").exists()
        stacks = (out_dir / "stacks" / f"{pid}.txt")
        dump = stacks.read_text().strip() if stacks.exists() else ""
        raise type(died)(f"{died} (rank {rank}, pid {pid}, "
                         f"{'after its last scenario' if done else 'in scenario ' + repr(at.read_text() if at.exists() else '-')})"
                         f"\n{dump or '(no stack written)'}", died.error_index, died.error_pid, died.exit_code,
                         died.signal_name) from None


def run_job(scenario_fn: Callable, world_size: int, out_dir: Path, scenarios: list, preload: list,
            deadline_s: float | None = None, idle_s: float | None = IDLE_S) -> list[dict]:
    """Run scenario_fn(name, world_size, rank, out_dir) -> JSON-able dict on every rank, for each scenario in
    order; return each rank's {name: result}. An exception in any rank fails the job (and the test), and so does a
    hung job (JobHung, after idle_s seconds without CPU use; see the module docstring). No wall-clock deadline unless
    deadline_s is given: a job of many scenarios takes 200 s on 2 quiet cores and 3-5 times that on a loaded one, and
    a job that spins without ending is pytest-timeout's (setup.cfg)."""
    if os.environ.get("JOB_SCENARIOS"):  # `make mutants`: only the scenarios the mutant's killing tests read
        scenarios = [s for s in scenarios if s in os.environ["JOB_SCENARIOS"].split(",")]
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", *preload])
    (out_dir / "stacks").mkdir(parents=True, exist_ok=True)
    stores = [torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # 0: the OS picks
              for _ in scenarios]
    try:
        context = tmp_mp.start_processes(_rank_entry, args=(scenario_fn, world_size, [s.port for s in stores],
                                                            str(out_dir), scenarios),
                                         nprocs=world_size, join=False, start_method="forkserver")
        watch = Watch(context.pids(), deadline_s, idle_s)
        while not _joined(context, out_dir, world_size):  # raises if a rank failed (after ending the others)
            why = watch.check()
            if why:
                at = [(out_dir / f"rank{r}.at").read_text() if (out_dir / f"rank{r}.at").exists() else "-"
                      for r in range(world_size)]  # (a forked rank's RANK is not in its /proc environ)
                names = {pid: f"rank {r} (pid {pid}, scenario {at[r]!r})" for r, pid in enumerate(context.pids())}
                raise JobHung(end_hung(context.pids(), out_dir / "stacks", f"{world_size}-rank job "
                                       f"{scenario_fn.__module__}.{scenario_fn.__name__} {why}", names))
    finally:
        del stores  # closes the servers
    accounted["ranks"] += world_size
    accounted["cpu_s"] += sum(float((out_dir / f"rank{r}.cpu").read_text()) for r in range(world_size))
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]
