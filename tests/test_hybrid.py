"""Hybrid data + model parallelism (launch/hybrid.py, manual_train/loops/hybrid.py, manual_train/hybrid.py).

dp-mp (one process, DataParallel inside each half; like every run of the loop a process group, here of one, with DDP
over the split averaging over that one process) trains the baseline's weights, and each wrapper holds its own half
(the source article wraps the encoder twice). ddp-mp under torchrun: 2 ranks with batch b train the
weights of one process with batch 2b, and evaluate exactly. One torchrun launch in all, and one job of 2 ranks
(tests/jobs.py) for a training set the ranks do not divide (61 samples: shards 31/30, no repeats), which also runs
ddp-mp with launch/ddp.py's --backend, --dist-timeout-s and DDP's exact knobs (HybridConfig is a DDPConfig; the
knobs are refused under dp-mp, --sync-bn everywhere: test_bad_input_is_one_line).

The parity proofs run in 64-true (float64; docs/parity.md) within PARITY_TOL_64 = 1e-9, over two epochs: dp-mp on
test_model_parallel.SEQ_PARITY's horizon (205 samples, 42 SGD steps, each epoch's last batch 5 = 3 + 2 over a group of two),
ddp-mp on 260 samples x 2 epochs with accumulate 2 (each epoch's last window partial; 14 steps). Known-wrong
variants of the technique's own code fail the same checks: the article's wrapping (the decoder's wrapper not holding
the model's decoder, which is then never trained) and, for ddp-mp, DistributedSampler's padding (below); the
catalogue's hybrid mutants (tests/mutants/hybrid.py: no_sync() inverted, the weight without x N, the ranks' device
pairs, the counts) fail these tests. The fp32 pairing (dp-mp explicit, the same horizon, seq2seq) is held to a noise
floor measured in the same test. Measured 2026-12-01 (2-core Xeon VM, AVX-512, torch 2.14.1): dp-mp torch 0.0,
explicit 4.4e-16, the article's wrapping 1.3; ddp-mp 2.2e-16 (no_sync() inverted: 5.0e-2, 2026-12-02); fp32 explicit
2.4e-7 against a floor of 4.8e-7, the article's wrapping 1.3. ddp-mp on 61 samples (two epochs,
64-true; 2026-12-02, 2-core AMD EPYC VM): 2.2e-16, accumulate 2 5.6e-17; the known-wrong variant, DistributedSampler's
padding (pad=True), 0.13 (the loop as it was before it passed pad=False: 0.11, and samples_seen 124 for 122).
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from conftest import (PARITY_TOL_64, SEQ, as_torchrun_rank, assert_cross_path_64, assert_resumes_not_reruns,
                      assert_within_fp32_floor, cuda_devices, fp32_noise_floor, load_model_state, make_cfg,
                      max_param_diff, run_script, torchrun, train_state)
from jobs import run_job
from test_model_parallel import SEQ_FP32, SEQ_PARITY
from manual_train import data
from manual_train.checkpoint import REQUIRED_KEYS
from manual_train.cli import run as cli_run
from manual_train.config import Config
from manual_train.data import ReverseDigits
from manual_train.data_parallel import ExplicitDataParallel, data_parallel
from manual_train.distributed import DistEnv
from manual_train.hybrid import hybrid_dp_mp as real_hybrid_dp_mp
from manual_train.loops import hybrid, model_parallel, single
from manual_train.metrics import CSV_COLUMNS, SUMMARY_KEYS
from manual_train.model_parallel import DecoderStage, EncoderStage
from manual_train.models import Seq2Seq
from manual_train.runtime import cuda_list

CPU = torch.device("cpu")
# Every run of the loop joins a process group (plain python: a group of one), and setup() adds MASTER_ADDR and
# MASTER_PORT to os.environ: as in the DDP tests, lone_process gives each test the environment it started with.
pytestmark = pytest.mark.usefixtures("lone_process")


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
    split = real_hybrid_dp_mp(model, [CPU, CPU], [CPU, CPU], impl)
    assert stages_hold_their_halves(split, model)
    assert param_ids(split) == param_ids(model)  # nothing copied, nothing left out
    article = copy.copy(split)
    article.decoder = data_parallel(EncoderStage(model.encoder), [CPU, CPU], CPU, impl)
    assert not stages_hold_their_halves(article, model)


def test_stage_hands_the_hidden_state_over_batch_first():
    """DataParallel gathers along dim 0; a GRU's hidden state is (1, B, H). Gathered raw, two chunks become
    (2, B/2, H): two "layers" of half a batch. EncoderStage hands it over as (B, 1, H) and the split is exact."""
    torch.manual_seed(0)
    model = Seq2Seq(ReverseDigits.VOCAB).double()  # float64: exact to 1e-9 on any CPU
    src = ReverseDigits(10, seed=3).x[:, 0]
    h = model.encoder(src)
    raw = ExplicitDataParallel(model.encoder, [CPU, CPU], CPU)(src)
    assert h.shape == (1, 10, 128) and raw.shape == (2, 5, 128)
    staged = ExplicitDataParallel(EncoderStage(model.encoder), [CPU, CPU], CPU)(src)
    assert (staged.transpose(0, 1) - h).abs().max() <= PARITY_TOL_64


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The single-device loop over the parity horizon, 64-true."""
    return train_state(single, Config, tmp_path_factory.mktemp("single"), "s", **SEQ_PARITY)


def train_dp_mp(tmp_path, name, impl, **flags):
    return train_state(hybrid, hybrid.HybridConfig, tmp_path, name, mode="dp-mp", impl=impl,
                       devices="cpu,cpu,cpu,cpu", **flags)


def articles_wrapping(model, group_a, group_b, impl="torch"):
    """The article's `self.decoder = DataParallel(self.encoder, ...)` as a run: the decoder's wrapper does not hold the
    model's decoder, so the model's decoder is never used or trained. (The article's exact line cannot run here: the
    encoder takes other inputs than the decoder. A wrapper around a copy of the decoder keeps the mistake: the
    optimizer steps the copy, and the model, the checkpoint's weights, keeps its initial decoder.)"""
    split = real_hybrid_dp_mp(model, group_a, group_b, impl)
    split.decoder = data_parallel(DecoderStage(copy.deepcopy(model.decoder)), group_b, group_b[0], impl)
    return split


@pytest.mark.parametrize("impl", ["torch", "explicit"])
def test_dp_mp_equals_baseline(tmp_path, baseline, impl):
    """cpu,cpu | cpu,cpu: explicit splits each half's batch in two; torch is DataParallel's CPU fallback. 64-true,
    two epochs, within 1e-9 (measured torch 0.0, explicit 4.4e-16)."""
    base, base_summary = baseline
    state, summary = train_dp_mp(tmp_path, "h", impl, **SEQ_PARITY)
    assert_cross_path_64(state, base, f"dp-mp {impl} vs one device")  # float64 tensors, within 1e-9
    assert summary["optimizer_steps"] == base_summary["optimizer_steps"] == 42
    assert summary["final_val_loss"] == pytest.approx(base_summary["final_val_loss"], rel=1e-9)
    assert (summary["encoder_devices"], summary["decoder_devices"]) == (["cpu", "cpu"], ["cpu", "cpu"])
    assert summary["world_size"] == 1 and not dist.is_initialized()  # a group of one, left on the way out


def test_the_articles_wrapping_fails_the_same_check(tmp_path, baseline, monkeypatch):
    """The loop with hybrid_dp_mp swapped for the article's wrapping: the model's decoder is never trained."""
    monkeypatch.setattr("manual_train.hybrid.hybrid_dp_mp", articles_wrapping)
    wrong, _ = train_dp_mp(tmp_path, "wrong", "explicit", **SEQ_PARITY)
    assert max_param_diff(baseline[0], wrong) > 1e6 * PARITY_TOL_64  # measured 1.3


def test_fp32_dp_mp_within_the_noise_floor_and_the_articles_wrapping_is_not(tmp_path, monkeypatch):
    """fp32 (seq2seq, explicit, two epochs): within 10 one-ulp drifts of the baseline; the article's wrapping not."""
    base, _ = train_state(single, Config, tmp_path, "single", **SEQ_FP32)
    floor = fp32_noise_floor(lambda name: train_state(single, Config, tmp_path, name, **SEQ_FP32)[0], base)
    state, _ = train_dp_mp(tmp_path, "h", "explicit", **SEQ_FP32)
    assert_within_fp32_floor(max_param_diff(base, state), floor, "dp-mp explicit vs one device")
    monkeypatch.setattr("manual_train.hybrid.hybrid_dp_mp", articles_wrapping)
    wrong, _ = train_dp_mp(tmp_path, "wrong", "explicit", **SEQ_FP32)
    with pytest.raises(AssertionError):
        assert_within_fp32_floor(max_param_diff(base, wrong), floor, "the article's wrapping vs one device")


def test_resume_continues_exactly(tmp_path):
    """3 steps, then --resume auto on to 6: the weights of 6 steps straight, and the resumed call trains only the 3
    remaining batches, the straight run's last 3; a rerun from scratch (--resume ignored) trains all 6 (test_data_parallel.py)."""
    common = dict(SEQ, mode="dp-mp", impl="explicit", schedule="constant")
    assert_resumes_not_reruns(tmp_path, hybrid, hybrid.HybridConfig, **common)


# ---------------------------------------------------------------------- ddp-mp under torchrun
def test_ddp_mp_two_ranks_equal_one_process_with_twice_the_batch(tmp_path):
    """2 ranks x batch 10 x accumulate 2 (no_sync on the first micro-step) == 1 process x batch 20 x accumulate 2, in
    64-true over two epochs, each with a partial last window (130 samples per rank: 13 micro-batches, 7 windows).
    65 validation samples split 33/32: the all-reduced sums give the single process's val loss and accuracy (a
    padded sampler would count one sample twice). The known-wrong variants are the loop's own: no_sync() inverted
    (tests/mutants/hybrid.py) fails this check; DistributedSampler's padding fails the 61-sample one below."""
    common = dict(SEQ, synthetic_size=260, epochs=2, max_steps=None, accumulate=2, precision="64-true")
    out_dir = tmp_path / "ddp"
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in common.items() if k not in ("max_steps", "batch_size")]
    result = run_script("hybrid", "--mode", "ddp-mp", "--batch-size", "10", "--no-progress", "--out-dir",
                        str(out_dir), "--backend", "gloo", "--dist-timeout-s", "120", *argv, launcher=torchrun(2))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "process group gloo, collectives time out after 120 s" in result.stdout  # launch/ddp.py's flags, taken
    ref, ref_summary = train_state(single, Config, tmp_path, "single", **dict(common, batch_size=20))
    ranks = load_model_state(out_dir)
    assert all(v.dtype == torch.float64 for v in ranks.values())
    assert_cross_path_64(ranks, ref, "ddp-mp 2 x 10 vs one process x 20")  # measured 2.2e-16
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["final_val_acc"] == ref_summary["final_val_acc"]
    assert summary["final_val_loss"] == pytest.approx(ref_summary["final_val_loss"], rel=1e-9)
    for key in ("global_batch_size", "optimizer_steps", "samples_seen"):
        assert summary[key] == ref_summary[key], key
    assert (summary["world_size"], summary["mode"], summary["optimizer_steps"]) == (2, "ddp-mp", 14)
    # the outputs contract, written by rank 0 alone
    assert result.stdout.count("done: ") == 1
    assert set(SUMMARY_KEYS) <= summary.keys()
    assert (out_dir / "metrics.csv").read_text().splitlines()[0].split(",") == list(CSV_COLUMNS)
    for name in ("last.pt", "best.pt"):
        ckpt = torch.load(out_dir / name, map_location="cpu", weights_only=True)
        assert set(REQUIRED_KEYS) <= ckpt.keys() and ckpt["world_size"] == 2
        assert not any(k.startswith("module.") for k in ckpt["model"])


# ---------------------------------------------------------------------- ddp-mp on a set 2 ranks do not divide
# 61 training samples on 2 ranks of 10 per micro-batch: shards of 31/30, so each epoch's last global micro-batch holds
# 1 sample, rank 0's, and rank 1's is empty (weight 0); validation 15 = 8/7. Two epochs, 64-true: 8 steps, or 4 with
# accumulate 2 (windows of 40 and 21 samples). The ranks are started by tests/jobs.py (one job, three scenarios).
UNEVEN = dict(SEQ, synthetic_size=61, max_steps=None, epochs=2, precision="64-true", log_every=2)
real_train_sampler = data.train_sampler


def padded_train_sampler(dataset, seed, world_size=1, rank=0, pad=False):
    """The loop's old sampler line: DistributedSampler's own rule, rank 1's shard filled up with a repeat of a
    sample (which then trains twice)."""
    return real_train_sampler(dataset, seed, world_size, rank, pad=True)


# launch/ddp.py's process-group flags and DDP's exact knobs, all at once (tiny buckets: several of them)
KNOBS = dict(backend="gloo", dist_timeout_s=120.0, bucket_cap_mb=0.05, gradient_as_bucket_view=True,
             static_graph=True, find_unused_parameters=True)


class _RecordingDDP(hybrid.DDP):
    """The loop's DDP, keeping each instance (test-only: to read what DDP was given)."""

    made: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _RecordingDDP.made.append(self)


def _uneven_scenario(name: str, world_size: int, rank: int, out) -> dict:
    flags = dict(UNEVEN, accumulate=2 if name == "uneven_accumulate" else 1, **(KNOBS if name == "knobs" else {}))
    joined, real_init = {}, dist.init_process_group

    def recording_init(*args, **kwargs):  # what the process group is created with, then the real thing
        joined.update(backend=kwargs["backend"], timeout_s=kwargs["timeout"].total_seconds())
        return real_init(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        if name == "padded":  # the known-wrong variant: the same loop with pad=True
            patch.setattr(hybrid.data, "train_sampler", padded_train_sampler)
        patch.setattr(dist, "init_process_group", recording_init)
        patch.setattr(hybrid, "DDP", _RecordingDDP)
        summary = hybrid.train(make_cfg(out / name, hybrid.HybridConfig, mode="ddp-mp", devices="cpu,cpu", **flags))
    logged = _RecordingDDP.made[-1]._get_ddp_logging_data()
    return {"group": joined, "ddp": {k: logged.get(k) for k in ("bucket_cap_bytes", "gradient_as_bucket_view",
                                                                 "static_graph", "find_unused_parameters")},
            **{k: summary[k] for k in ("final_val_loss", "final_val_acc", "optimizer_steps", "samples_seen",
                                       "global_batch_size")}}


@pytest.fixture(scope="module")
def uneven_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("uneven2")
    return out, run_job(_uneven_scenario, 2, out, ["uneven", "uneven_accumulate", "padded", "knobs"],
                        ["manual_train.loops.hybrid"])


@pytest.fixture(scope="module")
def uneven_single(tmp_path_factory):
    """The single process with the global batch, 20, per accumulate: (weights, summary)."""
    root = tmp_path_factory.mktemp("uneven_single")
    return {k: train_state(single, Config, root, f"k{k}", **dict(UNEVEN, batch_size=20, accumulate=k)) for k in (1, 2)}


@pytest.mark.parametrize("scenario", ["uneven", "uneven_accumulate"])
def test_ddp_mp_on_a_set_the_ranks_do_not_divide_equals_one_process(uneven_job, uneven_single, scenario):
    """2 ranks x batch 10 on 61 samples (shards 31/30, no repeats; rank 1's last micro-batch empty) == 1 process x
    batch 20, 64-true, two epochs, within 1e-9 (measured 2.2e-16; accumulate 2: 5.6e-17). Each sample counts once in
    samples_seen (the old line, x.shape[0] x N per micro-step, counted the repeat: 124), and the global batch is
    every rank's."""
    out, results = uneven_job
    accumulate = 2 if scenario == "uneven_accumulate" else 1
    ref, ref_summary = uneven_single[accumulate]
    assert ref_summary["samples_seen"] == 2 * 61 and ref_summary["optimizer_steps"] == 8 // accumulate
    for r in results:  # every rank's counts
        assert r[scenario]["samples_seen"] == ref_summary["samples_seen"]
        assert r[scenario]["global_batch_size"] == ref_summary["global_batch_size"] == 20 * accumulate
        assert r[scenario]["optimizer_steps"] == ref_summary["optimizer_steps"]
    assert_cross_path_64(load_model_state(out / scenario / "run"), ref, f"ddp-mp 2 x 10 on 61 samples ({scenario})")
    for r in results:  # every rank's evaluation of the full validation set
        assert r[scenario]["final_val_acc"] == ref_summary["final_val_acc"]  # 15 samples, shards 8/7
        assert r[scenario]["final_val_loss"] == pytest.approx(ref_summary["final_val_loss"], rel=1e-9)


def test_ddp_mp_joins_with_ddp_py_s_group_flags_and_keeps_the_weights_under_ddp_s_knobs(uneven_job, uneven_single):
    """--backend gloo and --dist-timeout-s 120 reach init_process_group on every rank (the default: 1800 s), DDP's
    exact knobs reach the DDP over the split (its logging data: a 0.05 MiB bucket cap, views, static graph, the unused
    search), and the weights stay the single process's: 64-true within 1e-9 on the 61 samples above."""
    out, results = uneven_job
    ref, ref_summary = uneven_single[1]
    for r in results:
        assert r["knobs"]["group"] == {"backend": "gloo", "timeout_s": 120.0}
        assert r["uneven"]["group"]["timeout_s"] == 1800.0
        assert r["knobs"]["ddp"] == {"bucket_cap_bytes": int(0.05 * 2 ** 20), "gradient_as_bucket_view": 1,
                                     "static_graph": 1, "find_unused_parameters": 1}
        assert r["knobs"]["optimizer_steps"] == ref_summary["optimizer_steps"]
    assert_cross_path_64(load_model_state(out / "knobs" / "run"), ref, "ddp-mp 2 x 10 with DDP's exact knobs")


def test_ddp_mp_with_the_samplers_padding_fails_the_same_check(uneven_job, uneven_single):
    """The known-wrong variant: DistributedSampler's padding (pad=True), rank 1's last micro-batch a repeat of one of
    rank 0's samples, trains that sample twice: outside the bound by orders of magnitude (measured 0.13)."""
    out, _ = uneven_job
    ref, _ = uneven_single[1]
    padded = load_model_state(out / "padded" / "run")
    print(f"ddp-mp with pad=True vs one process: {max_param_diff(padded, ref):.3g}")
    with pytest.raises(AssertionError, match="64-true max abs diff"):
        assert_cross_path_64(padded, ref, "ddp-mp with pad=True on 61 samples")


def test_ddp_mp_each_local_rank_takes_its_own_pair(monkeypatch):
    """Rank r of a node takes entries 2r and 2r+1 of --devices (auto: cuda:2r, cuda:2r+1): 4 ranks on 8 GPUs share
    none. (This host is told it has 8 GPUs: device_groups only names them; auto reads torchrun's LOCAL_WORLD_SIZE.)"""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    as_torchrun_rank(monkeypatch, world_size=4)
    for devices in ("auto", cuda_list(8)):
        cfg = hybrid.HybridConfig(mode="ddp-mp", devices=devices)
        pairs = [cfg.device_groups(DistEnv(rank=r, local_rank=r, world_size=4, local_world_size=4, launched=True))
                 for r in range(4)]
        assert pairs == [([torch.device(f"cuda:{2 * r}")], [torch.device(f"cuda:{2 * r + 1}")]) for r in range(4)]


def test_defaults_are_model_parallel_task_and_budget():
    """launch/hybrid.py trains launch/model_parallel.py's model on its data (hybrid keeps its own copy of the dict)."""
    assert hybrid.DEFAULTS == model_parallel.DEFAULTS


# ---------------------------------------------------------------------- bad input
def test_bad_input_is_one_line(tmp_path, capsys, monkeypatch):
    from test_data_parallel import cuda_missing_line

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
        # launch/ddp.py's flags that do not apply: DDP's knobs under dp-mp, --sync-bn anywhere
        *[(knob, f"error: {knob[0]}: is a knob of DDP's all-reduce between processes; dp-mp is one process "
                 "(DataParallel inside each half), whose group of one sends nothing (allowed: --mode ddp-mp, or leave "
                 "it out)") for knob in (["--bucket-cap-mb", "1"], ["--gradient-as-bucket-view"], ["--static-graph"],
                                         ["--find-unused-parameters"], ["--comm-hook", "fp16"])],
        *[(mode + ["--sync-bn"], "error: --sync-bn: the hybrid's seq2seq has no BatchNorm layers to synchronise "
                                 "(allowed: leave it out)") for mode in ([], ["--mode", "ddp-mp"])],
        (["--mode", "ddp-mp", "--static-graph", "--accumulate", "2"], "error: --static-graph: with --accumulate 2 "
         "fails in torch 2.14: the first backward runs inside no_sync(), and DDP's static graph asserts "
         "(expect_autograd_hooks_; pytorch/pytorch#143580) (allowed: --accumulate 1, or leave it out)"),
        (["--mode", "ddp-mp", "--devices", "cpu,cpu", "--backend", "nccl"], "error: --backend: nccl needs CUDA "
                                                                            "devices; this run uses the CPU (allowed: "
                                                                            "auto, gloo)"),
    ]
    for argv, line in cases:
        out_dir = tmp_path / "never"
        rc = cli_run(hybrid.train, hybrid.HybridConfig, script="hybrid", argv=argv + ["--out-dir", str(out_dir)],
                     **hybrid.DEFAULTS)
        assert (rc, capsys.readouterr().err) == (2, line + "\n"), argv
        assert not out_dir.exists()
    # dp-mp is a single-process form: under torchrun (as a rank of 2) it is refused before anything starts
    as_torchrun_rank(monkeypatch, world_size=2)
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
    launcher = torchrun(2)
    result = run_script("hybrid", "--mode", "ddp-mp", "--batch-size", "10", "--out-dir", str(out_dir), *argv,
                        launcher=launcher, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ref, _ = train_state(single, Config, tmp_path, "s", device="cuda:0", **dict(SEQ, batch_size=20))
    assert max_param_diff(ref, load_model_state(out_dir)) < 1e-5
