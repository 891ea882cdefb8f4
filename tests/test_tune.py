"""python -m manual_train.tune: its choices on a fake cost model and a fake clock (no training), bad input, one real
tuning run, and a parity run of a command that carries every exact lever it can suggest.

The two real runs (the tuner, and the parity tool on the forced command) start together in one module fixture and
run side by side: each test then waits for its own (22-27 s of wall time for the file on 2 cores, not twice that).
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
from conftest import REPO

from manual_train.tune import search
from manual_train.tune.cli import main
from manual_train.tune.search import Context, Setup, Trial, command, decide, levers

CORES = 2


# ---------------------------------------------------------------------- a fake machine: cost model and clock
def has(setup: Setup, text: str) -> bool:
    """The Setup sets this flag (`--static-graph`) or flag and value (`--num-workers 1`)."""
    return any(text in (flag, f"{flag} {value}") for flag, value in setup.flags)


class FakeMachine:
    """run(setup, timeout_s, lever) as the real trials do it, from a cost model: `cost(setup)` seconds per sample,
    a fixed wall time per trial (more for DDP and a compile), and a fake clock that the trials advance."""

    def __init__(self, cost, eval_cost=lambda setup: 0.05, wall_s: float = 10.0, ddp_wall_s: float = 15.0,
                 noise: float = 0.01, compile_s: float = 30.0):
        self.cost, self.eval_cost, self.noise, self.compile_s = cost, eval_cost, noise, compile_s
        self.wall_s, self.ddp_wall_s = wall_s, ddp_wall_s
        self.now, self.levers_run = 0.0, []

    def clock(self) -> float:
        return self.now

    def __call__(self, setup: Setup, timeout_s: float, lever: str) -> Trial:
        self.levers_run.append(lever)
        compiled = has(setup, "--compile")
        wall = (self.ddp_wall_s if setup.ranks > 1 else self.wall_s) + (self.compile_s if compiled else 0)
        if wall > timeout_s:
            self.now += timeout_s
            return Trial(ok=False, timed_out=True, error="timed out")
        self.now += wall
        return Trial(ok=True, sample_s=self.cost(setup), noise=self.noise, eval_s=self.eval_cost(setup),
                     compile_s=self.compile_s if compiled else 0.0)


def fake_search(cost, *, budget_s=10_000.0, allow_changes=False, fast_bf16=True, given=(), run_samples=1e6,
                check=lambda s: None, **machine):
    fake = FakeMachine(cost, **machine)
    ctx = Context(cores=CORES, fast_bf16=fast_bf16, bf16_note="no AVX512-BF16 or AMX")
    reference = Setup(ranks=1, threads=CORES, batch=32)
    result = search.search(levers(ctx), reference, fake, budget_s=budget_s, trial_s=2.0, clock=fake.clock,
                           allow_changes=allow_changes, given=set(given), check=check, run_samples=run_samples)
    return result, fake


def by_lever(result) -> dict:
    return {d["lever"]: d for d in result.decisions}


def cost_model(setup: Setup) -> float:
    """DDP 0.7x, 1 worker 1% faster (within noise), 2 workers and the for-loop kernel slower, --static-graph 0.8x,
    a larger global batch cheaper per sample (sqrt), bf16 1.3x slower. (Evaluations: eval_cost.)"""
    cost = 1e-3 * (32 / (setup.batch * setup.ranks)) ** 0.5
    for text, factor in (("--num-workers 1", 0.99), ("--num-workers 2", 1.2), ("--optimizer-impl for-loop", 1.5),
                         ("--static-graph", 0.8), ("--precision", 1.3)):
        cost *= factor if has(setup, text) else 1
    return cost * (0.7 if setup.ranks > 1 else 1)


def test_exact_levers_are_tried_first_and_a_lever_within_noise_is_not_taken():
    result, fake = fake_search(cost_model, allow_changes=True,
                               eval_cost=lambda setup: 0.05 * (0.5 if has(setup, "--eval-mode") else 1))
    d = by_lever(result)
    assert d["layout"]["status"] == "kept" and d["layout"]["chosen"] == "2 ranks x 1 thread"
    assert d["loader"]["status"] == "not kept"  # 1% faster, the noise is at least 3%: not taken
    verdicts = {c["label"]: c["verdict"] for c in d["loader"]["candidates"]}
    assert verdicts == {"--num-workers 1 --persistent-workers": "within noise",
                        "--num-workers 2 --persistent-workers": "slower"}
    assert d["prefetch"]["status"] == "skipped" and d["pin-memory"]["status"] == "skipped"
    assert d["optimizer-impl"]["status"] == "not kept"
    assert d["ddp-knobs"]["status"] == "kept" and d["eval-mode"]["status"] == "kept"
    # every exact lever is tried before any change; the changes are applied with --allow-changes
    kind = {lever.name: lever.kind for lever in levers(Context(cores=CORES))}
    kinds = [kind[name] for name in fake.levers_run if name != "warm-up"]
    assert "change" in kinds and kinds == sorted(kinds, key=lambda k: k != "exact")
    assert d["batch-size"]["status"] == "kept" and d["batch-size"]["chosen"].startswith("global batch x4")
    assert result.best == Setup(ranks=2, threads=1, batch=64, flags=(
        ("--static-graph", None), ("--eval-mode", "inference"), ("--lr-scaling", "linear"),
        ("--base-batch-size", "32")))
    # bf16 measured slower: refused, with the measurement
    precision = d["precision"]["candidates"][0]
    assert d["precision"]["status"] == "not kept" and precision["verdict"] == "slower"
    assert precision["speed"] == pytest.approx(1 / 1.3)


def test_changes_only_with_the_flag_and_bf16_only_with_fast_kernels():
    def cheap(setup):
        return 1e-3 * (0.5 if setup.batch > 32 or has(setup, "--precision") else 1)

    result, fake = fake_search(cheap)
    d = by_lever(result)
    assert d["batch-size"]["status"] == d["precision"]["status"] == "skipped"
    assert "--allow-changes" in d["batch-size"]["reason"]
    assert result.best == result.reference and not {"batch-size", "precision"} & set(fake.levers_run)
    result, fake = fake_search(cheap, allow_changes=True, fast_bf16=False)
    d = by_lever(result)
    assert (d["precision"]["status"], d["precision"]["reason"]) == ("skipped", "no AVX512-BF16 or AMX")
    assert d["batch-size"]["status"] == "kept" and "precision" not in fake.levers_run


def test_a_lever_whose_flag_the_user_set_is_fixed_and_refused_options_are_named():
    result, _ = fake_search(lambda s: 1e-3, given={"--num-workers"},
                            check=lambda s: "--compile: no blocks" if has(s, "--compile blocks") else None)
    d = by_lever(result)
    assert d["loader"]["status"] == "skipped" and "--num-workers" in d["loader"]["reason"]
    assert d["compile"]["refused"] == {"--compile blocks": "--compile: no blocks"}


def test_a_compile_that_does_not_pay_back_over_the_run_is_not_kept():
    def half(setup):
        return 1e-3 * (0.5 if has(setup, "--compile") else 1)

    # half of 1e-3 s per sample saved over 40,000 samples is 20 s: less than 30 s of compiling
    compile_ = by_lever(fake_search(half, run_samples=40_000)[0])["compile"]
    assert compile_["status"] == "not kept"
    assert {c["verdict"] for c in compile_["candidates"]} == {"does not pay back"}
    assert by_lever(fake_search(half, run_samples=1e6)[0])["compile"]["status"] == "kept"
    short = by_lever(fake_search(half, run_samples=5_000)[0])["compile"]  # 5 s of training: not even tried
    assert short["status"] == "skipped" and "cannot pay back" in short["reason"]


@pytest.mark.parametrize("budget_s", [5.0, 30.0, 65.0, 140.0])
def test_the_budget_is_respected_on_a_fake_clock(budget_s):
    # a DDP trial takes 4x the guess from the first trials: only the timeouts keep the search within the budget
    result, fake = fake_search(lambda s: 1e-3 * (0.7 if s.ranks > 1 else 1), budget_s=budget_s, wall_s=10.0,
                               ddp_wall_s=40.0)
    assert fake.now <= budget_s
    assert any(d["status"] == "skipped" and d["reason"].startswith("budget") for d in result.decisions)
    if budget_s == 5.0:  # the reference's first trial did not end: nothing measured, the reference stands
        assert result.best == result.reference and len(result.trials) == 1


def test_decide_uses_the_spread_between_rounds_and_between_runs_as_noise():
    def trials(*values, noise=0.0):
        return [Trial(ok=True, sample_s=v, noise=noise) for v in values]

    ref = trials(1.0, 1.0)
    # 7.5% faster on average, but 0.8 and 1.05 in the two rounds: noise 12.5%, more than the effect
    winner, verdicts = decide(ref, {"a": trials(0.8, 1.05)})
    assert winner is None and verdicts["a"]["verdict"] == "within noise"
    winner, verdicts = decide(ref, {"a": trials(0.85, 0.87), "b": trials(0.7, 0.72)})
    assert winner == "b" and verdicts["a"]["verdict"] == "faster" and verdicts["b"]["verdict"] == "kept"
    winner, _ = decide(ref, {"a": trials(0.85, 0.87, noise=0.2)})  # step-to-step spread inside the trials: 20%
    assert winner is None
    # twice as fast in both rounds, but the reference's own runs varied 5x (another job on the machine): a factor
    # of sqrt(5) = 2.24 either way is noise, and 2x is within it
    winner, verdicts = decide(ref, {"a": trials(0.5, 0.5)}, repeat=search.repeat_noise(trials(1.0, 5.0, 1.0)))
    assert winner is None and verdicts["a"]["verdict"] == "within noise"
    assert verdicts["a"]["noise"] == pytest.approx(5 ** 0.5 - 1)
    winner, verdicts = decide(ref, {"a": [Trial(ok=False, error="exit 1: boom")] * 2})
    assert winner is None and verdicts["a"] == {"verdict": "failed", "error": "exit 1: boom"}


def test_the_command_keeps_the_users_flags_and_the_global_batch():
    user = ["--model", "cnn", "--dataset", "digits", "--batch-size", "32", "--seed", "3"]
    ddp = command(Setup(ranks=2, threads=1, batch=16, flags=(("--static-graph", None),)), user, 32)
    assert ddp == {"env": {"OMP_NUM_THREADS": "1"},
                   "argv": ["torchrun", "--nproc_per_node=2", "launch/ddp.py", "--model", "cnn", "--dataset",
                            "digits", "--batch-size", "16", "--seed", "3", "--static-graph"]}
    assert command(Setup(ranks=1, threads=2, batch=32), user[:4], 32)["argv"] == ["python", "launch/single.py",
                                                                                 *user[:4]]
    assert command(Setup(ranks=2, threads=1, batch=16), ["--batch-size=32"], 32)["argv"][3:] == ["--batch-size=16"]
    assert search.shell_line(ddp).startswith("OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 launch/ddp.py --model")


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("argv", [
    ["--budget-s", "0"], ["--budget-s", "nan"], ["--budget-s", "abc"], ["--rounds", "0"], ["--levers", "warp"],
    ["--model", "nope"], ["--batch-size", "0"], ["--resume", "last.pt"], ["--fast-dev-run"], ["--no-such-flag"],
    ["--static-graph"], ["--out", "FILE"],
], ids=" ".join)
def test_bad_input_is_one_line_and_exit_2_and_writes_nothing(argv, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("a file, not a folder")
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's own errors (a value of the wrong type) exit from the parser
        status = e.code
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert [p.name for p in tmp_path.iterdir()] == ["FILE"]


# ---------------------------------------------------------------------- real runs, side by side
def forced_exact_setup() -> Setup:
    """Every exact lever the tuner can suggest on a 2-core CPU, each at its option with the most processes and flags,
    in one Setup; --compile left out (tests/test_compile.py holds compiled training to eager in 64-true: seconds of compiling per
    rank would not fit this file's time)."""
    ctx = Context(cores=CORES)
    setup = Setup(ranks=1, threads=CORES, batch=32)
    for lever in levers(ctx):
        if lever.kind != "exact" or lever.name == "compile":
            continue
        options, _ = lever.options(setup)
        if options:
            setup = max(options, key=lambda s: (s.ranks, len(s.flags)))
    return setup


TRAIN = ["--model", "mlp", "--dataset", "digits", "--seed", "3"]
PARITY = ["--precision", "64-true", "--max-steps", "5", "--limit-val-batches", "1"]


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("tune")
    forced = command(forced_exact_setup(), TRAIN + PARITY, 32)
    reference = command(Setup(ranks=1, threads=CORES, batch=32), TRAIN + PARITY, 32)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # both parity runs, on 2 cores (threads change no float64 result)
    jobs = {
        "tune": subprocess.Popen([sys.executable, "-m", "manual_train.tune", *TRAIN, "--budget-s", "25",
                                  "--trial-s", "0.5", "--out", str(work / "out"), "--no-progress"], cwd=REPO, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT),
        "parity": subprocess.Popen([sys.executable, "-m", "manual_train.parity", "--quiet", "--work-dir",
                                    str(work / "parity"), "--a", shlex.join(reference["argv"]), "--b",
                                    shlex.join(forced["argv"])], cwd=REPO, env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT),
    }
    yield {"work": work, "forced": forced, "jobs": jobs}
    for proc in jobs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_tuner_prints_a_ready_command_and_writes_the_contract(real_runs):
    out, _ = real_runs["jobs"]["tune"].communicate(timeout=300)
    assert real_runs["jobs"]["tune"].returncode == 0, out
    line = out.strip().splitlines()[-1]
    assert line.startswith("OMP_NUM_THREADS=") and " launch/" in line, out
    doc = json.loads((real_runs["work"] / "out" / "tune.json").read_text())
    cmd = doc["command"]
    assert search.shell_line(cmd) == line and cmd["argv"][0] in ("python", "torchrun")
    assert cmd["env"]["OMP_NUM_THREADS"].isdigit()
    script = next(a for a in cmd["argv"] if a.endswith(".py"))
    assert script in ("launch/single.py", "launch/ddp.py") and (REPO / script).is_file()
    at = cmd["argv"].index(script)
    assert cmd["argv"][at + 1:at + 1 + len(TRAIN)] == TRAIN  # the user's flags, kept in their order
    assert doc["trials"] and doc["trials"][0]["lever"] == "warm-up"
    assert {d["lever"] for d in doc["exact"]} >= {"layout", "loader", "optimizer-impl", "eval-mode", "compile"}
    assert {d["lever"] for d in doc["changes"]} == {"batch-size", "precision"}
    assert not any(d["applied"] for d in doc["changes"])
    assert doc["machine"]["cores"] >= 1 and "cpu_flags" in doc["machine"]


def test_every_exact_lever_the_tuner_can_suggest_trains_the_same_model(real_runs):
    forced = real_runs["forced"]
    argv = forced["argv"]
    # the command carries every exact lever (compile aside): so the parity run below covers each of them
    assert argv[:3] == ["torchrun", "--nproc_per_node=2", "launch/ddp.py"] and forced["env"]["OMP_NUM_THREADS"] == "1"
    for flag in ("--num-workers", "--persistent-workers", "--prefetch-factor", "--optimizer-impl",
                 "--gradient-as-bucket-view", "--static-graph", "--eval-mode"):
        assert flag in argv, flag
    out, _ = real_runs["jobs"]["parity"].communicate(timeout=300)
    assert real_runs["jobs"]["parity"].returncode == 0, out
    assert out.startswith("equal within 1e-09 over 6 steps (0-5)"), out  # the initial weights and 5 steps
