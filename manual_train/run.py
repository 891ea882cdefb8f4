"""The product around every lesson: --resume, the outputs, checkpoints, early stopping, restore-best, summary.

A loop is the lesson (data, model, forward, backward, step, evaluation); what a run must also do, and does the
same way in every loop, sits behind a handful of one-line calls on a `Run`, in the order a loop makes them:

    run = Run(cfg, SCRIPT, env, device=..., lr=..., ...)  # reads and checks --resume; nothing is written yet
    start_epoch, start_micro_step, step, samples_seen = run.start(model=raw_model, optimizer=..., scheduler=...,
                                                                  scaler=...)  # resume into them; open outputs
    for epoch in range(start_epoch, num_epochs):
        for micro_step, (x, y) in enumerate(run.timed(loader), start=...):   # counts the time spent waiting
            ...
            stepped = run.stepped(scaler, losses)  # False when 16-mixed's GradScaler skipped it (--trace-dir)
            run.log_train(step, epoch, loss, acc, lr, samples_seen)   # metrics.csv; NaN stops the run
        improved = run.log_val(step, epoch, val_loss, val_acc, lr)    # metrics.csv, early stopping, best
        run.save(epoch, micro_steps_done, step, samples_seen)         # last.pt (and best.pt), atomically
        if run.should_stop(step): break                               # early stop, or every step done
    if run.restore_best(): ...evaluate again...                       # --restore-best
    return run.finish(epoch, step, samples_seen, val_loss, val_acc)   # summary.json

Its techniques have their own pages: docs/checkpointing.md (atomic saves, exact resume, the resume rules),
docs/early_stopping.md, docs/logging.md. Under torchrun (`env.world_size > 1`) every rank makes the same calls;
rank 0 alone writes, and the few collectives this needs (the folder name, every rank's RNG streams, a barrier
after saving) are made here on every rank alike. A lone process is a group of one and makes none.

The checkpointed objects only need state_dict() and load_state_dict(): the loops pass their unwrapped model
(`raw_model`), or for ZeRO and O2 one whose state_dict() is the full fp32 state (checkpoint.FullState, O2's masters).
state_dict() is called on every rank (ZeRO gathers the shards with collectives), the file written by rank 0.
With --checkpoint-format dcp (launch/zero.py's: cfg.saves_dcp; the model object's `sharded` holds the DTensor module and
optimizer, checkpoint.FullState) nothing is gathered: every rank writes its shards into a folder that the link last.dcp
names once it is complete (_save_dcp, _commit_dcp; docs/checkpointing.md).
"""
from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import threading
import statistics
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from manual_train import profiling
from manual_train.checkpoint import (DCP_META, build_checkpoint, capture_rng, check_compatible, first_line,
                                     link_atomically, load_checkpoint, load_sharded, read_dcp_full, remove_unlinked_dcp,
                                     restore_rng, resume_point, save_checkpoint, save_sharded, what_is_intact)
from manual_train.config import UsageError
from manual_train.distributed import DistEnv
from manual_train.errors import Preempted, StorageError, os_error_in
from manual_train.early_stopping import EarlyStopping
from manual_train.metrics import RunLog, banner, lm_numbers, progress_bar, run_summary
from manual_train.parity import RunTrace
from manual_train.runtime import TrainingDiverged, peak_mem_bytes

LONE = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, launched=False)
_saved_handlers: dict = {}  # --save-on-signal: the handlers replaced, given back by restore_signal_handlers
_notice = [0]  # the first --save-on-signal signal received since the handlers went in (0: none)


def catch_notices(signals) -> None:
    """--save-on-signal: from now on these signals are recorded, not fatal. cli.run calls it before the loop's set-up,
    so a notice that lands while the data loads, the process group forms or a checkpoint is read is not lost (a
    preemption comes at any time): the run trains its first step, every rank stops after it and saves, as for a
    notice in that step (Run.should_stop). Python delivers signals to the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in signals:
        _saved_handlers.setdefault(sig, signal.getsignal(sig))
        signal.signal(sig, _record_notice)


def check_launcher_forwards(signals) -> None:
    """Under torchrun in a Slurm job step, every --save-on-signal signal must be one the torchrun agent passes on to
    its workers (its --signals-to-handle, which it exports as TORCHELASTIC_SIGNALS_TO_HANDLE): Slurm signals the
    step's tasks, the agents, and an agent that does not handle the signal dies of it, its workers killed with it
    and nothing saved. One line, exit 2, before anything is written."""
    forwarded = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    if forwarded is None or "SLURM_STEP_ID" not in os.environ:
        return
    names = {name.strip() for name in forwarded.split(",")}
    dropped = [sig.name for sig in signals if sig.name not in names]
    if dropped:
        raise UsageError("--save-on-signal", f"torchrun passes {forwarded} to its workers, not {','.join(dropped)}: "
                         f"in this Slurm job a {dropped[0]} notice would end the torchrun agent, and its workers with "
                         f"it, before they save (torchrun --signals-to-handle {forwarded},{','.join(dropped)}, as "
                         f"launch/slurm_train.sbatch does; or --save-on-signal without {','.join(dropped)})")


def _record_notice(signum, frame) -> None:
    _notice[0] = _notice[0] or signum  # the first notice counts; another one changes nothing


def restore_signal_handlers() -> None:
    """Give back the signal handlers a run installed (its finish() does; cli.run when a run fails before it), and
    forget its notice."""
    while _saved_handlers:
        sig, handler = _saved_handlers.popitem()
        signal.signal(sig, handler)
    _notice[0] = 0


class Run:
    """One training run's outputs and state around a loop (see the module docstring for the calls)."""

    def __init__(self, cfg, script: str, env: Optional[DistEnv] = None, *, device: torch.device, lr: float,
                 global_batch_size: int, total_steps: int, micro_steps_per_epoch: int, datasets: tuple,
                 replicas: Optional[int] = None):
        """`replicas`: how many ranks train on shares of every batch (the data-parallel world size: the global
        batch is batch x accumulate x replicas); all ranks by default, 1 where ranks split one model instead
        (pipeline stages). Checkpoints and the banner count the global batch with it."""
        self.cfg, self.script, self.env, self.device, self.lr = cfg, script, env or LONE, device, lr
        self.replicas = replicas or self.env.world_size
        self.global_batch_size, self.total_steps = global_batch_size, total_steps
        self.micro_steps_per_epoch, self.datasets = micro_steps_per_epoch, datasets
        self.resumed_from = cfg.resume_path()
        # (a dcp folder: its metadata now, checked; the shards in start(), resharded into this run's)
        self.ckpt = load_checkpoint(self.resumed_from, full=False) if self.resumed_from else None
        if self.ckpt:  # or exit: one line, nothing written
            check_compatible(self.ckpt, cfg, global_batch_size, total_steps, script=script)
        # launch/zero.py's --checkpoint-format dcp: last.dcp/ of every rank's shards (_save_dcp), maybe written async
        self.dcp, self.async_save = cfg.saves_dcp, cfg.saves_async
        self.language_model = cfg.dataset == "pydoc"  # bits per byte and perplexity beside the loss (text.py)
        self.async_group, self.pending, self.blocked_s = None, None, []
        self.early = EarlyStopping(cfg.monitor, cfg.early_stop_patience, cfg.early_stop_min_delta, cfg.stop_at)
        self.tracked: dict = {}
        self.skipped_steps, self.data_wait_s, self.improved = 0, 0.0, False
        self._last_scale = 1.0
        self.stopping, self.stop_reason, self.val_step = False, None, None
        self.signals, self.preempted = cfg.preemption_signals, None  # --save-on-signal
        self.keep = not cfg.fast_dev_run  # --fast-dev-run: nothing written
        self.profiler = None
        # --trace-dir (python -m manual_train.parity): the loss and weights after every optimizer step; None: no cost
        self.trace = RunTrace(self) if cfg.trace_dir else None

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    # ------------------------------------------------------------------ start
    def start(self, *, model, optimizer, scheduler, scaler) -> tuple[int, int, int, int]:
        """Resume into the given objects (when --resume), remember them for checkpoints, open the outputs and
        print the banner. Returns (start_epoch, start_micro_step, step, samples_seen): zeros for a fresh run."""
        self.tracked = dict(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
        ckpt, env = self.ckpt, self.env
        # the checkpoint's place in its epoch, in samples, as micro-steps of this run's (any split of the global batch)
        start_epoch, start_micro_step, step, samples_seen, self.best = resume_point(ckpt, self.cfg.batch_size *
                                                                                    self.replicas)
        if ckpt:
            self._load_model_optimizer(ckpt, model, optimizer)
            scheduler.load_state_dict(ckpt["scheduler"])
            self._load_scaler(scaler, ckpt["scaler"])
            self.early.load_state_dict(ckpt["early_stopping"])
            # Last: this rank's own RNG streams, so every draw from here on repeats the uninterrupted run's. At
            # another world size, check_compatible allowed the resume only if training draws nothing per rank
            # (no dropout, no augmentation): every rank takes rank 0's streams, which then decide nothing.
            per_rank = ckpt.get("rng_per_rank", [])
            restore_rng(per_rank[env.rank] if len(per_rank) == env.world_size else ckpt["rng"])
        # what stepped() compares the first step's scale with: a skip there leaves it below this (GradScaler before
        # its first step returns its initial or loaded scale without a host sync; disabled, 1)
        self._last_scale = scaler.get_scale()
        # The default folder name holds a timestamp that ranks could read a second apart: rank 0 picks it, the
        # others take its choice (for --restore-best and messages); rank 0 alone writes there.
        choice = [self.cfg.run_dir(self.script) if env.master_process else None]
        if self.distributed:
            dist.broadcast_object_list(choice, src=0)
        self.out_dir = Path(choice[0])
        self.cfg.out_dir = str(self.out_dir)
        self.log = RunLog(self.out_dir, enabled=env.master_process, tensorboard=self.cfg.tensorboard,
                          resume_step=step if ckpt else None, keep=self.keep, language_model=self.language_model)
        train_ds, val_ds = self.datasets
        banner(self.log, script=self.script, device=self.device, cfg=self.cfg, raw_model=_module_of(model),
               train_ds=train_ds, val_ds=val_ds, global_batch_size=self.global_batch_size,
               world_size=self.replicas, lr=self.lr, total_steps=self.total_steps, out_dir=self.out_dir,
               resumed_from=self.resumed_from if ckpt else None, start_epoch=start_epoch, step=step)
        if self.cfg.fast_dev_run:
            self.log.print("fast-dev-run: one training batch, one validation batch; no outputs kept")
        self.progress = progress_bar(self.total_steps, step, enabled=self.cfg.progress and env.master_process)
        self.start_step, self.samples_at_start, self.log_samples = step, samples_seen, samples_seen
        if self.cfg.profile:
            self.profiler = profiling.start(self.cfg.profile_range, step, self.device, self.out_dir, env, self.log)
        self._catch_signals()
        self.t_start = self.t_log = time.perf_counter()
        self.train_rows: list = []  # (seconds, samples, samples/s) of each train row: summary.json's compile_s
        self.max_time_s = self.cfg.time_limit_s
        if self.trace is not None:
            self.trace.start(step)  # the weights it starts from (initial, or the checkpoint's)
        return start_epoch, start_micro_step, step, samples_seen

    def _load_model_optimizer(self, ckpt: dict, model, optimizer) -> None:
        """A .pt checkpoint's full state; a dcp folder's shards straight into sharded (DTensor) parameters, DCP
        resharding them for this world size, or else read whole in each process (read_dcp_full)."""
        if ckpt.get("format") == "dcp" and getattr(model, "sharded", None):
            from torch.distributed.checkpoint.api import CheckpointException

            try:
                load_sharded(*model.sharded, Path(ckpt["dcp"]), rest=ckpt["rest"])
            except (Exception, CheckpointException) as e:  # another model's folder (DCP's is a BaseException)
                raise UsageError("--resume", f"{ckpt['dcp']}: its shards cannot be read into this model "
                                             f"({first_line(e)})") from None
            return
        if ckpt.get("format") == "dcp":
            ckpt.update(read_dcp_full(Path(ckpt["dcp"]), ckpt))
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])

    def _load_scaler(self, scaler, state: dict) -> None:
        """The "scaler" entry: {"precision", "scaler", "skipped_steps"}; a scale only means something to the
        same kind of scaler, so another precision's is not loaded."""
        if state.get("scaler") and state.get("precision") == self.cfg.precision:
            scaler.load_state_dict(state["scaler"])
        self.skipped_steps = int(state.get("skipped_steps", 0))

    def print(self, *parts) -> None:
        self.log.print(*parts)

    # ------------------------------------------------------------------ the loop
    def timed(self, loader):
        """The loader's batches, counting the time spent waiting for each (summary.json's data_wait_fraction)."""
        t = time.perf_counter()
        batches = iter(loader)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            self.data_wait_s += time.perf_counter() - t
            yield batch
            t = time.perf_counter()

    def stepped(self, scaler, losses=None) -> bool:
        """Whether the optimizer step was taken. GradScaler.step syncs to decide (it reads found_inf) but does not
        say what it decided; the scale only shrinks on a skipped step, so comparing it with the previous step's
        (kept on the host) tells. get_scale() is one host sync under 16-mixed, none when the scaler is off.
        `losses`: the loop's detached micro-step losses since its last log row, which --trace-dir records the step's
        loss from (unused otherwise)."""
        if self.trace is not None:
            self.trace.stepped(losses)  # the weights after this step (a gather when sharded), the step's loss
        scale = scaler.get_scale()
        stepped = scale >= self._last_scale
        self._last_scale = scale
        self.skipped_steps += not stepped
        return stepped

    def profile(self, step: int) -> None:
        """--profile: one optimizer step done; torch.profiler's schedule moves on (nothing when not profiling)."""
        if self.profiler is not None:
            self.profiler.step()

    def log_train(self, step: int, epoch: int, loss: float, acc: float, lr: float, samples_seen: int,
                  log_steps: int = 1) -> None:
        """A metrics.csv row and the progress bar; a NaN/inf loss stops the run (every rank alike: the numbers
        are all-reduced), keeping the last good checkpoint."""
        if self.trace is not None:
            self.trace.window_logged()  # the loop starts new lists next
        if not math.isfinite(loss):
            raise TrainingDiverged.at(loss, step, log_steps, self._checkpoint_path("last"))
        now = time.perf_counter()
        rate = (samples_seen - self.log_samples) / (now - self.t_log)
        self.log.row(step=step, epoch=epoch, split="train", loss=loss, acc=acc, lr=lr,
                     samples_per_s=rate, time_s=now - self.t_start)
        # the first row's interval holds --compile's tracing and compiling; the later rows are the steady state
        self.train_rows.append((now - self.t_log, samples_seen - self.log_samples, rate))
        if not self.progress.disable:  # a disabled bar (no terminal) still formats the postfix: ~12 us a row
            self.progress.update(step - self.progress.n)
            self.progress.set_postfix(loss=f"{loss:.4f}", refresh=False)
        self.t_log, self.log_samples = now, samples_seen

    def log_val(self, step: int, epoch: int, val_loss: float, val_acc: float, lr: float) -> bool:
        """A metrics.csv row and a console line; early stopping and the best values see it. Returns whether it
        improved on the best so far (then save() also writes best.pt)."""
        self.improved = self.early.update(val_loss if self.cfg.monitor == "val_loss" else val_acc, epoch)
        self.val_step = step
        self.best = {"val_loss": min(val_loss, self.best.get("val_loss", math.inf)),
                     "val_acc": max(val_acc, self.best.get("val_acc", -math.inf)), "epoch": self.early.best_epoch}
        self.log.row(step=step, epoch=epoch, split="val", loss=val_loss, acc=val_acc, lr=lr, samples_per_s=0.0,
                     time_s=time.perf_counter() - self.t_start)
        self.log.print(f"epoch {epoch + 1}/{math.ceil(self.total_steps / self._steps_per_epoch())} step {step}: "
                       f"val_loss {val_loss:.4f} val_acc {val_acc:.4f}" + self._lm_text(val_loss)
                       + (" (best)" if self.improved else ""))
        return self.improved

    def _lm_text(self, val_loss: float) -> str:
        """A language model's console numbers: its val loss as bits per byte and perplexity (nothing otherwise)."""
        return "".join(f" val_{k} {v:.4f}" for k, v in lm_numbers(val_loss).items()) if self.language_model else ""

    def _steps_per_epoch(self) -> int:
        return -(-self.micro_steps_per_epoch // self.cfg.accumulate)

    # ------------------------------------------------------------------ checkpoints
    def save(self, epoch: int, micro_steps_done: int, step: int, samples_seen: int, **extra) -> None:
        """last.pt (and best.pt after an improvement), written atomically. `micro_steps_done` short of the epoch
        (--max-steps ended mid-epoch) is where a resume starts the sampler. Under torchrun every rank takes part
        (RNG streams, ZeRO's gathers), rank 0 writes, and a barrier holds every rank until the file is on disk."""
        t = self.tracked
        if not self.keep:  # --fast-dev-run (every rank alike: no collectives are skipped on one rank only)
            self.improved = False
            return
        t_save = time.perf_counter()
        epoch_done = micro_steps_done >= self.micro_steps_per_epoch
        rng_per_rank = [capture_rng()]
        if self.distributed:
            rng_per_rank = [None] * self.env.world_size
            dist.all_gather_object(rng_per_rank, capture_rng())
        if self.dcp:
            model_state = optimizer_state = {}  # the shards go to DCP, every rank its own (_save_dcp)
            rest, folder = self._save_dcp(("last.dcp", "best.dcp") if self.improved else ("last.dcp",))
        else:
            model_state, optimizer_state = t["model"].state_dict(), t["optimizer"].state_dict()  # every rank (ZeRO)
        if self.env.master_process:
            checkpoint = build_checkpoint(
                model_state=model_state, optimizer_state=optimizer_state, scheduler=t["scheduler"],
                scaler_state=self._scaler_state(), early_stopping=self.early, cfg=self.cfg,
                world_size=self.replicas, epoch=epoch + 1 if epoch_done else epoch,
                micro_steps_done=0 if epoch_done else micro_steps_done, step=step, samples_seen=samples_seen,
                best=self.best, rng_per_rank=rng_per_rank, script=self.script, **extra)
            if self.dcp:  # everything but the shards, in the (not yet linked) folder
                with self._shards_into(folder):
                    save_checkpoint({**checkpoint, "format": "dcp", "rest": rest}, folder / DCP_META)
            else:
                save_checkpoint(checkpoint, self.out_dir / "last.pt")
                if self.improved:
                    save_checkpoint(checkpoint, self.out_dir / "best.pt")
        if self.dcp and not self.async_save:
            self._commit_dcp()  # (async: the next save, or restore_best, waits for the write and links the folder)
        self.improved = False
        if self.distributed:
            dist.barrier()
        self.blocked_s.append(time.perf_counter() - t_save)  # the time the loop waited for this save

    def _save_dcp(self, links: tuple) -> tuple[dict, Path]:
        """Every rank writes its shards of the tracked DTensor model and optimizer into a new folder .dcp-<pid>-<hex>
        (dcp.save, or async_save: then only the copy to host memory blocks), which _commit_dcp names `links`. The
        previous async save is finished and linked first: one write in flight at a time."""
        self._commit_dcp()
        name = [f".dcp-{os.getpid()}-{os.urandom(3).hex()}" if self.env.master_process else None]
        if self.distributed:
            dist.broadcast_object_list(name, src=0)
            if self.async_save and self.async_group is None:  # every rank creates it (a collective)
                self.async_group = dist.new_group(backend="gloo")
        folder = self.out_dir / name[0]
        folder.mkdir(exist_ok=True)
        with self._shards_into(folder):  # a disk that refuses them: one line, every rank (DCP raises on all)
            rest, future = save_sharded(*self.tracked["model"].sharded, folder,
                                        async_group=self.async_group if self.async_save else None)
        self.pending = (future, folder, links)
        return rest, folder

    @contextlib.contextmanager
    def _shards_into(self, folder: Path):
        """A write of the DCP folder that the file system refuses becomes StorageError, the folder removed (it was
        never linked: last.dcp still names the previous one)."""
        try:
            yield
        except BaseException as e:
            fault = os_error_in(e, folder)
            if fault is None:
                raise
            shutil.rmtree(folder, ignore_errors=True)
            raise StorageError(f"{self.out_dir / 'last.dcp'} (new shards in {folder.name})", fault,
                               intact=what_is_intact(self.out_dir / "last.dcp")) from None

    def _commit_dcp(self) -> None:
        """Wait for the save in flight, then rank 0 points last.dcp (best.dcp) at its folder: a link replaced
        atomically, so a crash at any point leaves the previous complete checkpoint named; older folders go."""
        if self.pending is None:
            return
        future, folder, links = self.pending
        if future is not None:
            with self._shards_into(folder):
                future.result()  # this rank's shards on disk (rank 0's: also DCP's .metadata, written last)
        if self.distributed:
            dist.barrier()  # every rank's shards on disk
        if self.env.master_process:
            for link in links:
                link_atomically(self.out_dir / link, folder.name)
            remove_unlinked_dcp(self.out_dir)
        self.pending = None

    def _checkpoint_path(self, name: str) -> Path:
        """RUN/last.pt (best.pt), or with --checkpoint-format dcp the link RUN/last.dcp (best.dcp) to its folder."""
        return self.out_dir / f"{name}.{'dcp' if self.dcp else 'pt'}"

    def _scaler_state(self) -> dict:
        return {"precision": self.cfg.precision, "scaler": self.tracked["scaler"].state_dict(),
                "skipped_steps": self.skipped_steps}

    def _catch_signals(self) -> None:
        """--save-on-signal: a notice only records itself (a handler may run between any two bytecodes, in a save
        too); should_stop() turns it into a stop at a step boundary. Ranks agree over a gloo group: a CPU tensor,
        so under nccl the per-step check adds no device sync."""
        if not self.signals or threading.current_thread() is not threading.main_thread():
            self.signals = ()  # (Python delivers signals to the main thread only)
            return
        if self.distributed:
            self.signal_group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        catch_notices(self.signals)  # (already caught since cli.run's start, with any notice from the set-up kept)

    def should_stop(self, step: int) -> bool:
        """Every step done, early stopping's decision (the same on every rank: it saw all-reduced numbers), or
        --max-time spent. The loops ask after every optimizer step and at every epoch's end; `stopping` keeps the
        answer. The clock is rank 0's, broadcast: ranks' clocks differ, and one rank stopping alone would hang the
        others in their next collective (one small broadcast per step, only with --max-time)."""
        if self.early.should_stop and not self.stopping:
            self.log.print(f"early stop: {self.early.reason}")
        if self.max_time_s is not None and not self.stopping and not self.early.should_stop:
            elapsed = [time.perf_counter() - self.t_start]
            if self.distributed:
                dist.broadcast_object_list(elapsed, src=0)
            if elapsed[0] >= self.max_time_s:
                self.stop_reason = f"--max-time {self.cfg.max_time} reached after step {step} ({elapsed[0]:.1f} s)"
                self.log.print(f"stop: {self.stop_reason}")
        if self.signals and not self.stopping:  # any rank's notice stops every rank after this same step
            notice = torch.tensor([_notice[0]], dtype=torch.int64)
            if self.distributed:  # one 8-byte all-reduce per optimizer step (tens of microseconds on gloo)
                dist.all_reduce(notice, op=dist.ReduceOp.MAX, group=self.signal_group)
            if notice.item():
                self.preempted, self.stop_reason = signal.Signals(int(notice.item())).name, "signal"
                self.log.print(f"stop: {self.preempted} received; saving after step {step}")
        self.stopping = self.stopping or bool(self.stop_reason) or self.early.should_stop or step == self.total_steps
        return self.stopping

    # ------------------------------------------------------------------ the end
    def restore_best(self) -> bool:
        """--restore-best: load best.pt's weights into the model; True when it did (then evaluate again). Rank 0
        says whether best.pt exists, so every rank takes the same branch (the evaluation all-reduces)."""
        self.progress.close()
        self.wall_s = time.perf_counter() - self.t_start
        self._commit_dcp()  # an async save still in flight
        if self.preempted:  # the notice's deadline: no loading and evaluating the best weights
            return False
        best = self._checkpoint_path("best")
        exists = [best.exists()]
        if self.distributed:
            dist.broadcast_object_list(exists, src=0)
        if not (self.cfg.restore_best and exists[0]):
            return False
        if self.dcp:
            load_sharded(*self.tracked["model"].sharded, best, model_only=True)
        else:
            self.tracked["model"].load_state_dict(load_checkpoint(best)["model"])
        return True

    def finish(self, epoch: int, step: int, samples_seen: int, val_loss: float, val_acc: float, *,
               restored: bool = False, **extra) -> dict:
        """summary.json and the closing line; returns the summary. After restore_best(), which stops the clock and
        links an async checkpoint still being written."""
        if self.profiler is not None:
            profiling.stop(self.profiler)  # a run that ended inside the window still writes what it recorded
        if self.stop_reason:
            extra.setdefault("stop_reason", self.stop_reason)
        if self.preempted:
            extra.setdefault("signal", self.preempted)
        if self.blocked_s:  # the time the loop waited per save (bench/checkpoint_io.py: sync vs async, pt vs dcp)
            extra.setdefault("checkpoint_blocked_s", statistics.mean(self.blocked_s))
            extra.setdefault("checkpoint_blocked_s_per_save", [round(s, 6) for s in self.blocked_s])
        extra = {**self._steady_state(), **extra}
        if self.language_model:  # final_val_bpb, final_val_ppl, best_val_bpb (per byte)
            extra = {**{f"final_val_{k}": v for k, v in lm_numbers(val_loss).items()},
                     "best_val_bpb": lm_numbers(self.best.get("val_loss", math.nan))["bpb"], **extra}
        if restored:
            self.log.print(f"restored best weights (epoch {self.early.best_epoch + 1}): "
                           f"val_loss {val_loss:.4f} val_acc {val_acc:.4f}")
        summary = run_summary(
            script=self.script, world_size=self.env.world_size, device=self.device, cfg=self.cfg,
            global_batch_size=self.global_batch_size, epoch=epoch, step=step, samples_seen=samples_seen,
            samples_this_run=samples_seen - self.samples_at_start, val_loss=val_loss, val_acc=val_acc,
            best=self.best, early=self.early, skipped_steps=self.skipped_steps, wall_s=self.wall_s,
            data_wait_s=self.data_wait_s, peak_mem_bytes=peak_mem_bytes(self.device),
            checkpoint=self._checkpoint_path("last"), lr=self.lr, **extra)
        self.log.write_summary(summary)
        self.log.print(f"done: val_acc {val_acc:.4f} val_loss {val_loss:.4f}{self._lm_text(val_loss)} after {step} steps in "
                       f"{self.wall_s:.1f} s; " + (f"outputs in {self.out_dir}" if self.keep else "no outputs kept"))
        self.log.close()
        restore_signal_handlers()
        if self.preempted:  # exit status 75: requeue (cli.run prints this line)
            raise Preempted(f"stopped by {self.preempted} after step {step}: {self._checkpoint_path('last')} saved; "
                            "requeue or rerun with --resume auto (exit status 75)")
        return summary

    def _steady_state(self) -> dict:
        """steady_samples_per_s: the median train row's rate after the first (a row that spans an evaluation is
        slower; the median ignores it). compile_s: how much longer the first row took than the steady rate
        explains: --compile's tracing and compiling of the training graph (eager: a few tenths of a second of
        warm-up; the eval-mode graph compiles inside the first evaluation, not counted). None with < 2 rows."""
        if len(self.train_rows) < 2:
            return dict(steady_samples_per_s=None, compile_s=None)
        steady = statistics.median(rate for _, _, rate in self.train_rows[1:])
        first_s, first_samples, _ = self.train_rows[0]
        return dict(steady_samples_per_s=steady, compile_s=max(0.0, first_s - first_samples / steady))


def _module_of(model) -> torch.nn.Module:
    """The nn.Module behind a checkpointed object (adapters such as checkpoint.FullState keep theirs in .module)."""
    return model if isinstance(model, torch.nn.Module) else model.module
