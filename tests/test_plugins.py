"""Your own model and dataset (manual_train/plugins.py, docs/your-model.md): --model/--dataset PACKAGE.MODULE:CALLABLE.

What is proven here:
  parity ............. the example model (manual_train.examples.tiny_vit) on a plug-in dataset of 61 digits (odd: 2
                       ranks' shards are 31 and 30) trains single.py's weights in 64-true within 1e-9 over 2 epochs
                       under DDP, ZeRO-1, FSDP2 (stage 3, each ViT block its own unit) and fairscale stage 2, 2 ranks
                       on gloo, and under launch/data_parallel.py's DataParallel over two CPU replicas; FSDP2 that shards the plug-in's units but sums the ranks' gradients (divide factor 1)
                       fails the same check
  ImageFolder ........ PNG files written here are read by manual_train.examples.image_folder with the values written,
                       train through single.py, and `python -m manual_train.evaluate` rebuilds the plug-ins from the
                       checkpoint's config and gets the run's own validation loss
  bad plug-ins ....... each is one `error: --flag: ...` line, exit status 2, no folder written; an exception inside
                       the user's own code propagates as theirs (their traceback, a note naming the spec, exit 1)
  resume ............. a checkpoint trained with one --model spec refuses another
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import REPO, assert_cross_path_64, load_model_state, make_cfg, max_param_diff, train_state
from jobs import run_job

from manual_train import evaluate, zero as zero_impl
from manual_train.cli import run
from manual_train.config import Config, UsageError, parse_config
from manual_train.examples import tiny_vit
from manual_train.loops import ddp, single, zero

VIT = "manual_train.examples.tiny_vit:build"
FOCAL = "manual_train.examples.focal_loss:focal_loss"  # every run here trains with a plug-in loss too
ODD = "test_plugins:odd_digits"  # this module, importable by that name in pytest's process and in the job's ranks
FLAGS = dict(model=VIT, dataset=ODD, loss=FOCAL, precision="64-true", optimizer="sgd", lr=0.1, epochs=2, log_every=2,
             eval_batch_size=16)
RANKS, BATCH, ACCUMULATE = 2, 2, 2  # global batch 8: 8 steps an epoch, the last window 5 samples
SCENARIOS = {
    "ddp": (ddp, ddp.DDPConfig, {}),
    "zero1": (zero, zero.ZeroConfig, dict(impl="torch", stage=1)),
    "fsdp2": (zero, zero.ZeroConfig, dict(impl="torch", stage=3)),
    "fairscale2": (zero, zero.ZeroConfig, dict(impl="fairscale", stage=2)),
    "wrong_fsdp2_undivided": (zero, zero.ZeroConfig, dict(impl="torch", stage=3)),
}


# ---------------------------------------------------------------------- plug-ins of this test, right and wrong
def odd_digits(cfg):
    """A plug-in dataset: the first 61 training digits and 15 validation ones, info as a dict."""
    from manual_train.data import load_digits_split

    train, val = load_digits_split()
    return (torch.utils.data.Subset(train, range(61)), torch.utils.data.Subset(val, range(15)),
            dict(num_classes=10, input_shape=(1, 8, 8)))


def deeper_vit(info):
    return tiny_vit.TinyViT(*info.input_shape, info.num_classes, depth=3)


NOT_CALLABLE = 3


def returns_str(info):
    return "a model"


def wrong_classes(info):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 3))


def wrong_input(info):
    return nn.Sequential(nn.Flatten(), nn.Linear(10, info.num_classes))


def raises(info):
    raise ZeroDivisionError("a bug in the user's model")


def loss_per_sample(logits, y, reduction="mean"):  # no reduction: one loss per sample
    return torch.nn.functional.cross_entropy(logits, y, reduction="none")


def loss_ignores_reduction(logits, y, reduction="mean"):  # evaluation would add means, not sums
    return torch.nn.functional.cross_entropy(logits, y)


def loss_detached(logits, y, reduction="mean"):
    return torch.nn.functional.cross_entropy(logits.detach(), y, reduction=reduction)


def loss_two_arguments(logits, y):
    return torch.nn.functional.cross_entropy(logits, y)


def returns_list(cfg):
    return [1, 2]


def info_lacks_classes(cfg):
    train, val, _ = odd_digits(cfg)
    return train, val, dict(input_shape=(1, 8, 8))


# ---------------------------------------------------------------------- parity: the job and the baseline
def undivided(real):
    """FSDP2 over the plug-in's units (fully_shard_units: each ViT block, then the root), reduce-scattering the
    gradients summed over the ranks instead of averaged: every step N times too long."""
    from torch.distributed.fsdp import FSDPModule

    def shard_units(raw_model, mesh, cfg, mp_policy=None):
        real(raw_model, mesh, cfg, mp_policy)
        for unit in raw_model.modules():
            if isinstance(unit, FSDPModule):
                unit.set_gradient_divide_factor(1.0)
    return shard_units


def _scenario(name: str, world_size: int, rank: int, out: Path) -> dict:
    module, config_cls, flags = SCENARIOS[name]
    with pytest.MonkeyPatch.context() as patch:
        if name == "wrong_fsdp2_undivided":
            patch.setattr(zero_impl, "fully_shard_units", undivided(zero_impl.fully_shard_units))
        summary = module.train(make_cfg(out / name, config_cls, **FLAGS, batch_size=BATCH, accumulate=ACCUMULATE,
                                        dist_timeout_s=120, **flags))
    return {k: summary[k] for k in ("optimizer_steps", "samples_seen", "final_val_loss")}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("plugins2")
    return out, run_job(_scenario, RANKS, out, list(SCENARIOS), ["manual_train.loops.ddp", "manual_train.loops.zero",
                                                                 "manual_train.examples.tiny_vit"])


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    out = tmp_path_factory.mktemp("plugins_single")
    summary = single.train(make_cfg(out, Config, **FLAGS, batch_size=RANKS * BATCH * ACCUMULATE))
    return load_model_state(out / "run"), summary


@pytest.mark.parametrize("name", [name for name in SCENARIOS if not name.startswith("wrong")])
def test_the_example_model_trains_single_pys_weights_in_every_data_parallel_loop(name, job, baseline):
    out, results = job
    weights, summary = baseline
    assert summary["samples_seen"] == 2 * 61 and summary["optimizer_steps"] == 16
    assert_cross_path_64(load_model_state(out / name / "run"), weights, f"{name}: tiny_vit on 61 digits, 2 ranks")
    for r in results:
        assert r[name]["optimizer_steps"] == summary["optimizer_steps"]
        assert r[name]["samples_seen"] == summary["samples_seen"]
        assert abs(r[name]["final_val_loss"] - summary["final_val_loss"]) < 1e-9


def test_the_example_model_trains_single_pys_weights_under_data_parallel(tmp_path, baseline):
    """launch/data_parallel.py's hand-written DataParallel (replicate, scatter, parallel_apply, gather) over two CPU devices."""
    from manual_train.loops import data_parallel

    weights, _ = train_state(data_parallel, data_parallel.DataParallelConfig, tmp_path, "dp", impl="explicit",
                             devices="cpu,cpu", **FLAGS, batch_size=RANKS * BATCH * ACCUMULATE)
    assert_cross_path_64(weights, baseline[0], "dp: tiny_vit on 61 digits, 2 CPU replicas")


def test_fsdp2_of_the_plugin_without_the_gradient_division_fails_the_same_check(job, baseline):
    out, _ = job
    weights = load_model_state(out / "wrong_fsdp2_undivided" / "run")
    print(f"wrong_fsdp2_undivided: {max_param_diff(weights, baseline[0]):.3g} from single.py")
    with pytest.raises(AssertionError):
        assert_cross_path_64(weights, baseline[0], "wrong_fsdp2_undivided")


def test_fsdp2_shards_each_block_of_the_example_as_its_own_unit():
    from manual_train.models import DataInfo
    from manual_train.sharding import blocks

    model = tiny_vit.build(DataInfo("digits", (1, 8, 8), 10))
    assert [getattr(parent, name) for parent, name in blocks(model)] == list(model.blocks)


# ---------------------------------------------------------------------- a folder of PNG files
def _write_pngs(root: Path) -> dict:
    from PIL import Image

    rng = np.random.default_rng(0)
    written = {}
    for split, per_class in (("train", 5), ("val", 2)):
        for label, cls in enumerate(("ants", "bees", "cats")):
            (root / split / cls).mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / cls / f"{i}.png")
                written[(split, cls, i)] = pixels
    return written


def test_an_image_folder_of_pngs_trains_through_single_and_evaluates_from_its_checkpoint(tmp_path, capsys):
    from manual_train.examples import image_folder

    written = _write_pngs(tmp_path / "images")
    train, val, info = image_folder.build(make_cfg(tmp_path, data_root=str(tmp_path / "images")))
    assert info == dict(num_classes=3, input_shape=(3, 8, 8)) and (len(train), len(val)) == (15, 6)
    x, y = train[5]  # sorted: ants 0-4, bees 0-4, ...
    assert y == 1
    expected = torch.from_numpy(written[("train", "bees", 0)]).permute(2, 0, 1) / 255 * 2 - 1
    torch.testing.assert_close(x, expected.float())
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MANUAL_TRAIN_GRAYSCALE", "1")
        assert image_folder.build(make_cfg(tmp_path, data_root=str(tmp_path / "images")))[2]["input_shape"] == (1, 8, 8)

    out = tmp_path / "run"
    argv = ["--model", VIT, "--dataset", "manual_train.examples.image_folder:build", "--data-root",
            str(tmp_path / "images"), "--loss", FOCAL, "--precision", "64-true", "--epochs", "2", "--batch-size", "4",
            "--out-dir",
            str(out), "--no-progress"]
    assert run(single.train, script="single", argv=argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["samples_seen"] == 30 and summary["optimizer_steps"] == 8
    capsys.readouterr()
    assert evaluate.main(["--checkpoint", str(out / "last.pt"), "--json", "--eval-mode", "no_grad"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["samples"] == 6
    assert abs(result["loss"] - summary["final_val_loss"]) < 1e-9


# ---------------------------------------------------------------------- bad plug-ins: one line, exit 2
BAD = [
    (["--model", "no_such_module_xyz:build"], "error: --model: cannot import no_such_module_xyz"),
    (["--model", "manual_train.examples.tiny_vit:nope"], "error: --model: manual_train.examples.tiny_vit has no "
                                                         "attribute 'nope'"),
    (["--model", "manual_train.examples.tiny_vit:"], "error: --model: 'manual_train.examples.tiny_vit:' is not a "
                                                     "plug-in spec"),
    (["--model", "test_plugins:NOT_CALLABLE"], "error: --model: test_plugins:NOT_CALLABLE is not callable"),
    (["--model", "test_plugins:returns_str"], "error: --model: test_plugins:returns_str returned a str, not a "
                                              "torch.nn.Module"),
    (["--model", "test_plugins:wrong_classes"], "error: --model: test_plugins:wrong_classes returned (1, 3) for one "
                                                "sample; the loss needs logits of shape (1, 10)"),
    (["--model", "test_plugins:wrong_input"], "error: --model: test_plugins:wrong_input cannot take digits's samples "
                                              "of shape (1, 8, 8)"),
    (["--model", VIT, "--dropout", "0.1"], "error: --dropout: a plug-in model builds its own dropout"),
    (["--dataset", "test_plugins:returns_list"], "error: --dataset: test_plugins:returns_list returned a list, not "
                                                 "(train, val, info)"),
    (["--dataset", "test_plugins:info_lacks_classes"], "error: --dataset: test_plugins:info_lacks_classes's info dict "
                                                       "lacks num_classes"),
    (["--dataset", "manual_train.examples.image_folder:build", "--data-root", "."], "error: --data-root: train is "
                                                                                   "not a folder"),
    (["--model", "mlp_typo"], "error: --model: invalid choice: 'mlp_typo'"),
    (["--loss", "test_plugins:nope"], "error: --loss: test_plugins has no attribute 'nope'"),
    (["--loss", "test_plugins:loss_per_sample"], "error: --loss: test_plugins:loss_per_sample returned shape (2,) "
                                                 "for reduction='mean', not a 0-d float tensor"),
    (["--loss", "test_plugins:loss_ignores_reduction"], "error: --loss: test_plugins:loss_ignores_reduction's sum "),
    (["--loss", "test_plugins:loss_detached"], "error: --loss: test_plugins:loss_detached's result has no gradient"),
    (["--loss", "test_plugins:loss_two_arguments"], "error: --loss: test_plugins:loss_two_arguments cannot be called "
                                                    "as loss(logits, y, reduction='sum')"),
]


@pytest.mark.parametrize("argv,expect", BAD, ids=[a[-1] if a[-1] != "." else "empty_folder" for a, _ in BAD])
def test_a_bad_plugin_is_one_line_exit_2_and_nothing_written(argv, expect, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --data-root . : a folder without train/
    out = tmp_path / "run"
    assert run(single.train, script="single", argv=[*argv, "--out-dir", str(out), "--epochs", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(expect) and len(err.splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.parametrize("config_cls_path,what", [
    ("manual_train.model_parallel:ModelParallelConfig", "model parallelism splits seq2seq's encoder and decoder"),
    ("manual_train.hybrid:HybridConfig", "the hybrid splits seq2seq's encoder and decoder"),
    ("manual_train.pipeline:PipelineConfig", "the pipeline splits the GPT's blocks"),
    ("manual_train.tensor_parallel:TensorParallelConfig", "tensor parallelism splits the GPT's attention and MLP")])
def test_the_splitting_loops_refuse_a_plugin_model_naming_what_it_lacks(config_cls_path, what, monkeypatch):
    import importlib

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    module, cls = config_cls_path.split(":")
    with pytest.raises(UsageError) as e:
        parse_config(getattr(importlib.import_module(module), cls), ["--model", VIT, "--dataset", "digits"])
    assert e.value.flag == "--model" and what in str(e.value) and VIT in str(e.value)


def test_an_exception_inside_the_users_code_is_theirs(tmp_path):
    """Not our one-line bad-input error: their traceback, a note naming the spec, exit status 1, no folder."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "single.py"), "--model", "test_plugins:raises",
                           "--out-dir", str(out)], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO / "tests")})
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" in proc.stderr and 'in raises\n    raise ZeroDivisionError' in proc.stderr
    assert "ZeroDivisionError: a bug in the user's model" in proc.stderr
    assert "raised in your code while calling --model test_plugins:raises" in proc.stderr
    assert "error: --model" not in proc.stderr and not out.exists()


def test_a_resume_with_another_model_spec_is_refused(tmp_path, capsys):
    first = tmp_path / "first"
    common = ["--dataset", ODD, "--precision", "64-true", "--epochs", "2", "--max-steps", "3", "--batch-size", "8",
              "--no-progress"]
    assert run(single.train, script="single", argv=["--model", VIT, *common, "--out-dir", str(first)]) == 0
    capsys.readouterr()
    second = tmp_path / "second"
    status = run(single.train, script="single", argv=["--model", "test_plugins:deeper_vit", *common, "--resume",
                                                      str(first / "last.pt"), "--out-dir", str(second)])
    err = capsys.readouterr().err.strip()
    assert status == 2 and err == (f"error: --resume: checkpoint was trained with --model {VIT}, this run has "
                                   "test_plugins:deeper_vit"), err
    assert not second.exists()


def test_the_loss_plugin_is_the_one_trained_and_evaluated_with(tmp_path):
    """The run's validation loss is the focal loss of its final weights, not their cross-entropy (both loops' lines,
    training and evaluation, call the plug-in), and the pipeline, which has its own loss shares, refuses it."""
    from manual_train import data, models
    from manual_train.evaluation import evaluate as evaluate_sums
    from manual_train.examples.focal_loss import focal_loss
    from manual_train.pipeline import PipelineConfig
    from manual_train.precision import CastInputs

    cfg = make_cfg(tmp_path, loss=FOCAL, precision="64-true", max_steps=3)
    summary = single.train(cfg)
    model = models.build_model_from(cfg, data.build_datasets(cfg)[2]).double()
    model.load_state_dict(load_model_state(tmp_path / "run"))
    loader = data.build_loader(data.build_datasets(cfg)[1], cfg, torch.device("cpu"), batch_size=64)
    means = {}
    for name, criterion in (("focal", focal_loss), ("cross-entropy", models.loss_fn)):
        loss_sum, _, count = evaluate_sums(CastInputs(model), loader, torch.device("cpu"), criterion=criterion)
        means[name] = (loss_sum / count).item()
    assert abs(summary["final_val_loss"] - means["focal"]) < 1e-9 < abs(means["focal"] - means["cross-entropy"])
    with pytest.raises(UsageError) as e:
        parse_config(PipelineConfig, ["--model", "gpt", "--dataset", "reverse", "--loss", FOCAL])
    assert e.value.flag == "--loss"
