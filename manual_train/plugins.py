"""Your own model, dataset and loss: `--model`, `--dataset` and `--loss PACKAGE.MODULE:CALLABLE` (docs/your-model.md).

    python launch/single.py --model manual_train.examples.tiny_vit:build --precision 64-true
    python launch/single.py --model manual_train.examples.tiny_vit:build \
        --dataset manual_train.examples.image_folder:build --data-root my_images

A spec is a name with a colon: the module is imported, the attribute looked up, called, and what it returns checked.
The contracts (the built-in names keep their own code in models.py and data.py; these are their plug-in branches):

  --dataset  callable(cfg: Config) -> (train, val, info): two map-style datasets whose items are (x, y) with y an
             int64 class id (or a tensor of them), and info a models.DataInfo or a dict with `num_classes` and
             `input_shape` (one sample's x shape, no batch dimension).
  --model    callable(info: DataInfo) -> nn.Module whose forward maps a batch x (B, *input_shape) to logits
             (B, num_classes) (or (B, L, num_classes) against y of shape (B, L)). A ModuleList attribute named
             `blocks` makes each block its own FSDP2 unit (sharding.blocks); without one, the top-level children that
             hold parameters are the units.
  --loss     callable(logits, y, reduction="mean") -> 0-d tensor, as F.cross_entropy: the mean over the targets
             (y != -100), or with reduction="sum" their sum (default: models.loss_fn, the mean cross-entropy).

What the user got wrong (no such module or attribute, not callable, the wrong type back, samples the model cannot
take) is one `error: --model: ...` line, exit status 2, before anything is written. An exception raised inside the
user's own code is theirs: it propagates with its own traceback (exit status 1), with a note naming the spec.
"""
from __future__ import annotations

import importlib
import math
from typing import Callable

import torch
import torch.nn as nn

from manual_train.errors import UsageError


def is_spec(name: str) -> bool:
    """A plug-in spec (PACKAGE.MODULE:CALLABLE), not a built-in name: it has a colon."""
    return ":" in name


def load(spec: str, flag: str) -> Callable:
    """The callable a spec names; one UsageError line when the module cannot be found or the attribute is missing or
    not callable. An import that fails inside the module itself (its own bad import, its own exception) propagates."""
    module_name, _, attr = spec.partition(":")
    allowed = "PACKAGE.MODULE:CALLABLE, e.g. manual_train.examples.tiny_vit:build"
    if not module_name or not attr or ":" in attr:
        raise UsageError(flag, f"{spec!r} is not a plug-in spec", allowed)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # only the spec's own module (or a package above it) missing is the user's typo; a module that the plug-in
        # itself imports and lacks is an error in their code, with their traceback
        if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
            _note(e, spec, flag, "importing")
            raise
        raise UsageError(flag, f"cannot import {module_name} (no module named {e.name}; is it on PYTHONPATH?)",
                         allowed) from None
    except Exception as e:
        _note(e, spec, flag, "importing")
        raise
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise UsageError(flag, f"{module_name} has no attribute {attr!r}", allowed)
        fn = getattr(fn, part)
    if not callable(fn):
        raise UsageError(flag, f"{spec} is not callable (a {type(fn).__name__} object)", allowed)
    return fn


def _note(e: BaseException, spec: str, flag: str, what: str) -> None:
    """Mark an exception from the user's own code as theirs (shown under their traceback); it is not ours to hide."""
    if hasattr(e, "add_note"):  # Python 3.11+
        e.add_note(f"(raised in your code while {what} {flag} {spec}; docs/your-model.md has the contract)")


def call(spec: str, flag: str, *args):
    """Call the spec's callable; an exception inside it propagates as the user's, with a note."""
    fn = load(spec, flag)
    try:
        return fn(*args)
    except UsageError:
        raise  # a plug-in may refuse its input the way manual_train does (the example image folder does)
    except Exception as e:
        _note(e, spec, flag, "calling")
        raise


LOSS_CONTRACT = 'a callable(logits, y, reduction="mean") -> 0-d tensor; "mean" over the targets, "sum" their sum'


def build_loss(cfg, default: Callable) -> Callable:
    """--loss PACKAGE.MODULE:CALLABLE, or `default` (the loop's loss_fn, models.loss_fn: the mean cross-entropy).
    Called as loss(logits, y) for the mean over the targets (the loops weight it by the micro-batch's share of its
    window) and loss(logits, y, reduction="sum") in evaluation (exact sums over batches and ranks)."""
    return default if cfg.loss is None else load(cfg.loss, "--loss")


def check_loss(cfg, info, train, ignore: int) -> None:
    """One call of the plug-in loss on random logits against the first two samples' targets, in float64: a 0-d
    tensor with a gradient, and "sum" == "mean" x the number of targets (what exact accumulation and evaluation
    rely on). One `--loss` line otherwise; an exception inside the loss is the user's, with a note. `ignore`:
    models.IGNORE, passed in by data.py (this module imports none of ours but errors: no import cycle)."""
    fn = load(cfg.loss, "--loss")
    y = torch.stack([torch.as_tensor(train[i][1]) for i in range(min(2, len(train)))])
    targets = int((y != ignore).sum())
    with torch.random.fork_rng(devices=[]):
        logits = torch.randn(*y.shape, info.num_classes, dtype=torch.float64, requires_grad=True)
    values = {}
    for reduction in ("mean", "sum"):
        try:
            values[reduction] = out = fn(logits, y) if reduction == "mean" else fn(logits, y, reduction="sum")
        except TypeError as e:
            raise UsageError("--loss", f"{cfg.loss} cannot be called as loss(logits, y, reduction={reduction!r}) "
                                       f"({e})", LOSS_CONTRACT) from None
        except Exception as e:
            _note(e, cfg.loss, "--loss", "calling")
            raise
        if not (isinstance(out, torch.Tensor) and out.dim() == 0 and out.is_floating_point()):
            got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else f"a {type(out).__name__}"
            raise UsageError("--loss", f"{cfg.loss} returned {got} for reduction={reduction!r}, not a 0-d float "
                                       "tensor", LOSS_CONTRACT)
        if not out.requires_grad:
            raise UsageError("--loss", f"{cfg.loss}'s result has no gradient (detached, or computed outside torch)",
                             LOSS_CONTRACT)
    mean, total = values["mean"].item(), values["sum"].item()
    if not math.isclose(total, mean * targets, rel_tol=1e-9, abs_tol=1e-12):
        raise UsageError("--loss", f"{cfg.loss}'s sum ({total:.6g}) is not its mean x the {targets} targets "
                                   f"({mean * targets:.6g}): the loops' accumulation and evaluation rely on it",
                         LOSS_CONTRACT)


def build_model(spec: str, info) -> nn.Module:
    """--model PACKAGE.MODULE:CALLABLE: callable(info) -> nn.Module."""
    model = call(spec, "--model", info)
    if not isinstance(model, nn.Module):
        raise UsageError("--model", f"{spec} returned a {type(model).__name__}, not a torch.nn.Module",
                         "a callable(info: DataInfo) -> nn.Module")
    return model


def build_datasets(cfg, DataInfo):
    """--dataset PACKAGE.MODULE:CALLABLE: callable(cfg) -> (train, val, DataInfo or {num_classes, input_shape}).
    DataInfo: models.DataInfo, passed in by data.py (this module imports none of ours but errors: no import cycle)."""
    spec, contract = cfg.dataset, "a callable(cfg) -> (train, val, DataInfo or dict(num_classes=, input_shape=))"
    result = call(spec, "--dataset", cfg)
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        raise UsageError("--dataset", f"{spec} returned a {type(result).__name__}, not (train, val, info)", contract)
    train, val, info = result
    for split, ds in (("train", train), ("val", val)):
        if not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
            raise UsageError("--dataset", f"{spec}'s {split} set is a {type(ds).__name__}, not a map-style dataset "
                                          "(__getitem__ and __len__)", contract)
        if len(ds) == 0:
            raise UsageError("--dataset", f"{spec}'s {split} set is empty", "at least one sample in each")
    if isinstance(info, dict):
        missing = [k for k in ("num_classes", "input_shape") if k not in info]
        if missing:
            raise UsageError("--dataset", f"{spec}'s info dict lacks {', '.join(missing)}", contract)
        info = DataInfo(spec, tuple(info["input_shape"]), info["num_classes"], info.get("predict"))
    if not isinstance(info, DataInfo):
        raise UsageError("--dataset", f"{spec}'s info is a {type(info).__name__}, not a DataInfo or dict", contract)
    if not isinstance(info.num_classes, int) or info.num_classes < 1:
        raise UsageError("--dataset", f"{spec}'s num_classes is {info.num_classes!r}", "an integer >= 1")
    x, y = train[0]
    if tuple(torch.as_tensor(x).shape) != tuple(info.input_shape):
        raise UsageError("--dataset", f"{spec}'s first sample has shape {tuple(torch.as_tensor(x).shape)}, its info "
                                      f"says input_shape {tuple(info.input_shape)}", "the two equal")
    y = torch.as_tensor(y)
    if y.is_floating_point() or not 0 <= int(y.min()) <= int(y.max()) < info.num_classes:
        raise UsageError("--dataset", f"{spec}'s first sample's target {y.tolist()} is not a class id in "
                                      f"0..{info.num_classes - 1}", "int64 class ids below num_classes")
    return train, val, info


def check_fits(cfg, info, train) -> None:
    """One forward of the plug-in model on the training set's first sample (the CPU, eval mode, no grad, inside
    fork_rng so that the loops' seeded build gives the same weights): samples the model cannot take, or logits of
    the wrong shape, are one `--model` line here, before anything is written."""
    x, y = (torch.as_tensor(t) for t in train[0])
    with torch.random.fork_rng(devices=[]):
        model = build_model(cfg.model, info)
        try:
            with torch.no_grad():
                logits = model.eval()(x.unsqueeze(0))
        except RuntimeError as e:  # shape and dtype mismatches; any other exception is the model's own bug
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UsageError("--model", f"{cfg.model} cannot take {cfg.dataset}'s samples of shape {tuple(x.shape)} "
                                        f"and dtype {x.dtype} (one forward pass fails: {reason})") from None
    want = (1, *y.shape, info.num_classes)
    if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != want:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise UsageError("--model", f"{cfg.model} returned {got} for one sample; the loss needs logits of shape {want} "
                                    f"({info.num_classes} classes)", "(batch, [targets,] num_classes) logits")
