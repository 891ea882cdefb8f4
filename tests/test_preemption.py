"""Preemption: SIGTERM or SIGUSR1 mid-epoch (what Slurm sends before its SIGKILL, and spot VMs and Kubernetes too)
saves a checkpoint at the next optimizer-step boundary, on which every rank agrees, and exits 75 for a requeue;
`--resume auto` then ends bit for bit where the uninterrupted run ends (manual_train/run.py, docs/checkpointing.md).

The signal is real: tests/faults.py's term/usr1 modes make one rank send it to itself in the middle of an optimizer
step (inside the loss), as a notice arriving at any moment would, and the other ranks get none. The runs compared
are one code path on one CPU, so bit for bit holds in 32-true as in 64-true.
"""
from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from conftest import (DDP_TORCHRUN_FLAGS, SINGLE_SCRIPT_FLAGS, ZERO_TORCHRUN_FLAGS, assert_same_path_bitwise,
                      final_weights, run_script, torchrun)
from manual_train import checkpoint as ckpt_io
from manual_train.cli import run
from manual_train.errors import Preempted
from manual_train.loops import single

SIGNAL_AT = 5  # optimizer steps done when the signal arrives: it lands in step 6, which is finished and saved
SINGLE = list(SINGLE_SCRIPT_FLAGS)  # the mlp, 2 epochs at batch 64 (24 steps an epoch), 32-true unless said


def stopped_by_signal(out_dir, name: str) -> dict:
    """The interrupted run's summary and checkpoint: stopped by `name`, saved after step SIGNAL_AT + 1, mid-epoch."""
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["stop_reason"] == "signal" and summary["signal"] == name, summary
    path = out_dir / "last.dcp" if (out_dir / "last.dcp").exists() else out_dir / "last.pt"
    saved = ckpt_io.load_checkpoint(path, full=False)
    assert (saved["step"], saved["epoch"]) == (SIGNAL_AT + 1, 0) and saved["progress"]["micro_steps_done"] > 0
    assert not [p.name for p in out_dir.iterdir() if ".tmp-" in p.name]
    return summary


@pytest.mark.parametrize("mode, name, precision", [("term", "SIGTERM", "32-true"), ("usr1", "SIGUSR1", "64-true")])
def test_one_process_saves_within_the_step_exits_75_and_resumes_bitwise(tmp_path, mode, name, precision, request):
    """All three runs are launch scripts (fresh processes): bit for bit is a claim about one code path in one kind of
    process. The 32-true uninterrupted run is conftest's single_script_uninterrupted (the same flags; once per pytest
    run: tests/test_storage_faults.py compares with it too)."""
    argv = [*SINGLE, "--precision", precision]
    if precision == "32-true":  # the default: the shared run's flags
        full = request.getfixturevalue("single_script_uninterrupted")
    else:
        full = tmp_path / "full"
        assert run_script("single", *argv, "--out-dir", str(full)).returncode == 0
    proc = run_script("tests/faulty_single", "--fail-at-step", str(SIGNAL_AT), "--fail-mode", mode, *argv,
                      "--out-dir", str(tmp_path / "cut"))
    assert proc.returncode == Preempted.EXIT_STATUS == 75, proc.stderr[-3000:]
    err = proc.stderr.strip().splitlines()
    assert err == [f"stopped by {name} after step {SIGNAL_AT + 1}: {tmp_path / 'cut' / 'last.pt'} saved; requeue "
                   "or rerun with --resume auto (exit status 75)"], proc.stderr[-3000:]
    stopped_by_signal(tmp_path / "cut", name)
    proc = run_script("single", *argv, "--out-dir", str(tmp_path / "cut"), "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"at step {SIGNAL_AT + 1}, in epoch 1" in proc.stdout  # a resume, not a rerun from scratch
    assert_same_path_bitwise(final_weights(full), final_weights(tmp_path / "cut"), "resumed")


@pytest.mark.parametrize("script, argv, mode", [
    ("ddp", list(DDP_TORCHRUN_FLAGS), "term"), ("zero", list(ZERO_TORCHRUN_FLAGS), "usr1")],
                         ids=["ddp-sigterm", "zero-fsdp2-dcp-sigusr1"])
def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step(tmp_path, script, argv, mode, request):
    """torchrun, 2 ranks: rank 1 alone gets the signal during step 6. Both ranks agree after step 6 (a 1-element
    all-reduce per step on a gloo group), save (FSDP2: each rank its DCP shards), exit 75 (torchrun then reports the
    failed workers and exits 1, as it does for any worker status but 0); the resumed job ends where the
    uninterrupted one does. The uninterrupted jobs are conftest's, with the same flags (one job each per pytest
    run): ddp_torchrun_uninterrupted (tests/test_ddp_torchrun.py reads it too) and zero_torchrun_uninterrupted (FSDP2
    with DCP checkpoints; tests/test_zero_parity.py holds it to the DDP loop)."""
    full = request.getfixturevalue(f"{script}_torchrun_uninterrupted")[0]
    proc = run_script(f"tests/faulty_{script}", "--fail-at-step", str(SIGNAL_AT), "--fail-rank", "1", "--fail-mode",
                      mode, *argv, "--out-dir", str(tmp_path / "cut"), launcher=torchrun(2))
    assert proc.returncode == 1 and "exitcode  : 75" in proc.stderr, proc.stderr[-3000:]
    name = "SIGTERM" if mode == "term" else "SIGUSR1"
    assert f"stopped by {name} after step {SIGNAL_AT + 1}" in proc.stderr
    stopped_by_signal(tmp_path / "cut", name)
    proc = run_script(script, *argv, "--out-dir", str(tmp_path / "cut"), "--resume", "auto", launcher=torchrun(2))
    assert proc.returncode == 0 and f"at step {SIGNAL_AT + 1}, in epoch 1" in proc.stdout, proc.stderr[-3000:]
    assert_same_path_bitwise(final_weights(full), final_weights(tmp_path / "cut"), "resumed")


def test_a_second_signal_while_saving_changes_nothing(tmp_path, monkeypatch, capsys):
    """SIGTERM again while last.pt is being written (Slurm repeats its notice; a user presses twice): the save goes
    on, the run stops once, and its checkpoint resumes to the uninterrupted weights."""
    assert run(single.train, script="single", argv=[*SINGLE, "--out-dir", str(tmp_path / "full")]) == 0
    real_save, real_loss, calls = ckpt_io.save_checkpoint, single.loss_fn, [0]

    def loss(logits, y, **kw):
        calls[0] += 0 if kw else 1  # training's calls (evaluation's pass reduction="sum")
        if calls[0] == SIGNAL_AT + 1 and not kw:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_loss(logits, y, **kw)

    def save(state, path):
        os.kill(os.getpid(), signal.SIGTERM)  # the second notice, in the middle of the save
        real_save(state, path)

    with monkeypatch.context() as m:
        m.setattr(single, "loss_fn", loss)
        m.setattr("manual_train.run.save_checkpoint", save)
        assert run(single.train, script="single", argv=[*SINGLE, "--out-dir", str(tmp_path / "cut")]) == 75
    stopped_by_signal(tmp_path / "cut", "SIGTERM")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the run gave the handlers back
    resume = [*SINGLE, "--out-dir", str(tmp_path / "cut"), "--resume", "auto"]
    capsys.readouterr()
    assert run(single.train, script="single", argv=resume) == 0
    assert f"at step {SIGNAL_AT + 1}, in epoch 1" in capsys.readouterr().out  # a resume, not a rerun from scratch
    assert_same_path_bitwise(final_weights(tmp_path / "full"), final_weights(tmp_path / "cut"), "resumed")


def test_save_on_signal_none_leaves_the_default_and_bad_names_are_one_line(tmp_path, capsys):
    """The default disposition is the process's (a real one: it dies of the signal). A bad name is refused by the
    CLI's validation (manual_train/cli.py's run, called here as launch/single.py calls it: the launch script itself
    adds nothing to a refusal; tests/test_cli.py holds the real script's exit status 2 and its one line)."""
    proc = run_script("tests/faulty_single", "--fail-at-step", str(SIGNAL_AT), "--fail-mode", "term", *SINGLE,
                      "--save-on-signal", "none", "--out-dir", str(tmp_path / "cut"))
    assert proc.returncode == -signal.SIGTERM and not (tmp_path / "cut" / "summary.json").exists()
    for bad, words in (("KILL", "SIGKILL cannot be caught"), ("TERM,NOPE", "unknown signal NOPE")):
        capsys.readouterr()
        status = run(single.train, script="single", argv=["--save-on-signal", bad, "--out-dir", str(tmp_path / bad)])
        err = capsys.readouterr().err.strip().splitlines()
        assert status == 2 and len(err) == 1 and err[0].startswith("error: --save-on-signal: "), err
        assert words in err[0] and not (tmp_path / bad).exists()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # a refused run installs no handler


def test_sigterm_to_torchrun_reaches_the_workers_which_save_and_stop(tmp_path):
    """What Slurm's srun and Kubernetes do: SIGTERM to the torchrun agent, mid-run. The agent forwards it to its
    workers and waits for them (30 s by default, --shutdown-timeout): they agree on a step, save and exit 75; the
    agent then exits 1 with its own traceback (SignalException), as it does whenever it is signalled."""
    import subprocess
    import time

    from conftest import REPO

    out = tmp_path / "run"
    cmd = [*torchrun(2), str(REPO / "launch" / "ddp.py"), "--model", "mlp", "--epochs", "30", "--log-every", "1",
           "--no-progress", "--out-dir", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    deadline = time.monotonic() + 600
    while not (out / "metrics.csv").exists() or len((out / "metrics.csv").read_text().splitlines()) < 4:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 1 and "stopped by SIGTERM after step" in output, output[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["stop_reason"], summary["signal"]) == ("signal", "SIGTERM")
    saved = ckpt_io.load_checkpoint(out / "last.pt")
    assert saved["step"] == summary["optimizer_steps"] < 30 * 47  # stopped long before its end
