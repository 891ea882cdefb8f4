"""The run configuration: one typed dataclass, the argparse parser built from it, and validation.

Every launch script shares the flags of `Config`; a script with flags of its own subclasses it
(e.g. `DDPConfig(Config)` adds `--backend`). Each field is declared with `arg(default, help, ...)`;
the parser, its `--help` text and the generic checks (choices, lower bounds) all come from that one
declaration, so a flag cannot be documented in one place and validated differently in another.

Bad input never produces a traceback: every check raises `UsageError(flag, what, allowed)`, which
`manual_train.cli.run` prints as one line

    error: --flag: what is wrong (allowed: ...)

on stderr before exiting with status 2. All checks run before any directory is created.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence


class UsageError(Exception):
    """A user error: printed as one `error: --flag: ...` line, exit status 2, no traceback."""

    def __init__(self, flag: str, what: str, allowed: Optional[str] = None):
        self.flag, self.what, self.allowed = flag, what, allowed
        text = f"{flag}: {what}" if flag else what
        if allowed:
            text += f" (allowed: {allowed})"
        super().__init__(text)


def arg(default, help: str, *, choices: Optional[Sequence] = None, min: Optional[float] = None,
        min_exclusive: bool = False, metavar: Optional[str] = None):
    """Declare a config field together with its flag's help text and generic checks.

    min: smallest allowed value (inclusive unless min_exclusive); None values are always allowed.
    """
    return field(default=default, metadata=dict(help=help, choices=choices, min=min,
                                                 min_exclusive=min_exclusive, metavar=metavar))


DATASETS = ("digits", "mnist", "fashion-mnist", "cifar10", "synthetic", "reverse")
MODELS = ("mlp", "cnn", "resnet18", "seq2seq")
PRECISIONS = ("32-true", "64-true", "16-mixed", "bf16-mixed", "16-o2", "apex-o2")


@dataclass
class Config:
    """Flags shared by every launch script (names fixed by docs/ and the tests)."""

    # data
    dataset: str = arg("digits", "dataset; digits (scikit-learn's bundled 8x8 digits) needs no download",
                       choices=DATASETS)
    data_root: str = arg("data", "folder holding torchvision datasets (mnist, fashion-mnist, cifar10)",
                         metavar="PATH")
    download: bool = arg(False, "allow torchvision to download --dataset into --data-root (opt-in)")
    synthetic_size: int = arg(2048, "number of training samples for --dataset synthetic/reverse "
                                    "(validation gets a quarter as many)", min=1)
    synthetic_shape: str = arg("3,32,32", "C,H,W of --dataset synthetic images", metavar="C,H,W")
    synthetic_classes: int = arg(10, "number of classes for --dataset synthetic", min=2)
    # model
    model: str = arg("cnn", "model to train (seq2seq only with --dataset reverse)", choices=MODELS)
    # schedule
    epochs: int = arg(10, "total epochs (a resumed run continues up to this number)", min=1)
    max_steps: Optional[int] = arg(None, "stop after this many optimizer steps (overrides --epochs)", min=1)
    batch_size: int = arg(32, "samples per micro-batch, per process", min=1)
    accumulate: int = arg(1, "micro-batches per optimizer step (gradient accumulation)", min=1)
    # optimisation
    lr: float = arg(0.05, "learning rate at --base-batch-size (see --lr-scaling)", min=0, min_exclusive=True)
    lr_scaling: str = arg("none", "scale --lr with the global batch: linear (Goyal et al.) or sqrt",
                          choices=("none", "linear", "sqrt"))
    base_batch_size: int = arg(32, "global batch size at which --lr was tuned (for --lr-scaling)", min=1)
    optimizer: str = arg("sgd", "sgd (momentum 0.9) or adamw", choices=("sgd", "adamw"))
    weight_decay: float = arg(0.0, "weight decay", min=0)
    grad_clip: Optional[float] = arg(None, "clip the global gradient norm to this value (after unscaling)",
                                     min=0, min_exclusive=True, metavar="NORM")
    schedule: str = arg("cosine", "LR schedule over all optimizer steps", choices=("cosine", "constant"))
    warmup_steps: int = arg(0, "linear LR warm-up steps", min=0)
    # precision
    precision: str = arg("32-true", "numeric precision; 64-true (float64 weights, inputs and optimizer state) is "
                                    "the parity mode whose results do not depend on the CPU; 16-o2 is apex's O2 "
                                    "written out; apex-o2 needs apex",
                         choices=PRECISIONS)
    loss_scale_init: float = arg(2.0 ** 16, "initial dynamic loss scale (16-mixed, 16-o2)", min=1)
    loss_scale_growth_interval: int = arg(2000, "clean steps before the loss scale doubles", min=1)
    loss_scale_max: float = arg(2.0 ** 24, "cap on the dynamic loss scale (16-o2, as apex)", min=1)
    # data loading
    num_workers: int = arg(0, "DataLoader worker processes (0 loads in the main process)", min=0)
    pin_memory: Optional[bool] = arg(None, "page-locked host batches for async copies (default: on for CUDA)")
    persistent_workers: bool = arg(False, "keep workers alive between epochs (needs --num-workers > 0)")
    prefetch_factor: Optional[int] = arg(None, "batches each worker loads ahead (needs --num-workers > 0; "
                                               "torch's default is 2)", min=1)
    # device and reproducibility
    device: str = arg("auto", "auto, cpu, cuda or cuda:N", metavar="{auto,cpu,cuda,cuda:N}")
    seed: int = arg(0, "seed for weights, shuffling and workers", min=0)
    deterministic: bool = arg(False, "torch.use_deterministic_algorithms(True) and deterministic cuDNN")
    # evaluation, early stopping, logging
    eval_every: int = arg(1, "evaluate every N epochs (and always after the last)", min=1)
    eval_mode: str = arg("no_grad", "evaluate under torch.no_grad() or torch.inference_mode()",
                         choices=("no_grad", "inference"))
    eval_batch_size: int = arg(256, "samples per evaluation batch", min=1)
    monitor: str = arg("val_loss", "metric for early stopping and best.pt", choices=("val_loss", "val_acc"))
    early_stop_patience: int = arg(10, "stop after N evaluations without improvement (0: never)", min=0)
    early_stop_min_delta: float = arg(0.0, "smallest change of --monitor that counts as improvement", min=0)
    restore_best: bool = arg(False, "reload the best weights at the end (from best.pt's copy)")
    log_every: int = arg(10, "optimizer steps between training-loss rows (each is one host sync)", min=1)
    progress: bool = arg(True, "tqdm progress bar on rank 0")
    tensorboard: bool = arg(False, "also write TensorBoard events (needs the tensorboard package)")
    out_dir: Optional[str] = arg(None, "run folder (default: runs/<script>-<timestamp>)", metavar="DIR")
    resume: Optional[str] = arg(None, "continue from a checkpoint (last.pt/best.pt); 'auto' = "
                                      "<out-dir>/last.pt if it exists", metavar="PATH")

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Checks that need more than one flag or the machine; raise UsageError. Subclasses extend."""
        self.input_shape()  # parses --synthetic-shape
        if self.model == "seq2seq" and self.dataset != "reverse":
            raise UsageError("--model", f"seq2seq needs --dataset reverse, not {self.dataset}",
                             "mlp, cnn, resnet18")
        if self.dataset == "reverse" and self.model != "seq2seq":
            raise UsageError("--model", f"--dataset reverse is a sequence task; {self.model} is an image model",
                             "seq2seq")
        if self.num_workers == 0 and self.persistent_workers:
            raise UsageError("--persistent-workers", "needs worker processes; set --num-workers > 0")
        if self.num_workers == 0 and self.prefetch_factor is not None:
            raise UsageError("--prefetch-factor", "needs worker processes; set --num-workers > 0")
        check_device_name(self.device, "--device")
        if self.precision == "apex-o2":
            from manual_train.precision import apex_amp_or_error
            apex_amp_or_error()
        if self.tensorboard:
            try:
                import torch.utils.tensorboard  # noqa: F401
            except ImportError:
                raise UsageError("--tensorboard", "the tensorboard package is not installed "
                                 "(pip install -e '.[tensorboard]')") from None
        if self.resume not in (None, "auto") and not Path(self.resume).is_file():
            raise UsageError("--resume", f"no checkpoint file at {self.resume}", "a last.pt/best.pt path or auto")
        if self.resume == "auto" and self.out_dir is None:
            raise UsageError("--resume", "auto needs an explicit --out-dir to look for last.pt in")
        check_writable_dir(self.out_dir, "--out-dir")
        if self.out_dir and self.resume is None and any((Path(self.out_dir) / name).exists()
                                                        for name in ("last.pt", "metrics.csv")):
            raise UsageError("--out-dir", f"{self.out_dir} already holds a run (nothing is overwritten)",
                             "--resume auto to continue it, or a new --out-dir")

    def input_shape(self) -> tuple:
        try:
            shape = tuple(int(s) for s in self.synthetic_shape.split(","))
        except ValueError:
            shape = ()
        if len(shape) != 3 or min(shape) < 1:
            raise UsageError("--synthetic-shape", f"{self.synthetic_shape!r} is not three positive integers",
                             "C,H,W such as 3,32,32")
        return shape

    def run_dir(self, script: str) -> Path:
        """--out-dir, or runs/<script>-<timestamp> (chosen once, so every rank agrees within a second)."""
        if self.out_dir is None:
            self.out_dir = str(Path("runs") / f"{script}-{time.strftime('%Y%m%d-%H%M%S')}")
        return Path(self.out_dir)

    def resume_path(self) -> Optional[Path]:
        if self.resume == "auto":
            path = Path(self.out_dir) / "last.pt"
            return path if path.is_file() else None
        return Path(self.resume) if self.resume else None


def check_device_name(name: str, flag: str) -> None:
    """Validate one device name: auto, cpu, cuda, cuda:N; CUDA ones must exist on this machine."""
    import torch

    allowed = "auto, cpu, cuda, cuda:N"
    if name in ("auto", "cpu"):
        return
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        if not torch.cuda.is_available():
            raise UsageError(flag, f"{name} requested but CUDA is not available on this machine", "auto, cpu")
        index = int(name[5:]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise UsageError(flag, f"{name} requested but only {torch.cuda.device_count()} CUDA device(s) exist",
                             allowed)
        return
    raise UsageError(flag, f"unknown device {name!r}", allowed)


def check_writable_dir(path: Optional[str], flag: str) -> None:
    """The folder (or its nearest existing parent) must be a writable directory; nothing is created."""
    if path is None:
        path = "runs"
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    if not p.is_dir():
        raise UsageError(flag, f"{p} exists and is not a directory")
    if not os.access(p, os.W_OK | os.X_OK):
        raise UsageError(flag, f"{p} is not writable")


# ---------------------------------------------------------------------- argparse from the dataclass
class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one `error: --flag: ...` line (no usage block), exit status 2.

    quiet=True prints nothing (not even --help) and keeps the exit status: under torchrun every rank
    parses the same argv, and one line per node is enough (manual_train.cli.run).
    """

    def __init__(self, *args, quiet: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.quiet = quiet

    def _print_message(self, message, file=None):
        if not self.quiet:
            super()._print_message(message, file)

    def error(self, message: str):
        if self.quiet:
            sys.exit(2)
        # argparse says "argument --dataset: invalid choice: 'x' (choose from 'a', 'b')"
        message = message.replace("argument ", "", 1).replace("(choose from", "(allowed:")
        if message.startswith("unrecognized arguments: "):
            extra = message.split(": ", 1)[1]
            message = f"{extra.split()[0]}: unknown flag or stray argument {extra!r} (see --help)"
        sys.stderr.write(f"error: {message}\n")
        sys.exit(2)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser(config_cls=Config, *, prog: Optional[str] = None, description: Optional[str] = None,
                 quiet: bool = False, **defaults) -> argparse.ArgumentParser:
    """One argparse flag per dataclass field; `defaults` overrides per script (e.g. dataset='reverse')."""
    parser = _OneLineParser(prog=prog, description=description, allow_abbrev=False, quiet=quiet,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        meta = f.metadata
        default = defaults.get(f.name, f.default)
        base = hints[f.name]
        if typing.get_origin(base) is typing.Union:  # Optional[X]
            base = next(t for t in typing.get_args(base) if t is not type(None))
        helptext = meta.get("help", "") + " (default: %(default)s)"
        if base is bool:
            parser.add_argument(_flag(f.name), dest=f.name, default=default,
                                action=argparse.BooleanOptionalAction, help=helptext)
            continue
        kwargs = dict(dest=f.name, default=default, type=base, help=helptext, metavar=meta.get("metavar"))
        if meta.get("choices"):
            kwargs["choices"] = meta["choices"]
            kwargs.pop("metavar")
        parser.add_argument(_flag(f.name), **kwargs)
    return parser


def check_bounds(cfg: Config) -> None:
    """The per-field lower bounds declared with arg(min=...)."""
    for f in dataclasses.fields(cfg):
        lo = f.metadata.get("min")
        value = getattr(cfg, f.name)
        if lo is None or value is None or isinstance(value, bool):
            continue
        bad = value <= lo if f.metadata.get("min_exclusive") else value < lo
        if bad:
            need = f"> {lo:g}" if f.metadata.get("min_exclusive") else f">= {lo:g}"
            raise UsageError(_flag(f.name), f"{value} is out of range", need)


def parse_config(config_cls=Config, argv: Optional[Sequence[str]] = None, *, prog: Optional[str] = None,
                 description: Optional[str] = None, quiet: bool = False, **defaults) -> Config:
    """Parse argv into a validated config. Raises UsageError (argparse errors exit 2 themselves)."""
    args = build_parser(config_cls, prog=prog, description=description, quiet=quiet, **defaults).parse_args(argv)
    cfg = config_cls(**vars(args))
    check_bounds(cfg)
    cfg.validate()
    return cfg
