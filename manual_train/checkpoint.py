"""Checkpoints that survive crashes and resume exactly (docs/checkpointing.md).

A checkpoint is a plain dict (docs/checkpointing.md): model (the unwrapped model's fp32 state_dict), optimizer,
scheduler, scaler, epoch, step, rng, early_stopping, config, world_size, plus `progress` (where in
the epoch it was written and the run's counters). Everything in it is a tensor or a Python
primitive, so it loads with `torch.load(weights_only=True)`: loading never runs pickled code.

Exact resume needs the RNG streams too (Lightning's checkpoints hold none): python `random`,
numpy, torch CPU and every CUDA device. The sampler's order needs nothing saved: it is
DistributedSampler(seed) at `epoch`, recomputed from the two numbers.

Writes are atomic: the bytes go to a temporary file in the same directory, are fsync'ed, and
os.replace() swaps it in, so a crash mid-write leaves the previous last.pt whole.

The position in a partial epoch is kept in samples of the epoch's order (`epoch_samples_done`), so a resume
with another split of the same global batch, or another world size, continues the data order exactly
(check_world_size_change says when per-rank random streams make that impossible). --checkpoint-format dcp
writes a folder instead: every rank's shards (torch.distributed.checkpoint: save_sharded, load_sharded) and a
meta.pt with the rest; a symlink swapped atomically names the complete one (load_dcp, link_atomically;
`python -m manual_train.checkpoint --to-pt` converts one to a .pt).
"""
from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn as nn

from manual_train.config import Config, UsageError, check_path
from manual_train.errors import StorageError, os_error_in

REQUIRED_KEYS = ("model", "optimizer", "scheduler", "scaler", "epoch", "step", "rng", "early_stopping",
                 "config", "world_size")
# Flags that change what is trained: a resume continues the same training, so these must match the checkpoint's.
# (--batch-size, --accumulate and the world size may change as long as the global batch does not; --epochs and
# --max-steps may grow when the LR schedule does not depend on the run's length; the rest, e.g. workers,
# logging, evaluation and --precision, may change freely.)
MUST_MATCH = ("model", "dataset", "synthetic_size", "synthetic_shape", "synthetic_classes", "optimizer", "lr",
              "lr_scaling", "base_batch_size", "weight_decay", "grad_clip", "grad_clip_value", "schedule",
              "warmup_steps", "seed", "dropout", "limit_train_batches", "loss")


class RunFinished(Exception):
    """--resume of a run that already reached its end: nothing to train, nothing is written (exit status 0)."""


def capture_rng() -> dict:
    """Every RNG stream a run draws from, as tensors and primitives (weights_only-loadable)."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np_state = state["numpy"]
    np.random.set_state(("MT19937", np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])


def save_checkpoint(state: dict, path: Path) -> None:
    """torch.save, all or nothing (write_atomically)."""
    write_atomically(path, lambda f: torch.save(state, f))


def write_atomically(path: Path, write: Callable, intact: Optional[str] = None) -> None:
    """`write(f)` into a temporary file beside `path` (opened "wb"), fsync, then os.replace: all or nothing. A write
    the file system refuses is StorageError, the temporary file removed; `intact` says what is left (by default what
    the previous file at `path` holds). Checkpoints, summary.json and a resume's metrics.csv are written so."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new, never half
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # and the rename itself survives a power cut
        finally:
            os.close(dir_fd)
    except BaseException as e:
        tmp.unlink(missing_ok=True)  # (deleting frees what it took: this works on a full disk)
        fault = os_error_in(e, path.parent)
        if fault is None:
            raise
        raise StorageError(path, fault, intact=what_is_intact(path) if intact is None else intact) from None


def what_is_intact(path: Path) -> str:
    """For a failed save: what `path` still holds (the write never touched it)."""
    if not Path(path).exists():
        return f"no {Path(path).name} was written before it"
    try:  # (a dcp link: its folder's metadata; a file: mapped, the tensors stay on disk)
        ckpt = (load_checkpoint(path, full=False) if Path(path).is_dir() else
                torch.load(path, map_location="cpu", weights_only=True, mmap=True))
        micro, epoch = ckpt["progress"]["micro_steps_done"], int(ckpt["epoch"])
        where = f"epoch {epoch + 1}, mid-epoch" if micro else f"after epoch {epoch}"
        return f"the previous {Path(path).name} ({where}, step {ckpt['step']}) is intact"
    except Exception:
        return f"the previous {Path(path).name} is untouched"


def remove_stale_temp_files(out_dir: Path) -> None:
    """Remove the temporary files of save_checkpoint (and summary.json's) left by a process that was killed while
    writing them: `.<name>.tmp-<pid>` whose pid no longer runs. A live writer's file is left alone."""
    for tmp in Path(out_dir).glob(".*.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _process_exists(int(pid)):
            tmp.unlink(missing_ok=True)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: no signal is sent, only the existence and permission checks are made
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, owned by another user
    return True


def check_checkpoint_arg(path: Optional[str], flag: str = "--checkpoint") -> None:
    """A tool's checkpoint argument (evaluate, generate): given, a path the OS can take, a file or a dcp folder."""
    if path is None:
        raise UsageError(flag, "is required", "a last.pt or best.pt path")
    check_path(path, flag)
    if not (Path(path).is_file() or Path(path).is_dir()):  # a dcp checkpoint is a folder
        raise UsageError(flag, f"no checkpoint file at {path}")


def saved_config(ckpt: dict) -> Config:
    """The Config a checkpoint was written with (fields this version does not know are left out)."""
    saved = ckpt["config"] if isinstance(ckpt["config"], dict) else {}
    return Config(**{f.name: saved[f.name] for f in dataclasses.fields(Config) if f.name in saved})


def load_checkpoint(path: Path, flag: str = "--resume", full: bool = True) -> dict:
    """Load with weights_only=True onto the CPU; a corrupt or foreign file is a one-line UsageError. A folder is a
    --checkpoint-format dcp checkpoint (load_dcp): with full=False only its metadata, the shards stay on disk."""
    if Path(path).is_dir():
        return load_dcp(Path(path), flag, full)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UsageError(flag, f"no checkpoint file at {path}") from None
    except Exception as e:  # truncated zip, random bytes, pickled code that weights_only refuses, ...
        raise UsageError(flag, f"{path} is not a readable checkpoint ({first_line(e)})") from None
    if not isinstance(state, dict) or any(k not in state for k in REQUIRED_KEYS):
        missing = [k for k in REQUIRED_KEYS if not isinstance(state, dict) or k not in state]
        raise UsageError(flag, f"{path} is not a manual_train checkpoint (missing: {', '.join(missing)})")
    return state


# ---------------------------------------------------------------------- what Run checkpoints, when not a module
@dataclasses.dataclass
class FullState:
    """A checkpointed object for manual_train.run.Run: state_dict() gathers the full state (a collective: every
    rank calls it, rank 0 receives it, the others get {}); load_state_dict() takes a full state (any loop's
    checkpoint, read by every rank) and keeps this rank's shard of it."""

    state_dict: Callable[[], dict]
    load_state_dict: Callable[[dict], None]
    module: Optional[nn.Module] = None  # the unwrapped model, for Run's banner (the model's FullState only)
    # (module, optimizer) whose parameters are DTensors (FSDP2, tensor parallel): Run's --checkpoint-format dcp saves
    # and loads their shards with torch.distributed.checkpoint (save_sharded, load_sharded), no gather
    sharded: Optional[tuple] = None


# ---------------------------------------------------------------------- --checkpoint-format dcp: a folder of shards
DCP_META = "meta.pt"  # beside DCP's .metadata and __<rank>_0.distcp files: everything but the tensors
CHECKPOINT_FORMATS = ("pt", "dcp")


def check_checkpoint_format(checkpoint_format: str, async_checkpoint: bool, *, sharded: bool, allowed: str) -> None:
    """--checkpoint-format dcp saves DTensor shards: only where the parameters are sharded (`sharded`, which runs
    are: `allowed`); --async-checkpoint is dcp's async_save. Refused in one line otherwise."""
    if checkpoint_format == "dcp" and not sharded:
        raise UsageError("--checkpoint-format", f"dcp writes each rank's shards of sharded (DTensor) parameters: "
                                                f"{allowed} only", f"pt, or dcp with {allowed}")
    if async_checkpoint and checkpoint_format != "dcp":
        raise UsageError("--async-checkpoint", "writes dcp checkpoints in the background", "--checkpoint-format dcp")


def split_tensors(tree: dict) -> tuple[dict, dict]:
    """(the tensors, the rest) of a nested dict, each in the same nesting: DCP stores the tensors (sharded, read back
    resharded), meta.pt the rest (param_groups, ...), loaded with weights_only. DCP would store the rest pickled,
    and it unpickles with weights_only=False: a folder that holds any is refused (load_dcp)."""
    tensors, rest = {}, {}
    for key, value in tree.items():
        if isinstance(value, dict):
            t, r = split_tensors(value)
            if t:
                tensors[key] = t
            if r or not t:
                rest[key] = r  # an empty dict (a parameter's optimizer state before its first step) stays too
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            rest[key] = value
    return tensors, rest


def merge(a: dict, b: dict) -> dict:
    """The nested dict that holds both (split_tensors undone)."""
    out = dict(a)
    for key, value in b.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def save_sharded(raw_model: nn.Module, optimizer, folder: Path, async_group=None) -> tuple[dict, object]:
    """Every rank writes its own shards with torch.distributed.checkpoint (DCP), no gather; (rest, future).

    The option for models whose full state does not fit on one rank: nothing is gathered, files are written in
    parallel, and DCP reshards on load (another world size works). Only the tensors go to DCP; `rest` (param_groups,
    the same on every rank) is for the caller to keep (Run: meta.pt). async_group: a process group of its own for
    dcp.async_save, which copies the shards to host memory and writes them in a thread (the future); its
    collectives must not interleave with training's on the default group. Call on every rank.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(raw_model, optimizer)  # DTensor shards, keyed by name
    tensors, rest = split_tensors({"model": model_state, "optimizer": optimizer_state})
    if async_group is not None:
        return rest, dcp.async_save(tensors, checkpoint_id=str(folder), process_group=async_group)
    dcp.save(tensors, checkpoint_id=str(folder))
    return rest, None


def load_sharded(raw_model: nn.Module, optimizer, folder: Path, rest: Optional[dict] = None,
                 model_only: bool = False) -> None:
    """Read a save_sharded folder into a DTensor model and its optimizer (each rank reads what its shards need, at
    any world size); `rest` as save_sharded returned it (None: keep the optimizer's own param_groups)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(raw_model, optimizer)  # the layout to read into
    layout = {"model": model_state} if model_only else {"model": model_state, "optimizer": optimizer_state}
    tensors, own_rest = split_tensors(layout)
    dcp.load(tensors, checkpoint_id=str(folder))
    state = merge(tensors, own_rest if rest is None else {k: rest.get(k, {}) for k in layout})
    if model_only:
        set_model_state_dict(raw_model, state["model"])
    else:
        set_state_dict(raw_model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def load_dcp(folder: Path, flag: str = "--resume", full: bool = True) -> dict:
    """A dcp checkpoint's meta.pt (every key of a .pt checkpoint but model and optimizer, plus `rest`), checked: DCP's
    .metadata readable and listing tensors only. full: also the model and optimizer, whole (read_dcp_full)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
    except Exception as e:
        raise UsageError(flag, f"{folder} is not a readable DCP checkpoint ({first_line(e)})") from None
    if any(isinstance(m, BytesStorageMetadata) for m in metadata.state_dict_metadata.values()):
        raise UsageError(flag, f"{folder} holds pickled objects, which DCP would load with weights_only=False "
                               "(manual_train's dcp checkpoints hold tensors only)")
    for info in (metadata.storage_data or {}).values():  # every shard file there, none cut short: checked now,
        shard = folder / info.relative_path               # before anything is written, not mid-load
        if not shard.is_file() or shard.stat().st_size < info.offset + info.length:
            raise UsageError(flag, f"{folder} is missing or has a truncated shard file ({info.relative_path})")
    meta = load_checkpoint(folder / DCP_META, flag) if (folder / DCP_META).is_file() else None
    if meta is None or meta.get("format") != "dcp":
        raise UsageError(flag, f"{folder} is not a manual_train dcp checkpoint (no {DCP_META} of one)")
    meta["dcp"] = str(folder.resolve())  # a link (last.dcp) names the folder its target was at load time
    if full:
        meta.update(read_dcp_full(folder, meta, flag))
    return meta


def read_dcp_full(folder: Path, meta: dict, flag: str = "--resume") -> dict:
    """{"model", "optimizer"} of a dcp checkpoint as whole tensors in torch.optim's layout (what a .pt holds), read
    in this process alone (no process group): how a loop without sharded parameters resumes one, and --to-pt."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}  # filled from the folder's own metadata: what format_utils.dcp_to_torch_save does, in memory
    try:
        _load_state_dict(state, storage_reader=FileSystemReader(str(folder)), planner=_EmptyStateDictLoadPlanner(),
                         no_dist=True)
    except (Exception, CheckpointException) as e:  # (DCP's is a BaseException)
        raise UsageError(flag, f"{folder}: its shards cannot be read ({first_line(e)})") from None
    state = merge(state, meta["rest"])
    return {"model": state["model"], "optimizer": by_position(state["optimizer"])}


def by_position(optimizer_state: dict) -> dict:
    """get_state_dict's optimizer state (keyed by parameter name) in torch.optim's own layout (by position)."""
    names = [name for group in optimizer_state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[name]: s for name, s in optimizer_state.get("state", {}).items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in optimizer_state["param_groups"]]}


def link_atomically(link: Path, target: str) -> None:
    """Point the symlink `link` (last.dcp) at the folder `target` (a name beside it): a new link under a temporary
    name, then os.replace. A folder cannot replace a non-empty folder atomically; a link can, so a reader sees the
    previous complete checkpoint or the new one, never a half-written folder."""
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, link)
    _fsync_dir(link.parent)


def remove_unlinked_dcp(out_dir: Path) -> None:
    """Remove the .dcp-* folders no link points at: the previous checkpoints, and a killed run's half-written one."""
    import shutil

    kept = {os.readlink(out_dir / name) for name in ("last.dcp", "best.dcp") if (out_dir / name).is_symlink()}
    for folder in Path(out_dir).glob(".dcp-*"):
        if folder.name not in kept and folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)


def _fsync_dir(folder: Path) -> None:
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def first_line(e: Exception) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:160]


def check_compatible(ckpt: dict, cfg: Config, global_batch_size: int, total_steps: int,
                     flag: str = "--resume", script: str = "") -> None:
    """Refuse, in one line naming the flag, a resume that would not continue the checkpoint's training; raise
    RunFinished when there is nothing left to train. Called before anything is written."""
    saved = ckpt["config"]
    for name in MUST_MATCH:
        if name in saved and saved[name] != getattr(cfg, name):
            raise UsageError(flag, f"checkpoint was trained with --{name.replace('_', '-')} {saved[name]}, "
                                   f"this run has {getattr(cfg, name)}")
    # The global batch fixes which samples each optimizer step averages (the sampler's order is per sample).
    saved_global = saved["batch_size"] * saved["accumulate"] * ckpt["world_size"]
    if global_batch_size != saved_global:
        raise UsageError("--batch-size", f"global batch {global_batch_size} differs from the checkpoint's "
                                         f"{saved_global} (batch x accumulate x world size): the steps after the "
                                         "resume would average other samples", f"a global batch of {saved_global}")
    world_size = global_batch_size // (cfg.batch_size * cfg.accumulate)  # this run's replicas
    if world_size != ckpt["world_size"]:
        check_world_size_change(ckpt, cfg, world_size, flag, script)
    if cfg.limit_train_batches and cfg.batch_size * world_size != saved["batch_size"] * ckpt["world_size"]:
        raise UsageError("--limit-train-batches", f"counts micro-batches, of {saved['batch_size'] * ckpt['world_size']}"
                         f" samples (all ranks) in the checkpoint's run and of {cfg.batch_size * world_size} in this "
                         "one: the epoch would hold other samples", "the checkpoint's --batch-size x world size")
    # Mid-epoch: the position is kept in samples of the epoch's order (all ranks'), so any split of the same global
    # batch starts where the checkpoint stopped; a position inside one of this run's windows cannot be continued.
    position = epoch_samples_done(ckpt)
    if position % global_batch_size:
        raise UsageError(flag, f"the checkpoint stopped {position} samples into its epoch, not at the end of a "
                               f"window of {global_batch_size}", "an epoch-end checkpoint")
    for name in ("epochs", "max_steps"):
        if cfg.schedule != "constant" and saved.get(name) != getattr(cfg, name):
            raise UsageError(f"--{name.replace('_', '-')}", f"{getattr(cfg, name)} changes the length of the "
                             f"{cfg.schedule} LR schedule the checkpoint follows ({saved.get(name)}): the LR of "
                             "every later step would differ from the run's", f"{saved.get(name)}")
    step = int(ckpt["step"])
    if step > total_steps:
        raise UsageError("--max-steps" if cfg.max_steps else "--epochs",
                         f"this run ends after {total_steps} optimizer steps, before the checkpoint's step {step}",
                         f"more than {step} steps (--epochs or --max-steps)")
    if step == total_steps or ckpt["early_stopping"].get("should_stop"):
        how = "stopped early" if ckpt["early_stopping"].get("should_stop") else f"all {total_steps} steps done"
        raise RunFinished(f"nothing to do: the checkpoint's run is finished ({how}); its outputs are left as they "
                          "are (a --schedule constant run trains on when resumed with more --epochs or --max-steps)")


def check_world_size_change(ckpt: dict, cfg: Config, world_size: int, flag: str = "--resume",
                            script: str = "") -> None:
    """A resume at another world size (data-parallel ranks) with the same global batch continues the training exactly
    when nothing draws random numbers per rank: rank r's shard is perm[r::N], so step i averages perm[i*G:(i+1)*G]
    at any N (G the global batch; only the order of the sum changes). Per-rank RNG streams cannot be redistributed:
    N ranks draw N streams of dropout masks that M ranks cannot repeat: refused in one line. (Augmentation is drawn
    per sample, data.PerSampleRNG, so it moves with the samples.)"""
    saved_size = ckpt["world_size"]
    why = None
    if cfg.dropout:
        why = f"with --dropout {cfg.dropout} every rank draws its own masks from its own RNG stream, which " \
              f"{world_size} ranks cannot repeat"
    elif "hybrid" in (ckpt.get("script"), script):
        why = "the hybrid loop's resume is proven at its own world size only"
    if why:
        raise UsageError(flag, f"the checkpoint was written at world size {saved_size}, this run has {world_size}: "
                               f"{why}", f"world size {saved_size}")


def epoch_samples_done(ckpt: dict) -> int:
    """How far into its epoch the checkpoint stopped, in samples of the epoch's order (every rank's). Checkpoints
    written before `epoch_samples_done` was kept count micro-batches of batch x world size."""
    progress = ckpt.get("progress", {})
    if "epoch_samples_done" in progress:
        return int(progress["epoch_samples_done"])
    return int(progress.get("micro_steps_done", 0)) * ckpt["config"]["batch_size"] * ckpt["world_size"]


def build_checkpoint(*, model_state: dict, optimizer_state: dict, scheduler, scaler_state: dict, early_stopping,
                     cfg: Config, epoch: int, micro_steps_done: int, step: int, samples_seen: int, best: dict,
                     world_size: int, **extra) -> dict:
    """The checkpoint dict (docs/checkpointing.md). `epoch` is the epoch being run; micro_steps_done > 0 means
    it stopped mid-epoch (--max-steps), and a resume starts the sampler at that point."""
    return {
        "model": model_state,
        "optimizer": optimizer_state,
        "scheduler": scheduler.state_dict(),
        "scaler": scaler_state,
        "epoch": epoch,
        "step": step,
        "rng": capture_rng(),
        "early_stopping": early_stopping.state_dict(),
        "config": dataclasses.asdict(cfg),
        "world_size": world_size,
        "progress": {"micro_steps_done": micro_steps_done, "samples_seen": samples_seen, "best": best,
                     "epoch_samples_done": micro_steps_done * cfg.batch_size * world_size},  # all ranks' samples
        **extra,
    }


def resume_point(ckpt: Optional[dict], micro_batch: int) -> tuple[int, int, int, int, dict]:
    """(epoch, micro-step to start at, step, samples_seen, best) to continue from; zeros for a fresh run.
    micro_batch: this run's micro-batch, all ranks' (batch x data-parallel world size): the checkpoint's position
    in samples becomes a number of this run's micro-steps, whatever split the checkpoint's run had."""
    if ckpt is None:
        return 0, 0, 0, 0, {}
    progress = ckpt.get("progress", {})
    return (int(ckpt["epoch"]), epoch_samples_done(ckpt) // micro_batch, int(ckpt["step"]),
            int(progress.get("samples_seen", 0)), dict(progress.get("best", {})))


def main(argv=None) -> int:
    """python -m manual_train.checkpoint --to-pt RUN/last.dcp OUT.pt: a dcp checkpoint as the plain .pt checkpoint
    that every loop resumes (launch/single.py --resume OUT.pt); whole tensors, torch.optim's layout."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m manual_train.checkpoint", description=main.__doc__)
    parser.add_argument("--to-pt", nargs=2, metavar=("DCP_FOLDER", "OUT_PT"), required=True)
    args = parser.parse_args(argv)
    folder, out = Path(args.to_pt[0]), Path(args.to_pt[1])
    try:
        if out.exists():
            raise UsageError("--to-pt", f"{out} exists; it is left as it is", "a new file name")
        state = load_checkpoint(folder, "--to-pt")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for key in ("dcp", "rest", "format"):
        state.pop(key, None)
    save_checkpoint(state, out)
    print(f"{folder} -> {out} (step {state['step']}, world size {state['world_size']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
