"""Run outputs (docs/logging.md): metrics.csv, summary.json, the console, a progress bar, TensorBoard.

`RunLog` does only I/O, and only where `enabled` (rank 0): the loops decide what to log and when,
and pass plain Python numbers (already synced to the host at a log step).

Epochs are counted from 1 in everything a user reads (console, metrics.csv, summary.json's best_epoch), as the
console's "epoch 3/10" always did; the loops and checkpoints count completed epochs from 0 internally.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from manual_train.checkpoint import remove_stale_temp_files, write_atomically
from manual_train.config import UsageError
from manual_train.errors import StorageError

CSV_COLUMNS = ("step", "epoch", "split", "loss", "acc", "lr", "samples_per_s", "time_s")
LM_COLUMNS = ("bpb", "ppl")  # a byte-level language model's (--dataset pydoc): the loss as bits per byte, perplexity
SUMMARY_KEYS = ("script", "world_size", "device", "precision", "global_batch_size", "epochs_run",
                "optimizer_steps", "samples_seen", "final_val_loss", "final_val_acc", "best_val_loss",
                "best_val_acc", "best_epoch", "stopped_early", "skipped_steps", "wall_s", "samples_per_s",
                "data_wait_fraction", "peak_mem_bytes", "checkpoint")


# Folders whose metrics.csv this process created as a fresh run (RunLog), for discard_unstarted_runs.
_claimed_here: list[Path] = []


def discard_unstarted_runs() -> None:
    """Remove the folders this process claimed whose metrics.csv is still only its header (the run failed
    before its first log row: nothing to keep), so they do not block the next try as "already holds a run"."""
    while _claimed_here:
        out_dir = _claimed_here.pop()
        metrics = out_dir / "metrics.csv"
        try:
            if len(metrics.read_text().splitlines()) <= 1 and not (out_dir / "last.pt").exists():
                metrics.unlink()
                if (out_dir / "tb").is_dir():
                    shutil.rmtree(out_dir / "tb")
                out_dir.rmdir()  # fails (and keeps the folder) if anything else is in it
        except OSError:
            pass


def _last_step(rows: str, before: Optional[int]) -> Optional[int]:
    """The step of the last of these CSV rows (`before` when there is none: only the header)."""
    last = rows.splitlines()[-1] if rows else ""
    return int(last.split(",", 1)[0]) if last[:1].isdigit() else before


class RunLog:
    """metrics.csv rows, console lines, optional TensorBoard scalars and summary.json, on rank 0."""

    def __init__(self, out_dir: Path, *, enabled: bool = True, tensorboard: bool = False,
                 resume_step: Optional[int] = None, keep: bool = True, language_model: bool = False):
        """keep=False (--fast-dev-run): console lines only; no folder, no file. language_model: every row also has
        LM_COLUMNS (its loss is per byte)."""
        self.out_dir, self.enabled, self.language_model = Path(out_dir), enabled, language_model
        self.tb = None
        self.writes = enabled and keep
        if not self.writes:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_files(self.out_dir)  # half-written checkpoints of a killed run
        path = self._path = self.out_dir / "metrics.csv"
        self._size, self.last_step = 0, None  # metrics.csv's whole bytes, and its last row's step
        self._line = io.StringIO()  # one row formatted at a time, then appended whole (_append)
        self._rows = csv.writer(self._line)
        header = csv.DictWriter(self._line, fieldnames=CSV_COLUMNS + LM_COLUMNS * language_model)
        header.writeheader()
        if resume_step is not None and path.exists():
            # Resuming into the same folder: keep the rows up to the checkpoint, drop the ones the crashed run
            # logged after it (they are about to be recomputed); written beside it and swapped in, so a disk that
            # cannot take the copy leaves the old file whole.
            with open(path, newline="") as f:
                header.writerows(row for row in csv.DictReader(f) if int(row["step"]) <= resume_step)
            rows = self._line.getvalue().encode()
            write_atomically(path, lambda f: f.write(rows), intact=f"the previous {path.name} is untouched")
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
            self._size, self.last_step = os.fstat(self._fd).st_size, _last_step(self._line.getvalue(), None)
        else:
            # A fresh run claims the folder atomically: creating metrics.csv with O_EXCL fails when another run
            # (started in the same instant, past the same "is it free" check) created it first.
            try:
                self._fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_APPEND, 0o644)
            except FileExistsError:
                raise UsageError("--out-dir", f"{out_dir} was just claimed by another run (nothing is overwritten)",
                                 "a new --out-dir") from None
            _claimed_here.append(self.out_dir)
            self._append(self._line.getvalue())
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.out_dir / "tb"))

    def print(self, *parts) -> None:
        if self.enabled:
            tqdm.write(" ".join(str(p) for p in parts))

    def row(self, *, step: int, epoch: int, split: str, loss: float, acc: float, lr: float,
            samples_per_s: float, time_s: float) -> None:
        if not self.writes:
            return
        # a tuple in CSV_COLUMNS' order: DictWriter's dict and its key check cost ~15 us a row inside a training loop
        row = (step, epoch + 1, split, f"{loss:.8g}", f"{acc:.6g}", f"{lr:.8g}", f"{samples_per_s:.2f}", f"{time_s:.3f}")
        self._line.seek(0)
        self._line.truncate()
        self._rows.writerow(row + tuple(f"{v:.8g}" for v in lm_numbers(loss).values()) * self.language_model)
        self._append(self._line.getvalue())
        if self.tb is not None:
            self.tb.add_scalar(f"{split}/loss", loss, step)
            self.tb.add_scalar(f"{split}/acc", acc, step)
            if split == "train":
                self.tb.add_scalar("train/lr", lr, step)

    def _append(self, text: str) -> None:
        """Append whole rows to metrics.csv, or none: a write the disk refuses part-way is cut off again (shrinking
        a file frees space, so this works on a full disk), and the file never ends in half a row."""
        data, size = text.encode(), self._size
        try:
            done = 0
            while done < len(data):  # os.write may take part of it (a full disk), then raises on the rest
                done += os.write(self._fd, data[done:])
        except OSError as e:
            os.ftruncate(self._fd, size)
            raise StorageError(self._path, e, intact=f"its rows up to step {self.last_step} are whole"
                               if self.last_step is not None else "it holds its header only") from None
        self._size, self.last_step = size + len(data), _last_step(text, self.last_step)

    def write_summary(self, summary: dict) -> None:
        """summary.json, written whole to a temp file and renamed, like the checkpoints."""
        if not self.writes:
            return
        missing = [k for k in SUMMARY_KEYS if k not in summary]
        assert not missing, f"summary lacks {missing}"
        path = self.out_dir / "summary.json"
        intact = ("the previous summary.json is intact" if path.exists()
                  else "the checkpoints and metrics.csv are intact")
        text = json.dumps(_finite_or_none(summary), indent=2) + "\n"
        write_atomically(path, lambda f: f.write(text.encode()), intact=intact)

    def close(self) -> None:
        if not self.writes:
            return
        if self.out_dir in _claimed_here:
            _claimed_here.remove(self.out_dir)  # the run finished: its folder is its results
        os.close(self._fd)
        if self.tb is not None:
            self.tb.close()


def lm_numbers(loss_per_byte: float) -> dict:
    """A byte-level language model's loss (mean nats per byte) as bits per byte and perplexity (per byte)."""
    return {"bpb": loss_per_byte / math.log(2), "ppl": math.exp(min(loss_per_byte, 700.0))}  # exp(700): ~1e304


def run_summary(*, script: str, world_size: int, device, cfg, global_batch_size: int, epoch: int, step: int,
                samples_seen: int, samples_this_run: int, val_loss: float, val_acc: float, best: dict,
                early, skipped_steps: int, wall_s: float, data_wait_s: float, peak_mem_bytes: int, checkpoint: Path,
                **extra) -> dict:
    """The summary.json dict (loops pass their counters; extra keys go last)."""
    return {
        "script": script, "world_size": world_size, "device": str(device), "precision": cfg.precision,
        "global_batch_size": global_batch_size, "epochs_run": epoch + 1, "optimizer_steps": step,
        "samples_seen": samples_seen, "final_val_loss": val_loss, "final_val_acc": val_acc,
        "best_val_loss": best.get("val_loss"), "best_val_acc": best.get("val_acc"),
        "best_epoch": early.best_epoch + 1 if early.best_epoch >= 0 else None,  # 1-based, as the console
        "stopped_early": early.should_stop, "stop_reason": early.reason,
        "skipped_steps": skipped_steps, "wall_s": wall_s, "samples_per_s": samples_this_run / wall_s,
        "data_wait_fraction": data_wait_s / wall_s, "peak_mem_bytes": peak_mem_bytes,
        "checkpoint": str(checkpoint), **extra,
    }


def banner(log: RunLog, *, script: str, device, cfg, raw_model, train_ds, val_ds, global_batch_size: int,
           world_size: int, lr: float, total_steps: int, out_dir: Path, resumed_from=None, start_epoch: int = 0,
           step: int = 0) -> None:
    """The start banner: where it runs, in what precision, and the global batch it trains with."""
    from manual_train.data import suggest_num_workers
    from manual_train.distributed import read_env

    n_params = sum(p.numel() for p in raw_model.parameters())
    log.print(f"{script}: device {device}, precision {cfg.precision}, model {cfg.model} ({n_params:,} params), "
              f"dataset {cfg.dataset} ({len(train_ds)} train / {len(val_ds)} val)")
    if cfg.summary_depth:
        log.print(model_summary(raw_model, cfg.summary_depth))
    log.print(f"global batch {global_batch_size} = batch {cfg.batch_size} x accumulate {cfg.accumulate} x "
              f"world size {world_size}; lr {lr:g} ({cfg.lr_scaling} scaling from base batch "
              f"{cfg.base_batch_size}); {total_steps} optimizer steps; num_workers {cfg.num_workers} "
              f"(suggested here: {suggest_num_workers(read_env().local_world_size)}); out {out_dir}"
              + (f"; resuming {resumed_from} at step {step}, in epoch {start_epoch + 1}" if resumed_from else ""))


def model_summary(model, max_depth: int = 1) -> str:
    """Lightning's ModelSummary from the module tree: one row per submodule down to max_depth (name, type,
    parameters, trainable ones), then the totals. A parameter shared by two modules (the GPT's tied embedding and
    head) is counted once, in the first row of its depth that holds it; summing every module's own
    parameters() would count it twice (test_everyday.py::test_model_summary_counts_tied_weights_once)."""
    rows, seen = [], {}  # seen: per depth, the parameters already counted in a row of that depth
    for name, module in model.named_modules():
        depth = name.count(".") + 1 if name else 0
        if not 1 <= depth <= max_depth:
            continue
        counted = seen.setdefault(depth, set())
        params = [p for p in module.parameters() if id(p) not in counted]
        counted.update(id(p) for p in params)
        rows.append(("  " * (depth - 1) + name, type(module).__name__, sum(p.numel() for p in params),
                     sum(p.numel() for p in params if p.requires_grad)))
    unique = {id(p): p for p in model.parameters()}.values()  # parameters() yields a shared one once
    total = sum(p.numel() for p in unique)
    trainable = sum(p.numel() for p in unique if p.requires_grad)
    size_mb = sum(p.numel() * p.element_size() for p in unique) / 1e6
    width = max([len(r[0]) for r in rows] + [4])
    type_width = max([len(r[1]) for r in rows] + [4])
    lines = [f"  {'name':<{width}}  {'type':<{type_width}}  {'params':>11}  {'trainable':>11}"]
    lines += [f"  {n:<{width}}  {t:<{type_width}}  {c:>11,}  {tr:>11,}" for n, t, c, tr in rows]
    lines.append(f"  {trainable:,} trainable, {total - trainable:,} non-trainable, {total:,} total parameters "
                 f"({size_mb:.2f} MB)")
    return "\n".join(lines)


def progress_bar(total: int, initial: int, enabled: bool):
    """A tqdm bar over optimizer steps; it appears only for runs longer than a couple of seconds, and only on a
    terminal: into a log file its carriage-return redraws would interleave with the epoch lines."""
    return tqdm(total=total, initial=initial, disable=not enabled or not sys.stderr.isatty(), delay=2.0,
                unit="step", dynamic_ncols=True, leave=False)


def _finite_or_none(obj):
    """JSON has no NaN/inf: write null for them (e.g. a run that never evaluated)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_none(v) for v in obj]
    return obj
