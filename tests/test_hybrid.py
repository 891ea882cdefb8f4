"""Hybrid data + model parallelism (launch/hybrid.py, manual_train/loops/hybrid.py, parallel.hybrid_dp_mp).

dp-mp (one process, DataParallel inside each half) trains the baseline's weights, and each wrapper holds its
own half (the source article wraps the encoder twice). ddp-mp under torchrun: 2 ranks with batch b train the
weights of one process with batch 2b, and evaluate exactly. One torchrun launch in all.
"""
from __future__ import annotations

import copy
import json
import sys

import pytest
import torch
import torch.nn as nn

from conftest import SEQ, cuda_devices, load_model_state, make_cfg, max_param_diff, run_script, train_state
from manual_train import parallel
from manual_train.checkpoint import REQUIRED_KEYS
from manual_train.cli import run as cli_run
from manual_train.config import Config
from manual_train.data import ReverseDigits
from manual_train.loops import hybrid, single
from manual_train.metrics import CSV_COLUMNS, SUMMARY_KEYS
from manual_train.models import Seq2Seq

CPU = torch.device("cpu")


def param_ids(module: nn.Module) -> set:
    return {id(p) for p in module.parameters()}


def stages_hold_their_halves(split, model) -> bool:
    """The encoder's wrapper holds exactly the encoder's parameters, the decoder's the decoder's."""
    return (param_ids(split.encoder) == param_ids(model.encoder) and param_ids(split.decoder) ==
            param_ids(model.decoder) and not param_ids(split.encoder) & param_ids(split.decoder))


# ---------------------------------------------------------------------- dp-mp
@pytest.mark.parametrize("impl", ["torch", "explicit"])
def test_dp_mp_wrappers_hold_their_own_stage(impl):
    """Regression for the article's `self.decoder = DataParallel(self.encoder, ...)`, which the check catches."""
    torch.manual_seed(0)
    model = Seq2Seq(ReverseDigits.VOCAB)
    split = parallel.hybrid_dp_mp(model, [CPU, CPU], [CPU, CPU], impl)
    assert stages_hold_their_halves(split, model)
    assert param_ids(split) == param_ids(model)  # nothing copied, nothing left out
    article = copy.copy(split)
    article.decoder = parallel.data_parallel(parallel.EncoderStage(model.encoder), [CPU, CPU], CPU, impl)
    assert not stages_hold_their_halves(article, model)


def test_stage_hands_the_hidden_state_over_batch_first():
    """DataParallel gathers along dim 0; a GRU's hidden state is (1, B, H). Gathered raw, two chunks become
    (2, B/2, H): two "layers" of half a batch. EncoderStage hands it over as (B, 1, H) and the split is exact."""
    torch.manual_seed(0)
    model = Seq2Seq(ReverseDigits.VOCAB)
    src = ReverseDigits(10, seed=3).x[:, 0]
    h = model.encoder(src)
    raw = parallel.ExplicitDataParallel(model.encoder, [CPU, CPU], CPU)(src)
    assert h.shape == (1, 10, 128) and raw.shape == (2, 5, 128)
    staged = parallel.ExplicitDataParallel(parallel.EncoderStage(model.encoder), [CPU, CPU], CPU)(src)
    assert (staged.transpose(0, 1) - h).abs().max() < 1e-6


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    return train_state(single, Config, tmp_path_factory.mktemp("single"), "s", **SEQ)


@pytest.mark.parametrize("impl", ["torch", "explicit"])
def test_dp_mp_equals_baseline(tmp_path, baseline, impl):
    """cpu,cpu | cpu,cpu: explicit splits each half's batch in two; torch is DataParallel's CPU fallback."""
    base, base_summary = baseline
    state, summary = train_state(hybrid, hybrid.HybridConfig, tmp_path, "h", mode="dp-mp", impl=impl,
                                 devices="cpu,cpu,cpu,cpu", **SEQ)
    assert max_param_diff(base, state) < 1e-6
    assert summary["final_val_loss"] == pytest.approx(base_summary["final_val_loss"], abs=1e-6)
    assert (summary["encoder_devices"], summary["decoder_devices"]) == (["cpu", "cpu"], ["cpu", "cpu"])


def test_resume_continues_exactly(tmp_path):
    common = dict(SEQ, mode="dp-mp", impl="explicit", schedule="constant")
    straight, _ = train_state(hybrid, hybrid.HybridConfig, tmp_path, "a", **dict(common, max_steps=6))
    hybrid.train(make_cfg(tmp_path / "b", hybrid.HybridConfig, **dict(common, max_steps=3)))
    summary = hybrid.train(make_cfg(tmp_path / "b", hybrid.HybridConfig, resume="auto", **dict(common, max_steps=6)))
    assert summary["optimizer_steps"] == 6
    assert max_param_diff(straight, load_model_state(tmp_path / "b" / "run")) == 0.0


# ---------------------------------------------------------------------- ddp-mp under torchrun
def test_ddp_mp_two_ranks_equal_one_process_with_twice_the_batch(tmp_path):
    """2 ranks x batch 10 x accumulate 2 (no_sync on the first micro-step) == 1 process x batch 20 x accumulate 2,
    over a whole epoch with a partial last window. 65 validation samples split 33/32: the all-reduced sums give
    the single process's val loss and accuracy (a padded sampler would count one sample twice)."""
    common = dict(SEQ, synthetic_size=260, epochs=1, max_steps=None, accumulate=2)
    out_dir = tmp_path / "ddp"
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in common.items() if k not in ("max_steps", "batch_size")]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    result = run_script("hybrid", "--mode", "ddp-mp", "--batch-size", "10", "--no-progress", "--out-dir",
                        str(out_dir), *argv, launcher=launcher, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    ref, ref_summary = train_state(single, Config, tmp_path, "single", **dict(common, batch_size=20))
    assert max_param_diff(ref, load_model_state(out_dir)) < 1e-6
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["final_val_acc"] == ref_summary["final_val_acc"]
    assert summary["final_val_loss"] == pytest.approx(ref_summary["final_val_loss"], abs=1e-6)
    for key in ("global_batch_size", "optimizer_steps", "samples_seen"):
        assert summary[key] == ref_summary[key], key
    assert (summary["world_size"], summary["mode"]) == (2, "ddp-mp")
    # the outputs contract, written by rank 0 alone
    assert result.stdout.count("done: ") == 1
    assert set(SUMMARY_KEYS) <= summary.keys()
    assert (out_dir / "metrics.csv").read_text().splitlines()[0].split(",") == list(CSV_COLUMNS)
    for name in ("last.pt", "best.pt"):
        ckpt = torch.load(out_dir / name, map_location="cpu", weights_only=True)
        assert set(REQUIRED_KEYS) <= ckpt.keys() and ckpt["world_size"] == 2
        assert not any(k.startswith("module.") for k in ckpt["model"])


# ---------------------------------------------------------------------- bad input
def test_bad_input_is_one_line(tmp_path, capsys, monkeypatch):
    from test_dp import cuda_missing_line

    cases = [
        (["--devices", "cpu,cpu,cpu"], "error: --devices: 3 devices given; dp-mp needs an even number (two equal "
                                       "groups) (allowed: e.g. cpu,cpu,cpu,cpu or cuda:0,cuda:1,cuda:2,cuda:3)"),
        (["--devices", "cuda:0,cuda:0,cuda:1,cuda:2"], "error: --devices: cuda:0 is listed twice; each dp-mp group "
                                                       "needs distinct GPUs (allowed: each cuda:N once (cpu may "
                                                       "repeat))"),
        (["--devices", "cpu,cuda:0,cpu,cpu"], "error: --devices: cpu,cuda:0 mixes cpu and cuda; each dp-mp group "
                                              "needs devices of one kind (allowed: all cpu or all cuda:N)"),
        (["--devices", "cuda:8,cuda:9"], cuda_missing_line("--devices", "cuda:8", 8)),  # each group checked in turn
        (["--mode", "ddp-mp", "--impl", "explicit"], "error: --impl: ddp-mp's data parallelism is DDP; --impl "
                                                     "chooses dp-mp's (allowed: torch)"),
        (["--mode", "ddp-mp", "--devices", "cpu,cpu,cpu"], "error: --devices: 3 devices for 1 local rank(s); ddp-mp "
                                                           "takes two per local rank (allowed: cpu,cpu, or 2 x "
                                                           "--nproc_per_node GPUs)"),
        (["--dataset", "digits", "--model", "mlp"], "error: --model: the hybrid splits seq2seq's encoder and "
                                                    "decoder; mlp has no such halves (allowed: seq2seq (with "
                                                    "--dataset reverse))"),
    ]
    for argv, line in cases:
        out_dir = tmp_path / "never"
        rc = cli_run(hybrid.train, hybrid.HybridConfig, script="hybrid", argv=argv + ["--out-dir", str(out_dir)],
                     **hybrid.DEFAULTS)
        assert (rc, capsys.readouterr().err) == (2, line + "\n"), argv
        assert not out_dir.exists()
    # dp-mp is a single-process form: under torchrun (as a rank of 2) it is refused before anything starts
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    rc = cli_run(hybrid.train, hybrid.HybridConfig, script="hybrid", argv=["--out-dir", str(tmp_path / "never")],
                 **hybrid.DEFAULTS)
    assert (rc, capsys.readouterr().err) == (2, "error: --mode: dp-mp is one process driving every device; under "
                                                "torchrun use ddp-mp (allowed: ddp-mp)\n")


# ---------------------------------------------------------------------- GPUs
@pytest.mark.parametrize("devices", [pytest.param("cuda:0,cuda:1", marks=cuda_devices(2)),
                                     pytest.param("cuda:0,cuda:1,cuda:2,cuda:3", marks=cuda_devices(4))])
def test_gpu_dp_mp_equals_one_gpu(tmp_path, devices):
    """nn.DataParallel inside each half, on real GPUs, against the baseline on cuda:0."""
    base, _ = train_state(single, Config, tmp_path, "s", device="cuda:0", **SEQ)
    state, _ = train_state(hybrid, hybrid.HybridConfig, tmp_path, "h", mode="dp-mp", devices=devices, **SEQ)
    assert max_param_diff(base, state) < 1e-5  # cuDNN GRU over half batches rounds differently


@pytest.mark.parametrize("_", [pytest.param(None, marks=cuda_devices(4))], ids=["4gpus"])
def test_gpu_ddp_mp_two_ranks(tmp_path, _):
    """torchrun 2 ranks, each on its own pair (cuda:0,1 and cuda:2,3), nccl: the weights of one process, batch 2b."""
    out_dir = tmp_path / "ddp"
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in SEQ.items() if k != "batch_size"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    result = run_script("hybrid", "--mode", "ddp-mp", "--batch-size", "10", "--out-dir", str(out_dir), *argv,
                        launcher=launcher, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ref, _ = train_state(single, Config, tmp_path, "s", device="cuda:0", **dict(SEQ, batch_size=20))
    assert max_param_diff(ref, load_model_state(out_dir)) < 1e-5
