"""Real text (manual_train/text.py): documents of every length, so samples carry different numbers of targets, and
every loop that trains the GPT weights each optimizer step by every target token of its window (data.Windows).

The proof is 64-true parity with single.py at the same global batch, two epochs on a slice of 49 samples (2 and 3
ranks divide neither it nor its windows; the 97 used until 2026-12-06 cost 1.3x the ranks' CPU and showed nothing
more: each bug below is 1e7 or more times the bound on either), on a GPT of 2 blocks (TEXT_LAYERS: what is weighed
is each target token, which no block's count changes; the pipeline's 2 stages get one block each), and the three
normalisation bugs of current training stacks fail the same check: each micro-batch's own token mean / K (the 2024
gradient-accumulation bug of HF transformers, PR 34191), each rank's own token mean (torchtitan #1842), and weighting
by samples (this repository's rule before the text).
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from conftest import (PARITY_TOL_64, assert_cross_path_64, assert_gpt_blocks, gpt_blocks, load_model_state, make_cfg,
                      max_param_diff, run_script)
from jobs import run_job
from manual_train import data, text
from manual_train.config import Config
from manual_train.loops import ddp, pipeline, single, tensor_parallel, zero

TEXT = dict(model="gpt", dataset="pydoc", block_size=16, text_samples=49, optimizer="sgd", lr=0.1, epochs=2,
            log_every=2, precision="64-true", eval_batch_size=16, limit_val_batches=2)  # 32 val samples: the sums
ACC = dict(batch_size=2, accumulate=2)  # per rank; the global batch is 2 x 2 x N
TEXT_LAYERS = 2  # the GPT's blocks in these runs (4 by default): the same proof at ~60% of the ranks' CPU
LOOPS = {"ddp": (ddp, ddp.DDPConfig), "zero": (zero, zero.ZeroConfig), "pipe": (pipeline, pipeline.PipelineConfig),
         "tp": (tensor_parallel, tensor_parallel.TensorParallelConfig)}
SCENARIOS = {  # name: (loop, flags, [world sizes]); every global batch is 8 at 2 and 4 ranks, 12 at 3
    "ddp": ("ddp", dict(batch_size=4), (2, 3)),
    "ddp_acc": ("ddp", ACC, (2, 3)),
    "fsdp2_acc": ("zero", dict(ACC, impl="torch", stage=3), (2, 3)),
    "pipe_uneven": ("pipe", dict(batch_size=8, microbatches=3), (2,)),  # micro-batches of 3, 3 and 2 rows
    "tp2_acc": ("tp", dict(batch_size=4, accumulate=2, tp=2), (2,)),
    "dp2tp2_acc": ("tp", dict(ACC, tp=2, dp=2), (4,)),
    "wrong_micro_batch_mean": ("ddp", ACC, (2,)),
    "wrong_rank_mean": ("ddp", ACC, (2,)),
    "wrong_sample_weights": ("ddp", ACC, (2,)),
}
COUNT = data.Windows.count


def per_micro_batch_mean(self, micro_step):
    """Each micro-batch's own token mean / K (HF transformers' accumulation bug)."""
    mine, _ = COUNT(self, micro_step)
    return mine, max(mine, 1) * self.accumulate * self.sampler.num_replicas  # weight 1/K (0 if empty)


def per_rank_mean(self, micro_step):
    """Each rank's own token mean over its window (torchtitan #1842), then DDP's average of the ranks."""
    first = micro_step // self.accumulate * self.accumulate
    own = sum(COUNT(self, k)[0] for k in range(first, first + self.accumulate))
    return COUNT(self, micro_step)[0], self.sampler.num_replicas * max(own, 1)  # (an empty window has weight 0)


def _scenario(name: str, world_size: int, rank: int, out: Path) -> dict:
    loop, flags, _ = SCENARIOS[name]
    module, config_cls = LOOPS[loop]
    with pytest.MonkeyPatch.context() as patch:
        gpt_blocks(patch, TEXT_LAYERS)
        if name == "wrong_micro_batch_mean":
            patch.setattr(data.Windows, "count", per_micro_batch_mean)
        if name == "wrong_rank_mean":
            patch.setattr(data.Windows, "count", per_rank_mean)
        if name == "wrong_sample_weights":  # every sample counted as block_size targets
            patch.setattr(data, "target_counts", lambda dataset: None)
        summary = module.train(make_cfg(out / name, config_cls, **TEXT, **flags))
    return {k: summary[k] for k in ("optimizer_steps", "samples_seen", "global_batch_size", "final_val_loss")}


def _job(tmp_path_factory, world_size: int) -> tuple[Path, list]:
    out = tmp_path_factory.mktemp(f"text{world_size}")
    names = [name for name, (_, _, sizes) in SCENARIOS.items() if world_size in sizes]
    return out, run_job(_scenario, world_size, out, names, ["manual_train.loops.ddp", "manual_train.loops.zero",
                                                             "manual_train.loops.pipeline",
                                                             "manual_train.loops.tensor_parallel"])


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """jobs(N): the N-rank job's (folder, every rank's results), run when a test first asks for it."""
    found: dict = {}
    return lambda world_size: found.get(world_size) or found.setdefault(world_size, _job(tmp_path_factory, world_size))


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    """single.py at the global batches of the jobs: 8 (2 and 4 ranks) and 12 (3 ranks)."""
    out = tmp_path_factory.mktemp("text_single")
    found = {}
    for batch in (8, 12):
        with pytest.MonkeyPatch.context() as patch:
            gpt_blocks(patch, TEXT_LAYERS)
            summary = single.train(make_cfg(out / str(batch), Config, **TEXT, batch_size=batch))
        found[batch] = load_model_state(out / str(batch) / "run"), summary
        assert_gpt_blocks(found[batch][0], TEXT_LAYERS)
    return found


def test_samples_carry_different_numbers_of_targets_and_every_byte_is_a_target_once():
    train, val, info = text.pydoc_datasets(32)
    docs = text.documents()
    assert len(train) + len(val) == sum(math.ceil(len(d) / 32) for d in docs.values())
    counts = train.targets_per_sample
    assert int(counts.sum()) + int(val.targets_per_sample.sum()) == sum(len(d) for d in docs.values())
    assert counts.min() >= 1 and len(set(counts.tolist())) > 10  # short last chunks of every length
    x, y = train[0]
    assert (x[1:][y[:-1] != -100] == y[:-1][y[:-1] != -100]).all()  # y is x shifted by one
    assert info.num_classes == text.VOCAB == 257 and x.shape == (32,)
    val_names = {name for name in docs if text.is_val(name)}
    assert 0 < len(val_names) < len(docs) / 4  # the split is by document
    again = text.pydoc_datasets(32)[0]
    assert torch.equal(again.x, train.x) and torch.equal(again.y, train.y)  # deterministic


def test_windows_count_every_ranks_targets_without_communication():
    """Rank r's count is the targets of the batch its loader yields; the ranks' counts add up to the window's (also
    with DistributedSampler's padding, whose repeats a loader yields too)."""
    train = text.pydoc_datasets(32, 97)[0]
    for world_size, batch, accumulate, pad in ((1, 8, 1, True), (2, 2, 2, False), (3, 4, 2, False), (2, 4, 3, True)):
        windows_total: dict = {}
        for rank in range(world_size):
            sampler = data.train_sampler(train, 5, world_size, rank, pad=pad)
            sampler.set_epoch(1)
            cfg = make_cfg(Path("/nonexistent"), Config, **dict(TEXT, batch_size=batch, accumulate=accumulate))
            windows = data.Windows(train, sampler, cfg)
            loader = data.build_loader(train, cfg, torch.device("cpu"), batch_size=batch, sampler=sampler)
            for k, (_, y) in enumerate(loader):
                mine, window = windows.count(k)
                assert mine == int((y != -100).sum())
                windows_total.setdefault(k // accumulate, [0, window])[0] += mine
        assert all(total == window for total, window in windows_total.values())


@pytest.mark.parametrize("name", [name for name in SCENARIOS if not name.startswith("wrong")])
def test_every_loop_trains_single_pys_weights_on_text(name, jobs, baselines):
    for world_size in SCENARIOS[name][2]:
        out, results = jobs(world_size)
        weights, summary = baselines[12 if world_size == 3 else 8]
        assert_cross_path_64(load_model_state(out / name / "run"), weights, f"{name} at {world_size} ranks on text")
        for r in results:  # every rank counted the same steps; the logged val loss per token is the baseline's
            assert r[name]["optimizer_steps"] == summary["optimizer_steps"]
            assert r[name]["global_batch_size"] == summary["global_batch_size"]
            assert abs(r[name]["final_val_loss"] - summary["final_val_loss"]) < PARITY_TOL_64


@pytest.mark.parametrize("name", [name for name in SCENARIOS if name.startswith("wrong")])
def test_the_three_normalisation_bugs_fail_the_same_check(name, jobs, baselines):
    out, _ = jobs(2)
    diff = max_param_diff(load_model_state(out / name / "run"), baselines[8][0])
    print(f"{name}: {diff:.3g} from single.py")
    with pytest.raises(AssertionError):
        assert_cross_path_64(load_model_state(out / name / "run"), baselines[8][0], name)


def test_a_language_models_numbers_are_per_byte(tmp_path):
    """Bits per byte and perplexity in metrics.csv, summary.json and the console; train accuracy per token."""
    result = run_script("single", "--model", "gpt", "--dataset", "pydoc", "--text-samples", "40",
                        "--block-size", "16", "--epochs", "1", "--batch-size", "8", "--limit-val-batches", "1", "--out-dir", str(tmp_path / "r"))
    assert result.returncode == 0, result.stderr
    summary = __import__("json").loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["final_val_bpb"] == pytest.approx(summary["final_val_loss"] / math.log(2), rel=1e-12)
    assert summary["final_val_ppl"] == pytest.approx(math.exp(summary["final_val_loss"]), rel=1e-12)
    header = (tmp_path / "r" / "metrics.csv").read_text().splitlines()[0]
    assert header.endswith(",bpb,ppl")
    assert "val_bpb" in result.stdout


@pytest.mark.parametrize("args, expect", [
    (("--model", "gpt", "--dataset", "pydoc", "--block-size", "0"), "--block-size"),
    (("--model", "cnn", "--dataset", "pydoc"), "not a language model"),
    (("--model", "seq2seq", "--dataset", "pydoc"), "seq2seq needs --dataset reverse"),
])
def test_bad_text_flags_are_one_line(tmp_path, args, expect):
    result = run_script("single", *args, "--out-dir", str(tmp_path / "r"))
    assert result.returncode == 2 and expect in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists()


@pytest.mark.parametrize("topics, expect", [(None, "has no pydoc_data module"), ("topics = {}\n", "holds no text")])
def test_a_missing_or_empty_pydoc_data_is_one_line(tmp_path, topics, expect):
    """A Python packaged without pydoc_data (some distributions split it off), or one whose topics are empty."""
    fake = tmp_path / "fake" / "pydoc_data"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    if topics is not None:
        (fake / "topics.py").write_text(topics)
    result = run_script("single", "--model", "gpt", "--dataset", "pydoc", "--out-dir", str(tmp_path / "r"),
                        env={"PYTHONPATH": str(tmp_path / "fake")})
    assert result.returncode == 2 and expect in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists()


def test_a_datasets_labels_are_not_taken_for_target_counts(tmp_path):
    """torchvision's MNIST keeps its labels in a tensor named `targets`: they must not be read as each sample's
    number of targets (that weighted every sample by its label, and a 0 by nothing). Only `targets_per_sample` is."""
    from idx import write_tiny_mnist

    cfg = make_cfg(tmp_path, dataset="mnist", data_root=str(write_tiny_mnist(tmp_path / "data")), model="mlp",
                   batch_size=32)
    train, _, _ = data.build_datasets(cfg)
    assert isinstance(train.targets, torch.Tensor) and data.target_counts(train) is None
    sampler = data.train_sampler(train, cfg.seed)
    sampler.set_epoch(0)
    assert data.Windows(train, sampler, cfg).count(0) == (32, 32)  # one target per sample
