"""python -m manual_train.evaluate: any loop's checkpoint, val or test, exact sums, sharded under torchrun."""
from __future__ import annotations

import json
import subprocess

import pytest
import torch
from conftest import REPO, make_cfg, torchrun
from idx import write_tiny_mnist
from torch.utils.data import DataLoader

from manual_train import data
from manual_train.evaluate import main
from manual_train.loops import data_parallel, single
from manual_train.models import build_model


def evaluated(capsys, *argv) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A short 64-true mlp run on digits: its last.pt and its summary."""
    tmp = tmp_path_factory.mktemp("trained")
    summary = single.train(make_cfg(tmp, model="mlp", max_steps=20, precision="64-true", eval_batch_size=100))
    return tmp / "run" / "last.pt", summary


def test_evaluates_the_checkpoint_exactly(trained, capsys):
    path, summary = trained
    result = evaluated(capsys, "--checkpoint", str(path), "--eval-batch-size", "100")
    assert result["samples"] == 297 and result["step"] == 20 and result["precision"] == "64-true"
    assert result["loss"] == pytest.approx(summary["final_val_loss"], abs=1e-12)  # the run's own last evaluation
    assert result["acc"] == summary["final_val_acc"]
    # known-wrong: the mean of per-batch mean losses (batches of 100, 100, 97) is another number
    cfg = make_cfg(path.parent, out_dir=str(path.parent / "x"), model="mlp")
    _, val_ds, info = data.build_datasets(cfg)
    model = build_model("mlp", info).double().eval()
    model.load_state_dict(torch.load(path, weights_only=True)["model"])
    with torch.no_grad():
        means = [torch.nn.functional.cross_entropy(model(x.double()), y).item()
                 for x, y in DataLoader(val_ds, batch_size=100)]
    assert abs(sum(means) / len(means) - result["loss"]) > 1e-6


def test_a_data_parallel_checkpoint_loads_into_the_plain_model(tmp_path, capsys):
    summary = data_parallel.train(make_cfg(tmp_path, data_parallel.DataParallelConfig, model="mlp", max_steps=5,
                                           devices="cpu,cpu", impl="explicit"))
    result = evaluated(capsys, "--checkpoint", str(tmp_path / "run" / "last.pt"))
    assert result["loss"] == pytest.approx(summary["final_val_loss"], rel=1e-6)


def test_test_split_of_mnist_and_none_for_digits(trained, tmp_path, capsys):
    root = write_tiny_mnist(tmp_path / "data")
    single.train(make_cfg(tmp_path, dataset="mnist", data_root=str(root), model="mlp", max_steps=3))
    result = evaluated(capsys, "--checkpoint", str(tmp_path / "run" / "last.pt"), "--split", "test")
    assert result["samples"] == 64  # the t10k files
    assert main(["--checkpoint", str(trained[0]), "--split", "test"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --split: digits has no test set (its 1797 images are split 1500 train / 297 val) " \
                  "(allowed: val)\n"


@pytest.mark.parametrize("argv,flag", [([], "--checkpoint"), (["--checkpoint", "/no/such.pt"], "--checkpoint"),
                                       (["--checkpoint", "x.pt", "--split", "train"], "--split"),
                                       (["--checkpoint", "x.pt", "--eval-batch-size", "0"], "--eval-batch-size"),
                                       (["--checkpoint", "x.pt", "--precision", "16-o2"], "--precision")])
def test_bad_input_is_one_line(argv, flag, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.pt").write_bytes(b"not a checkpoint")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {flag}: ") and "Traceback" not in err


def test_under_torchrun_the_sharded_sums_are_the_whole_sets(trained):
    path, summary = trained
    proc = subprocess.run(torchrun(2) + ["-m", "manual_train.evaluate", "--checkpoint", str(path), "--json",
                                         "--eval-batch-size", "64"],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 0 alone prints
    result = json.loads(lines[0])
    assert result["world_size"] == 2 and result["samples"] == 297  # 149 + 148: no padding, no repeats
    assert result["loss"] == pytest.approx(summary["final_val_loss"], rel=1e-12)


def test_help(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--checkpoint PATH" in out and "--split {val,test}" in out
