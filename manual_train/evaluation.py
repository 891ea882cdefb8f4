"""Evaluation without autograd: torch.no_grad() or torch.inference_mode() (docs/evaluation.md).

Both stop autograd from recording a graph, so no activations are kept for a backward that never
comes: memory drops to what one forward needs. inference_mode goes further (no version counters,
no view tracking), but its tensors can never enter autograd later; no_grad is what Lightning uses
inside fit, inference_mode what its trainer.validate/test use.

The result is sums, not means: loss summed over every target, correct predictions, and the
target count (labels; a text's tokens, its padding ignored). A mean of per-batch means is wrong whenever the last batch is smaller; sums also
add up exactly across DDP ranks (the DDP loop all-reduces these three numbers).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
from manual_train.models import IGNORE, correct_count, loss_fn


def evaluate(model, loader, device: torch.device, autocast=nullcontext, eval_mode: str = "no_grad", criterion=loss_fn):
    """(loss_sum, correct, count) over the loader, as float64 device tensors (no host sync). `autocast()` is
    the training loop's context (torch.autocast under 16-mixed / bf16-mixed); `criterion` the loop's loss (--loss),
    called with reduction="sum"."""
    was_training = model.training
    model.eval()  # BatchNorm uses running statistics, dropout is off
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    context = torch.inference_mode() if eval_mode == "inference" else torch.no_grad()
    with context:
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast():
                logits = model(x)
            # the loss in fp32 at least (fp16/bf16 logits are upcast; 64-true's stay float64)
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            loss_sum += criterion(logits, y, reduction="sum")
            correct += correct_count(logits, y)
            count += (y != IGNORE).sum()  # targets: a text's padded positions have none
    model.train(was_training)
    return loss_sum, correct, count
