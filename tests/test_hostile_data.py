"""Hostile data: corrupt MNIST-format files under --data-root, and model/shape combinations that cannot run.

Each is refused through the real CLI entry (manual_train.cli.run) as one line `error: --flag: ...` on stderr,
exit status 2, before the banner (nothing on stdout), with nothing written: no out-dir, no byte changed under
--data-root. Before, these were tracebacks: at load (AssertionError, ValueError), or mid-epoch (IndexError,
`Target 200 is out of bounds`, the cnn's max-pool on a 1x1 image), or silently ignored (surplus labels).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_cfg
from idx import read_idx, write_idx_images, write_idx_labels, write_tiny_mnist

from manual_train import data, models
from manual_train.cli import run
from manual_train.config import Config, UsageError
from manual_train.loops import data_parallel, ddp, single

IMAGES, LABELS = "train-images-idx3-ubyte", "train-labels-idx1-ubyte"
VAL_IMAGES, VAL_LABELS = "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"


def snapshot(root: Path) -> dict:
    return {p: p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def refused(capsys, tmp_path: Path, argv: list, train=single.train, config_cls=Config, script="single",
            **defaults) -> str:
    """Run the CLI entry; assert the contract (exit 2, one line, no traceback, no banner, no out-dir); the line."""
    out = tmp_path / "run"
    code = run(train, config_cls, script=script, argv=[*argv, "--out-dir", str(out), "--no-progress"], **defaults)
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert "Traceback" not in captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert captured.out == "", "refused before the banner"
    assert not out.exists(), "nothing written"
    return lines[0]


# ---------------------------------------------------------------------- corrupt IDX files
def relabel(name: str, change):
    def corrupt(raw: Path):
        labels = read_idx(raw / name)
        write_idx_labels(raw / name, change(labels))
    return corrupt


def out_of_range(labels):
    labels[17] = 200
    return labels


# (id, the file at fault, how to corrupt the raw folder, what the line says after "<file>: ")
CORRUPT = [
    ("images-file-with-label-magic", IMAGES,
     lambda raw: write_idx_images(raw / IMAGES, read_idx(raw / IMAGES), magic=2049),
     "wrong magic number 2049 (an IDX image file starts with 2051)"),
    ("val-labels-file-with-image-magic", VAL_LABELS,
     lambda raw: write_idx_labels(raw / VAL_LABELS, read_idx(raw / VAL_LABELS), magic=2051),
     "wrong magic number 2051 (an IDX label file starts with 2049)"),
    ("zero-byte-images-file", IMAGES, lambda raw: (raw / IMAGES).write_bytes(b""),
     "is empty (0 bytes; an IDX image file starts with a 16-byte header)"),
    ("header-cut-short", VAL_IMAGES, lambda raw: (raw / VAL_IMAGES).write_bytes((raw / VAL_IMAGES).read_bytes()[:6]),
     "is truncated: 6 bytes, shorter than its 16-byte header"),
    ("truncated-images-file", IMAGES,
     lambda raw: (raw / IMAGES).write_bytes((raw / IMAGES).read_bytes()[:-1000]),
     f"truncated: {16 + 256 * 784 - 1000} bytes, but its header promises 256 images of 28x28 ({16 + 256 * 784} bytes)"),
    ("trailing-bytes-on-labels", LABELS, lambda raw: (raw / LABELS).write_bytes((raw / LABELS).read_bytes() + b"\0\0"),
     "has trailing bytes: 266 bytes, but its header promises 256 labels (264 bytes)"),
    ("fewer-labels-than-images", LABELS, relabel(LABELS, lambda y: y[:250]),
     "holds 250 labels, but {raw}/" + IMAGES + " holds 256 images (one label per image)"),
    ("more-labels-than-images", VAL_LABELS, relabel(VAL_LABELS, lambda y: np.concatenate([y, y[:3]])),
     "holds 67 labels, but {raw}/" + VAL_IMAGES + " holds 64 images (one label per image)"),
    ("label-out-of-range", LABELS, relabel(LABELS, out_of_range),
     "label 200 (sample 17) is out of range for {dataset}'s 10 classes (allowed: 0..9)"),
    ("images-of-another-size", VAL_IMAGES,
     lambda raw: write_idx_images(raw / VAL_IMAGES, np.zeros((64, 32, 32))),
     "images are 32x32, {dataset}'s are 28x28"),
    ("no-images", IMAGES, lambda raw: (write_idx_images(raw / IMAGES, np.zeros((0, 28, 28))),
                                       write_idx_labels(raw / LABELS, np.zeros(0))),
     "holds no images"),
]
DATASETS = [("mnist", "MNIST"), ("fashion-mnist", "FashionMNIST")]


@pytest.mark.parametrize("dataset,folder", DATASETS, ids=[d for d, _ in DATASETS])
@pytest.mark.parametrize("name,bad_file,corrupt,what", CORRUPT, ids=[c[0] for c in CORRUPT])
def test_corrupt_idx_file_is_one_line_naming_the_file(tmp_path, capsys, dataset, folder, name, bad_file, corrupt,
                                                      what):
    root = write_tiny_mnist(tmp_path / "data", folder=folder)
    raw = root / folder / "raw"
    corrupt(raw)
    before = snapshot(root)
    line = refused(capsys, tmp_path, ["--dataset", dataset, "--data-root", str(root), "--model", "mlp"])
    assert line == f"error: --data-root: {raw / bad_file}: {what.format(raw=raw, dataset=dataset)}"
    assert snapshot(root) == before, "nothing written under --data-root"


def test_missing_file_names_it_and_says_how_to_fix_it(tmp_path, capsys):
    root = write_tiny_mnist(tmp_path / "data")
    (root / "MNIST" / "raw" / VAL_LABELS).unlink()
    line = refused(capsys, tmp_path, ["--dataset", "mnist", "--data-root", str(root)])
    assert line == (f"error: --data-root: no usable mnist data under {root}; pass --download to fetch it "
                    f"({root / 'MNIST' / 'raw' / VAL_LABELS} is missing)")


@pytest.mark.parametrize("split", ["train", "t10k"])
def test_a_missing_file_of_either_split_is_the_one_named(tmp_path, capsys, split):
    """torchvision wants all four files whichever split it loads: the one named is the one missing, train's too."""
    root = write_tiny_mnist(tmp_path / "data")
    missing = root / "MNIST" / "raw" / f"{split}-images-idx3-ubyte"
    missing.unlink()
    line = refused(capsys, tmp_path, ["--dataset", "mnist", "--data-root", str(root)])
    assert line.endswith(f"({missing} is missing)"), line


def test_a_multi_line_loader_error_keeps_its_first_and_last_lines():
    assert data._one_line(RuntimeError("Error downloading x:\n  first cause\n  [Errno 101] unreachable")) == \
        "RuntimeError: Error downloading x: [Errno 101] unreachable"
    assert data._one_line(OSError("one line")) == "OSError: one line"
    assert data._one_line(ValueError("")) == "ValueError"


def _runtime(text: str) -> str:
    """The flag's value as a string built at run time, as sys.argv's are (a literal in a test is interned, so code
    comparing with `is` would pass here and fail from the command line)."""
    return "".join(list(text))


@pytest.mark.parametrize("dataset, cls, mean, std", [("mnist", "MNIST", 0.1307, 0.3081),
                                                     ("fashion-mnist", "FashionMNIST", 0.2860, 0.3530)])
def test_mnist_and_fashion_mnist_read_their_own_folder_and_normalize_with_their_own_statistics(tmp_path, dataset, cls,
                                                                                                mean, std):
    root = write_tiny_mnist(tmp_path / "data", folder=cls)
    raw = read_idx(root / cls / "raw" / "train-images-idx3-ubyte")
    train_ds, val_ds, info = data.build_datasets(make_cfg(tmp_path, dataset=_runtime(dataset), data_root=str(root)))
    assert type(train_ds).__name__ == cls and info == models.DataInfo(dataset, (1, 28, 28), 10)
    x, _ = train_ds[0]
    torch.testing.assert_close(x[0], (torch.tensor(raw[0], dtype=torch.float32) / 255 - mean) / std)


def write_tiny_cifar(root: Path, per_batch: int = 4) -> Path:
    """CIFAR-10's python files (5 training batches, a test batch, the meta file) holding a uniform grey 32x32 image
    per sample, labels 0, 1, 2, ..."""
    import pickle

    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": np.full((per_batch, 3 * 32 * 32), 200, np.uint8), "labels": list(range(per_batch))}
        (folder / name).write_bytes(pickle.dumps(batch))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [f"class {i}" for i in range(10)]}))
    return root


def test_cifar10_is_read_by_torchvision_normalized_and_its_crops_pad_4_pixels_per_sample(tmp_path, monkeypatch):
    """cifar10 through torchvision's own reader (only its MD5 check, of the real files' digests, is bypassed): the
    validation images normalized with cifar10's per-channel statistics; the training set wrapped in PerSampleRNG
    (its crops and flips a function of the sample), whose random crops show at most 4 pixels of zero padding on a
    side, and all 4 in some draws."""
    import torchvision.datasets.cifar

    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *args, **kwargs: True)
    root = write_tiny_cifar(tmp_path / "data")
    train_ds, val_ds, info = data.build_datasets(make_cfg(tmp_path, dataset=_runtime("cifar10"), data_root=str(root),
                                                          model="mlp"))
    assert isinstance(train_ds, data.PerSampleRNG) and not isinstance(val_ds, data.PerSampleRNG)
    # the wrapper passes on the wrapped set's attributes (CIFAR10's classes, data, targets)
    assert (train_ds.classes[:2], len(train_ds.data), train_ds.targets[:5]) == (["class 0", "class 1"], 20,
                                                                                [0, 1, 2, 3, 0])
    assert (len(train_ds), len(val_ds), info) == (20, 4, models.DataInfo("cifar10", (3, 32, 32), 10))
    mean, std = torch.tensor([0.4914, 0.4822, 0.4465]), torch.tensor([0.2470, 0.2435, 0.2616])
    x, y = val_ds[1]
    assert y == 1
    torch.testing.assert_close(x, ((200 / 255 - mean) / std).view(3, 1, 1).expand(3, 32, 32))
    padding = (-mean / std)[0]  # a zero pixel of the padding, normalized (channel 0)
    widths = []
    for epoch in range(5):
        train_ds.set_epoch(epoch)
        for i in range(len(train_ds)):
            x, _ = train_ds[i]
            border = (x[0] - padding).abs() < 1e-5
            rows, cols = border.all(1), border.all(0)
            widths += [int(rows[:8].sum()), int(rows[-8:].sum()), int(cols[:8].sum()), int(cols[-8:].sum())]
    assert max(widths) == 4, sorted(set(widths))
    again = data.build_datasets(make_cfg(tmp_path, dataset="cifar10", data_root=str(root), model="mlp"))[0]
    again.set_epoch(4)
    assert torch.equal(again[3][0], train_ds[3][0])  # the same sample, epoch and seed: the same crop


def test_intact_files_pass_the_checks(tmp_path):
    """The control: the same tiny files, uncorrupted, load (the checks refuse the corruption, not the files)."""
    root = write_tiny_mnist(tmp_path / "data")
    train_ds, val_ds, info = data.build_datasets(make_cfg(tmp_path, dataset="mnist", data_root=str(root)))
    assert (len(train_ds), len(val_ds), info.input_shape, info.num_classes) == (256, 64, (1, 28, 28), 10)
    x, y = train_ds[0]
    assert x.shape == (1, 28, 28) and 0 <= y < 10


# ---------------------------------------------------------------------- model/shape combinations
SMALL = "(allowed: H and W >= 2 for --model cnn, or --model mlp, or --model resnet18)"


@pytest.mark.parametrize("shape", ["1,1,1", "3,1,8", "3,8,1"])
def test_synthetic_shape_too_small_for_the_cnn_is_one_line(tmp_path, capsys, shape):
    line = refused(capsys, tmp_path, ["--dataset", "synthetic", "--synthetic-shape", shape, "--model", "cnn"])
    assert line.startswith(f"error: --synthetic-shape: {shape} is too small for --model cnn (one forward pass fails: ")
    assert line.endswith(SMALL)


LOOPS = [
    (data_parallel.train, data_parallel.DataParallelConfig, "data_parallel", ["--devices", "cpu,cpu"], {}),
    (ddp.train, ddp.DDPConfig, "ddp", [], ddp.DEFAULTS),
]


@pytest.mark.parametrize("train,config_cls,script,extra,defaults", LOOPS, ids=[s for _, _, s, _, _ in LOOPS])
def test_every_loop_refuses_before_its_banner(tmp_path, capsys, lone_process, train, config_cls, script, extra,
                                              defaults):
    """build_datasets is shared: the dp loop and ddp (a group of one, joined and left here) refuse the same way."""
    line = refused(capsys, tmp_path, ["--dataset", "synthetic", "--synthetic-shape", "1,1,1", "--model", "cnn", *extra],
                   train=train, config_cls=config_cls, script=script, **defaults)
    assert line.startswith("error: --synthetic-shape: 1,1,1 is too small for --model cnn") and line.endswith(SMALL)
    assert not torch.distributed.is_initialized()


def train_step_runs(name: str, shape: tuple) -> bool:
    """Whether a real training step (train mode, batch of 2, backward) runs on the CPU."""
    model = models.build_model(name, data.DataInfo("synthetic", shape, 10))
    try:
        models.loss_fn(model(torch.randn(2, *shape)), torch.tensor([0, 1])).backward()
    except RuntimeError:
        return False
    return True


CASES = [("cnn", s) for s in [(1, 1, 1), (1, 1, 2), (1, 2, 1), (1, 2, 2), (3, 3, 5)]] + \
        [("mlp", (1, 1, 1)), ("mlp", (2, 3, 1)), ("resnet18", (1, 1, 1))]


@pytest.mark.parametrize("name,shape", CASES, ids=[f"{n}-{'x'.join(map(str, s))}" for n, s in CASES])
def test_check_accepts_exactly_what_trains(name, shape):
    """No false refusals, no false acceptances: the check passes iff a real training step runs."""
    info = data.DataInfo("synthetic", shape, 10)
    try:
        models.check_input_fits(name, info)
        accepted = True
    except UsageError as e:
        assert e.flag == "--synthetic-shape"
        accepted = False
    assert accepted == train_step_runs(name, shape)


def test_check_leaves_the_global_rng_alone():
    """The loops seed right before build_model: the check (passing or refusing) must not move those weights."""
    def weights_after(check) -> list:
        torch.manual_seed(0)
        check()
        return [p.clone() for p in models.build_model("cnn", data.DataInfo("synthetic", (1, 4, 4), 10)).parameters()]

    def refuse():
        with pytest.raises(UsageError):
            models.check_input_fits("cnn", data.DataInfo("synthetic", (1, 1, 1), 10))

    reference = weights_after(lambda: None)
    for check in (lambda: models.check_input_fits("cnn", data.DataInfo("synthetic", (1, 4, 4), 10)),
                  lambda: models.check_input_fits("resnet18", data.DataInfo("synthetic", (3, 8, 8), 10)), refuse):
        assert all(torch.equal(a, b) for a, b in zip(reference, weights_after(check)))


def test_smallest_accepted_cnn_shape_trains_through_the_cli(tmp_path, capsys):
    code = run(single.train, Config, script="single",
               argv=["--dataset", "synthetic", "--synthetic-shape", "1,2,2", "--model", "cnn", "--synthetic-size",
                     "8", "--batch-size", "4", "--max-steps", "2", "--out-dir", str(tmp_path / "run"), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "run" / "summary.json").is_file()
