"""Nothing lost, nothing faked: a resume cannot destroy or fake a finished run's results, a resume that would
not continue the same training is refused in one line, runs cannot collide in one folder, killed writers leave
nothing behind, and everything a user reads counts epochs from 1. Through the real CLI entry (cli.run)."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, make_cfg

from manual_train.checkpoint import save_checkpoint
from manual_train.cli import run
from manual_train.config import UsageError
from manual_train.loops import single
from manual_train.metrics import RunLog

QUICK = ["--model", "mlp", "--no-progress"]


def snapshot(folder):
    """Every file's bytes and modification time: equal snapshots mean nothing was touched."""
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def one_error_line(capsys, flag: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {flag}:"), err
    return err[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished two-epoch run (cosine schedule) and a finished constant-schedule one."""
    root = tmp_path_factory.mktemp("finished")
    for name, extra in (("cosine", []), ("constant", ["--schedule", "constant"])):
        assert run(single.train, script="single", argv=[*QUICK, "--epochs", "2", *extra,
                                                        "--out-dir", str(root / name)]) == 0
    return root


def test_resuming_a_finished_run_says_so_and_touches_nothing(finished, capsys):
    before = snapshot(finished / "cosine")
    code = run(single.train, script="single", argv=[*QUICK, "--epochs", "2", "--out-dir", str(finished / "cosine"),
                                                    "--resume", "auto"])
    out = capsys.readouterr()
    assert code == 0 and out.err == ""
    assert out.out.strip().splitlines() == ["nothing to do: the checkpoint's run is finished (all 94 steps done); "
                                            "its outputs are left as they are (a --schedule constant run trains "
                                            "on when resumed with more --epochs or --max-steps)"]
    assert snapshot(finished / "cosine") == before
    summary = json.loads((finished / "cosine" / "summary.json").read_text())
    assert summary["final_val_loss"] is not None and summary["wall_s"] > 0.01  # the real results, not a fake


@pytest.mark.parametrize("argv, flag, words", [
    (["--epochs", "1"], "--epochs", "changes the length of the cosine LR schedule"),  # a run of 2 epochs resumed with 1
    (["--epochs", "3"], "--epochs", "changes the length of the cosine LR schedule"),
    (["--epochs", "2", "--batch-size", "64"], "--batch-size", "global batch 64 differs from the checkpoint's 32"),
    (["--epochs", "2", "--lr", "0.1"], "--resume", "checkpoint was trained with --lr 0.05, this run has 0.1"),
    (["--epochs", "2", "--seed", "1"], "--resume", "checkpoint was trained with --seed 0, this run has 1"),
])
def test_a_resume_that_changes_what_is_trained_is_one_line(finished, tmp_path, capsys, argv, flag, words):
    code = run(single.train, script="single", argv=[*QUICK, *argv, "--resume", str(finished / "cosine" / "last.pt"),
                                                    "--out-dir", str(tmp_path / "new")])
    assert code == 2 and words in one_error_line(capsys, flag)
    assert not (tmp_path / "new").exists()  # nothing written


def test_a_constant_schedule_run_can_be_extended_but_not_shortened(finished, tmp_path, capsys):
    ckpt = str(finished / "constant" / "last.pt")
    code = run(single.train, script="single", argv=[*QUICK, "--schedule", "constant", "--epochs", "1",
                                                    "--resume", ckpt, "--out-dir", str(tmp_path / "short")])
    assert code == 2 and "ends after 47 optimizer steps, before the checkpoint's step 94" in one_error_line(
        capsys, "--epochs")
    code = run(single.train, script="single", argv=[*QUICK, "--schedule", "constant", "--epochs", "3",
                                                    "--resume", ckpt, "--out-dir", str(tmp_path / "longer")])
    assert code == 0
    summary = json.loads((tmp_path / "longer" / "summary.json").read_text())
    assert summary["optimizer_steps"] == 3 * 47 and summary["final_val_loss"] is not None


def test_the_same_global_batch_may_be_split_otherwise_at_an_epoch_end(tmp_path):
    """16 x accumulate 2 continues a batch-32 checkpoint (one global batch); it must match the straight run."""
    flags = dict(model="mlp", schedule="constant", precision="64-true")
    straight = single.train(make_cfg(tmp_path / "a", out_dir=str(tmp_path / "a"), epochs=2, **flags))
    single.train(make_cfg(tmp_path / "b", out_dir=str(tmp_path / "b"), epochs=1, **flags))
    resumed = single.train(make_cfg(tmp_path / "c", out_dir=str(tmp_path / "c"), epochs=2, batch_size=16,
                                    accumulate=2, resume=str(tmp_path / "b" / "last.pt"), **flags))
    assert resumed["optimizer_steps"] == straight["optimizer_steps"] == 2 * 47
    assert resumed["final_val_loss"] == pytest.approx(straight["final_val_loss"], rel=1e-12)


def test_synthetic_size_must_match(tmp_path, capsys):
    seq = ["--dataset", "reverse", "--model", "seq2seq", "--max-steps", "2", "--schedule", "constant",
           "--no-progress"]
    assert run(single.train, script="single", argv=[*seq, "--synthetic-size", "64", "--out-dir",
                                                    str(tmp_path / "a")]) == 0
    capsys.readouterr()
    code = run(single.train, script="single", argv=[*seq, "--max-steps", "4", "--synthetic-size", "128",
                                                    "--resume", str(tmp_path / "a" / "last.pt"),
                                                    "--out-dir", str(tmp_path / "b")])
    assert code == 2 and "--synthetic-size 64, this run has 128" in one_error_line(capsys, "--resume")


def test_claiming_a_folder_is_atomic(tmp_path):
    """The second of two fresh runs that both passed the "is it free" check is refused when it claims it."""
    first = RunLog(tmp_path / "run")
    with pytest.raises(UsageError, match="--out-dir: .* was just claimed by another run"):
        RunLog(tmp_path / "run")
    first.close()


@pytest.mark.slow
def test_two_runs_started_together_into_one_folder_one_wins_one_line(tmp_path):
    cmd = [sys.executable, str(REPO / "launch" / "single.py"), *QUICK, "--max-steps", "3", "--out-dir",
           str(tmp_path / "shared")]
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
    assert sorted(code for code, _ in results) == [0, 2], results
    loser = next(err for code, err in results if code == 2).strip().splitlines()
    assert len(loser) == 1 and loser[0].startswith("error: --out-dir:"), loser
    assert json.loads((tmp_path / "shared" / "summary.json").read_text())["optimizer_steps"] == 3


def test_default_folders_of_runs_started_in_the_same_second_differ(tmp_path):
    from manual_train.config import Config

    names = {Config().run_dir("single").name for _ in range(2)}  # same process, same second
    other = subprocess.run([sys.executable, "-c", "from manual_train.config import Config; "
                            "print(Config().run_dir('single').name)"], cwd=REPO, capture_output=True, text=True)
    assert other.stdout.strip() and other.stdout.strip() not in names  # another process, another name


def test_a_killed_writers_temp_file_is_removed_on_the_next_start(tmp_path):
    out = tmp_path / "run"
    single.train(make_cfg(tmp_path, out_dir=str(out), model="mlp", max_steps=2, schedule="constant"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs, as after a SIGKILL mid-save
    (out / f".last.pt.tmp-{dead.pid}").write_bytes(b"half a checkpoint")
    (out / f".last.pt.tmp-{os.getppid()}").write_bytes(b"a live writer's")  # pytest's parent is alive
    single.train(make_cfg(tmp_path, out_dir=str(out), model="mlp", max_steps=4, schedule="constant",
                          resume="auto"))
    assert not (out / f".last.pt.tmp-{dead.pid}").exists()
    assert (out / f".last.pt.tmp-{os.getppid()}").exists()


def test_a_run_that_fails_before_its_first_step_leaves_no_folder(tmp_path, capsys, monkeypatch):
    def broken_loss(logits, y):
        raise UsageError("--model", "broken on purpose")

    monkeypatch.setattr(single, "loss_fn", broken_loss)
    code = run(single.train, script="single", argv=[*QUICK, "--out-dir", str(tmp_path / "run")])
    assert code == 2 and not (tmp_path / "run").exists()
    monkeypatch.undo()
    assert run(single.train, script="single", argv=[*QUICK, "--max-steps", "2", "--out-dir",
                                                    str(tmp_path / "run")]) == 0  # the folder is free


def test_epochs_count_from_one_in_everything_a_user_reads(finished):
    """The console's "epoch 2/2", metrics.csv's epoch column and summary.json's best_epoch agree."""
    folder = finished / "cosine"
    with open(folder / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows if r["split"] == "val"] == [1, 2]
    assert {int(r["epoch"]) for r in rows if r["split"] == "train"} == {1, 2}
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["best_epoch"] in (1, 2) and summary["epochs_run"] == 2
    ckpt = torch.load(folder / "best.pt", weights_only=True)
    assert ckpt["epoch"] == summary["best_epoch"]  # best.pt was written at the end of that (1-based) epoch


def test_save_checkpoint_leaves_no_temp_file(tmp_path):
    save_checkpoint({"x": torch.ones(1)}, tmp_path / "last.pt")
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_no_progress_bar_into_a_log_file():
    """Where stderr is a file (not a terminal) tqdm's carriage-return redraws would interleave with the epoch
    lines: no bar there (pytest captures stderr into a file, so the bar must come out disabled)."""
    from manual_train.metrics import progress_bar

    assert not sys.stderr.isatty() and progress_bar(10, 0, enabled=True).disable
