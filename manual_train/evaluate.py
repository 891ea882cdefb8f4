"""Evaluate a saved checkpoint: Lightning's trainer.validate / trainer.test, written out (docs/evaluation.md).

    python -m manual_train.evaluate --checkpoint runs/single-<time>/best.pt             # the val split it trained on
    python -m manual_train.evaluate --checkpoint runs/zero-<time>/last.pt --split test  # mnist, fashion-mnist, cifar10
    torchrun --nproc_per_node=4 -m manual_train.evaluate --checkpoint runs/ddp-<time>/last.pt   # sharded, exact

Any loop's checkpoint (single, apex_o2, dp, mp, hybrid, ddp, zero at every stage) holds the unwrapped model's full
fp32 (64-true: float64) state_dict, so one plain model loads it. The data and model flags come from the
checkpoint's own config; --data-root, --device, --precision, --eval-batch-size and --num-workers may change (none
of them changes the numbers beyond rounding). The result is exact: loss and correct predictions summed over every
sample in float64 (evaluation.evaluate), never a mean of per-batch means; under torchrun each rank takes indices
r, r+N, ... (no padding, no repeats) and all_sum adds the sums.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence


from manual_train import data
from manual_train.checkpoint import check_checkpoint_arg, load_checkpoint, saved_config
from manual_train.config import PRECISIONS, Config, arg, check_device_name, check_path, parse_config
from manual_train.distributed import all_sum, pick_device, read_env, setup, teardown
from manual_train.errors import UsageError
from manual_train.evaluation import evaluate
from manual_train.models import build_model, loss_fn
from manual_train.plugins import build_loss
from manual_train.precision import CastInputs, autocast_for, param_dtype


@dataclass
class EvalArgs:
    """The flags of python -m manual_train.evaluate."""

    checkpoint: Optional[str] = arg(None, "the checkpoint to evaluate (last.pt or best.pt of any launch script, or a "
                                            "last.dcp/best.dcp folder, read whole)",
                                    metavar="PATH")
    split: str = arg("val", "val: the split the run validated on; test: the official test set (mnist, "
                            "fashion-mnist, cifar10)", choices=("val", "test"))
    data_root: Optional[str] = arg(None, "folder holding torchvision datasets (default: the checkpoint's)",
                                   metavar="PATH")
    device: str = arg("auto", "auto, cpu, cuda or cuda:N (under torchrun: cuda:LOCAL_RANK)",
                      metavar="{auto,cpu,cuda,cuda:N}")
    precision: Optional[str] = arg(None, "evaluate in this precision (default: the checkpoint's; 32-true for apex "
                                         "O2's, whose checkpoint holds the fp32 masters)",
                                   metavar="{" + ",".join(PRECISIONS) + "}")
    eval_batch_size: Optional[int] = arg(None, "samples per batch (default: the checkpoint's)", min=1)
    eval_mode: str = arg("inference", "torch.inference_mode() (as Lightning's validate/test) or torch.no_grad()",
                         choices=("inference", "no_grad"))
    num_workers: int = arg(0, "DataLoader worker processes", min=0)
    json: bool = arg(False, "print the result as one JSON object")

    def validate(self) -> None:
        check_checkpoint_arg(self.checkpoint)
        if self.data_root is not None:
            check_path(self.data_root, "--data-root")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise UsageError("--precision", f"unknown precision {self.precision!r}", ", ".join(PRECISIONS))
        check_device_name(self.device, "--device")


def checkpoint_config(ckpt: dict, args: EvalArgs) -> Config:
    """The run's Config from its checkpoint, with this evaluation's flags over it (and no --limit-val-batches:
    every sample counts)."""
    cfg = saved_config(ckpt)
    cfg.limit_val_batches, cfg.num_workers, cfg.pin_memory, cfg.persistent_workers = None, args.num_workers, None, False
    cfg.prefetch_factor = None
    cfg.data_root = args.data_root or cfg.data_root
    cfg.eval_batch_size = args.eval_batch_size or cfg.eval_batch_size
    cfg.precision = args.precision or (cfg.precision if cfg.precision in PRECISIONS else "32-true")
    return cfg


def evaluate_checkpoint(args: EvalArgs) -> dict:
    """Load, evaluate (sharded under torchrun), all_sum: {"split", "loss", "acc", "samples", "checkpoint", "step"}."""
    ckpt = load_checkpoint(Path(args.checkpoint), flag="--checkpoint")
    cfg = checkpoint_config(ckpt, args)
    env = read_env()
    device = pick_device(args.device, env)
    setup(env, device)  # a group of one outside torchrun: the same code path everywhere
    try:
        _, val_ds, info = data.build_datasets(cfg)
        dataset = val_ds if args.split == "val" else data.test_dataset(cfg)
        loader = data.build_loader(data.eval_shard(dataset, env.world_size, env.rank), cfg, device,
                                   batch_size=cfg.eval_batch_size)
        raw_model = build_model(cfg.model, info, cfg.dropout).to(param_dtype(cfg.precision)).to(device)
        raw_model.load_state_dict(ckpt["model"])  # copies into the model's dtype (a 64-true state into fp32 too)
        model = CastInputs(raw_model) if cfg.precision == "64-true" else raw_model
        criterion = build_loss(cfg, loss_fn)  # the checkpoint's --loss, or the mean cross-entropy
        sums = evaluate(model, loader, device, autocast_for(cfg.precision, device), args.eval_mode, criterion)
        loss_total, correct, count = all_sum(*sums, device=device)
        return {"split": args.split, "loss": (loss_total / count).item(), "acc": (correct / count).item(),
                "samples": int(count.item()), "checkpoint": str(args.checkpoint), "step": int(ckpt["step"]),
                "precision": cfg.precision, "world_size": env.world_size}
    finally:
        teardown()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit status 0, or 2 with one `error: --flag: ...` line for bad input (one line per node under torchrun)."""
    report = "RANK" not in os.environ or os.environ.get("LOCAL_RANK", "0") == "0"
    try:
        args = parse_config(EvalArgs, argv, prog="python -m manual_train.evaluate", description=__doc__,
                            quiet=not report)
        result = evaluate_checkpoint(args)
    except UsageError as e:
        if report:
            print(f"error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse: --help (0), or a bad flag already printed as one line (2)
        return int(e.code or 0)
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(result) if args.json else
              f"{result['split']}: loss {result['loss']:.6f} acc {result['acc']:.6f} over {result['samples']} "
              f"samples ({result['checkpoint']}, step {result['step']}, {result['precision']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
