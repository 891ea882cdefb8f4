"""DataParallel's pieces (loops/data_parallel.py is the lesson; docs/data_parallel.md).

  DataParallelConfig ... launch/data_parallel.py's flags: --devices, --impl, --output-device
  written out .......... what nn.DataParallel does in one forward, as four functions:
                         scatter -> replicate -> parallel_apply -> gather (ExplicitDataParallel)

On CUDA the four functions are torch.nn.parallel's own. On the CPU there is one memory and one set of
cores, so the same structure runs with chunk (scatter), a plain loop (parallel_apply), torch.cat (gather)
and the module itself as every replica: the arithmetic is exactly the CUDA version's, which is what lets
the parity tests run without GPUs. `--devices cpu,cpu,cpu` means three chunks on the one CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn as nn

from manual_train.config import COMPILE_SCRIPTS, Config, UsageError, arg, parsed_from
from manual_train.runtime import cuda_list, parse_devices


@dataclass
class DataParallelConfig(Config):
    """Config plus the device list, the implementation and the device that gathers the outputs
    (launch/data_parallel.py)."""

    devices: str = arg("auto", "devices each batch is split over: cpu,cpu,... or cuda:0,cuda:1,... "
                               "(auto: every visible GPU, else cpu,cpu)", metavar="LIST")
    impl: str = arg("torch", "torch: nn.DataParallel; explicit: its replicate/scatter/parallel_apply/gather "
                             "written out (splits the batch on CPU too)", choices=("torch", "explicit"))
    output_device: Optional[str] = arg(None, "where outputs are gathered and the loss is computed "
                                             "(default: the first of --devices)", metavar="DEVICE")

    @parsed_from("devices")
    def device_list(self) -> list[torch.device]:
        """--devices (auto: every visible GPU, else cpu,cpu, resolved by validate on this machine)."""
        text = self.devices
        if text == "auto":
            text = cuda_list(torch.cuda.device_count()) if torch.cuda.is_available() else "cpu,cpu"
        return parse_devices(text, "--devices", same_type=True, role="data parallelism")

    @parsed_from("devices", "output_device")
    def gather_device(self) -> torch.device:
        """--output-device, or the first of --devices."""
        devices = self.device_list()
        if self.output_device is None:
            return devices[0]
        out = parse_devices(self.output_device, "--output-device", count=1, role="--output-device")[0]
        if out.type != devices[0].type:
            raise UsageError("--output-device", f"{out} is not a {devices[0].type} device like --devices",
                             ", ".join(sorted({str(d) for d in devices})))
        return out

    def check_compile(self) -> None:
        if self.compile != "none":
            raise UsageError("--compile", "DataParallel copies the module into replicas every step; a compiled forward "
                                          "is not what runs there", COMPILE_SCRIPTS)

    def validate(self) -> None:
        super().validate()
        if self.device != "auto":
            raise UsageError("--device", "launch/data_parallel.py places the model with --devices, not --device",
                             "auto")
        devices = self.device_list()
        if self.impl == "torch" and devices[0].type == "cpu" and torch.cuda.is_available():
            raise UsageError("--devices", "nn.DataParallel takes only CUDA devices when CUDA is available",
                             "cuda:N lists, or --impl explicit for cpu lists")
        self.gather_device()
        if self.batch_size < len(devices):
            raise UsageError("--batch-size", f"{self.batch_size} cannot be split over {len(devices)} devices",
                             f">= {len(devices)}")


# ---------------------------------------------------------------------- data parallelism, written out
def replicate(module: nn.Module, devices: Sequence[torch.device]) -> list:
    """One copy of `module` per device, made again at every forward.

    CUDA: torch.nn.parallel.replicate broadcasts every parameter and buffer from devices[0]; the
    copies are autograd outputs of that broadcast, so backward sums the replicas' gradients back
    into the original parameters on devices[0] (ReduceAddCoalesced). In no_grad (evaluation) the
    copies are detached. CPU: the replica *is* the module (one memory), so gradients accumulate
    into the originals directly, as the broadcast's backward would.
    """
    if devices[0].type == "cuda":
        return torch.nn.parallel.replicate(module, list(devices), detach=not torch.is_grad_enabled())
    return [module for _ in devices]


def scatter(inputs: tuple, devices: Sequence[torch.device]) -> list:
    """Split every input tensor along dim 0 into len(devices) chunks: a list of per-device input tuples.

    Chunk sizes are tensor.chunk's (ceil(B/n), ..., the rest): a batch of 10 over 3 devices gives
    4, 4, 2, and a batch smaller than the device count gives fewer chunks (DataParallel then uses
    fewer replicas). CUDA: torch.nn.parallel.scatter, which copies each chunk to its device.
    """
    if devices[0].type == "cuda":
        return torch.nn.parallel.scatter(tuple(inputs), list(devices))
    return list(zip(*(t.chunk(len(devices)) for t in inputs)))


def parallel_apply(replicas: Sequence[nn.Module], inputs: Sequence[tuple], devices: Sequence[torch.device]) -> list:
    """replica_i(*inputs_i) for every chunk.

    CUDA: torch.nn.parallel.parallel_apply starts one Python thread per device; the threads share
    the GIL, so the Python half of every layer call is serialised and only kernels overlap (the
    reason one process per GPU, DDP, scales better). It carries grad mode and autocast into the
    threads. CPU: one call after another on the same cores.
    """
    if devices[0].type == "cuda":
        return torch.nn.parallel.parallel_apply(list(replicas), list(inputs), devices=list(devices[: len(inputs)]))
    return [replica(*chunk) for replica, chunk in zip(replicas, inputs)]


def gather(outputs: Sequence[torch.Tensor], output_device: torch.device) -> torch.Tensor:
    """Concatenate the per-device outputs along dim 0 on one device, where the loss is computed.

    Everything downstream (the full batch's logits, the loss, its backward start) lands on this
    one device: the memory imbalance of DataParallel. Backward of the gather scatters the
    gradient back to each chunk's device.
    """
    if output_device.type == "cuda":
        return torch.nn.parallel.gather(list(outputs), output_device)
    return torch.cat([o.to(output_device) for o in outputs])


class ExplicitDataParallel(nn.Module):
    """nn.DataParallel's forward in four visible steps: launch/data_parallel.py --impl explicit, and the dp-mp hybrid.

    The module must already be on devices[0]. The output is the whole batch's, on output_device: the loss
    is computed there, once, over the gathered batch (its gradient is the full batch's mean).
    """

    def __init__(self, module: nn.Module, devices: Sequence[torch.device], output_device: torch.device):
        super().__init__()
        self.module, self.devices, self.output_device = module, list(devices), output_device

    def forward(self, *inputs):
        if len(self.devices) == 1:  # as DataParallel: one device, no copies
            return self.module(*(t.to(self.devices[0]) for t in inputs))
        chunks = scatter(inputs, self.devices)  # B samples -> chunks of ceil(B/n) along dim 0, one per device
        replicas = replicate(self.module, self.devices[: len(chunks)])  # every forward, a fresh copy per device
        outputs = parallel_apply(replicas, chunks, self.devices)  # CUDA: one Python thread per device
        return gather(outputs, self.output_device)  # the whole batch's outputs on one device


def data_parallel(module: nn.Module, devices: Sequence[torch.device], output_device: torch.device,
                  impl: str) -> nn.Module:
    """impl 'torch': nn.DataParallel (which ignores its device list and calls the module on a host
    without CUDA); impl 'explicit': ExplicitDataParallel. The module must already be on devices[0]."""
    if impl == "torch":
        ids = list(devices) if devices[0].type == "cuda" else None  # on the CPU, DataParallel ignores them anyway
        return nn.DataParallel(module, device_ids=ids, output_device=output_device if ids else None)
    return ExplicitDataParallel(module, devices, output_device)


def dp_plan(impl: str, devices: Sequence[torch.device], output_device: torch.device, batch_size: int) -> str:
    """The console line that says how each batch is split (and that nn.DataParallel without CUDA is the baseline)."""
    sizes = [len(c) for c in torch.arange(batch_size).chunk(len(devices))]
    if impl == "torch" and not torch.cuda.is_available():
        return (f"no CUDA here: nn.DataParallel ignores device_ids and calls the module directly, so each batch of "
                f"{batch_size} runs whole on {output_device} (the single-device baseline); --impl explicit splits it "
                f"into chunks of {sizes} on the CPU")
    return (f"{impl} data parallel over {','.join(map(str, devices))}: each batch of {batch_size} splits into chunks "
            f"of {sizes}; outputs gathered and loss computed on {output_device}")
