"""Single-process parallelism, applied by functions to an unmodified model (docs/data_parallel.md,
docs/model_parallel.md, docs/hybrid.md).

  device lists ........... parse_devices: `--devices cpu,cpu` or `cuda:0,cuda:1`, validated up front;
                           DPConfig (launch/dp.py) and MPConfig (launch/mp.py) hold the scripts' own flags
  data parallelism ....... what nn.DataParallel does in one forward, as four functions:
                           scatter -> replicate -> parallel_apply -> gather (ExplicitDataParallel)
  model parallelism ...... split_encoder_decoder: the seq2seq encoder on device A, the decoder on B,
                           the activation moved with .to(B); optional GPipe fill-drain micro-batches
  hybrids ................ hybrid_dp_mp: each half of the split is itself data-parallel over a group
                           of devices (the source article's form, with its wrapping bug fixed)

On CUDA the four data-parallel functions are torch.nn.parallel's own. On the CPU there is one
memory and one set of cores, so the same structure runs with chunk (scatter), a plain loop
(parallel_apply), torch.cat (gather) and the module itself as every replica: the arithmetic is
exactly the CUDA version's, which is what lets the parity tests run without GPUs. Listing `cpu`
several times (`--devices cpu,cpu,cpu`) means that many chunks or stages on the one CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn as nn

from manual_train.config import Config, UsageError, arg
from manual_train.runtime import peak_mem_bytes

DEVICE_LIST_ALLOWED = "a comma list of cpu and cuda:N, e.g. cpu,cpu or cuda:0,cuda:1"


# ---------------------------------------------------------------------- device lists
def parse_devices(text: str, flag: str = "--devices", *, count: Optional[int] = None, even: bool = False,
                  cuda_repeats: bool = False, same_type: bool = False, role: str = "this script",
                  check_machine: bool = True) -> list:
    """'cpu,cpu' or 'cuda:0,cuda:1' -> [torch.device, ...]; every mistake is a one-line UsageError.

    count: exactly this many entries. even: an even number (two groups of equal size).
    cuda_repeats: a GPU may appear twice (model parallelism on one GPU); `cpu` may always repeat.
    same_type: all cpu or all cuda (scatter/gather is either chunking or torch.nn.parallel).
    check_machine: False checks the list only, not that this machine has the GPUs it names.
    Checks run from syntax to machine, so a malformed list is reported the same on every host.
    """
    names = [n.strip() for n in text.split(",")]
    for name in names:
        if not name:
            raise UsageError(flag, f"empty entry in {text!r}", DEVICE_LIST_ALLOWED)
        if name != "cpu" and not (name.startswith("cuda:") and name[5:].isdigit()):
            hint = " (name each GPU: cuda:0, cuda:1, ...)" if name == "cuda" else ""
            raise UsageError(flag, f"unknown device {name!r}{hint}", "cpu, cuda:N")
    if count is not None and len(names) != count:
        raise UsageError(flag, f"{len(names)} device(s) given; {role} needs exactly {count}", DEVICE_LIST_ALLOWED)
    if even and len(names) % 2:
        raise UsageError(flag, f"{len(names)} devices given; {role} needs an even number (two equal groups)",
                         "e.g. cpu,cpu,cpu,cpu or cuda:0,cuda:1,cuda:2,cuda:3")
    if same_type and len({name.split(":")[0] for name in names}) > 1:
        raise UsageError(flag, f"{text} mixes cpu and cuda; {role} needs devices of one kind",
                         "all cpu or all cuda:N")
    repeated = sorted({n for n in names if n != "cpu" and names.count(n) > 1})
    if repeated and not cuda_repeats:
        raise UsageError(flag, f"{repeated[0]} is listed twice; {role} needs distinct GPUs",
                         "each cuda:N once (cpu may repeat)")
    wanted = sorted({int(n[5:]) for n in names if n != "cpu"})
    if wanted and check_machine:
        if not torch.cuda.is_available():
            raise UsageError(flag, f"{', '.join(f'cuda:{i}' for i in wanted)} requested but CUDA is not available "
                                   "on this machine", "cpu,cpu")
        have = torch.cuda.device_count()
        if wanted[-1] >= have:
            raise UsageError(flag, f"cuda:{wanted[-1]} requested but this machine has only {have} CUDA device(s)",
                             ", ".join(f"cuda:{i}" for i in range(have)))
    return [torch.device(n) for n in names]


def cuda_list(n: int) -> str:
    """The --devices text of the first n GPUs: cuda:0,...,cuda:n-1."""
    return ",".join(f"cuda:{i}" for i in range(n))


def peak_mem_per_device(devices: Sequence[torch.device]) -> dict:
    """summary.json's peak_mem_bytes_per_device: each distinct device's peak (on the CPU: one process, one number).
    Data parallelism shows its imbalance here (the output device holds more); model parallelism its halves."""
    return {str(d): peak_mem_bytes(d) for d in dict.fromkeys(devices)}


# ---------------------------------------------------------------------- the scripts' flags
@dataclass
class DPConfig(Config):
    """Config plus the device list, the implementation and the device that gathers the outputs (launch/dp.py)."""

    devices: str = arg("auto", "devices each batch is split over: cpu,cpu,... or cuda:0,cuda:1,... "
                               "(auto: every visible GPU, else cpu,cpu)", metavar="LIST")
    impl: str = arg("torch", "torch: nn.DataParallel; explicit: its replicate/scatter/parallel_apply/gather "
                             "written out (splits the batch on CPU too)", choices=("torch", "explicit"))
    output_device: Optional[str] = arg(None, "where outputs are gathered and the loss is computed "
                                             "(default: the first of --devices)", metavar="DEVICE")

    def device_list(self) -> list:
        text = self.devices
        if text == "auto":
            text = cuda_list(torch.cuda.device_count()) if torch.cuda.is_available() else "cpu,cpu"
        return parse_devices(text, "--devices", same_type=True, role="data parallelism")

    def gather_device(self) -> torch.device:
        devices = self.device_list()
        if self.output_device is None:
            return devices[0]
        out = parse_devices(self.output_device, "--output-device", count=1, role="--output-device")[0]
        if out.type != devices[0].type:
            raise UsageError("--output-device", f"{out} is not a {devices[0].type} device like --devices",
                             ", ".join(sorted({str(d) for d in devices})))
        return out

    def validate(self) -> None:
        super().validate()
        if self.device != "auto":
            raise UsageError("--device", "dp.py places the model with --devices, not --device", "auto")
        devices = self.device_list()
        if self.impl == "torch" and devices[0].type == "cpu" and torch.cuda.is_available():
            raise UsageError("--devices", "nn.DataParallel takes only CUDA devices when CUDA is available",
                             "cuda:N lists, or --impl explicit for cpu lists")
        self.gather_device()
        if self.batch_size < len(devices):
            raise UsageError("--batch-size", f"{self.batch_size} cannot be split over {len(devices)} devices",
                             f">= {len(devices)}")


@dataclass
class MPConfig(Config):
    """Config plus the two devices and the number of pipelined micro-batches (launch/mp.py)."""

    devices: str = arg("auto", "encoder device,decoder device (auto: cuda:0,cuda:1 with two GPUs, cuda:0,cuda:0 "
                               "with one, else cpu,cpu)", metavar="A,B")
    microbatches: int = arg(1, "micro-batches per batch, pipelined fill-drain (GPipe); 1 = naive model "
                               "parallelism", min=1)

    def device_list(self) -> list:
        text = self.devices
        if text == "auto":
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            text = "cuda:0,cuda:1" if n >= 2 else "cuda:0,cuda:0" if n == 1 else "cpu,cpu"
        return parse_devices(text, "--devices", count=2, cuda_repeats=True,
                             role="model parallelism (encoder device, decoder device)")

    def validate(self) -> None:
        super().validate()
        if self.model != "seq2seq":
            raise UsageError("--model", f"model parallelism splits seq2seq's encoder and decoder; {self.model} has "
                                        "no such halves", "seq2seq (with --dataset reverse)")
        if self.device != "auto":
            raise UsageError("--device", "mp.py places the model with --devices, not --device", "auto")
        devices = self.device_list()
        if self.precision not in ("32-true", "64-true") and devices[0].type != devices[1].type:
            raise UsageError("--precision", f"{self.precision} autocasts one device type; {devices[0]} and "
                                            f"{devices[1]} differ", "32-true, or two devices of one kind")
        if self.microbatches > self.batch_size:
            raise UsageError("--microbatches", f"{self.microbatches} micro-batches cannot be cut from a batch of "
                                               f"{self.batch_size}", f"<= --batch-size ({self.batch_size})")


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
    """nn.DataParallel's forward in four visible steps: launch/dp.py --impl explicit, and the dp-mp hybrid.

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


# ---------------------------------------------------------------------- model parallelism
def fill_drain_schedule(num_stages: int, num_microbatches: int) -> list:
    """GPipe's forward timeline: clock t lists the (stage, micro-batch) pairs running at t.

    Stage s works on micro-batch t - s; it cannot start before stage s-1 has finished that
    micro-batch. The pipeline fills for S-1 clocks and drains for S-1 clocks, so of
    S x (M + S - 1) stage-clocks S x M are busy: the idle "bubble" is (S-1) / (M+S-1).
    """
    return [[(s, t - s) for s in range(num_stages) if 0 <= t - s < num_microbatches]
            for t in range(num_microbatches + num_stages - 1)]


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """Fraction of each device's time spent idle in a fill-drain pipeline: (S-1) / (M+S-1)."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


class EncoderDecoderSplit(nn.Module):
    """A seq2seq model across two devices: encoder on `enc_device`, decoder on `dec_device`.

    The input x is (B, 2, L) on any device: row 0 goes to the encoder's device, row 1 (the
    teacher-forcing input) to the decoder's; the encoder's hidden state crosses with .to(B) and
    the logits come out on B, where the loss is computed. With microbatches M > 1 the batch is
    cut into M micro-batches and run on GPipe's fill-drain schedule.
    """

    def __init__(self, encoder: nn.Module, decoder: nn.Module, enc_device: torch.device, dec_device: torch.device,
                 microbatches: int = 1):
        super().__init__()
        self.encoder, self.decoder = encoder, decoder
        self.enc_device, self.dec_device, self.microbatches = enc_device, dec_device, microbatches

    def forward(self, x):
        if self.microbatches == 1:
            # Naive model parallelism: while the encoder runs on A, B has nothing to do, and the
            # other way round. Each device is idle half the time (the bubble with M = 1).
            h = self.encoder(x[:, 0].to(self.enc_device))
            h = h.to(self.dec_device)  # the only activation that crosses devices: one (1, B, H) copy
            return self.decoder(x[:, 1].to(self.dec_device), h)
        micro = x.chunk(self.microbatches)  # tensor.chunk sizes; a micro-batch holds whole samples
        hidden, logits = {}, {}
        for clock in fill_drain_schedule(2, len(micro)):
            # Later stage first: its input copy and kernels are queued on B before A's next encoder
            # call, so on CUDA (asynchronous launches) B decodes micro-batch m while A encodes m+1.
            # For two stages the issue order is simply enc 0 | dec 0, enc 1 | dec 1, enc 2 | ...
            for stage, m in reversed(clock):
                if stage == 0:
                    hidden[m] = self.encoder(micro[m][:, 0].to(self.enc_device))
                else:
                    logits[m] = self.decoder(micro[m][:, 1].to(self.dec_device), hidden.pop(m).to(self.dec_device))
        # Fill-drain keeps every micro-batch's activations alive until the one backward below the
        # loss (as much memory as the full batch; GPipe recomputes them to save it). Backward runs
        # in autograd's reverse order; on CUDA its per-device threads let the stages overlap again.
        return torch.cat([logits[m] for m in range(len(micro))])


def split_encoder_decoder(model: nn.Module, devices: Sequence[torch.device], microbatches: int = 1) -> nn.Module:
    """Move model.encoder to devices[0] and model.decoder to devices[1]; the returned module's forward
    moves the activation between them. The parameters stay the model's own (nothing is copied)."""
    enc_device, dec_device = devices
    model.encoder.to(enc_device)
    model.decoder.to(dec_device)
    return EncoderDecoderSplit(model.encoder, model.decoder, enc_device, dec_device, microbatches)


def mp_plan(devices: Sequence[torch.device], microbatches: int, batch_size: int) -> str:
    """The console line that says where each half runs and what the pipeline leaves idle."""
    sizes = [len(c) for c in torch.arange(batch_size).chunk(microbatches)]
    return (f"model parallel: encoder on {devices[0]}, decoder on {devices[1]}; {len(sizes)} micro-batch(es) of "
            f"{sizes}; fill-drain bubble (S-1)/(M+S-1) = {bubble_fraction(2, len(sizes)):.2f}")


# ---------------------------------------------------------------------- hybrid: data parallelism inside each stage
class EncoderStage(nn.Module):
    """The encoder with a batch-first output, so DataParallel can gather it.

    DataParallel scatters every input and gathers every output along one dim (0). A GRU's hidden
    state is (layers, B, H): batch in dim 1. Gathering it along dim 0 would stack the chunks as
    extra layers, so the stage hands it over as (B, layers, H).
    """

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder

    def forward(self, src):
        return self.encoder(src).transpose(0, 1)


class DecoderStage(nn.Module):
    """The decoder taking the batch-first hidden state: both of its inputs scatter along dim 0."""

    def __init__(self, decoder: nn.Module):
        super().__init__()
        self.decoder = decoder

    def forward(self, dec_in, h):
        return self.decoder(dec_in, h.transpose(0, 1).contiguous())  # cuDNN's GRU wants a contiguous state


def hybrid_dp_mp(model: nn.Module, group_a: Sequence[torch.device], group_b: Sequence[torch.device],
                 impl: str = "torch") -> EncoderDecoderSplit:
    """The source article's hybrid: the encoder data-parallel over group_a, the decoder over group_b.

    The article writes `self.decoder = DataParallel(self.encoder, ...)`: the encoder wrapped twice,
    so the decoder's weights would never be used or trained. Here each wrapper holds its own stage
    (tests/test_hybrid.py::test_dp_mp_wrappers_hold_their_own_stage).
    """
    model.encoder.to(group_a[0])  # DataParallel replicates from device_ids[0]
    model.decoder.to(group_b[0])
    encoder = data_parallel(EncoderStage(model.encoder), group_a, group_a[0], impl)
    decoder = data_parallel(DecoderStage(model.decoder), group_b, group_b[0], impl)
    return EncoderDecoderSplit(encoder, decoder, group_a[0], group_b[0])
