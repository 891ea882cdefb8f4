"""16-bit precision: native torch.amp, apex's O2 written out by hand, and apex O2 itself.

The loop has one code path for every --precision (docs/precision.md):

    with amp.autocast():                       # nullcontext() for 32-true, 16-o2, apex-o2
        loss = loss_fn(model(x), y)
    amp.backward(loss * weight, optimizer, window_end)   # scaled backward (scale 1 when off)
    if window_end:
        amp.unscale_(optimizer)                # true gradients, ready for clipping
        clip_grad_norm_(params, ...)           # optional, on unscaled (master) gradients
        stepped = amp.step(optimizer)          # False when inf/NaN gradients made it skip
        if stepped: scheduler.step()           # Lightning steps the scheduler anyway (issue 5558)

What each precision does:
  32-true     nothing: autocast is a no-op context, the GradScaler is disabled (scale 1).
  64-true     float64 weights, inputs and optimizer state (Lightning's name): the parity mode. fp32
              rounding differs between CPUs (AVX2 vs AVX-512 kernels sum in other orders) and training
              amplifies it; in float64 the same differences stay ~1e-15, so two loops that compute the same
              algorithm agree to 1e-9 on any machine. The model is built in fp32 (the same initial weights
              as 32-true) and upcast exactly; floating inputs are cast on the device (`CastInputs`).
  16-mixed    autocast(float16) around forward and loss; GradScaler with dynamic loss scaling.
  bf16-mixed  autocast(bfloat16); no loss scaling (bf16 has fp32's exponent range).
  16-o2       apex's O2, written out: fp16 model (BatchNorm kept fp32), fp32 master weights in the
              optimizer, dynamic loss scaling (`DynamicLossScaler`), masters copied back each step.
  apex-o2     apex.amp.initialize(model, optimizer, opt_level="O2") when apex.amp is importable.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn

from manual_train.errors import UsageError


def apex_amp_or_error():
    """apex.amp, or a one-line UsageError saying why not and what to use instead."""
    try:
        from apex import amp  # NVIDIA apex <= 25.05 built from source; the PyPI "apex" is unrelated
    except Exception:
        raise UsageError("--precision", "apex-o2 needs apex.amp, which is not importable here (apex is not on "
                         "PyPI and apex.amp was removed after release 25.05); --precision 16-o2 runs the same "
                         "O2 algorithm without apex", "32-true, 16-mixed, bf16-mixed, 16-o2") from None
    return amp


def check_precision(precision: str, device: torch.device) -> None:
    """Combinations that cannot work say so in one line."""
    if precision == "apex-o2" and device.type != "cuda":
        raise UsageError("--precision", "apex-o2 runs on CUDA only; on CPU use 16-o2 (the same algorithm)",
                         "32-true, 16-mixed, bf16-mixed, 16-o2")
    if precision == "bf16-mixed" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UsageError("--precision", f"{torch.cuda.get_device_name(device)} has no bfloat16 support",
                         "32-true, 16-mixed, 16-o2")


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
    """The dtype the model's weights are kept (and checkpointed) in: float64 for 64-true, else fp32
    (16-o2's fp16 model is a copy; its fp32 masters are what the checkpoint holds)."""
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


class Precision:
    """What --precision changes: the autocast context, the loss scaler and (O2) the master weights."""

    def __init__(self, cfg, device: torch.device):  # cfg: manual_train.config.Config
        check_precision(cfg.precision, device)
        self.name, self.device = cfg.precision, device
        self.autocast_dtype = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(cfg.precision)
        self.skipped_steps = 0
        self.apex_amp = apex_amp_or_error() if cfg.precision == "apex-o2" else None
        if cfg.precision == "16-o2":
            self.scaler = DynamicLossScaler(cfg.loss_scale_init, growth_interval=cfg.loss_scale_growth_interval,
                                            max_scale=cfg.loss_scale_max)
        else:
            # Disabled (scale 1, every call a pass-through) unless fp16 autocast is on: bf16 needs none.
            self.scaler = torch.amp.GradScaler(device.type, init_scale=cfg.loss_scale_init,
                                               growth_interval=cfg.loss_scale_growth_interval,
                                               enabled=cfg.precision == "16-mixed")
        self._last_scale = cfg.loss_scale_init  # 16-mixed: the GradScaler's scale after the previous step
        self.model_params: list[nn.Parameter] = []  # 16-o2: the fp16 model's parameters ...
        self.master_params: list[nn.Parameter] = []  # ... and their fp32 masters, held by the optimizer
        self.found_inf = False

    # ------------------------------------------------------------------ set-up
    def prepare(self, model: nn.Module) -> tuple[nn.Module, list]:
        """(the module to call, the parameters to give the optimizer). Call after model.to(device).

        16-o2: clone fp32 masters first, then cast the model. (apex cast first and cloned the fp16
        values, rounding the initial weights once; cloning first keeps them, and is what makes a
        resumed run continue from the saved fp32 masters exactly.)
        """
        if self.name == "64-true":
            model.to(torch.float64)  # a no-op when the loop built it in param_dtype already
            return CastInputs(model, torch.float64), list(model.parameters())
        if self.name != "16-o2":
            return model, list(model.parameters())
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        self.master_params = [nn.Parameter(p.detach().clone().float()) for p in self.model_params]
        cast_o2(model)
        return O2Forward(model), self.master_params

    def apex_initialize(self, model: nn.Module, optimizer):
        """apex-o2: let apex do the cast, the masters and the scaler (CUDA, apex <= 25.05)."""
        if self.apex_amp is None:
            return model, optimizer
        return self.apex_amp.initialize(model, optimizer, opt_level="O2")

    def autocast(self):
        """autocast around forward and loss only; backward runs in the dtypes forward chose."""
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    # ------------------------------------------------------------------ the step
    def backward(self, loss: torch.Tensor, optimizer, window_end: bool) -> None:
        """Backward of the scaled loss; the gradients accumulate scaled until unscale_."""
        if self.apex_amp is not None:
            # apex unscales into its masters on leaving the context unless told to wait for the window's end
            with self.apex_amp.scale_loss(loss, optimizer, delay_unscale=not window_end) as scaled:
                scaled.backward()
        elif self.name == "16-o2":
            (loss.float() * self.scaler.scale).backward()
        else:
            self.scaler.scale(loss).backward()

    def unscale_(self, optimizer) -> None:
        """Make the optimizer's .grad the true gradients (once per window, before clipping)."""
        if self.name == "16-o2":
            # fp16 grads -> fp32 master grads, divided by the scale in fp32 (dividing in fp16 could
            # underflow exactly the small gradients the scale was protecting). The fp16 grads are
            # consumed: setting them to None is the model's zero_grad.
            inv_scale = 1.0 / self.scaler.scale
            for p, master in zip(self.model_params, self.master_params):
                master.grad = None if p.grad is None else p.grad.float().mul_(inv_scale)
                p.grad = None
            grads = [m.grad for m in self.master_params if m.grad is not None]
            # One host sync per optimizer step: the skip decision is made on the host (as apex did).
            self.found_inf = bool(grads) and not bool(torch.stack([g.isfinite().all() for g in grads]).all())
        elif self.apex_amp is None:
            self.scaler.unscale_(optimizer)  # no-op when disabled

    def step(self, optimizer) -> bool:
        """Optimizer step unless the gradients overflowed; returns whether it stepped."""
        if self.name == "16-o2":
            found_inf = self.found_inf
            if not found_inf:
                optimizer.step()
                with torch.no_grad():  # the fp16 model is a rounded copy of the fp32 masters
                    for p, master in zip(self.model_params, self.master_params):
                        p.copy_(master)
            self.scaler.update(found_inf)
            stepped = not found_inf
        elif self.apex_amp is not None:
            optimizer.step()  # apex patched step() to skip itself after an overflow
            stepped = not getattr(self.apex_amp._amp_state.loss_scalers[0], "_has_overflow", False)
        elif self.scaler.is_enabled():
            # GradScaler.step already syncs to decide (it calls .item() on found_inf) but does not say
            # what it decided. The scale only shrinks on a skipped step, so comparing it with the
            # previous step's (remembered on the host) tells; get_scale() is the one extra sync.
            self.scaler.step(optimizer)
            self.scaler.update()
            scale = self.scaler.get_scale()
            stepped = scale >= self._last_scale
            self._last_scale = scale
        else:
            optimizer.step()
            stepped = True
        self.skipped_steps += not stepped
        return stepped

    # ------------------------------------------------------------------ checkpoints
    def model_state_dict(self, raw_model: nn.Module) -> dict:
        """The unwrapped model's state in fp32: under 16-o2 the masters, not the rounded fp16 copy."""
        state = raw_model.state_dict()
        if self.name != "16-o2":
            return state
        master_of = {id(p): m for p, m in zip(self.model_params, self.master_params)}
        params = dict(raw_model.named_parameters(remove_duplicate=False))
        return {k: (master_of[id(params[k])].detach().clone() if k in params and id(params[k]) in master_of
                    else v.float() if v.is_floating_point() else v)
                for k, v in state.items()}

    def load_model_state_dict(self, raw_model: nn.Module, state: dict) -> None:
        """Load fp32 weights into a prepared model: under 16-o2 into the masters and the fp16 copy."""
        if self.name == "16-o2":
            master_of = {id(p): m for p, m in zip(self.model_params, self.master_params)}
            params = dict(raw_model.named_parameters(remove_duplicate=False))
            with torch.no_grad():
                for k, v in state.items():
                    if k in params and id(params[k]) in master_of:
                        master_of[id(params[k])].copy_(v)
        raw_model.load_state_dict(state)  # copy_ casts fp32 values into fp16 parameters under 16-o2

    def state_dict(self) -> dict:
        scaler = self.scaler.state_dict() if self.apex_amp is None else self.apex_amp.state_dict()
        return {"precision": self.name, "scaler": scaler, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if state.get("scaler"):
            if self.apex_amp is not None:
                self.apex_amp.load_state_dict(state["scaler"])
            elif state.get("precision") == self.name:  # a scale only means something to the same scaler
                self.scaler.load_state_dict(state["scaler"])
                if self.name == "16-mixed":
                    self._last_scale = self.scaler.get_scale()
        self.skipped_steps = int(state.get("skipped_steps", 0))
