"""The hybrid's plumbing, decided once (loops/hybrid.py is the lesson; docs/hybrid.md).

  HybridConfig ...... launch/ddp.py's flags (DDPConfig: --backend, --dist-timeout-s, DDP's knobs) plus --mode,
                      --devices and --impl, and their one-line checks; DDP's knobs under ddp-mp only
  device_groups ..... the encoder's devices (group_a) and the decoder's (group_b), from --devices and torchrun
  split_model ....... the mode applied to an unmodified seq2seq model: dp-mp, each half data-parallel over its
                      group (hybrid_dp_mp below, the source article's form); ddp-mp, the halves on this
                      rank's device pair (split_encoder_decoder, as launch/model_parallel.py). The loop wraps either
                      in DDP, so after set-up it never branches on the mode.
  describe, summary_extra  the console line and summary.json's extra keys: where each half runs
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from manual_train.config import COMPILE_SCRIPTS, arg, parsed_from
from manual_train.data_parallel import data_parallel
from manual_train.distributed import DDPConfig, DistEnv, read_env
from manual_train.errors import UsageError
from manual_train.model_parallel import DecoderStage, EncoderDecoderSplit, EncoderStage, split_encoder_decoder
from manual_train.runtime import cuda_list, parse_devices, peak_mem_bytes

# launch/hybrid.py's defaults: launch/model_parallel.py's task and budget (loops/model_parallel.py), so the two scripts
# train the same model on the same data (tests/test_hybrid.py checks they stay equal)
DEFAULTS = dict(dataset="reverse", model="seq2seq", optimizer="adamw", lr=3e-3, epochs=2, synthetic_size=16384)


@dataclass
class HybridConfig(DDPConfig):
    """The DDP loop's flags plus the mode, the device list and (dp-mp) the data-parallel implementation."""

    mode: str = arg("dp-mp", "dp-mp: one process, encoder data-parallel over the first half of --devices, "
                             "decoder over the second; ddp-mp: one process per device pair (torchrun), the split "
                             "model in DDP", choices=("dp-mp", "ddp-mp"))
    devices: str = arg("auto", "dp-mp: encoder group then decoder group, equal halves (auto: every GPU, else "
                               "cpu,cpu,cpu,cpu); ddp-mp: cpu,cpu for every rank, or two GPUs per local rank, rank r "
                               "taking entries 2r and 2r+1 (auto: cuda:2r,cuda:2r+1, else cpu,cpu)", metavar="LIST")
    impl: str = arg("torch", "dp-mp's data parallelism: torch (nn.DataParallel) or explicit (replicate/scatter/"
                             "parallel_apply/gather written out; splits the batch on CPU too)",
                    choices=("torch", "explicit"))

    def device_groups(self, env: DistEnv) -> tuple:
        """(group_a, group_b): the encoder's and the decoder's devices; under ddp-mp one each, this rank's pair of
        --devices (the list parsed once; here only the rank's pair is picked)."""
        if self.mode == "dp-mp":
            return self._dp_mp_groups()
        devices = self._ddp_mp_devices()
        if all(d.type == "cpu" for d in devices) and len(devices) == 2:
            return [devices[0]], [devices[1]]  # every rank on the one CPU
        if len(devices) != 2 * env.local_world_size:
            raise UsageError("--devices", f"{len(devices)} devices for {env.local_world_size} local rank(s); ddp-mp "
                                          "takes two per local rank", "cpu,cpu, or 2 x --nproc_per_node GPUs")
        return [devices[2 * env.local_rank]], [devices[2 * env.local_rank + 1]]

    @parsed_from("devices")
    def _dp_mp_groups(self) -> tuple[list, list]:
        """dp-mp's --devices: its two equal halves (auto, on this machine: every GPU, else cpu,cpu,cpu,cpu)."""
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        text = self.devices
        if text == "auto":
            text = cuda_list(n - n % 2) if n >= 2 else "cuda:0,cuda:0" if n == 1 else "cpu,cpu,cpu,cpu"
        names = parse_devices(text, "--devices", even=True, cuda_repeats=True, role="dp-mp",
                              check_machine=False)  # the list first, then each group on this machine
        half = len(names) // 2
        return tuple(parse_devices(",".join(map(str, group)), "--devices", same_type=True,
                                   role="each dp-mp group") for group in (names[:half], names[half:]))

    @parsed_from("devices")
    def _ddp_mp_devices(self) -> list[torch.device]:
        """ddp-mp's --devices: the local ranks' pairs in turn (auto, on this node: cuda:0 .. cuda:2L-1 for torchrun's
        L local ranks, else cpu,cpu)."""
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        text = self.devices
        if text == "auto":
            local_world_size = read_env().local_world_size
            if n == 0:
                text = "cpu,cpu"
            elif n < 2 * local_world_size:
                raise UsageError("--devices", f"ddp-mp needs two GPUs per process: {local_world_size} local "
                                              f"rank(s) need {2 * local_world_size}, this node has {n}",
                                 "cpu,cpu, or fewer --nproc_per_node")
            else:
                text = cuda_list(2 * local_world_size)
        return parse_devices(text, "--devices", role="ddp-mp")

    def rank_device(self, env: DistEnv) -> torch.device:
        """The current device of this rank (the encoder's first; the loop joins the group without binding it)."""
        return self.device_groups(env)[0][0]

    def on_cuda(self) -> bool:
        """--devices decides, not --device (DDPConfig's checks of --backend nccl read this)."""
        return self.device_groups(read_env())[0][0].type == "cuda"

    def check_compile(self) -> None:
        if self.compile != "none":
            raise UsageError("--compile", "the hybrid's stages replace forward with their own split; not built for it",
                             COMPILE_SCRIPTS)

    def validate(self) -> None:
        if self.device != "auto":
            raise UsageError("--device", "hybrid.py places the model with --devices, not --device", "auto")
        if self.sync_bn:  # before DDPConfig's CUDA-only check, whose advice (--device cuda) is not hybrid.py's
            raise UsageError("--sync-bn", "the hybrid's seq2seq has no BatchNorm layers to synchronise",
                             "leave it out")
        super().validate()  # the baseline's checks, then DDPConfig's: --backend against --devices, PowerSGD's flags
        if self.model != "seq2seq":
            raise UsageError("--model", f"the hybrid splits seq2seq's encoder and decoder; {self.model} has no such "
                                        "halves", "seq2seq (with --dataset reverse)")
        env = read_env()
        if self.mode == "dp-mp" and env.world_size > 1:
            raise UsageError("--mode", "dp-mp is one process driving every device; under torchrun use ddp-mp",
                             "ddp-mp")
        if self.mode == "dp-mp" and self.knobs_set():  # DDP's constructor arguments and comm hooks, as ZeroConfig
            raise UsageError(self.knobs_set()[0], "is a knob of DDP's all-reduce between processes; dp-mp is one "
                                                  "process (DataParallel inside each half), whose group of one sends "
                                                  "nothing", "--mode ddp-mp, or leave it out")
        if self.mode == "ddp-mp" and self.impl != "torch":
            raise UsageError("--impl", "ddp-mp's data parallelism is DDP; --impl chooses dp-mp's", "torch")
        group_a, group_b = self.device_groups(env)
        if self.mode == "dp-mp" and self.impl == "torch" and torch.cuda.is_available() and \
                "cpu" in {group_a[0].type, group_b[0].type}:
            raise UsageError("--devices", "nn.DataParallel takes only CUDA devices when CUDA is available",
                             "cuda:N lists, or --impl explicit for cpu lists")
        if group_a[0].type != group_b[0].type:  # (and autocast's one device type fits both halves)
            raise UsageError("--devices", f"the encoder's {group_a[0]} and the decoder's {group_b[0]} differ in kind; "
                                          "DDP wraps the split and takes devices of one kind", "all cpu or all cuda:N")
        if self.batch_size < max(len(group_a), len(group_b)):
            raise UsageError("--batch-size", f"{self.batch_size} cannot be split over {len(group_a)} devices",
                             f">= {len(group_a)}")


def split_model(cfg: HybridConfig, raw_model: nn.Module, group_a: list, group_b: list) -> nn.Module:
    """raw_model's encoder placed on group_a[0] and its decoder on group_b[0] (moved once), in the mode's form:
    dp-mp wraps each half in its own data parallelism over its group; ddp-mp runs each half on one device.
    Either way the returned module holds raw_model's own parameters (nothing copied): the optimizer, the
    checkpoint and --restore-best all work on raw_model."""
    if cfg.mode == "dp-mp":
        return hybrid_dp_mp(raw_model, group_a, group_b, cfg.impl)
    return split_encoder_decoder(raw_model, [group_a[0], group_b[0]])


def describe(cfg: HybridConfig, group_a: list, group_b: list, env: DistEnv) -> str:
    """The console line under the banner: where each half runs."""
    where = f"hybrid {cfg.mode}: encoder on {','.join(map(str, group_a))}, decoder on {','.join(map(str, group_b))}"
    if cfg.mode == "ddp-mp":
        return where + (f" (rank 0 of {env.world_size}; each rank its own pair; process group {dist.get_backend()}, "
                        f"collectives time out after {cfg.dist_timeout_s:g} s)")
    where += f", data parallel: {cfg.impl} (a process group of one: DDP over it averages over this one process)"
    if cfg.impl == "torch" and not torch.cuda.is_available():
        where += ("\nno CUDA here: nn.DataParallel ignores device_ids and calls each half directly (the seq2seq "
                  "baseline, split); --impl explicit splits each half's batch on CPU")
    return where


def summary_extra(cfg: HybridConfig, group_a: list, group_b: list) -> dict:
    """summary.json's hybrid keys: the mode and rank 0's devices (each rank of ddp-mp has its own pair)."""
    return dict(mode=cfg.mode, impl=cfg.impl, encoder_devices=[str(d) for d in group_a],
                decoder_devices=[str(d) for d in group_b],
                peak_mem_bytes_per_device={str(d): peak_mem_bytes(d) for d in dict.fromkeys(group_a + group_b)})


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
