"""--precision's pieces: torch.amp for every loop, and apex's O2 for its own lesson (loops/apex_o2.py).

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
launch/apex_o2.py only (`O2Config`; the loop writes the steps out, these are its reusable pieces):
  16-o2       apex's O2, written out: fp16 model (BatchNorm kept fp32, `cast_o2`, `O2Forward`), fp32 master
              weights in the optimizer, dynamic loss scaling (`DynamicLossScaler`), masters copied back each
              step; checkpoints hold the masters (`O2Masters`).
  apex-o2     apex.amp.initialize(model, optimizer, opt_level="O2") and amp.scale_loss, when apex.amp is
              importable (CUDA only; `apex_amp_or_error`, `ApexScaler`).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn

from manual_train.config import MAX_LOSS_SCALE, O2_PRECISIONS, Config, _number, arg
from manual_train.errors import UsageError
from manual_train.runtime import resolve_device


def apex_amp_or_error():
    """apex.amp, or a one-line UsageError saying why not and what to use instead."""
    try:
        from apex import amp  # NVIDIA apex <= 25.05 built from source; the PyPI "apex" is unrelated
    except Exception:
        raise UsageError("--precision", "apex-o2 needs apex.amp, which is not importable here (apex is not on "
                         "PyPI and apex.amp was removed after release 25.05); --precision 16-o2 runs the same "
                         "O2 algorithm without apex", "16-o2") from None
    return amp


def check_precision(precision: str, device: torch.device) -> None:
    """Combinations that cannot work say so in one line."""
    if precision == "apex-o2" and device.type != "cuda":
        raise UsageError("--precision", "apex-o2 runs on CUDA only; on CPU use 16-o2 (the same algorithm)", "16-o2")
    if precision == "bf16-mixed" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UsageError("--precision", f"{torch.cuda.get_device_name(device)} has no bfloat16 support",
                         "32-true, 64-true, 16-mixed")


class DynamicLossScaler:
    """apex's dynamic loss scale, step by step (apex/amp/scaler.py, release 25.05 defaults).

    fp16 gradients of small losses underflow to zero; multiplying the loss by a large scale before
    backward moves them into fp16's range, and dividing the gradients by it afterwards restores
    them. Too large a scale overflows to inf: then the step is skipped and the scale halved. After
    `growth_interval` clean steps in a row it is doubled again, up to `max_scale`.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, max_scale: float = 2.0 ** 24):
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.max_scale = growth_interval, max_scale
        self.clean_steps = 0  # steps since the last overflow or growth

    def get_scale(self) -> float:
        """As GradScaler.get_scale (Run.stepped reads it: the scale only shrinks on a skipped step); no host sync."""
        return self.scale

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale = min(self.scale * self.growth_factor, self.max_scale)
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])


def cast_o2(model: nn.Module) -> nn.Module:
    """O2's model cast: every parameter and buffer to fp16, except affine BatchNorm layers.

    BatchNorm stays fp32 because its running variance and the normalisation's reductions lose too
    much in fp16; cuDNN (and torch on CPU) accept fp16 input with fp32 BatchNorm weights.
    """
    for module in model.modules():
        keep_fp32 = isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine
        for tensors in (module._parameters, module._buffers):
            for name, t in tensors.items():
                if t is not None and t.is_floating_point() and not keep_fp32:
                    t.data = t.data.half()
    return model


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


class O2Forward(nn.Module):
    """O2's forward patch: floating inputs cast to fp16 going in, outputs cast to fp32 coming out.

    apex replaced `model.forward`; a wrapper module does the same visibly. The loss is then
    computed in fp32 from fp32 logits.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x):
        x = x.half() if x.is_floating_point() else x
        return self.module(x).float()


class O2Masters:
    """16-o2's model as a checkpoint sees it (`run.start(model=O2Masters(...))`).

    state_dict(): the model's, with each fp16 parameter replaced by its fp32 master and every other floating
    entry in fp32, so an O2 checkpoint holds the weights the optimizer steps (not their rounded copy) and loads
    into a 32-true run as well. load_state_dict(): fp32 weights into the masters and into the fp16 model (copy_
    rounds), so a resumed run continues from the saved masters exactly (--resume, --restore-best).
    """

    def __init__(self, module: nn.Module, model_params: list, master_params: list):
        self.module = module
        self.master_of = {id(p): m for p, m in zip(model_params, master_params)}

    def _masters_by_name(self) -> dict:
        return {name: self.master_of[id(p)] for name, p in self.module.named_parameters(remove_duplicate=False)
                if id(p) in self.master_of}

    def state_dict(self) -> dict:
        masters = self._masters_by_name()
        return {k: masters[k].detach().clone() if k in masters else v.float() if v.is_floating_point() else v
                for k, v in self.module.state_dict().items()}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for name, master in self._masters_by_name().items():
                master.copy_(state[name])
        self.module.load_state_dict(state)


class ApexScaler:
    """apex-o2's loss scale as the loop and Run see a scaler: state_dict()/load_state_dict() are amp's own (what
    apex said to checkpoint), get_scale() its current scale (Run.stepped compares it with the previous step's:
    apex, too, halves it only on a skipped step), and update() nothing: apex updated it when scale_loss closed."""

    def __init__(self, amp):
        self.amp = amp

    def get_scale(self) -> float:
        return float(self.amp._amp_state.loss_scalers[0].loss_scale())

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return self.amp.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.amp.load_state_dict(state)


@dataclass
class O2Config(Config):
    """launch/apex_o2.py's flags: the base ones with --precision 16-o2 (default) or apex-o2, and the O2 scaler's
    cap. The other scripts refuse these two precisions (Config.check_precision_choice)."""

    precision: str = arg("16-o2", "16-o2 is apex's O2 written out (loops/apex_o2.py); apex-o2 is apex.amp itself "
                                  "(CUDA, apex <= 25.05 built from source)", choices=O2_PRECISIONS)
    loss_scale_max: float = arg(2.0 ** 24, "cap on the dynamic loss scale (16-o2, as apex; at most 2**64)",
                                min=1, max=MAX_LOSS_SCALE)

    def check_precision_choice(self) -> None:
        pass  # argparse took one of O2_PRECISIONS

    def validate_step(self) -> None:
        super().validate_step()
        if self.precision == "16-o2" and self.loss_scale_init > self.loss_scale_max:  # the scaler's cap
            cap = _number(self.loss_scale_max)
            raise UsageError("--loss-scale-init", f"{_number(self.loss_scale_init)} is above --loss-scale-max {cap}",
                             f"<= {cap}")
        if self.precision == "apex-o2":
            apex_amp_or_error()
            check_precision(self.precision, resolve_device(self.device))
