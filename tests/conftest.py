"""Shared test helpers: configs without argv, real CLI subprocesses, parameter comparisons."""
from __future__ import annotations

import atexit
import fcntl
import gc

gc.disable()  # no collections while torch and the library import (as the launch scripts do: docs/levers.md, Start-up)

import hashlib
import json
import math
import os
import shutil
from contextlib import contextmanager
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import costs
from jobs import IDLE_S, JobHung, Watch, end_hung

from manual_train.config import Config, config_from

REPO = Path(__file__).resolve().parents[1]

# torch.compile's on-disk cache (Inductor's compiled kernels and graphs) defaults to /tmp/torchinductor_<user>, one
# folder for every run on the machine: other checkouts, killed runs, `make mutants`' mutated copies. On 2026-12-02
# a cache shared that way made a fresh clone's compile tests fail (a compiled DDP backward aborted; FSDP2 with
# --compile blocks ended 210 from eager), and the same tests passed with an empty cache. Each pytest run (and the
# launch scripts and ranks it starts, which inherit the variable) compiles into its own cache, cold as on a CI
# machine: one run, one tree of code. Under pytest-xdist the workers share the run's (pytest_configure_node hands
# the controller's folder to each): the GPT's kernels compiled once serve test_compile.py, test_tensor_parallel.py
# and their jobs' ranks. Measured 2026-12-07 on the 2-core AVX-512 EPYC: tests/test_compile.py cost 53.9 and 58.4
# CPU s in a cold cache, 36.3 and 38.6 after test_tensor_parallel's compile test had filled it. A pytest that a test
# starts (a mutant's kill run: other code) is no worker of this run and makes a cache of its own. (A hook, not an
# import-time line: a job's ranks import this module too, and must share the run's.)
#
# One intra-op thread in every process of the suite: this pytest process, its jobs' ranks (tests/jobs.py) and every
# process it starts (OMP_NUM_THREADS, inherited; torchrun sets the same for its ranks). The models here are tiny: a
# second thread gains little on them, and OpenMP's threads wait for each other, spinning, at every op. Measured 2026-12-04 on
# a 2-core AMD EPYC under load from other jobs, 60 steps of the cnn on digits in 64-true in one process: 2 threads
# 40 s of CPU and 107 s wall, 1 thread 3.3 s and 9.7 s. Every process alike also keeps "one code path, one kind of
# process": a run here and a launch script compute with the same thread count.
def pytest_configure(config):
    gc.freeze()  # what the imports above made (torch): collections skip it; the collector is on from here
    gc.enable()
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    run_cache = getattr(config, "workerinput", {}).get("inductor_cache_dir")  # an xdist worker: the run's folder
    if run_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = run_cache  # (the controller made it, and removes it at its exit)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="pytest-inductor-")
        atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
    if config.getoption("cost_report"):
        costs.enable()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist's controller, before it starts a worker: the worker compiles into this run's Inductor cache."""
    node.workerinput["inductor_cache_dir"] = os.environ["TORCHINDUCTOR_CACHE_DIR"]


# The dearest files first (wall seconds in a `make test --cost-report` run: 2 workers, 2-core AMD EPYC with AVX-512,
# 2026-12-07; README's Tests section). Under pytest-xdist --dist loadfile (`make test`) a worker takes the next file
# when it runs out: a dear file taken last leaves the other workers idle while it runs alone (before this order,
# xdist sorted files by their number of tests, so 150 one-line checks went first and a 90 s file could go last; and
# a file missing from this list goes after them: test_tune.py, 36 s, ran last while the other core idled ~30 s).
# Only the order changes; a file missing from the list keeps its place after them.
DEAREST_FIRST = ["test_compile.py", "test_preemption.py", "test_text.py", "test_zero_parity.py", "test_parity_tool.py",
                 "test_bench.py", "test_pipeline.py", "test_hang_deadline.py", "test_everyday.py", "test_tune.py",
                 "test_tensor_parallel.py", "test_ddp_torchrun.py", "test_storage_faults.py",
                 "test_operator_kills.py", "test_ddp_knobs.py", "test_generate.py", "test_site.py",
                 "test_ddp_parity.py", "test_hybrid.py", "test_mutants.py", "test_checkpoint.py", "test_teardown.py",
                 "test_hostile_flags.py", "test_any_cpu.py", "test_multinode.py", "test_flags_observed.py",
                 "test_gpt_task.py"]


def dearest_first(items: list) -> list:
    """items in DEAREST_FIRST's file order, the others after them in collection order (a stable sort)."""
    rank = {name: i for i, name in enumerate(DEAREST_FIRST)}
    return sorted(items, key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_collection_modifyitems(config, items):
    items[:] = dearest_first(items)


def pytest_collection_finish(session):
    """Collected: torch, the library and the test modules are imported, and none of it is garbage. gc.freeze moves
    it out of the collector's reach, so each full collection during the run (the interpreter's own, and teardown()'s
    after an in-process group) scans only what the tests made since, not the whole heap of torch._dynamo's modules
    (tests/jobs.py's ranks do the same)."""
    gc.freeze()


# `pytest --cost-report=FILE`: where the time goes, per test file (tests/costs.py; README's Tests section).
def pytest_addoption(parser):
    parser.addoption("--cost-report", metavar="FILE", help="write wall and CPU seconds and process starts per test "
                                                           "file to FILE (tests/costs.py)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if item.config.getoption("cost_report"):
        yield from costs.measure(item)
    else:
        yield


def pytest_sessionfinish(session):
    if session.config.getoption("cost_report") and hasattr(session.config, "workeroutput"):  # an xdist worker
        session.config.workeroutput["costs"] = dict(costs.totals)


@pytest.hookimpl(optionalhook=True)  # (pytest-xdist's hook: the controller, as each worker ends)
def pytest_testnodedown(node, error):
    costs.add(getattr(node, "workeroutput", {}).get("costs", {}))


def pytest_terminal_summary(terminalreporter, config):  # (the controller, under xdist: after every worker ended)
    if config.getoption("cost_report"):
        from manual_train.bench.report import _cpu_model

        workers = config.getoption("numprocesses", None) or 0
        machine = (f"{os.cpu_count()} cores of {_cpu_model()}, ATen {torch.backends.cpu.get_cpu_capability()}; "
                   + (f"{workers} pytest-xdist workers" if workers else "one pytest process"))
        terminalreporter.write_line(costs.write(config.getoption("cost_report"), machine))


def make_cfg(tmp_path: Path, config_cls=Config, **overrides) -> Config:
    """A validated config as the CLI would build it (progress bar off, outputs under tmp_path)."""
    overrides.setdefault("progress", False)
    overrides.setdefault("out_dir", str(tmp_path / "run"))
    return config_from(config_cls, **overrides)


def max_param_diff(a: dict, b: dict) -> float:
    """Max abs difference over the floating tensors of two state dicts with the same keys."""
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())


# ---------------------------------------------------------------------- parity: 64-true proof, fp32 noise floor
# 64-true (float64) runs prove the algorithm: a technique that computes the baseline's sums in another order
# differs from it by ~1e-15 per step in float64, far below 1e-9 after two epochs, on any CPU. fp32 runs differ
# by whatever the machine's kernels round to, amplified by training (cnn on digits: 3e-8 on one AVX-512 CPU,
# 1.5e-4 on another), so no fixed fp32 bound is portable.
PARITY_TOL_64 = 1e-9
# The fp32 checks compare with a floor measured in the same test: how far the baseline itself drifts when its
# initial weights move by one ulp (the size of one rounding). A technique's fp32 difference is rounding too, so
# it must stay within FP32_FLOOR_FACTOR floors. Measured here (2026-12-01, 2-core Xeon, AVX-512 and AVX2 kernels;
# mlp, 2 epochs): floor 8.9e-8, 16x4 vs 64 4.5e-8, the ÷K variant 6.3e-3 (7000 floors). The fp32 checks use the
# mlp: the cnn on digits amplifies a one-ulp change to 7e-5..8e-4 in two epochs (that many, and which, depends
# on the CPU), a floor too coarse to tell rounding from a wrong algorithm.
FP32_FLOOR_FACTOR = 10
FP32_MODEL = "mlp"


@contextmanager
def initial_weights_nudged(loop_module, direction: float):
    """While active, `loop_module.build_model_from` moves every initial weight by one ulp towards +-inf."""
    real_build = loop_module.build_model_from

    def nudged(*args, **kwargs):
        model = real_build(*args, **kwargs)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.nextafter(p, torch.full_like(p, direction * math.inf)))
        return model

    loop_module.build_model_from = nudged
    try:
        yield
    finally:
        loop_module.build_model_from = real_build


def fp32_noise_floor(train_fn, reference: dict) -> float:
    """The fp32 noise floor: max drift from `reference` (the baseline's final weights) of the same baseline
    run with its initial weights one ulp up and one ulp down. train_fn(name) runs it and returns final weights
    (with manual_train.loops.single's build_model_from nudged)."""
    from manual_train.loops import single

    drifts = []
    for direction, name in ((1, "ulp_up"), (-1, "ulp_down")):
        with initial_weights_nudged(single, direction):
            drifts.append(max_param_diff(train_fn(name), reference))
    assert min(drifts) > 0, "a one-ulp change made no difference: the floor measures nothing"
    return max(drifts)


# ---------------------------------------------------------------------- which equality a check claims
# The rule. Bit-for-bit equality is a property of ONE code path: the same loop function, the same modules and the
# same tensor layouts, run twice (a resume and the uninterrupted run, a checkpoint and its reload, the ranks of one
# job). It holds on any CPU, in any precision. Two code paths (a technique and the baseline, FSDP2 and DDP, fused
# and for-loop, a recomputed forward and a stored one) may pick other kernels for other layouts and alignments:
# in fp32 they agree bit for bit on one CPU and differ by 2^-27 on another (FSDP2 vs DDP: equal on an AVX-512
# Xeon, 7.45e-9 apart with AVX2 kernels). So a cross-path check runs in 64-true and is held to PARITY_TOL_64
# (assert_cross_path_64), or in fp32 to a noise floor measured in the same test (assert_within_fp32_floor), and
# never `max_param_diff(...) == 0.0` (tests/test_equality_kinds.py scans the suite for that and fails).
def assert_same_path_bitwise(a: dict, b: dict, what: str) -> None:
    """Two state dicts ONE code path computed (see the rule above): equal bit for bit, in any precision."""
    assert a.keys() == b.keys(), what
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{what}: one code path, yet {different[:5]} differ (max {max_param_diff(a, b):.3g})"


def assert_cross_path_64(a: dict, b: dict, what: str) -> float:
    """Two code paths in 64-true: every floating tensor is float64 (an fp32 pair is refused: its bound is a noise
    floor, not this) and the max abs difference is <= PARITY_TOL_64; integer tensors (step and batch counts) are
    equal. Returns the difference (printed)."""
    assert a.keys() == b.keys(), what
    dtypes = {v.dtype for d in (a, b) for v in d.values() if v.is_floating_point()}
    assert dtypes == {torch.float64}, f"{what}: a cross-path check needs float64 (64-true) tensors, got {dtypes}"
    counts = [k for k in a if not a[k].is_floating_point() and not torch.equal(a[k], b[k])]
    assert not counts, f"{what}: integer tensors {counts[:5]} differ"
    diff = max_param_diff(a, b)
    print(f"{what}: 64-true max abs diff {diff:.3g} (bound {PARITY_TOL_64:g})")
    assert diff <= PARITY_TOL_64, f"{what}: 64-true max abs diff {diff:.3g} > {PARITY_TOL_64:g}"
    return diff


def assert_within_fp32_floor(diff: float, floor: float, what: str) -> None:
    """The fp32 check: diff <= FP32_FLOOR_FACTOR x floor; both printed (pytest -rP shows them)."""
    bound = FP32_FLOOR_FACTOR * floor
    line = (f"{what}: fp32 max abs diff {diff:.3g}; noise floor {floor:.3g} (one-ulp drift of the baseline); "
            f"bound {FP32_FLOOR_FACTOR} x floor = {bound:.3g}")
    print(line)
    assert diff <= bound, line


def train_state(module, config_cls, tmp_path: Path, name: str, **overrides) -> tuple[dict, dict]:
    """Run a loop module's train(cfg) in this process under tmp_path/name; (final weights, summary)."""
    summary = module.train(make_cfg(tmp_path / name, config_cls, **overrides))
    return load_model_state(tmp_path / name / "run"), summary


def once_per_run(tmp_path_factory, name: str, make) -> tuple[Path, object]:
    """make(out) -> a JSON-able result, run once per pytest run into a folder `out` of its own; returns (out, the
    result). Under pytest-xdist each worker is a session of its own, so a session-scoped fixture alone would run
    its set-up once per worker that needs it (a 2-rank torchrun job: three interpreter starts). Here the first
    worker to ask runs make under a lock in the run's shared temporary folder (the parent of the workers' own);
    the others wait on the lock and read the folder and result it left. A make that fails leaves no result: the
    next one to ask runs it again, in a new folder (a launch script refuses to write into a used run folder)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    done = shared / f"{name}.json"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if make raises
        if not done.exists():
            out = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=shared))
            done.write_text(json.dumps({"out": str(out), "result": make(out)}))
    found = json.loads(done.read_text())
    return Path(found["out"]), found["result"]


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """reference(**flags) -> (final weights, summary) of the single-device loop (manual_train.loops.single, in a
    pytest process, outputs in a folder of its own) with these flags, computed once per pytest run (once_per_run:
    also under xdist): several files compare their technique with the same baseline run. Call it before any
    monkeypatch of the loop's code."""
    from manual_train.loops import single

    cache = {}

    def get(**flags):
        key = tuple(sorted(flags.items()))
        if key not in cache:
            name = "reference-" + hashlib.sha256(repr(key).encode()).hexdigest()[:16]
            out, summary = once_per_run(tmp_path_factory, name,
                                        lambda out: single.train(make_cfg(out / "s", Config, **flags)))
            cache[key] = load_model_state(out / "s" / "run"), summary
        return cache[key]
    return get


# The seq2seq parity settings of the MP and hybrid tests. SGD, not Adam: Adam divides each gradient element by
# its running RMS, which turns rounding-level differences in near-zero gradients (a GRU over 4 rows instead of
# 10 rounds differently) into learning-rate-sized updates; with SGD they stay rounding-sized (~6e-8 after 6 steps).
SEQ = dict(dataset="reverse", model="seq2seq", synthetic_size=200, optimizer="sgd", lr=0.5, batch_size=10,
           max_steps=6, log_every=2)


def load_model_state(run_dir: Path, name: str = "last.pt") -> dict:
    return torch.load(Path(run_dir) / name, map_location="cpu", weights_only=True)["model"]


def final_weights(run_dir: Path) -> dict:
    """The run's last checkpoint's model, whole: last.pt, or a --checkpoint-format dcp run's last.dcp folder (read in
    this process)."""
    from manual_train import checkpoint

    path = run_dir / "last.dcp" if (run_dir / "last.dcp").exists() else run_dir / "last.pt"
    return checkpoint.load_checkpoint(path)["model"]


# How long one launch script (or torchrun job) may take before the test fails. The jobs here take 5-60 s on 2
# quiet cores; CI's machine may be loaded (load ~6 on 2 cores makes them 3-5x slower), so the limit is generous:
# it is there to end a job that spins, not to measure one. A hung job (ranks waiting on each other) fails long before
# it: tests/jobs.py's watcher ends it after jobs.IDLE_S seconds without CPU use, naming each rank and where it waited.
SUBPROCESS_TIMEOUT_S = 900
STACKDUMP = REPO / "tests" / "stackdump"  # its sitecustomize.py: every Python process of a job dumps its stacks


def run_script(script: str, *args: str, timeout: float = SUBPROCESS_TIMEOUT_S, launcher: list[str] | None = None,
               env: dict | None = None, unset: tuple | list = (), idle_s: float | None = IDLE_S
               ) -> subprocess.CompletedProcess:
    """Run launch/<script>.py (or <script>.py when it names a folder, e.g. tests/faulty_ddp) as a user would (a
    real subprocess), capturing its output; `env` adds variables, `unset` removes them. Watched (tests/jobs.py): past
    `timeout`, or idle_s seconds without CPU use in all its processes (None: not watched for that; a run that
    waits for something outside it), it is ended and the test fails naming each process and where it waited."""
    path = REPO / f"{script}.py" if "/" in script else REPO / "launch" / f"{script}.py"
    cmd = (launcher or [sys.executable]) + [str(path), *args]
    with tempfile.TemporaryDirectory(prefix="stacks-") as stack_dir:
        full_env = {k: v for k, v in {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}.items() if k not in unset}
        full_env.update(TESTS_STACK_DIR=stack_dir,
                        PYTHONPATH=os.pathsep.join(filter(None, [str(STACKDUMP), full_env.get("PYTHONPATH")])))
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                              env=full_env) as proc:
            watch = Watch([proc.pid], timeout, idle_s)
            while True:
                try:
                    stdout, stderr = proc.communicate(timeout=2)  # retried after a timeout, it loses no output
                    break
                except subprocess.TimeoutExpired:
                    why = watch.check()
                    if why:
                        what = f"{'torchrun ' if launcher else ''}{script}.py {' '.join(args)}"[:300]
                        message = end_hung([proc.pid], Path(stack_dir), f"{what} {why}")
                        stdout, stderr = proc.communicate()
                        raise JobHung(f"{message}\n--- its stderr's end:\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def cuda_devices(n: int = 1):
    """Mark a test as GPU-only: skipped unless at least n CUDA devices exist."""
    return [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < n,
                                                reason=f"needs {n} CUDA device(s)")]


def needs_cuda(n: int = 1):
    """Decorator: mark gpu, and skip unless at least n CUDA devices exist."""

    def decorate(fn):
        for mark in cuda_devices(n):
            fn = mark(fn)
        return fn

    return decorate


# torchrun's agent as the `torchrun` command runs it (torch.distributed.run's main(), its exit status), its imports
# made with the garbage collector off and then frozen, as the launch scripts make theirs (docs/levers.md, Start-up):
# a 2-rank job of launch/ddp.py 7.9 -> 7.2 CPU s, the agent's own share (2-core EPYC, 2026-12-06, side by side).
TORCHRUN_AGENT = [sys.executable, "-c", "import gc, sys; gc.disable(); from torch.distributed.run import main; "
                  "gc.freeze(); gc.enable(); sys.exit(main())"]


def torchrun(nproc: int, *extra: str) -> list[str]:
    """The launcher prefix for run_script: real torchrun, one node, nproc processes."""
    return [*TORCHRUN_AGENT, "--standalone", "--nproc_per_node", str(nproc), *extra]


def run_ok(script: str, *args: str, launcher=None,
           timeout: float = SUBPROCESS_TIMEOUT_S) -> subprocess.CompletedProcess:
    """run_script that must succeed (stderr's tail in the failure message)."""
    proc = run_script(script, *args, launcher=launcher, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def gpt_blocks(patch, blocks: int) -> None:
    """--model gpt built with `blocks` blocks (models.GPT_LAYERS, 4) while `patch` (a MonkeyPatch) lasts, and the
    pipeline's check of --stages against it (manual_train/pipeline.py holds its own copy): for tests whose proof no
    block count changes and whose CPU the blocks are (tests/test_text.py, tests/test_compile.py)."""
    from manual_train import models
    from manual_train import pipeline

    patch.setattr(models, "GPT_LAYERS", blocks)
    patch.setattr(pipeline, "GPT_LAYERS", blocks)


def assert_gpt_blocks(state: dict, blocks: int) -> None:
    """A GPT's weights hold blocks 0 to blocks - 1: its run was built as gpt_blocks said."""
    found = {k.split(".")[1] for k in state if k.startswith("blocks.")}
    assert found == {str(i) for i in range(blocks)}, found


# One real 2-rank torchrun job of launch/ddp.py, run once per pytest run and read by the tests whose subject is the
# launch (tests/test_ddp_torchrun.py: its parity with one process and a killed worker's restart; tests/
# test_preemption.py: a signal on one rank; tests/test_multinode.py: the same job on two "nodes"): their
# uninterrupted run is this one, not one job each. A job costs torchrun's agent and one interpreter per rank (~35 s of
# CPU on a 2-core EPYC); the mlp in 64-true, 2 epochs of digits at a global batch of 32 (47 steps an epoch) is the
# smallest run those tests' proofs need.
DDP_TORCHRUN_FLAGS = ("--model", "mlp", "--batch-size", "16", "--epochs", "2", "--precision", "64-true",
                      "--no-progress")


def torchrun_once(tmp_path_factory, script: str, flags: tuple, folder: str) -> tuple[Path, subprocess.CompletedProcess]:
    """(out dir, CompletedProcess) of `torchrun --nproc_per_node=2 launch/<script>.py *flags --out-dir <folder>`,
    run once per pytest run (once_per_run: one job also under xdist); the job must end with status 0."""
    def make(out):
        proc = run_script(script, *flags, "--out-dir", str(out / folder), launcher=torchrun(2), timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [proc.args, proc.returncode, proc.stdout, proc.stderr]

    out, proc = once_per_run(tmp_path_factory, f"{script}-torchrun", make)
    return out / folder, subprocess.CompletedProcess(*proc)


@pytest.fixture(scope="session")
def ddp_torchrun_uninterrupted(tmp_path_factory):
    """torchrun_once of launch/ddp.py with DDP_TORCHRUN_FLAGS, into A."""
    return torchrun_once(tmp_path_factory, "ddp", DDP_TORCHRUN_FLAGS, "A")


# The same for FSDP2: `torchrun --nproc_per_node=2 launch/zero.py` with these flags, run once per pytest run: tests/
# test_zero_parity.py holds it to the DDP loop (within 1e-9, its last.dcp read whole) and tests/test_preemption.py
# resumes a signalled copy of it and compares bit for bit. Stage 3, the stage that changes most, with sharded (DCP)
# checkpoints: the mlp in 64-true, 2 epochs of digits at a global batch of 128 (12 steps an epoch, the last partial).
ZERO_TORCHRUN_FLAGS = ("--stage", "3", "--impl", "torch", "--model", "mlp", "--optimizer", "adamw", "--lr", "1e-3",
                       "--schedule", "constant", "--batch-size", "64", "--epochs", "2", "--precision", "64-true",
                       "--checkpoint-format", "dcp", "--no-progress")


@pytest.fixture(scope="session")
def zero_torchrun_uninterrupted(tmp_path_factory):
    """torchrun_once of launch/zero.py with ZERO_TORCHRUN_FLAGS, into Z."""
    return torchrun_once(tmp_path_factory, "zero", ZERO_TORCHRUN_FLAGS, "Z")


# The same for one process: launch/single.py's uninterrupted run of the mlp (32-true, 2 epochs of digits at batch 64,
# 24 steps an epoch), run once per pytest run for the tests that interrupt that script for real and compare its
# resumed end with it bit for bit (a launch script on both sides: one kind of process). tests/test_preemption.py (a
# signal) and tests/test_storage_faults.py (a full disk) read it.
SINGLE_SCRIPT_FLAGS = ("--model", "mlp", "--epochs", "2", "--batch-size", "64", "--log-every", "5", "--no-progress")


@pytest.fixture(scope="session")
def single_script_uninterrupted(tmp_path_factory):
    """The out dir of `python launch/single.py *SINGLE_SCRIPT_FLAGS --out-dir A` (a real subprocess; once_per_run)."""
    def make(out):
        proc = run_script("single", *SINGLE_SCRIPT_FLAGS, "--out-dir", str(out / "A"))
        assert proc.returncode == 0, proc.stderr[-3000:]

    return once_per_run(tmp_path_factory, "single-script", make)[0] / "A"


TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT")


def as_torchrun_rank(monkeypatch, rank: int = 0, world_size: int = 2) -> None:
    """Set the environment torchrun gives a worker (rank `rank` of `world_size` on one node), for tests of
    what a script decides from it before any process group exists."""
    for name, value in dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world_size, LOCAL_WORLD_SIZE=world_size,
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=29500).items():
        monkeypatch.setenv(name, str(value))


@pytest.fixture
def lone_process():
    """No torchrun environment; afterwards os.environ as it was (setup() adds MASTER_ADDR/MASTER_PORT)."""
    saved = dict(os.environ)
    for name in TORCHRUN_VARS:
        os.environ.pop(name, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


# ---------------------------------------------------------------------- resume: a real one, not a rerun
def targets_trained_on(loop, cfg) -> tuple[dict, list]:
    """loop.train(cfg) with the loop module's loss_fn recording the targets of each call (one call per micro-step):
    what the run trained on, in order. Returns (summary, [each micro-batch's targets, as lists])."""
    seen = []
    real_loss_fn = loop.loss_fn

    def recording_loss_fn(logits, y, **kw):  # evaluation's calls (reduction="sum") are not training's
        if not kw:
            seen.append(y.tolist())
        return real_loss_fn(logits, y, **kw)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "loss_fn", recording_loss_fn)
        summary = loop.train(cfg)
    return summary, seen


def resume_runs(tmp_path, loop, config_cls, **common) -> SimpleNamespace:
    """The resume proof's runs (accumulate 1: a micro-step is an optimizer step), each recording what it trained on:
    `straight`, 6 steps; 3 steps, then `resumed` on to 6 with --resume auto; and the known-wrong variant `ignored`:
    on to 6 from the 3-step checkpoint (--resume PATH, into a new --out-dir) with --resume accepted, then never
    loaded (cfg.resume_path() None), i.e. a rerun from scratch. Each: (final weights, summary, targets)."""
    def run(name, **flags):
        summary, seen = targets_trained_on(loop, make_cfg(tmp_path / name, config_cls, **dict(common, **flags)))
        return load_model_state(tmp_path / name / "run"), summary, seen

    straight = run("a", max_steps=6)
    loop.train(make_cfg(tmp_path / "b", config_cls, **dict(common, max_steps=3)))
    three_steps = shutil.copy(tmp_path / "b" / "run" / "last.pt", tmp_path / "three_steps.pt")  # b's is rewritten
    resumed = run("b", max_steps=6, resume="auto")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(config_cls, "resume_path", lambda self: None)
        ignored = run("c", max_steps=6, resume=str(three_steps))
    print(f"{loop.__name__}: micro-batches trained straight {len(straight[2])}, resumed {len(resumed[2])}, "
          f"with --resume ignored {len(ignored[2])}")
    return SimpleNamespace(straight=straight, resumed=resumed, ignored=ignored)


def assert_resumes_not_reruns(tmp_path, loop, config_cls, **common) -> None:
    """--resume: 3 steps, then on to 6, gives the weights of 6 steps straight (constant LR: no schedule length), and
    the resumed call trains only the 3 remaining micro-batches, the straight run's last 3. A rerun from scratch
    (--resume ignored) ends in the same weights, so the weights alone cannot tell; it trains all 6 and fails there."""
    runs = resume_runs(tmp_path, loop, config_cls, **common)
    straight, _, straight_seen = runs.straight
    weights, summary, seen = runs.resumed
    assert summary["optimizer_steps"] == 6 and summary["samples_seen"] == 60
    assert_same_path_bitwise(straight, weights, "resumed vs 6 steps straight")
    assert len(straight_seen) == 6 and seen == straight_seen[3:]  # only the remaining steps, on their samples
    weights, summary, seen = runs.ignored  # the known-wrong variant: the weights check passes, this one does not
    assert_same_path_bitwise(straight, weights, "a rerun from scratch vs 6 steps straight")
    assert seen != straight_seen[3:] and seen == straight_seen
