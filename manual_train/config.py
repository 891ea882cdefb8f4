"""The run configuration: one typed dataclass, the argparse parser built from it, and validation.

Every launch script shares the flags of `Config`; a script with flags of its own subclasses it
(e.g. `DDPConfig(Config)` adds `--backend`). Each field is declared with `arg(default, help, ...)`;
the parser, its `--help` text and the generic checks (choices, bounds, finite floats) all come from that
one declaration, so a flag cannot be documented in one place and validated differently in another.

A flag whose value has a structure (--synthetic-shape C,H,W, --limit-*-batches N|FRACTION, --max-time DURATION,
--save-on-signal NAMES, --profile-steps A:B, the device scripts' --devices) keeps the text the user typed in its field:
--help shows it, checkpoints save it, --resume compares it, and a command line is rebuilt from it. The code reads it
as a typed value (`cfg.train_limit`, `cfg.time_limit_s`, `cfg.device_list()`, ...), declared with `@parsed_from`: parsed
once, by validate(), and parsed again only if its text is set anew (--fast-dev-run's limits, evaluate's override).

Bad input never produces a traceback: every check raises `UsageError(flag, what, allowed)`, which
`manual_train.cli.run` prints as one line

    error: --flag: what is wrong (allowed: ...)

on stderr before exiting with status 2. All checks run before any directory is created (the one
probe that tries whether --out-dir can be created removes what it made).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import secrets
import signal
import sys
import tempfile
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Collection, Optional, Sequence, TypeVar

from manual_train.errors import UsageError


def arg(default, help: str, *, choices: Optional[Sequence] = None, min: Optional[float] = None,
        min_exclusive: bool = False, max: Optional[float] = None, metavar: Optional[str] = None):
    """Declare a config field together with its flag's help text and generic checks.

    min: smallest allowed value (inclusive unless min_exclusive); max: largest allowed value (inclusive).
    None values are always allowed; float values must also be finite (nan, inf and -inf are refused).
    """
    return field(default=default, metadata=dict(help=help, choices=choices, min=min,
                                                 min_exclusive=min_exclusive, max=max, metavar=metavar))


T = TypeVar("T")


def parsed_from(*names: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorate a config method that parses the text of the flag fields `names` into a typed value: it runs once and
    its value is kept (in the instance, not as a dataclass field: the parser, checkpoints and summary.json see the
    text only); it runs again only after one of those fields is set to another text. validate() reads each such value
    once, so a bad text is its one-line UsageError before any work starts. Stack @property on top for an attribute.
    """
    def decorate(parse: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(parse)
        def value(self) -> T:
            texts = tuple(getattr(self, name) for name in names)
            kept = vars(self).setdefault("_parsed", {})
            if parse.__name__ not in kept or kept[parse.__name__][0] != texts:
                kept[parse.__name__] = (texts, parse(self))
            return kept[parse.__name__][1]
        return value
    return decorate


DATASETS = ("digits", "mnist", "fashion-mnist", "cifar10", "synthetic", "reverse", "pydoc")
MODELS = ("mlp", "cnn", "resnet18", "seq2seq", "gpt")
CHECKPOINTING = ("none", "full", "selective")  # --activation-checkpointing (manual_train/models.py, docs/levers.md)
COMPILE = ("none", "model", "blocks")  # --compile (models.compile_model, docs/levers.md)
# --compile's scripts, named by the configs whose script refuses it (their check_compile)
COMPILE_SCRIPTS = "none, or launch/single.py, ddp.py, zero.py, pipeline.py or tensor_parallel.py"
PRECISIONS = ("32-true", "64-true", "16-mixed", "bf16-mixed")
# apex's O2 is its own lesson: only launch/apex_o2.py takes these (manual_train/apex_o2.py, loops/apex_o2.py)
O2_PRECISIONS = ("16-o2", "apex-o2")
# GradScaler hands a fused optimizer the skip decision (found_inf); torch 2.14's fused SGD kernel still writes its
# momentum buffer on a skipped (overflow) step: the next real step jumps by it and the run reaches NaN (fused AdamW
# leaves its state at zero; LibreYOLO/libreyolo#771 saw the same on CUDA). So 16-mixed never fuses SGD (optim.py).
SCALER_SKIPS_FUSED_SGD = ("fused SGD writes its momentum on the steps the 16-mixed loss scaler skips (torch 2.14), "
                          "so one overflow corrupts the run")
# --seed: each rank reseeds numpy with seed + rank, and numpy takes seeds below 2**32; 2**31 - 1 leaves room
# for 2**31 ranks.
MAX_SEED = 2 ** 31 - 1
# --loss-scale-*: far above any useful scale (fp16 overflows at 65504), far below float32's 3.4e38, where the
# scale itself would become inf (every step skipped, forever).
MAX_LOSS_SCALE = 2.0 ** 64
# A run folder's own files (checkpoints' temp files, tb/ event files named after the host) need this many
# characters of the OS's path limit beyond the folder's own path.
OUT_DIR_ROOM = 160


@dataclass
class Config:
    """Flags shared by every launch script (names fixed by docs/ and the tests)."""

    # data
    dataset: str = arg("digits", "dataset; digits (scikit-learn's bundled 8x8 digits) needs no download; "
                                 "your own: docs/your-model.md",
                       metavar="{" + ",".join(DATASETS) + "} or PACKAGE.MODULE:CALLABLE")
    data_root: str = arg("data", "folder holding torchvision datasets (mnist, fashion-mnist, cifar10)",
                         metavar="PATH")
    download: bool = arg(False, "allow torchvision to download --dataset into --data-root (opt-in)")
    synthetic_size: int = arg(2048, "number of training samples for --dataset synthetic/reverse "
                                    "(validation gets a quarter as many)", min=1)
    synthetic_shape: str = arg("3,32,32", "C,H,W of --dataset synthetic images", metavar="C,H,W")
    synthetic_classes: int = arg(10, "number of classes for --dataset synthetic", min=2)
    block_size: int = arg(64, "--dataset pydoc (Python's reference manual as bytes, --model gpt): the most tokens "
                              "a sample holds, and the GPT's context length", min=1)
    text_samples: int = arg(0, "--dataset pydoc: train on the first N samples of the text only (0: all of it)", min=0)
    # model
    model: str = arg("cnn", "model to train (seq2seq only with --dataset reverse; gpt with reverse or pydoc); "
                            "yours: docs/your-model.md",
                     metavar="{" + ",".join(MODELS) + "} or PACKAGE.MODULE:CALLABLE")
    loss: Optional[str] = arg(None, "your loss, called as loss(logits, y, reduction='mean'|'sum') like "
                                    "F.cross_entropy (default: the mean cross-entropy); docs/your-model.md",
                              metavar="PACKAGE.MODULE:CALLABLE")
    activation_checkpointing: str = arg("none", "recompute activations in backward instead of keeping them, per "
                                                "block (gpt, resnet18): full, or selective (matmul and attention "
                                                "outputs kept); less memory for more time", choices=CHECKPOINTING)
    compile: str = arg("none", "torch.compile the whole model's forward (model) or each block's (blocks: gpt, "
                               "resnet18), before any wrapper; the first step compiles (tens of seconds)",
                       choices=COMPILE)
    # schedule
    epochs: int = arg(10, "total epochs; a resume passes the checkpoint's (another value is refused), except "
                          "under --schedule constant, where more epochs train on", min=1)
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
    optimizer_impl: Optional[str] = arg(None, "optimizer kernels: for-loop (one op per tensor), foreach (one op per "
                                              "step of the math) or fused (one kernel); default: the fastest that "
                                              "applies to the device and dtype (fused on CPU and CUDA)",
                                         choices=("for-loop", "foreach", "fused"))
    grad_clip: Optional[float] = arg(None, "clip the global gradient norm to this value (after unscaling)",
                                     min=0, min_exclusive=True, metavar="NORM")
    schedule: str = arg("cosine", "LR schedule over all optimizer steps", choices=("cosine", "constant"))
    warmup_steps: int = arg(0, "linear LR warm-up steps", min=0)
    # precision
    # (not argparse choices: 16-o2 and apex-o2 get a line that names the script taking them, check_precision_choice)
    precision: str = arg("32-true", "numeric precision; 64-true (float64 weights, inputs and optimizer state) is "
                                    "the parity mode whose results do not depend on the CPU; apex's O2 (16-o2, "
                                    "apex-o2) is launch/apex_o2.py's", metavar="{" + ",".join(PRECISIONS) + "}")
    loss_scale_init: float = arg(2.0 ** 16, "initial dynamic loss scale (16-mixed; launch/apex_o2.py's 16-o2, "
                                            "at most its --loss-scale-max)", min=1, max=MAX_LOSS_SCALE)
    loss_scale_growth_interval: int = arg(2000, "clean steps before the loss scale doubles", min=1)
    # data loading
    num_workers: int = arg(0, "DataLoader worker processes (0 loads in the main process)", min=0)
    pin_memory: Optional[bool] = arg(None, "page-locked host batches for async copies (default: on for CUDA)")
    persistent_workers: bool = arg(False, "keep workers alive between epochs (needs --num-workers > 0)")
    prefetch_factor: Optional[int] = arg(None, "batches each worker loads ahead (needs --num-workers > 0; "
                                               "torch's default is 2)", min=1)
    # device and reproducibility
    device: str = arg("auto", "auto, cpu, cuda or cuda:N", metavar="{auto,cpu,cuda,cuda:N}")
    seed: int = arg(0, "seed for weights, shuffling and workers; at most 2**31 - 1, so that seed + rank (each "
                       "rank's own stream) stays a valid numpy seed (< 2**32) for up to 2**31 ranks",
                    min=0, max=MAX_SEED)
    deterministic: bool = arg(False, "torch.use_deterministic_algorithms(True) and deterministic cuDNN")
    # evaluation, early stopping, logging
    eval_every: int = arg(1, "evaluate every N epochs (and always after the last)", min=1)
    eval_mode: str = arg("no_grad", "evaluate under torch.no_grad() or torch.inference_mode()",
                         choices=("no_grad", "inference"))
    eval_batch_size: int = arg(256, "samples per evaluation batch", min=1)
    monitor: str = arg("val_loss", "metric for early stopping and best.pt", choices=("val_loss", "val_acc"))
    early_stop_patience: int = arg(10, "stop after N evaluations without improvement (0: never)", min=0)
    early_stop_min_delta: float = arg(0.0, "smallest change of --monitor that counts as improvement", min=0)
    stop_at: Optional[float] = arg(None, "stop once --monitor reaches VALUE (val_acc >= VALUE, val_loss <= VALUE): "
                                         "training to a target, Lightning's stopping_threshold", metavar="VALUE")
    restore_best: bool = arg(False, "reload the best weights at the end (from best.pt's copy)")
    log_every: int = arg(10, "optimizer steps between training-loss rows (each is one host sync)", min=1)
    train_acc: bool = arg(True, "the training rows' accuracy: one argmax per micro-step on the device "
                                "(--no-train-acc: none, acc is nan; Lightning logs none unless asked)")
    progress: bool = arg(True, "tqdm progress bar on rank 0")
    tensorboard: bool = arg(False, "also write TensorBoard events (needs the tensorboard package)")
    out_dir: Optional[str] = arg(None, "run folder (default: runs/<script>-<YYYYmmdd-HHMMSS>-<6 random hex "
                                       "digits>, new for every run)", metavar="DIR")
    resume: Optional[str] = arg(None, "continue from a checkpoint (last.pt/best.pt); 'auto' = "
                                      "<out-dir>/last.pt if it exists", metavar="PATH")
    # everyday tools (docs/everyday.md): regularisation, mid-epoch validation and checkpoints, smoke-test limits,
    # clipping by value, anomaly detection, a time limit, a profiler window, the model summary
    dropout: float = arg(0.0, "dropout probability (mlp: on its input and hidden layers; cnn: before its head; gpt: "
                              "after the embeddings and in every block); 0 draws no random numbers", min=0, max=0.9)
    val_every_steps: Optional[int] = arg(None, "also validate every N optimizer steps inside an epoch "
                                               "(Lightning's val_check_interval=N)", min=1, metavar="N")
    checkpoint_every_steps: Optional[int] = arg(None, "also write last.pt every N optimizer steps inside an epoch; a "
                                                      "resume continues from there exactly", min=1, metavar="N")
    limit_train_batches: Optional[str] = arg(None, "train on the first N micro-batches of each epoch, or a FRACTION "
                                                   "(0 < f <= 1) of them", metavar="N|FRACTION")
    limit_val_batches: Optional[str] = arg(None, "validate on the first N batches of --eval-batch-size, or a "
                                                 "FRACTION (0 < f <= 1) of them", metavar="N|FRACTION")
    fast_dev_run: bool = arg(False, "smoke test: one training batch (one optimizer step) and one validation batch; "
                                    "no outputs kept")
    grad_clip_value: Optional[float] = arg(None, "clip every gradient element to [-VALUE, VALUE] (after unscaling; "
                                                 "instead of --grad-clip)", min=0, min_exclusive=True, metavar="VALUE")
    detect_anomaly: bool = arg(False, "torch.autograd.set_detect_anomaly: backward raises at the first NaN/inf, with "
                                      "the forward operation that made it (slow: for debugging)")
    max_time: Optional[str] = arg(None, "stop at the first step boundary after this much training time in this "
                                        "launch (DD:HH:MM:SS, HH:MM:SS, MM:SS or seconds); last.pt and summary.json "
                                        "are written, --resume continues", metavar="DURATION")
    save_on_signal: str = arg("TERM,USR1", "on these signals (Slurm's preemption notice, spot VMs, Kubernetes) "
                                           "finish the optimizer step, save last.pt mid-epoch on every rank at once "
                                           "and exit 75 to be requeued; none: the default action (the process "
                                           "dies)", metavar="NAMES")
    profile: bool = arg(False, "torch.profiler over a window of optimizer steps (--profile-steps): a Chrome trace "
                               "and the top operators, in <out-dir>/profile/")
    profile_steps: Optional[str] = arg(None, "the profiled window A:B: optimizer steps A+1 to B (default: 5:10; "
                                             "implies --profile)", metavar="A:B")
    summary_depth: int = arg(1, "module depth of the banner's per-layer model summary (0: none)", min=0)
    trace_dir: Optional[str] = arg(None, "record the loss and the full weights' checksums after every optimizer step "
                                         "into DIR for python -m manual_train.parity (off: no cost)", metavar="DIR")

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Checks that need more than one flag or the machine; raise UsageError. Subclasses extend."""
        self.validate_step()
        self.validate_everyday()
        if self.num_workers == 0 and self.persistent_workers:
            raise UsageError("--persistent-workers", "needs worker processes; set --num-workers > 0")
        if self.num_workers == 0 and self.prefetch_factor is not None:
            raise UsageError("--prefetch-factor", "needs worker processes; set --num-workers > 0")
        if self.tensorboard:
            try:
                import torch.utils.tensorboard  # noqa: F401
            except ImportError:
                raise UsageError("--tensorboard", "the tensorboard package is not installed "
                                 "(pip install -e '.[tensorboard]')") from None
        if self.resume not in (None, "auto"):
            check_path(self.resume, "--resume")
            if not (Path(self.resume).is_file() or Path(self.resume).is_dir()):  # a dir: --checkpoint-format dcp's
                raise UsageError("--resume", f"no checkpoint file at {self.resume}",
                                 "a last.pt/best.pt path, a last.dcp/best.dcp folder, or auto")
        if self.resume == "auto" and self.out_dir is None:
            raise UsageError("--resume", "auto needs an explicit --out-dir to look for last.pt in")
        check_writable_dir(self.out_dir, "--out-dir", room=OUT_DIR_ROOM)
        if self.trace_dir is not None:
            check_writable_dir(self.trace_dir, "--trace-dir", room=OUT_DIR_ROOM)
        if self.out_dir and self.resume is None and not self.fast_dev_run and any((Path(self.out_dir) / name).exists()
                                                        for name in ("last.pt", "metrics.csv")):
            raise UsageError("--out-dir", f"{self.out_dir} already holds a run (nothing is overwritten)",
                             "--resume auto to continue it, or a new --out-dir")

    def validate_everyday(self) -> None:
        """The everyday tools' flags (docs/everyday.md); --fast-dev-run sets the limits it stands for."""
        if self.dropout and self.model in ("resnet18", "seq2seq"):
            raise UsageError("--dropout", f"--model {self.model} has no dropout here", "0, or --model mlp, cnn, gpt")
        if self.activation_checkpointing != "none" and self.model not in ("gpt", "resnet18"):
            raise UsageError("--activation-checkpointing", f"--model {self.model} has no repeated blocks to "
                             "checkpoint", "none, or --model gpt or resnet18")
        self.check_compile()
        if self.grad_clip and self.grad_clip_value:
            raise UsageError("--grad-clip-value", "clips by value; --grad-clip clips by norm: choose one")
        # the text flags parsed, once (@parsed_from): a bad one is its one-line error now, before any work
        self.train_limit, self.val_limit, self.time_limit_s, self.preemption_signals
        if self.profile or self.profile_steps:
            self.profile = True
            self.profile_range
        if self.fast_dev_run:
            if self.resume:
                raise UsageError("--fast-dev-run", "keeps no outputs and trains one step: nothing to resume")
            # Lightning's fast_dev_run=True: one batch of each, one step, no checkpoints or logs (Run keeps none)
            self.max_steps, self.limit_train_batches, self.limit_val_batches = 1, "1", "1"
            self.val_every_steps = self.checkpoint_every_steps = None
            self.profile = False

    # ------------------------------------------------------------------ what this config's script supports
    # A script's config class states what its loop builds by overriding these (no lookups by class name, no probing
    # for attributes): check_compile (DataParallelConfig, ModelParallelConfig, HybridConfig, ApexO2Config refuse
    # --compile; ZeroConfig and TensorParallelConfig some of its forms), compile_after_wrapping (ZeroConfig,
    # TensorParallelConfig, PipelineConfig) and saves_dcp, saves_async (ZeroConfig's --checkpoint-format and
    # --async-checkpoint).
    def check_compile(self) -> None:
        """--compile where it applies: models.build_model_from compiles before any wrapper, the right order only where
        the wrapper leaves forward alone (single, DDP); a script whose wrapper replaces or patches forward overrides
        this to refuse it (naming COMPILE_SCRIPTS), one that compiles after wrapping sets compile_after_wrapping."""
        if self.compile == "none":
            return
        if self.activation_checkpointing != "none":  # checkpoint's recompute runs Python (BatchNorm's momentum swap)
            raise UsageError("--compile", "with --activation-checkpointing is not built (its recompute is Python "
                             "that dynamo would have to trace)", "none, or --activation-checkpointing none")
        if self.compile == "blocks" and self.model not in ("gpt", "resnet18"):
            raise UsageError("--compile", f"--model {self.model} has no repeated blocks to compile one by one",
                             "none, model, or --model gpt or resnet18")

    @property
    def compile_after_wrapping(self) -> bool:
        """Whether this script applies --compile itself, after its wrapper (FSDP2's fully_shard, the pipeline's split,
        tensor parallelism), so that models.build_model_from leaves the model uncompiled. No: compiled before any
        wrapper."""
        return False

    @property
    def saves_dcp(self) -> bool:
        """Whether checkpoints are DCP folders, every rank writing its own shards (run.Run: last.dcp, best.dcp). No:
        last.pt and best.pt, the full state gathered to rank 0, which every loop resumes."""
        return False

    @property
    def saves_async(self) -> bool:
        """Whether those DCP shards are written in a background thread, the loop waiting only for a copy to host
        memory. No: every save blocks until it is on disk."""
        return False

    # ------------------------------------------------------------------ the flags typed as text, as typed values
    @property
    @parsed_from("synthetic_shape")
    def synthetic_input_shape(self) -> tuple[int, int, int]:
        """--synthetic-shape C,H,W: one synthetic image's shape."""
        return parse_shape(self.synthetic_shape, "--synthetic-shape")

    @property
    @parsed_from("limit_train_batches")
    def train_limit(self) -> Optional[int | float]:
        """--limit-train-batches: a number of micro-batches (int), a fraction of them (float), or None: all."""
        return parse_limit(self.limit_train_batches, "--limit-train-batches")

    @property
    @parsed_from("limit_val_batches")
    def val_limit(self) -> Optional[int | float]:
        """--limit-val-batches: a number of evaluation batches (int), a fraction of them (float), or None: all."""
        return parse_limit(self.limit_val_batches, "--limit-val-batches")

    @property
    @parsed_from("max_time")
    def time_limit_s(self) -> Optional[float]:
        """--max-time in seconds, or None: no limit."""
        return parse_duration(self.max_time, "--max-time")

    @property
    @parsed_from("save_on_signal")
    def preemption_signals(self) -> tuple[signal.Signals, ...]:
        """--save-on-signal as signals (() for none)."""
        return parse_signals(self.save_on_signal, "--save-on-signal")

    @property
    @parsed_from("profile_steps")
    def profile_range(self) -> tuple[int, int]:
        """--profile-steps A:B as (A, B): optimizer steps A+1..B are recorded (default 5:10)."""
        return parse_window(self.profile_steps or "5:10", "--profile-steps")

    def validate_step(self) -> None:
        """The checks for what one training step needs: data, model, loss scale, device (find_batch_size's)."""
        self.check_precision_choice()
        self.check_model_and_dataset()
        self.synthetic_input_shape  # --synthetic-shape parsed, once (@parsed_from)
        check_path(self.data_root, "--data-root")
        token_sets = {"seq2seq": ("reverse",), "gpt": ("reverse", "pydoc")}.get(self.model)
        if token_sets and self.dataset not in token_sets:
            raise UsageError("--model", f"{self.model} needs --dataset {' or '.join(token_sets)}, not {self.dataset}",
                             "mlp, cnn, resnet18")
        if self.dataset == "pydoc" and self.model != "gpt":
            raise UsageError("--model", f"--dataset pydoc is language modelling; {self.model} is not a language model",
                             "gpt")
        if self.dataset == "reverse" and self.model not in ("seq2seq", "gpt"):
            raise UsageError("--model", f"--dataset reverse is a sequence task; {self.model} is an image model",
                             "seq2seq, gpt")
        check_device_name(self.device, "--device")
        if self.optimizer_impl == "fused" and self.optimizer == "sgd" and self.precision == "16-mixed":
            raise UsageError("--optimizer-impl", SCALER_SKIPS_FUSED_SGD, "foreach, for-loop, or --optimizer adamw")

    def check_model_and_dataset(self) -> None:
        """--model and --dataset: a built-in name (checked here, not by argparse's choices, which would refuse a spec),
        or a plug-in spec PACKAGE.MODULE:CALLABLE whose module imports and whose attribute is callable
        (manual_train/plugins.py; calling it and checking what it returns is data.build_datasets')."""
        from manual_train import plugins

        for flag, value, names in (("--dataset", self.dataset, DATASETS), ("--model", self.model, MODELS)):
            if plugins.is_spec(value):
                plugins.load(value, flag)
            elif value not in names:
                raise UsageError(flag, f"invalid choice: {value!r}", ", ".join(repr(n) for n in names) +
                                 ", or PACKAGE.MODULE:CALLABLE")
        if self.loss is not None:
            plugins.load(self.loss, "--loss")
        if plugins.is_spec(self.model) and self.dropout:
            raise UsageError("--dropout", f"a plug-in model builds its own dropout; {self.model} is not given this "
                                          "flag", "0")

    def check_precision_choice(self) -> None:
        """--precision is one of PRECISIONS; apex's O2 is refused with a pointer to its own script (ApexO2Config, which
        takes only O2_PRECISIONS, overrides this)."""
        allowed = ", ".join(PRECISIONS)
        if self.precision in O2_PRECISIONS:
            raise UsageError("--precision", f"{self.precision} is apex's O2, its own lesson: run launch/apex_o2.py "
                                            f"--precision {self.precision}", allowed)
        if self.precision not in PRECISIONS:
            raise UsageError("--precision", f"unknown precision {self.precision!r}", allowed)

    def run_dir(self, script: str) -> Path:
        """--out-dir, or runs/<script>-<YYYYmmdd-HHMMSS>-<6 random hex digits> (chosen once; under torchrun
        rank 0 chooses and broadcasts it). The random part keeps two runs started in the same second apart,
        also where a process id would not (containers sharing a folder often run the same pid)."""
        if self.out_dir is None:
            self.out_dir = str(Path("runs") / f"{script}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}")
        return Path(self.out_dir)

    def resume_path(self) -> Optional[Path]:
        if self.resume == "auto":  # last.pt, or a --checkpoint-format dcp run's last.dcp (a link to its folder)
            path, folder = Path(self.out_dir) / "last.pt", Path(self.out_dir) / "last.dcp"
            return path if path.is_file() else folder if folder.is_dir() else None
        return Path(self.resume) if self.resume else None


# ---------------------------------------------------------------------- the text flags' parsers (one each)
def parse_shape(text: str, flag: str) -> tuple[int, int, int]:
    """C,H,W as three positive integers."""
    try:
        shape = tuple(int(s) for s in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise UsageError(flag, f"{text!r} is not three positive integers", "C,H,W such as 3,32,32")
    return shape


def parse_limit(text: Optional[str], flag: str) -> Optional[int | float]:
    """--limit-*-batches as Lightning reads them: an integer is a number of batches (>= 1), a number with a point
    a fraction of them (0 < f <= 1); None: no limit."""
    if text is None:
        return None
    allowed = "an integer N >= 1 (batches) or a fraction 0 < f <= 1, such as 10 or 0.25"
    try:
        value = int(text) if text.strip().lstrip("+").isdigit() else float(text)
    except ValueError:
        raise UsageError(flag, f"{text!r} is not a number", allowed) from None
    if isinstance(value, int) and value < 1 or isinstance(value, float) and not 0 < value <= 1:
        raise UsageError(flag, f"{text} is out of range", allowed)  # (not 0 < nan <= 1: nan and inf land here)
    return value


def limited_batches(limit, n_batches: int, flag: str) -> int:
    """How many of an epoch's n_batches a --limit-*-batches value keeps: int(f * n) for a fraction, as Lightning,
    and like Lightning refusing a fraction that keeps none."""
    if limit is None:
        return n_batches
    if isinstance(limit, int):
        return min(limit, n_batches)
    kept = int(limit * n_batches)
    if kept < 1:
        raise UsageError(flag, f"{limit} of {n_batches} batches is less than one batch", f">= {1 / n_batches:.3g}")
    return kept


def parse_duration(text: Optional[str], flag: str) -> Optional[float]:
    """DD:HH:MM:SS (Lightning's max_time string), HH:MM:SS, MM:SS or a number of seconds, as seconds."""
    if text is None:
        return None
    parts = text.split(":")
    allowed = "DD:HH:MM:SS, HH:MM:SS, MM:SS or seconds, more than 0, such as 00:12:00:00 or 90"
    try:
        numbers = [float(p) if len(parts) == 1 else int(p) for p in parts]
    except ValueError:
        numbers = []
    if not 1 <= len(parts) <= 4 or len(numbers) != len(parts) or not all(math.isfinite(n) and n >= 0 for n in numbers):
        raise UsageError(flag, f"{text!r} is not a duration", allowed)
    seconds = sum(n * unit for n, unit in zip(reversed(numbers), (1, 60, 3600, 86400)))
    if not 0 < seconds <= 10 ** 9:
        raise UsageError(flag, f"{text} is out of range", allowed)
    return float(seconds)


def parse_signals(text: str, flag: str) -> tuple[signal.Signals, ...]:
    """Signal names, comma-separated (TERM or SIGTERM), that a process may catch as a preemption notice; none: ()."""
    if text.strip().lower() == "none":
        return ()
    found = []
    for name in (n.strip().upper() for n in text.split(",")):
        full = name if name.startswith("SIG") else "SIG" + name
        if full in ("SIGKILL", "SIGSTOP"):
            raise UsageError(flag, f"{full} cannot be caught", "TERM, USR1, USR2, HUP, or none")
        if full not in signal.Signals.__members__ or full in ("SIGINT", "SIGCHLD"):
            raise UsageError(flag, f"unknown signal {name}" if full not in signal.Signals.__members__
                             else f"{full} is not a preemption notice", "TERM, USR1, USR2, HUP, or none")
        found.append(signal.Signals[full])
    return tuple(found)


def parse_window(text: str, flag: str) -> tuple[int, int]:
    """A:B as (A, B), two integers 0 <= A < B."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or int(parts[0]) >= int(parts[1]):
        raise UsageError(flag, f"{text!r} is not a window A:B of steps", "two integers 0 <= A < B, such as 10:15")
    return int(parts[0]), int(parts[1])


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


def _nearest_existing(p: Path) -> Path:
    """p or its nearest ancestor that exists (os.path.exists: False, not an exception, for any OSError)."""
    while not os.path.exists(p) and p != p.parent:
        p = p.parent
    return p


def _pathconf(path: Path, name: str, fallback: int) -> int:
    try:
        value = os.pathconf(path, name)
    except (OSError, ValueError):
        return fallback
    return value if value and value > 0 else fallback


def check_path(path: str, flag: str, *, room: int = 0) -> None:
    """A path the OS can take: not empty, each name within the file system's NAME_MAX (bytes) and the whole
    absolute path, plus `room` characters for what goes inside it, within PATH_MAX. Otherwise the first
    open/mkdir fails with `OSError: [Errno 36] File name too long`, after set-up."""
    if not path:
        raise UsageError(flag, "is empty", "a path")
    p = Path(path).absolute()
    existing = _nearest_existing(p)
    name_max = _pathconf(existing, "PC_NAME_MAX", 255)
    path_max = _pathconf(existing, "PC_PATH_MAX", 4096)  # counts the terminating NUL
    for part in p.parts:
        if len(os.fsencode(part)) > name_max:
            raise UsageError(flag, f"the name {part[:20]}... is {len(os.fsencode(part))} bytes long, over this "
                                   f"file system's limit", f"names of at most {name_max} bytes")
    length = len(os.fsencode(str(p)))
    if length + room > path_max - 1:
        what = f"the path is {length} bytes long" + (" as an absolute path" if str(p) != path else "")
        if room:
            what += f", and files inside it need {room} more"
        raise UsageError(flag, f"{what}; the OS allows {path_max - 1}",
                         f"a path of at most {path_max - 1 - room} bytes")


def check_writable_dir(path: Optional[str], flag: str, *, room: int = 0) -> None:
    """The folder must be creatable (or, if it exists, writable): its path within the OS's limits, its
    nearest existing parent a directory in which a folder can really be made. That is tried, not inferred
    from os.access (which says yes to root everywhere, /proc included): a uniquely named probe folder is
    made there and removed at once, so nothing is left behind and concurrent ranks cannot collide."""
    if path is None:
        path = "runs"
    check_path(path, flag, room=room)
    p = _nearest_existing(Path(path).absolute())
    if not p.is_dir():
        raise UsageError(flag, f"{p} exists and is not a directory")
    try:
        probe = tempfile.mkdtemp(prefix=".probe-", dir=p)
    except OSError as e:
        raise UsageError(flag, f"{p} is not writable: cannot create a folder in it ({e.strerror})") from None
    try:
        os.rmdir(probe)
    except OSError:
        pass


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
        elif message.endswith(": expected one argument"):  # also `--lr -1e-3`: argparse takes it for a flag
            flag = message.split(":", 1)[0].split("/")[-1]
            message += f" (a value that starts with '-' needs {flag}=VALUE)"
        sys.stderr.write(f"error: {message}\n")
        sys.exit(2)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser(config_cls=Config, *, prog: Optional[str] = None, description: Optional[str] = None,
                 quiet: bool = False, fields: Optional[Collection[str]] = None,
                 **defaults) -> argparse.ArgumentParser:
    """One argparse flag per dataclass field; `defaults` overrides per script (e.g. dataset='reverse').

    fields: only these fields become flags (a tool that uses a few of them, e.g. find_batch_size); the
    others keep their defaults and passing one is an unknown flag.
    """
    parser = _OneLineParser(prog=prog, description=description, allow_abbrev=False, quiet=quiet,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        if fields is not None and f.name not in fields:
            continue
        meta = f.metadata
        default = defaults.get(f.name, f.default)
        base = hints[f.name]
        if typing.get_origin(base) is typing.Union:  # Optional[X]
            base = next(t for t in typing.get_args(base) if t is not type(None))
        helptext = meta.get("help", "")
        if default is not None and "(default:" not in helptext:  # one default: the help's own, or this one
            helptext += " (default: %(default)s)"
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


def _number(x) -> str:
    """A bound as the user would type it: 2147483647, 1e+07, 2**64."""
    if isinstance(x, int):
        return str(x)
    mantissa, exponent = math.frexp(x)
    if mantissa == 0.5 and exponent > 24:
        return f"2**{exponent - 1}"
    return f"{x:g}"


def check_bounds(cfg: Config) -> None:
    """The per-field bounds declared with arg(min=..., max=...); every float must be finite.

    `x < lo` is False for nan, so without the finiteness check nan would pass every bound (and inf every
    lower one) and reach the optimizer, the loss scaler or datetime.timedelta.
    """
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        lo, hi = f.metadata.get("min"), f.metadata.get("max")
        exclusive = f.metadata.get("min_exclusive")
        need = []
        if lo is not None:
            need.append(f"> {_number(lo)}" if exclusive else f">= {_number(lo)}")
        if hi is not None:
            need.append(f"<= {_number(hi)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(_flag(f.name), f"{value} is not a finite number",
                             " and ".join(["a finite number"] + need))
        if (lo is not None and (value <= lo if exclusive else value < lo)) or (hi is not None and value > hi):
            raise UsageError(_flag(f.name), f"{value} is out of range", " and ".join(need))


def parse_config(config_cls=Config, argv: Optional[Sequence[str]] = None, *, prog: Optional[str] = None,
                 description: Optional[str] = None, quiet: bool = False, fields: Optional[Collection[str]] = None,
                 **defaults) -> Config:
    """Parse argv into a validated config. Raises UsageError (argparse errors exit 2 themselves)."""
    args = vars(build_parser(config_cls, prog=prog, description=description, quiet=quiet, fields=fields,
                             **defaults).parse_args(argv))
    names = {f.name for f in dataclasses.fields(config_cls)}
    cfg = config_cls(**{**{k: v for k, v in defaults.items() if k in names}, **args})  # + fields not shown
    check_bounds(cfg)
    cfg.validate()
    return cfg


def config_from(config_cls=Config, **fields) -> Config:
    """parse_config of the flags these fields spell (`batch_size=8` -> `--batch-size 8`, True/False ->
    `--flag`/`--no-flag`, None left out): a validated config exactly as the command line would build it."""
    argv: list = []
    for key, value in fields.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
        elif value is not None:
            argv += [flag, str(value)]
    return parse_config(config_cls, argv)
