"""Model parallelism's pieces (loops/model_parallel.py is the lesson; docs/model_parallel.md).

  ModelParallelConfig ... launch/model_parallel.py's flags: --devices A,B and --microbatches
  split_encoder_decoder . the seq2seq encoder on device A, the decoder on B, the activation moved with
                          .to(B); optional GPipe fill-drain micro-batches (fill_drain_schedule)
  EncoderStage, DecoderStage  the halves as modules of their own (the hybrid wraps each in DataParallel)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

from manual_train.config import COMPILE_SCRIPTS, Config, UsageError, arg, parsed_from
from manual_train.runtime import parse_devices


@dataclass
class ModelParallelConfig(Config):
    """Config plus the two devices and the number of pipelined micro-batches (launch/model_parallel.py)."""

    devices: str = arg("auto", "encoder device,decoder device (auto: cuda:0,cuda:1 with two GPUs, cuda:0,cuda:0 "
                               "with one, else cpu,cpu)", metavar="A,B")
    microbatches: int = arg(1, "micro-batches per batch, pipelined fill-drain (GPipe); 1 = naive model "
                               "parallelism", min=1)

    @parsed_from("devices")
    def device_list(self) -> list[torch.device]:
        """--devices as (encoder device, decoder device); auto resolved by validate on this machine."""
        text = self.devices
        if text == "auto":
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            text = "cuda:0,cuda:1" if n >= 2 else "cuda:0,cuda:0" if n == 1 else "cpu,cpu"
        return parse_devices(text, "--devices", count=2, cuda_repeats=True,
                             role="model parallelism (encoder device, decoder device)")

    def check_compile(self) -> None:
        if self.compile != "none":
            raise UsageError("--compile", "model parallelism replaces forward with its own split over devices; "
                                          "compiling it is not built", COMPILE_SCRIPTS)

    def validate(self) -> None:
        super().validate()
        if self.model != "seq2seq":
            raise UsageError("--model", f"model parallelism splits seq2seq's encoder and decoder; {self.model} has "
                                        "no such halves", "seq2seq (with --dataset reverse)")
        if self.device != "auto":
            raise UsageError("--device", "launch/model_parallel.py places the model with --devices, not --device",
                             "auto")
        devices = self.device_list()
        if self.precision not in ("32-true", "64-true") and devices[0].type != devices[1].type:
            raise UsageError("--precision", f"{self.precision} autocasts one device type; {devices[0]} and "
                                            f"{devices[1]} differ", "32-true, or two devices of one kind")
        if self.microbatches > self.batch_size:
            raise UsageError("--microbatches", f"{self.microbatches} micro-batches cannot be cut from a batch of "
                                               f"{self.batch_size}", f"<= --batch-size ({self.batch_size})")


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
