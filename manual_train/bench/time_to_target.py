"""Bench entry time_to_target: wall time until the cnn reaches val_acc 0.95 on MNIST-shaped data, three ways.

  naive     the articles' loop (`naive_loop` below): batch 32, DataLoader(shuffle=True), fp32, for-loop SGD,
            .item() every step, grad-enabled evaluation every epoch, torch's default threads
  defaults  python launch/single.py --model cnn --dataset mnist --stop-at 0.95 --monitor val_acc
  tuned     the command the tuner (manual_train.tune, run once first) wrote into tune.json, with the same flags added

The data: scikit-learn's digits (1500 train / 297 val, the `digits` split) upsampled to 20x20 and padded to 28x28,
written as MNIST IDX files and read by `--dataset mnist`: MNIST's shape with no download. Every configuration is a
fresh `python` started here (torchrun: its agent and workers), timed from the start of that process until it prints
the epoch-end evaluation that reached the target: interpreter start, imports, data loading, model build, training
and evaluations, in all three alike. Repeats interleave (naive, defaults, tuned, naive, ...); a row's ratio is the
naive time over the configuration's, per repeat. Also writes time_to_target.png (val_acc against seconds) next to
bench.json.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from manual_train.bench.harness import Bench, Goal, Outcome, interleave, median, ratio_row, value_row

REPO = Path(__file__).resolve().parents[2]
TARGET = 0.95  # val_acc: 283 of the 297 validation images (282 is 0.9495); the defaults reach it in 6-7 of 10 epochs
MODEL_FLAGS = ("--model", "cnn", "--dataset", "mnist")  # + --data-root, the folder written here
NAIVE_MAX_EPOCHS = 30  # the naive loop trains until the target (no schedule); this only bounds a broken run
CLAIM = "'10x faster' (art. 2's headline, the sum of its tricks)"
EVAL_LINE = re.compile(r"^epoch (\d+)\S*.*?\bval_acc ([0-9.]+)")  # run.py's epoch-end line, and naive_loop's
LABELS = {"naive": "naive loop", "defaults": "launch/single.py defaults", "tuned": "the tuner's command"}


# ---------------------------------------------------------------------- the naive configuration (its own process)
def naive_loop(target: float, argv: list) -> None:
    """The loop the articles start from, on the same data, initial weights and learning rate as launch/single.py."""
    import torch

    from manual_train import data
    from manual_train.bench.harness import single_config
    from manual_train.bench.speedups import naive_epoch
    from manual_train.models import build_model_from, loss_fn

    cfg = single_config(*argv)
    train_ds, val_ds, info = data.build_datasets(cfg)
    torch.manual_seed(cfg.seed)
    model = build_model_from(cfg, info)
    print(f"naive: {len(train_ds)} train / {len(val_ds)} val samples", flush=True)  # start-up done, as the banner
    # ---- the naive loop
    loader = torch.utils.data.DataLoader(train_ds, batch_size=32, shuffle=True)
    val_loader = torch.utils.data.DataLoader(val_ds, batch_size=32)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9, foreach=False)
    for epoch in range(NAIVE_MAX_EPOCHS):
        losses = naive_epoch(model, loader, optimizer, loss_fn)  # .item() every step
        correct = 0
        for x, y in val_loader:  # no torch.no_grad(): every batch records a graph
            correct += (model(x).argmax(1) == y).sum().item()
        val_acc = correct / len(val_ds)
        print(f"epoch {epoch + 1}: val_acc {val_acc:.4f} train_loss {sum(losses) / len(losses):.4f}", flush=True)
        if val_acc >= target:
            print(f"target reached: val_acc {val_acc:.4f} at epoch {epoch + 1}", flush=True)
            return
    # ----


# ---------------------------------------------------------------------- data (a forkserver child)
def _write_data_child(root: str) -> None:
    """digits' split, upsampled to 20x20 and centred in 28x28 (MNIST's layout), as train-* and t10k-* IDX files."""
    import struct

    import torch
    import torch.nn.functional as F

    from manual_train.data import load_digits_split

    raw = Path(root) / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, split in zip(("train", "t10k"), load_digits_split()):
        x, y = split.tensors
        x = F.pad(F.interpolate((x + 1) / 2, size=(20, 20), mode="bilinear", align_corners=False), (4, 4, 4, 4))
        images = (x.squeeze(1).clamp(0, 1) * 255).round().to(torch.uint8)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, len(y), 28, 28)
                                                          + images.numpy().tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, len(y))
                                                          + y.to(torch.uint8).numpy().tobytes())


# ---------------------------------------------------------------------- processes (started here, no torch)
def base_env() -> dict:
    """This process's environment without thread settings (torch's defaults, as a user's shell has them), and
    unbuffered output, so that each evaluation's line arrives when it is printed."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    return {**env, "PYTHONUNBUFFERED": "1"}


def tuned_command(tune_json: dict) -> tuple:
    """(argv, env additions) of tune.json's command: "python" is this interpreter, "torchrun" its module."""
    argv, env = list(tune_json["command"]["argv"]), dict(tune_json["command"].get("env", {}))
    starts = {"python": [sys.executable], "torchrun": [sys.executable, "-m", "torch.distributed.run"]}
    if argv[0] not in starts:
        raise ValueError(f"tune.json's command starts with {argv[0]!r}, not python or torchrun")
    return starts[argv[0]] + argv[1:], {k: str(v) for k, v in env.items()}


def run_to_target(argv: list, env: dict, log_path: Path, timeout_s: float,
                  out_dir: Optional[Path] = None) -> dict:
    """Start argv in the repository root; the seconds since its start at which each evaluation line arrived, and
    whether it stopped because it reached the target (summary.json's stop_reason; the naive loop prints its own)."""
    t0 = time.perf_counter()
    with open(log_path, "a") as log:
        log.write(f"--- {' '.join(argv)} at {time.strftime('%H:%M:%S')}\n")
        log.flush()
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                                start_new_session=True)  # its own process group: a timeout kills torchrun's workers
        killer = threading.Timer(timeout_s, os.killpg, (proc.pid, signal.SIGKILL))
        killer.start()
        curve, first_line_s, reason = [], None, ""
        for line in proc.stdout:
            now = time.perf_counter() - t0
            first_line_s = now if first_line_s is None else first_line_s
            log.write(line)
            match = EVAL_LINE.match(line)
            if match:
                curve.append((now, float(match.group(2))))
            if line.startswith("target reached"):
                reason = line.strip()
        returncode = proc.wait()
        killer.cancel()
    exit_s = time.perf_counter() - t0
    if out_dir is not None and (out_dir / "summary.json").exists():
        reason = json.loads((out_dir / "summary.json").read_text()).get("stop_reason") or ""
    reached = reason.startswith("target reached") and bool(curve)
    return {"time_to_target_s": curve[-1][0] if reached else math.nan, "reached": reached, "stop_reason": reason,
            "epochs": len(curve), "curve": curve, "first_line_s": first_line_s, "exit_s": exit_s,
            "returncode": returncode}


def _measure(name: str, argv: list, env: dict, tmp: Path, log_path: Path, timeout_s: float, counter) -> dict:
    out_dir = None
    if name != "naive":  # each run its own new folder for last.pt, metrics.csv and summary.json
        out_dir = tmp / f"{name}-{next(counter)}"
        argv = [*argv, "--stop-at", str(TARGET), "--monitor", "val_acc", "--out-dir", str(out_dir)]
    return run_to_target(argv, env, log_path, timeout_s, out_dir)


def _tune(bench: Bench, tmp: Path, data_flags: tuple) -> Optional[tuple]:
    """Run the tuner once: (tune.json's content, its wall seconds); None where there is no tuner or it failed."""
    if importlib.util.find_spec("manual_train.tune") is None:
        return None
    budget_s = bench.pick(90, 180)  # 180: the tuner's default; 90 leaves one round of its first lever (layout)
    argv = [sys.executable, "-m", "manual_train.tune", *data_flags, "--budget-s", str(budget_s), "--out",
            str(tmp / "tune")]
    t0 = time.perf_counter()
    with open(bench.log_dir / f"{bench.entry}.log", "a") as log:
        log.write(f"--- {' '.join(argv)}\n")
        log.flush()
        try:
            subprocess.run(argv, cwd=REPO, env=base_env(), stdout=log, stderr=subprocess.STDOUT, check=True,
                           timeout=budget_s * 3 + 120)
        except subprocess.SubprocessError as e:  # the other two configurations are still measured
            log.write(f"the tuner failed: {e}\n")
            return None
    return json.loads((tmp / "tune" / "tune.json").read_text()), time.perf_counter() - t0


def levers_note(tune_json: dict) -> str:
    """What tune.json says each lever bought: kept ones with their measured speed and noise, the others' verdict."""
    parts = []
    for d in tune_json.get("exact", []) + tune_json.get("changes", []):
        if d["status"] == "kept":
            best = next(c for c in d["candidates"] if c["label"] == d["chosen"])
            parts.append(f"{d['lever']} kept {d['chosen']} ({best['speed']:.2f}x, noise {best['noise']:.0%})")
        elif d["status"] == "skipped":
            parts.append(f"{d['lever']} skipped ({d.get('reason', '')[:48]})")
        else:
            verdicts = ", ".join(f"{c['label']} {c['verdict']}" for c in d.get("candidates", []))
            parts.append(f"{d['lever']} not kept ({verdicts or d.get('reason', '')})")
    return "; ".join(parts)


# ---------------------------------------------------------------------- the entry
def time_to_target(bench: Bench) -> Outcome:
    log_path = bench.log_dir / f"{bench.entry}.log"
    notes, raw = [], {}
    with tempfile.TemporaryDirectory(prefix="time-to-target-") as tmp_name:
        tmp = Path(tmp_name)
        bench.child(_write_data_child, root=str(tmp / "data"))
        data_flags = (*MODEL_FLAGS, "--data-root", str(tmp / "data"))
        configs = {"naive": ([sys.executable, "-m", "manual_train.bench.time_to_target", str(TARGET), *data_flags],
                             base_env()),
                   "defaults": ([sys.executable, "launch/single.py", *data_flags], base_env())}
        tuned = _tune(bench, tmp, data_flags)
        if tuned:
            tune_json, tune_s = tuned
            argv, env = tuned_command(tune_json)
            configs["tuned"] = (argv, {**base_env(), **env})
            raw["tune_json"], raw["tune_s"] = tune_json, tune_s
            notes.append(f"the tuner ran once, {tune_s:.0f} s (not counted in any time to target), and chose "
                         f"{tune_json.get('shell', argv)}, about {tune_json.get('estimated_speedup', math.nan):.2f}x "
                         f"its reference's training speed by its own estimate; its levers: {levers_note(tune_json)}")
        else:
            notes.append("the tuned command is not measured: the tuner (manual_train.tune) is missing or failed "
                         "(its output is in the log)")
        counter, timeout_s = iter(range(10 ** 6)), bench.pick(400, 900)
        runs = interleave({name: functools.partial(_measure, name, argv, env, tmp, log_path, timeout_s, counter)
                           for name, (argv, env) in configs.items()}, bench.repeats(3, 5), warmup=0)
    raw.update(runs=runs, target=TARGET, commands={k: v[0] for k, v in configs.items()})
    times = {name: [r["time_to_target_s"] for r in rs] for name, rs in runs.items()}
    metric = f"1 / seconds to val_acc {TARGET} (cnn, digits as 28x28 MNIST): naive time / this one"
    rows = [ratio_row(bench.entry, LABELS["naive"], LABELS[name], metric, [1 / t for t in times["naive"]],
                      [1 / t for t in times[name]], better="higher", claim=CLAIM,
                      goal=Goal(">=", 3.0) if name == "tuned" else None)
            for name in configs if name != "naive"]
    rows += [value_row(bench.entry, "-", LABELS[name], f"seconds from process start to val_acc {TARGET}",
                       times[name], unit="s") for name in configs]
    for name, rs in runs.items():
        missed = sum(not r["reached"] for r in rs)
        startup = [r["first_line_s"] or math.nan for r in rs]
        per_epoch = [(t - s) / r["epochs"] for t, s, r in zip(times[name], startup, rs) if r["epochs"]]
        notes.append(f"{name}: {median(times[name]):.1f} s to the target (median), epochs "
                     f"{'/'.join(str(r['epochs']) for r in rs)}; start-up to its first printed line "
                     f"{median(startup):.1f} s, then {median(per_epoch) if per_epoch else math.nan:.1f} s per epoch"
                     + (f"; {missed} of {len(rs)} runs never reached it ({rs[0]['stop_reason'] or 'no reason'})"
                        if missed else ""))
    chart = bench.log_dir.parent / "time_to_target.png"
    if write_chart(chart, runs, TARGET):
        notes.append(f"chart: {chart}")
    return Outcome(rows, raw, notes)


def write_chart(path: Path, runs: dict, target: float) -> bool:
    """val_acc against seconds since the process started, one line per configuration (its median run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    drawn = False
    for name, rs in runs.items():
        done = sorted((r for r in rs if r["reached"]), key=lambda r: r["time_to_target_s"])
        run = done[len(done) // 2] if done else (rs[0] if rs else None)
        if not run or not run["curve"]:
            continue
        ts, accs = zip(*run["curve"])
        ax.plot(ts, accs, marker="o", markersize=3, label=f"{LABELS[name]}: {run['time_to_target_s']:.1f} s")
        drawn = True
    if not drawn:
        plt.close(fig)
        return False
    ax.axhline(target, color="black", linestyle=":", linewidth=1, label=f"target {target}")
    ax.set_xlabel("seconds since the process started (python start, imports and data loading included)")
    ax.set_ylabel("val_acc after each epoch")
    ax.set_title(f"time to val_acc {target}: cnn on digits as 28x28 MNIST (median run of each)", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


if __name__ == "__main__":  # the naive configuration's process: python -m manual_train.bench.time_to_target T FLAGS
    naive_loop(float(sys.argv[1]), sys.argv[2:])
