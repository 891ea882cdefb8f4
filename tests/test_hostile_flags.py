"""Hostile input through the real CLI entry: nan/inf, values past what they feed, paths past the OS's limits,
unwritable folders. Each is one `error: --flag: ...` line on stderr, exit status 2, no traceback, nothing
written. Also: default run folders never collide, --help shows one default per flag, find_batch_size offers
only its flags, and what torchrun adds (docs/what-happens-when.md lists every case with its test here).
"""
from __future__ import annotations

import dataclasses
import os
import re
import typing
from pathlib import Path

import numpy as np
import pytest
from conftest import as_torchrun_rank, run_script, torchrun

from manual_train import config as config_module
from manual_train import find_batch_size
from manual_train.cli import run
from manual_train.config import MAX_SEED, Config, parse_config
from manual_train.loops import apex_o2, data_parallel, ddp, hybrid, model_parallel, single
from manual_train.loops import zero as zero_loop
from manual_train.apex_o2 import ApexO2Config

# (script, module, config class): what launch/<script>.py passes to run(), with the module's DEFAULTS
SCRIPTS = [
    ("single", single, Config),
    ("data_parallel", data_parallel, data_parallel.DataParallelConfig),
    ("model_parallel", model_parallel, model_parallel.ModelParallelConfig),
    ("hybrid", hybrid, hybrid.HybridConfig),
    ("ddp", ddp, ddp.DDPConfig),
    ("zero", zero_loop, zero_loop.ZeroConfig),
    ("apex_o2", apex_o2, ApexO2Config),
]


def _never_trains(cfg):
    raise AssertionError(f"bad input reached training: {cfg}")


def run_cli(argv, *, script="single", module=single, config_cls=Config, train=None):
    """manual_train.cli.run as launch/<script>.py calls it; the exit status (argparse's own errors too)."""
    defaults = getattr(module, "DEFAULTS", {}) if script != "single" else {}
    try:
        return run(train or module.train, config_cls, script=script, doc=module.__doc__, argv=argv, **defaults)
    except SystemExit as e:
        return e.code


def assert_one_line(err: str, flag: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"error: {flag}: "), lines[0]
    assert "Traceback" not in err
    return lines[0]


def assert_nothing_written(root: Path) -> None:
    left = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    assert left == [], f"written although the input was refused: {left}"


@pytest.fixture
def empty_cwd(tmp_path, monkeypatch, lone_process):
    """An empty working folder (the default out dir would be ./runs/...), no torchrun environment."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


# ---------------------------------------------------------------------- 1. nan / inf / past what a value feeds
# (argv, flag, the line's text after "error: --flag: ")
NUMBERS = [
    (["--lr", "nan"], "--lr", "nan is not a finite number (allowed: a finite number and > 0)"),
    (["--lr", "inf"], "--lr", "inf is not a finite number"),
    (["--lr=-inf"], "--lr", "-inf is not a finite number"),  # "--lr -inf": argparse takes -inf for a flag
    (["--lr", "1e400"], "--lr", "inf is not a finite number"),  # float() overflows to inf
    (["--grad-clip", "nan"], "--grad-clip", "nan is not a finite number"),
    (["--grad-clip", "inf"], "--grad-clip", "inf is not a finite number"),
    (["--weight-decay", "nan"], "--weight-decay", "nan is not a finite number (allowed: a finite number and >= 0)"),
    (["--early-stop-min-delta", "nan"], "--early-stop-min-delta", "nan is not a finite number"),
    (["--early-stop-min-delta", "inf"], "--early-stop-min-delta", "inf is not a finite number"),
    (["--loss-scale-init", "inf"], "--loss-scale-init", "inf is not a finite number"),
    (["--loss-scale-init", "1e30"], "--loss-scale-init", "1e+30 is out of range (allowed: >= 1 and <= 2**64)"),
    (["--seed", "99999999999"], "--seed", "99999999999 is out of range (allowed: >= 0 and <= 2147483647)"),
    (["--seed", str(MAX_SEED + 1)], "--seed", "2147483648 is out of range"),
    (["--seed", "-1"], "--seed", "-1 is out of range"),
    (["--lr", "-inf"], "--lr", "expected one argument (a value that starts with '-' needs --lr=VALUE)"),
    (["--lr", "-1e-3"], "--lr", "expected one argument (a value that starts with '-' needs --lr=VALUE)"),
    # the everyday flags (docs/everyday.md)
    (["--dropout", "nan"], "--dropout", "nan is not a finite number (allowed: a finite number and >= 0 and <= 0.9)"),
    (["--dropout", "1"], "--dropout", "1.0 is out of range (allowed: >= 0 and <= 0.9)"),
    (["--dropout=-0.1"], "--dropout", "-0.1 is out of range"),
    (["--model", "resnet18", "--dropout", "0.1"], "--dropout", "--model resnet18 has no dropout here"),
    (["--grad-clip-value", "0"], "--grad-clip-value", "0.0 is out of range (allowed: > 0)"),
    (["--grad-clip-value", "inf"], "--grad-clip-value", "inf is not a finite number"),
    (["--grad-clip", "1", "--grad-clip-value", "1"], "--grad-clip-value", "clips by value; --grad-clip clips by norm"),
    (["--val-every-steps", "0"], "--val-every-steps", "0 is out of range (allowed: >= 1)"),
    (["--checkpoint-every-steps=-5"], "--checkpoint-every-steps", "-5 is out of range (allowed: >= 1)"),
    (["--limit-train-batches", "0"], "--limit-train-batches", "0 is out of range (allowed: an integer N >= 1"),
    (["--limit-train-batches", "1.5"], "--limit-train-batches", "1.5 is out of range"),
    (["--limit-train-batches", "nan"], "--limit-train-batches", "nan is out of range"),
    (["--limit-val-batches", "inf"], "--limit-val-batches", "inf is out of range"),
    (["--limit-val-batches", "some"], "--limit-val-batches", "'some' is not a number"),
    (["--limit-val-batches=-2"], "--limit-val-batches", "-2 is out of range"),
    (["--max-time", "nan"], "--max-time", "'nan' is not a duration (allowed: DD:HH:MM:SS, HH:MM:SS, MM:SS or seconds"),
    (["--max-time", "inf"], "--max-time", "'inf' is not a duration"),
    (["--max-time", "0"], "--max-time", "0 is out of range"),
    (["--max-time", "1:2:3:4:5"], "--max-time", "'1:2:3:4:5' is not a duration"),
    (["--max-time", "00:1.5:00"], "--max-time", "'00:1.5:00' is not a duration"),
    (["--max-time=-10"], "--max-time", "'-10' is not a duration"),
    (["--max-time", "1e30"], "--max-time", "1e30 is out of range"),
    (["--profile-steps", "5"], "--profile-steps", "'5' is not a window A:B of steps (allowed: two integers 0 <= A < B"),
    (["--profile-steps", "7:3"], "--profile-steps", "'7:3' is not a window A:B of steps"),
    (["--profile-steps", "a:b"], "--profile-steps", "'a:b' is not a window A:B of steps"),
    (["--profile-steps=-1:3"], "--profile-steps", "'-1:3' is not a window A:B of steps"),
    (["--summary-depth=-1"], "--summary-depth", "-1 is out of range (allowed: >= 0)"),
    (["--fast-dev-run", "--resume", "auto"], "--fast-dev-run", "keeps no outputs and trains one step"),
    (["--activation-checkpointing", "full"], "--activation-checkpointing",
     "--model cnn has no repeated blocks to checkpoint (allowed: none, or --model gpt or resnet18)"),
    (["--activation-checkpointing", "some"], "--activation-checkpointing", "invalid choice: 'some'"),
    (["--optimizer-impl", "apex"], "--optimizer-impl", "invalid choice: 'apex'"),
    (["--compile", "blocks"], "--compile", "--model cnn has no repeated blocks to compile one by one"),
    (["--compile", "all"], "--compile", "invalid choice: 'all'"),
]


@pytest.mark.parametrize("argv,flag,text", NUMBERS, ids=[" ".join(a) for a, _, _ in NUMBERS])
def test_bad_numbers_are_one_line_exit_2(argv, flag, text, empty_cwd, capsys):
    out = empty_cwd / "run"
    assert run_cli(argv + ["--out-dir", str(out)]) == 2
    line = assert_one_line(capsys.readouterr().err, flag)
    assert line.startswith(f"error: {flag}: {text}"), line
    assert_nothing_written(empty_cwd)


# apex's O2 flags, through launch/apex_o2.py (the only script that takes --precision 16-o2 and --loss-scale-max)
O2_NUMBERS = [
    (["--loss-scale-max", "nan"], "--loss-scale-max", "nan is not a finite number"),
    (["--loss-scale-max", "1e39"], "--loss-scale-max", "1e+39 is out of range (allowed: >= 1 and <= 2**64)"),
    (["--precision", "16-o2", "--loss-scale-init", "1e8"], "--loss-scale-init",
     "1e+08 is above --loss-scale-max 2**24 (allowed: <= 2**24)"),
    (["--loss-scale-init", "1e8"], "--loss-scale-init", "1e+08 is above --loss-scale-max 2**24"),  # the default
]


@pytest.mark.parametrize("argv,flag,text", O2_NUMBERS, ids=[" ".join(a) for a, _, _ in O2_NUMBERS])
def test_bad_o2_numbers_are_one_line_exit_2(argv, flag, text, empty_cwd, capsys):
    assert run_cli(argv + ["--out-dir", str(empty_cwd / "run")], script="apex_o2", module=apex_o2,
                   config_cls=ApexO2Config) == 2
    line = assert_one_line(capsys.readouterr().err, flag)
    assert line.startswith(f"error: {flag}: {text}"), line
    assert_nothing_written(empty_cwd)


def _float_fields(config_cls):
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        base = hints[f.name]
        if typing.get_origin(base) is typing.Union:
            base = next(t for t in typing.get_args(base) if t is not type(None))
        if base is float:
            yield f.name


FLOAT_FLAGS = [(script, module, cls, name) for script, module, cls in SCRIPTS for name in _float_fields(cls)]


@pytest.mark.parametrize("script,module,config_cls,name", FLOAT_FLAGS,
                         ids=[f"{s}--{n.replace('_', '-')}" for s, _, _, n in FLOAT_FLAGS])
def test_every_float_flag_of_every_script_refuses_nan_and_inf(script, module, config_cls, name, empty_cwd, capsys):
    """Generic (check_bounds): `x < min` is False for nan, so a bound alone lets nan through."""
    flag = "--" + name.replace("_", "-")
    for value in ("nan", "inf", "-inf"):
        status = run_cli([f"{flag}={value}", "--out-dir", str(empty_cwd / "run")], script=script, module=module,
                         config_cls=config_cls, train=_never_trains)
        assert status == 2, (flag, value)
        line = assert_one_line(capsys.readouterr().err, flag)
        assert line.startswith(f"error: {flag}: {value} is not a finite number (allowed: a finite number"), line
    assert_nothing_written(empty_cwd)


@pytest.mark.parametrize("value", ["1e300", "1e8"])
def test_dist_timeout_past_what_timedelta_and_torch_take_is_refused(value, empty_cwd, capsys):
    """datetime.timedelta(seconds=1e300) raises OverflowError inside setup(): a traceback after start-up. The guard
    is max=1e7 on DDPConfig.dist_timeout_s (manual_train/loops/ddp.py); without it the value reaches training, which
    here fails the test (_never_trains) instead of starting a run."""
    status = run_cli(["--dist-timeout-s", value, "--out-dir", str(empty_cwd / "run")], script="ddp", module=ddp,
                     config_cls=ddp.DDPConfig, train=_never_trains)
    assert status == 2
    line = assert_one_line(capsys.readouterr().err, "--dist-timeout-s")
    assert "is out of range (allowed: > 0 and <= 1e+07)" in line
    assert_nothing_written(empty_cwd)


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_dist_timeout_nan_and_inf_are_refused(value, empty_cwd, capsys):
    status = run_cli(["--dist-timeout-s", value, "--out-dir", str(empty_cwd / "run")], script="ddp", module=ddp,
                     config_cls=ddp.DDPConfig)
    assert status == 2
    assert_one_line(capsys.readouterr().err, "--dist-timeout-s")
    assert_nothing_written(empty_cwd)


def test_the_largest_seed_is_taken_and_stays_a_valid_seed_on_2_to_the_31_ranks(tmp_path):
    cfg = parse_config(Config, ["--seed", str(MAX_SEED), "--out-dir", str(tmp_path / "run")])
    assert cfg.seed == 2 ** 31 - 1
    np.random.seed(cfg.seed + 2 ** 31)  # seed + rank for the last rank promised: numpy takes it (< 2**32)
    with pytest.raises(ValueError):
        np.random.seed(2 ** 32)  # what --seed 99999999999 (or seed + rank past 2**32 - 1) used to reach


def test_loss_scale_init_above_max_is_allowed_where_no_max_applies(tmp_path):
    """--loss-scale-max caps 16-o2's scaler only; 16-mixed's GradScaler has no cap, so no cross check."""
    cfg = parse_config(Config, ["--loss-scale-init", "1e8", "--out-dir", str(tmp_path / "run")])
    assert cfg.loss_scale_init == 1e8


# ---------------------------------------------------------------------- 3. paths
def _deep(root: Path, length: int) -> str:
    """A path under root about `length` bytes long, of 200-byte names (each within NAME_MAX)."""
    parts, total = [], len(str(root))
    while total < length:
        parts.append("d" * 200)
        total += 201
    return str(root.joinpath(*parts))


# (argv, flag, the line's text after "error: --flag: " as a regular expression); NAME_MAX 255, PATH_MAX 4096
PATHS = [
    (["--out-dir", "{tmp}/" + "x" * 300], "--out-dir", r"the name x{20}\.\.\. is 300 bytes long, over this file "
                                                       r"system's limit \(allowed: names of at most \d+ bytes\)"),
    (["--out-dir", "{deep5000}"], "--out-dir", r"the path is \d+ bytes long, and files inside it need 160 more; "
                                               r"the OS allows \d+ \(allowed: a path of at most \d+ bytes\)"),
    # fits PATH_MAX, but not with the run's files inside it
    (["--out-dir", "{deep4000}"], "--out-dir", r"the path is 4\d\d\d bytes long, and files inside it need 160"),
    (["--resume", "{tmp}/" + "y" * 300 + ".pt"], "--resume", r"the name y{20}\.\.\. is 303 bytes long"),
    (["--resume", "{deep5000}/last.pt"], "--resume", r"the path is \d+ bytes long; the OS allows"),
    (["--data-root", "{tmp}/" + "z" * 300], "--data-root", r"the name z{20}\.\.\. is 300 bytes long"),
    (["--out-dir", ""], "--out-dir", r"is empty \(allowed: a path\)$"),
    (["--resume", ""], "--resume", r"is empty"),
    (["--out-dir", "/proc/x"], "--out-dir", r"/proc is not writable: cannot create a folder in it \(.+\)$"),
    (["--out-dir", "/proc/self/status/run"], "--out-dir", r"/proc/self/status exists and is not a directory$"),
]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="Linux paths")
@pytest.mark.parametrize("argv,flag,text", PATHS, ids=[" ".join(a)[:40] for a, _, _ in PATHS])
def test_bad_paths_are_one_line_exit_2(argv, flag, text, empty_cwd, capsys):
    """Today's failures: OSError [Errno 36] File name too long, or (/proc, where os.access says root may
    write) a traceback from mkdir after the set-up."""
    subs = {"{tmp}": str(empty_cwd), "{deep5000}": _deep(empty_cwd, 5000), "{deep4000}": _deep(empty_cwd, 4000)}
    for key, value in subs.items():
        argv = [a.replace(key, value) for a in argv]
    assert run_cli(argv) == 2
    line = assert_one_line(capsys.readouterr().err, flag)
    assert re.match(f"error: {flag}: {text}", line), line
    assert_nothing_written(empty_cwd)
    assert not Path("/proc/x").exists()


def test_the_creatability_probe_leaves_nothing_behind(tmp_path):
    """The probe makes a folder where --out-dir would go and removes it: an existing or a new out dir."""
    parse_config(Config, ["--out-dir", str(tmp_path / "a" / "b")])
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "given").mkdir()
    parse_config(Config, ["--out-dir", str(tmp_path / "given")])
    assert list((tmp_path / "given").iterdir()) == []


def test_a_path_just_within_the_limits_is_taken(tmp_path):
    parse_config(Config, ["--out-dir", str(tmp_path / ("x" * 255)), "--data-root", str(tmp_path / ("d" * 255))])


def test_bad_paths_through_the_real_script(tmp_path):
    """End to end: a subprocess as a user runs it, one for a number and one for a path."""
    proc = run_script("single", "--lr", "nan", "--out-dir", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["error: --lr: nan is not a finite number (allowed: a finite number and > 0)"]
    assert not (tmp_path / "r").exists()
    proc = run_script("single", "--out-dir", "/proc/x")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "error: --out-dir: /proc is not writable: cannot create a folder in it (No such file or directory)"]
    assert not Path("/proc/x").exists()


# ---------------------------------------------------------------------- 4. default run folders never collide
def test_two_runs_started_in_the_same_second_get_different_default_folders(empty_cwd, monkeypatch):
    monkeypatch.setattr(config_module.time, "strftime", lambda fmt, *a: "20260101-120000")
    chosen = []

    def train(cfg):  # what every loop does first with the folder (rank 0 under torchrun, then broadcast)
        chosen.append(cfg.run_dir("single"))

    for _ in range(2):
        assert run_cli(["--no-progress"], train=train) == 0
    assert chosen[0] != chosen[1]
    for path in chosen:
        assert re.fullmatch(r"runs/single-20260101-120000-[0-9a-f]{6}", str(path)), path
    assert_nothing_written(empty_cwd)  # run_dir only names it; the loop's RunLog creates it


# ---------------------------------------------------------------------- 5. one default per flag in --help
@pytest.mark.parametrize("script,module,config_cls", SCRIPTS, ids=[s for s, _, _ in SCRIPTS])
def test_help_shows_one_default_per_flag(script, module, config_cls, capsys):
    assert run_cli(["--help"], script=script, module=module, config_cls=config_cls) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text
    assert not re.search(r"\(default:[^)]*\)\s*\(default:", text), re.search(r".{80}\(default:[^)]*\)\s*\(default:",
                                                                             text)
    assert "(default: on for CUDA)" in text and "(default: on for CUDA) (default" not in text
    assert "(default:runs/<script>-<YYYYmmdd-HHMMSS>-<6randomhexdigits>,newforeveryrun)" in "".join(text.split())
    assert "(default: 0)" in text  # --seed: a real default is still shown


# ---------------------------------------------------------------------- 6. find_batch_size offers its flags only
def test_find_batch_size_help_lists_only_the_flags_it_uses(capsys):
    with pytest.raises(SystemExit) as e:
        find_batch_size.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    options = text.split("options:", 1)[1]
    flags = set(re.findall(r"^\s+(--[a-z-]+)", options, re.M))
    assert flags == {"--dataset", "--data-root", "--download", "--synthetic-size", "--synthetic-shape",
                     "--synthetic-classes", "--model", "--optimizer", "--optimizer-impl", "--precision",
                     "--activation-checkpointing", "--device", "--seed", "--memory-budget-bytes", "--start",
                     "--max-batch-size", "--trial"}
    assert "(default: the training set size)" in " ".join(text.split())
    assert "(default: None)" not in text


@pytest.mark.parametrize("argv,flag", [(["--epochs", "3"], "--epochs"), (["--out-dir", "x"], "--out-dir"),
                                       (["--seed", "99999999999"], "--seed"),
                                       (["--memory-budget-bytes", "0"], "--memory-budget-bytes"),
                                       (["--precision", "apex-o2", "--memory-budget-bytes", "9"], "--precision")])
def test_find_batch_size_refuses_training_flags_and_bad_values(argv, flag, empty_cwd, capsys):
    try:
        status = find_batch_size.main(argv)
    except SystemExit as e:
        status = e.code
    assert status == 2
    assert_one_line(capsys.readouterr().err, flag)
    assert_nothing_written(empty_cwd)


# ---------------------------------------------------------------------- 7. under torchrun
def test_a_quiet_rank_that_refuses_waits_to_be_stopped_then_says_why_itself(tmp_path, monkeypatch, capsys):
    """Local rank 1 under torchrun (as_torchrun_rank's environment) refuses silently while it waits for torchrun to
    stop it (QUIET_RANK_WAIT_S); a refusal only it meets, not stopped, is then said by it: one line, exit 2. Its
    wait is shortened here and counted: one full wait, not none."""
    from manual_train import cli

    as_torchrun_rank(monkeypatch, rank=1)
    waits = []
    monkeypatch.setattr(cli, "QUIET_RANK_WAIT_S", 0.01)
    monkeypatch.setattr(cli.time, "sleep", lambda s: waits.append(s))
    status = run(ddp.train, ddp.DDPConfig, script="ddp", argv=["--seed", "99999999999", "--out-dir",
                                                                str(tmp_path / "run")])
    line = assert_one_line(capsys.readouterr().err, "--seed")
    assert status == 2 and waits == [0.01], waits
    assert line.endswith("(rank 1; local rank 0 did not end the job)") and not (tmp_path / "run").exists()


def test_under_torchrun_one_error_line_then_torchruns_report_and_exit_1(tmp_path):
    """The honest behaviour (docs/what-happens-when.md): local rank 0 prints the one line and exits 2;
    torchrun then prints its ChildFailedError report and exits 1 whatever its workers returned. Local rank 0 starts
    2 s after rank 1 (tests/faults.py's --late-s; launch/ddp.py otherwise): the quiet rank, which refuses first, must
    not exit before rank 0 has said why (torchrun stops the other workers when one exits: on a loaded machine the
    suite saw no line at all)."""
    proc = run_script("tests/faulty_ddp", "--fail-at-step", "0", "--late-s", "2", "--seed", "99999999999",
                      "--out-dir", str(tmp_path / "run"), launcher=torchrun(2), timeout=180)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: --seed: 99999999999 is out of range (allowed: >= 0 and <= 2147483647)"], proc.stderr
    assert proc.returncode == 1, "torchrun's own status (if this changes, update docs/what-happens-when.md)"
    assert "ChildFailedError" in proc.stderr and re.search(r"exitcode\s*: 2 ", proc.stderr)
    assert "manual_train/" not in proc.stderr, "no worker traceback: the only traceback is torchrun's own"
    assert not (tmp_path / "run").exists()
