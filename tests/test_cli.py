"""The CLI contract of launch/single.py: outputs, help, and one-line errors for bad input."""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import run_script

from manual_train.cli import run
from manual_train.loops import single
from manual_train.metrics import CSV_COLUMNS, SUMMARY_KEYS


def test_smoke_run_writes_the_outputs_contract(tmp_path):
    out = tmp_path / "run"
    proc = run_script("single", "--epochs", "2", "--max-steps", "30", "--log-every", "5", "--out-dir", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "global batch 32" in proc.stdout and "val_acc" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert set(SUMMARY_KEYS) <= summary.keys()
    assert summary["optimizer_steps"] == 30 and summary["samples_seen"] == 30 * 32
    assert summary["script"] == "single" and summary["world_size"] == 1 and summary["global_batch_size"] == 32
    assert 0 <= summary["data_wait_fraction"] < 1 and summary["peak_mem_bytes"] > 0
    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0].keys()) == CSV_COLUMNS
    train_steps = [int(r["step"]) for r in rows if r["split"] == "train"]
    assert train_steps == [5, 10, 15, 20, 25, 30]
    assert [r["split"] for r in rows].count("val") == 1  # max-steps ends inside epoch 1: one final eval
    ckpt = torch.load(out / "last.pt", weights_only=True)
    for key in ("model", "optimizer", "scheduler", "scaler", "epoch", "step", "rng", "early_stopping", "config",
                "world_size"):
        assert key in ckpt
    assert ckpt["step"] == 30 and ckpt["world_size"] == 1 and ckpt["config"]["batch_size"] == 32
    assert all(v.dtype == torch.float32 for v in ckpt["model"].values())
    assert not list(out.glob(".*tmp*")), "no temporary files left behind"


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit) as e:
        run(single.train, script="single", doc=single.__doc__, argv=["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--dataset", "--accumulate", "--precision", "--num-workers", "--pin-memory", "--no-pin-memory",
                 "--eval-mode", "--early-stop-patience", "--resume", "--lr-scaling", "--max-steps"):
        assert flag in text
    assert "python launch/single.py" in text  # the docstring's commands come first
    assert "(default: digits)" in text


# (argv, the flag the one error line must name)
BAD_INPUT = [
    (["--dataset", "imagenet"], "--dataset"),
    (["--model", "vit"], "--model"),
    (["--precision", "fp8"], "--precision"),
    (["--device", "tpu"], "--device"),
    (["--device", "cuda:7"], "--device"),
    (["--batch-size", "0"], "--batch-size"),
    (["--accumulate", "-2"], "--accumulate"),
    (["--lr", "0"], "--lr"),
    (["--epochs", "abc"], "--epochs"),
    (["--max-steps", "0"], "--max-steps"),
    (["--num-workers", "-1"], "--num-workers"),
    (["--persistent-workers"], "--persistent-workers"),
    (["--prefetch-factor", "4"], "--prefetch-factor"),
    (["--dataset", "mnist", "--data-root", "{tmp}/no-such-dir"], "--data-root"),
    (["--out-dir", "{tmp}/a-file/run"], "--out-dir"),
    (["--resume", "{tmp}/missing.pt"], "--resume"),
    (["--model", "seq2seq"], "--model"),
    (["--synthetic-shape", "3,x,4", "--dataset", "synthetic"], "--synthetic-shape"),
    (["--precision", "apex-o2"], "--precision"),  # launch/apex_o2.py's (tests/test_apex_o2.py)
    (["--precision", "16-o2"], "--precision"),
    (["--grad-clip", "-1"], "--grad-clip"),
    (["--unknown-flag"], "--unknown-flag"),
]


@pytest.mark.parametrize("argv,flag", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_naming_the_flag_exit_2(tmp_path, capsys, monkeypatch, argv, flag):
    if "{tmp}/a-file/run" in argv:
        (tmp_path / "a-file").write_text("not a directory")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    monkeypatch.chdir(tmp_path)  # the default out dir would be ./runs/...: prove nothing is created
    try:
        code = run(single.train, script="single", doc=single.__doc__, argv=argv)
    except SystemExit as e:  # argparse's own errors (unknown flag, bad type, bad choice)
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"error: {flag}"), lines[0]
    assert "Traceback" not in err
    assert not (tmp_path / "runs").exists()
    leftovers = [p for p in tmp_path.rglob("*") if p.suffix == ".pt" or p.name == "metrics.csv"]
    assert leftovers == []


def test_bad_input_through_the_real_script(tmp_path):
    """The same contract end to end: a subprocess, its exit status and its stderr."""
    proc = run_script("single", "--batch-size", "0", "--out-dir", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: --batch-size: 0 is out of range (allowed: >= 1)"]
    assert not (tmp_path / "r").exists()
    proc = run_script("single", "--dataset", "cifar10", "--data-root", str(tmp_path / "nope"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "--download" in proc.stderr and "Traceback" not in proc.stderr


def _refused(cfg):
    raise AssertionError(f"an unwritable --out-dir reached training: {cfg.out_dir}")


def _unwritable_dirs(tmp_path):
    """Existing folders in which no folder can be made. /proc and /sys (Linux) refuse everyone, root included
    (where os.access says root may write: the check tries instead), so the case runs as root too, as in CI; a folder
    without write permission refuses everyone but root, so it is added for a non-root user."""
    dirs = [Path(d) for d in ("/proc", "/sys") if os.path.isdir(d)]
    assert dirs or os.geteuid() != 0, "no folder here refuses root: nothing to check the refusal with"
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        dirs.append(ro)
    return dirs


def test_unwritable_out_dir(tmp_path, capsys, monkeypatch):
    """An out dir that cannot be created is one line naming it, exit 2, before any work, and nothing is made."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    for parent in _unwritable_dirs(tmp_path):
        out = parent / "manual-train-run"
        code = run(_refused, script="single", doc=single.__doc__, argv=["--out-dir", str(out)])
        err = capsys.readouterr().err
        assert code == 2, (parent, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err, err
        assert lines[0].startswith(f"error: --out-dir: {parent} is not writable: cannot create a folder in it ("), \
            lines[0]
        assert not out.exists()
        if parent.is_relative_to(tmp_path):
            assert list(parent.iterdir()) == []
    assert list(cwd.iterdir()) == [], "nothing written in the working folder (no default runs/)"
