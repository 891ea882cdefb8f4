"""--precision's pieces: torch.amp as every loop writes it inline.

Every loop writes torch's AMP calls inline (loops/single.py, docs/precision.md):

    autocast = autocast_for(cfg.precision, device)     # torch.autocast, or a context that changes nothing
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "16-mixed")
    with autocast():
        loss = loss_fn(model(x), y)
    scaler.scale(loss * weight).backward()
    scaler.unscale_(optimizer); clip; scaler.step(optimizer); scaler.update()

What each precision does:
  32-true     nothing: autocast is a no-op context, the GradScaler is disabled (scale 1).
  64-true     float64 weights, inputs and optimizer state (Lightning's name): the parity mode. fp32
              rounding differs between CPUs (AVX2 vs AVX-512 kernels sum in other orders) and training
              amplifies it; in float64 the same differences stay ~1e-15, so two loops that compute the same
              algorithm agree to 1e-9 on any machine. The model is built in fp32 (the same initial weights
              as 32-true) and upcast exactly (`param_dtype`); floating inputs are cast on the device (`CastInputs`).
  16-mixed    autocast(float16) around forward and loss; GradScaler with dynamic loss scaling.
  bf16-mixed  autocast(bfloat16); no loss scaling (bf16 has fp32's exponent range).
apex's O2 (16-o2, apex-o2) is launch/apex_o2.py's alone: manual_train/apex_o2.py, docs/apex_o2.md.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn

from manual_train.errors import UsageError


def check_precision(precision: str, device: torch.device) -> None:
    """Combinations that cannot work say so in one line."""
    if precision == "apex-o2" and device.type != "cuda":
        raise UsageError("--precision", "apex-o2 runs on CUDA only; on CPU use 16-o2 (the same algorithm)", "16-o2")
    if precision == "bf16-mixed" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UsageError("--precision", f"{torch.cuda.get_device_name(device)} has no bfloat16 support",
                         "32-true, 64-true, 16-mixed")


def param_dtype(precision: str) -> torch.dtype:
    """The dtype the model's weights are built (and checkpointed) in: float64 for 64-true, else fp32
    (16-o2 casts its model to fp16 after cloning the fp32 masters, which are what the checkpoint holds)."""
    return torch.float64 if precision == "64-true" else torch.float32


AUTOCAST_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


def autocast_for(precision: str, device: torch.device):
    """`autocast()` for the loop: torch.autocast in float16 (16-mixed) or bfloat16 (bf16-mixed), else a context
    that changes nothing. Combinations that cannot work are refused here, in one line."""
    check_precision(precision, device)
    dtype = AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        return nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)


def cast_input(x, dtype: torch.dtype):
    """A floating tensor in `dtype` (64-true's images); anything else, e.g. token ids, as it is."""
    return x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x


class CastInputs(nn.Module):
    """64-true's forward: floating inputs cast to the model's dtype on the way in (token ids pass).

    The datasets yield fp32 images; casting here, on the device, keeps the loaders and their pinned
    buffers as they are (Lightning's `convert_input` does the same for its 64-true).
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype = torch.float64):
        super().__init__()
        self.module, self.dtype = module, dtype

    def forward(self, x):
        return self.module(cast_input(x, self.dtype))
