"""Datasets, samplers and DataLoaders: the data plumbing every loop shares.

Datasets (all real code paths, none needs the network unless --download is given):
  digits         scikit-learn's bundled 8x8 handwritten digits (1797 images); fixed split 1500/297
  mnist, fashion-mnist, cifar10
                 torchvision.datasets with torchvision transforms, read from --data-root
  synthetic      random images of --synthetic-shape with learnable class offsets (benchmarks)
  reverse        digit sequences and their reversal (the seq2seq task for model parallelism; with --model gpt
                 the same task as decoder-only language modelling, manual_train/tokens.py)
  pydoc          Python's reference manual (pydoc_data, shipped with CPython) as byte-level language modelling for
                 --model gpt: samples of up to --block-size targets (manual_train/text.py)

DataLoader tuning (docs/dataloader.md): `build_loader` exposes num_workers, pin_memory,
persistent_workers and prefetch_factor, and seeds workers with `seed_worker` so a run
with workers is reproducible. Shuffling always goes through `train_sampler`, which is
`DistributedSampler(seed=seed)` also at world size 1: that is what makes a single process with
batch N*b see, step by step, the same samples as N DDP ranks with batch b. With pad=False (the DDP
and ZeRO loops) a set that N does not divide is not padded with repeats: a short shard ends in an empty
micro-batch (ShardBatches, collate_or_empty), so any size trains the single-process weights (docs/ddp_knobs.md).
"""
from __future__ import annotations

import functools
import gzip
import importlib.util
import itertools
import math
import os
import random
import struct
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, Subset, TensorDataset
from torch.utils.data import default_collate

from manual_train import plugins, text, tokens
from manual_train.config import Config, UsageError, limited_batches
from manual_train.models import IGNORE, DataInfo, check_input_fits  # noqa: F401 (DataInfo re-exported)

DIGITS_TRAIN = 1500  # 1797 = 1500 train + 297 val; 1500 divides by 2, 3, 4, 5 and 6 ranks
DIGITS_SPLIT_KEY = 20240229  # a fixed key, independent of --seed, so the split never moves


# ---------------------------------------------------------------------- datasets
def digits_file() -> Path:
    """scikit-learn's copy of the digits (1797 rows: 64 pixels 0..16, then the label), found without importing
    scikit-learn: `from sklearn.datasets import load_digits` costs ~1.3 s of CPU (scipy and more, measured
    2026-12-06 on a 2-core Xeon), paid by every process that trains on digits, every rank of a torchrun job
    included; the file itself reads in milliseconds. sklearn.datasets.load_digits reads this file the same way
    (tests/test_data.py checks the two agree element for element)."""
    spec = importlib.util.find_spec("sklearn")  # finds the package; does not run its __init__
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("--dataset digits needs scikit-learn (pip install scikit-learn)")
    return Path(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")


def load_digits_split() -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's digits as (N, 1, 8, 8) float tensors in [-1, 1] and int64 labels."""
    with gzip.open(digits_file(), "rt") as f:
        data = np.loadtxt(f, delimiter=",")  # float64, as load_digits reads it
    x = torch.tensor(data[:, :-1].reshape(-1, 8, 8), dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0  # pixels 0..16
    y = torch.tensor(data[:, -1].astype(int), dtype=torch.int64)
    # The file is ordered roughly by writer; a fixed permutation mixes writers into both splits.
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(DIGITS_SPLIT_KEY))
    train, val = order[:DIGITS_TRAIN], order[DIGITS_TRAIN:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


class SyntheticImages(Dataset):
    """Deterministic random images: sample i is generated from its own seed, so any worker can make it.

    Each class adds a fixed per-channel offset, so models can learn something (loss goes down),
    which makes benchmark runs look like training rather than noise-fitting.
    """

    def __init__(self, size: int, shape: tuple, num_classes: int, seed: int = 0):
        self.size, self.shape, self.num_classes, self.seed = size, tuple(shape), num_classes, seed
        g = torch.Generator().manual_seed(seed + 7919)
        self.class_offsets = torch.randn(num_classes, shape[0], 1, 1, generator=g)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        label = int(torch.randint(self.num_classes, (), generator=g))
        image = torch.randn(self.shape, generator=g) + self.class_offsets[label]
        return image, label


class ReverseDigits(Dataset):
    """The seq2seq task: read a sequence of digits, write it reversed.

    x[i] is a (2, L) int64 tensor: row 0 the source digits, row 1 the decoder's input under
    teacher forcing (BOS followed by the reversed digits shifted right); y[i] is the reversal.
    Token ids: digits 0..9, BOS = 10 (so the vocabulary has 11 entries). Deterministic by seed.
    """

    BOS = 10
    VOCAB = 11

    def __init__(self, size: int, length: int = 8, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        src = torch.randint(0, 10, (size, length), generator=g)
        self.y = src.flip(1)
        bos = torch.full((size, 1), self.BOS, dtype=torch.int64)
        self.x = torch.stack([src, torch.cat([bos, self.y[:, :-1]], dim=1)], dim=1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


IDX_IMAGE_MAGIC = 2051  # 0x00000803: unsigned bytes, 3 dimensions (count, rows, columns)
IDX_LABEL_MAGIC = 2049  # 0x00000801: unsigned bytes, 1 dimension (count)


def _idx_files(cls, root: Path, train: bool):
    """The two MNIST-format files torchvision reads for one split (its raw_folder: root/<class name>/raw)."""
    raw = root / cls.__name__ / "raw"
    prefix = "train" if train else "t10k"
    return raw / f"{prefix}-images-idx3-ubyte", raw / f"{prefix}-labels-idx1-ubyte"


def _idx_problem(path: Path, kind: str):
    """What makes one IDX file unreadable (kind 'image' or 'label'), or None: size, magic number, header."""
    magic, dims = (IDX_IMAGE_MAGIC, 3) if kind == "image" else (IDX_LABEL_MAGIC, 1)
    header_bytes = 4 * (1 + dims)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            header = f.read(header_bytes)
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if size == 0:
        return f"is empty (0 bytes; an IDX {kind} file starts with a {header_bytes}-byte header)"
    found = int.from_bytes(header[:4], "big")
    if size >= 4 and found != magic:
        return f"wrong magic number {found} (an IDX {kind} file starts with {magic})"
    if size < header_bytes:
        return f"is truncated: {size} bytes, shorter than its {header_bytes}-byte header"
    shape = struct.unpack(f">{dims}I", header[4:])
    expected = header_bytes + math.prod(shape)
    if size != expected:
        what = f"{shape[0]} images of {shape[1]}x{shape[2]}" if kind == "image" else f"{shape[0]} labels"
        return (f"{'truncated' if size < expected else 'has trailing bytes'}: {size} bytes, but its header "
                f"promises {what} ({expected} bytes)")
    if shape[0] == 0:
        return f"holds no {kind}s"
    return None


def _one_line(e: BaseException) -> str:
    """An exception as one line: its first line and, for a multi-line one, its last (where the cause usually is)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines:  # an exception without a message (torchvision raises some): its type alone, not an IndexError
        return type(e).__name__
    text = lines[0] if len(lines) < 2 else f"{lines[0].rstrip(':')}: {lines[-1]}"
    return f"{type(e).__name__}: {text}" if lines else type(e).__name__


def _load_error(cfg: Config, cls, root: Path, train: bool, e: Exception) -> UsageError:
    """torchvision's exception while loading one split, as the one-line error that names the file at fault."""
    files = _idx_files(cls, root, train) if cfg.dataset != "cifar10" else ()
    if isinstance(e, RuntimeError) and "not found" in str(e):  # "Dataset not found[ or corrupted]. You can ..."
        both = _idx_files(cls, root, True) + _idx_files(cls, root, False) if files else ()  # it wants all four
        missing = [f for f in both if not f.is_file()]
        hint = "" if cfg.download else "; pass --download to fetch it"
        detail = f"{missing[0]} is missing" if missing else str(e).split(".")[0]
        return UsageError("--data-root", f"no usable {cfg.dataset} data under {root}{hint} ({detail})")
    for path, kind in zip(files, ("image", "label")):
        problem = path.is_file() and _idx_problem(path, kind)
        if problem:
            return UsageError("--data-root", f"{path}: {problem}")
    if cfg.download and isinstance(e, (RuntimeError, OSError)):  # e.g. no network: "Error downloading ..."
        return UsageError("--download", f"could not download {cfg.dataset} into {root}: {_one_line(e)}")
    return UsageError("--data-root", f"could not load {cfg.dataset} from {root}: {_one_line(e)}")


def _check_loaded(cfg: Config, cls, root: Path, train: bool, ds, classes: int, sample_shape: tuple) -> None:
    """What torchvision loads without complaint but training would trip over mid-epoch (or silently skip):
    a label count that differs from the image count, a label outside [0, classes), images of another size,
    an empty split."""
    if cfg.dataset == "cifar10":
        images = labels = root / ds.base_folder
    else:
        images, labels = _idx_files(cls, root, train)
    n_images, n_labels = len(ds.data), len(ds.targets)
    if n_images == 0:
        raise UsageError("--data-root", f"{images}: holds no images")
    if n_labels != n_images:
        raise UsageError("--data-root", f"{labels}: holds {n_labels} labels, but {images} holds {n_images} "
                                        f"images (one label per image)")
    targets = torch.as_tensor(ds.targets)
    bad = ((targets < 0) | (targets >= classes)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise UsageError("--data-root", f"{labels}: label {int(targets[i])} (sample {i}) is out of range for "
                                        f"{cfg.dataset}'s {classes} classes", f"0..{classes - 1}")
    found = tuple(ds.data.shape[1:])
    if found != sample_shape:
        show = "x".join(map(str, found))
        raise UsageError("--data-root", f"{images}: images are {show}, {cfg.dataset}'s are "
                                        f"{'x'.join(map(str, sample_shape))}")


def _torchvision_dataset(cfg: Config):
    """mnist / fashion-mnist / cifar10 through torchvision: every unusable file is a one-line error that names it,
    raised here, before the model is built (not a traceback mid-epoch)."""
    import torchvision
    from torchvision import transforms as T

    if cfg.dataset == "cifar10":
        cls, stats, shape, classes = torchvision.datasets.CIFAR10, ((0.4914, 0.4822, 0.4465),
                                                                    (0.2470, 0.2435, 0.2616)), (3, 32, 32), 10
        train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(),
                              T.Normalize(*stats)])
        stored = (32, 32, 3)  # CIFAR10.data: (N, H, W, C) uint8
    else:
        cls = torchvision.datasets.MNIST if cfg.dataset == "mnist" else torchvision.datasets.FashionMNIST
        stats = ((0.1307,), (0.3081,)) if cfg.dataset == "mnist" else ((0.2860,), (0.3530,))
        shape, classes = (1, 28, 28), 10
        train_tf = T.Compose([T.ToTensor(), T.Normalize(*stats)])
        stored = (28, 28)  # MNIST.data: (N, H, W) uint8
    val_tf = T.Compose([T.ToTensor(), T.Normalize(*stats)])
    root = Path(cfg.data_root)
    splits = []
    for is_train, tf in ((True, train_tf), (False, val_tf)):
        try:
            ds = cls(str(root), train=is_train, download=cfg.download, transform=tf)
        except Exception as e:  # torchvision's AssertionError, ValueError, RuntimeError, OSError ... for bad files
            raise _load_error(cfg, cls, root, is_train, e) from None
        _check_loaded(cfg, cls, root, is_train, ds, classes, stored)
        splits.append(ds)
    if cfg.dataset == "cifar10":  # its crops and flips drawn per sample, not per worker: resumes stay exact
        splits[0] = PerSampleRNG(splits[0], cfg.seed)
    return splits[0], splits[1], DataInfo(cfg.dataset, shape, classes)


def mix64(*keys: int) -> int:
    """A 64-bit seed from integers: splitmix64's finalizer over each in turn (nearby keys give unrelated seeds)."""
    h = 0x9E3779B97F4A7C15
    for k in keys:
        h = ((h ^ k) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h = ((h ^ (h >> 31)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h


class PerSampleRNG(Dataset):
    """A training set whose transforms draw random numbers (torchvision's crops and flips draw from torch's global
    RNG), made a function of the sample: each item is loaded with that RNG seeded from (seed, epoch, index), so a
    sample gets the same augmentation in any worker, at any position in the epoch, after a mid-epoch resume and at
    any world size. Without it a worker's stream depends on which batches it served before (resumes differ).

    The hook for a dataset of yours: `PerSampleRNG(your_train_set, cfg.seed)` (torch's draws only: numpy's and
    `random`'s are not seeded per sample). The epoch reaches every worker
    (persistent ones too) through a shared-memory tensor that TrainSampler.set_epoch sets. Cost: one seeding and
    one save and restore of the CPU generator's state per sample, about 3 us (a TensorDataset item is 2-3 us)."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        rng = torch.default_generator  # (torch.manual_seed would also seed every CUDA device: 200 us, not 1)
        saved = rng.get_state()
        rng.manual_seed(mix64(self.seed, int(self.epoch), int(index)))
        try:
            return self.dataset[index]
        finally:
            rng.set_state(saved)  # the caller's stream is left where it was

    def __getattr__(self, name: str):  # the wrapped set's own attributes (CIFAR10's classes, targets, data)
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


def build_datasets(cfg: Config) -> tuple[Dataset, Dataset, DataInfo]:
    """(train, val, info) for cfg.dataset. Raises UsageError for missing or corrupt data, and for a --model that
    cannot run on the data's input shape (e.g. --synthetic-shape 1,1,1 with cnn)."""
    train, val, info = _datasets(cfg)
    val = limit_val(val, cfg)  # --limit-val-batches, --fast-dev-run

    if plugins.is_spec(cfg.model):  # your model: one forward of a real sample, and the logits' shape
        plugins.check_fits(cfg, info, train)
    else:
        check_input_fits(cfg.model, info, "--synthetic-shape" if cfg.dataset == "synthetic" else "--model")
    if cfg.loss is not None:  # your loss: called on random logits against real targets, its contract checked
        plugins.check_loss(cfg, info, train, IGNORE)
    return train, val, info


def _datasets(cfg: Config) -> tuple[Dataset, Dataset, DataInfo]:
    if plugins.is_spec(cfg.dataset):  # --dataset PACKAGE.MODULE:CALLABLE, your own (docs/your-model.md)
        return plugins.build_datasets(cfg, DataInfo)
    if cfg.dataset == "digits":
        train, val = load_digits_split()
        return train, val, DataInfo("digits", (1, 8, 8), 10)
    if cfg.dataset == "synthetic":
        shape = cfg.synthetic_input_shape
        train = SyntheticImages(cfg.synthetic_size, shape, cfg.synthetic_classes, seed=0)
        val = SyntheticImages(max(1, cfg.synthetic_size // 4), shape, cfg.synthetic_classes, seed=1)
        return train, val, DataInfo("synthetic", shape, cfg.synthetic_classes)
    if cfg.dataset == "pydoc":  # real text, samples with different numbers of targets: manual_train/text.py
        return text.pydoc_datasets(cfg.block_size, cfg.text_samples)
    if cfg.dataset == "reverse" and cfg.model == "gpt":  # the same task as one token row: manual_train/tokens.py
        return tokens.reverse_lm_datasets(cfg.synthetic_size)
    if cfg.dataset == "reverse":
        train = ReverseDigits(cfg.synthetic_size, seed=0)
        val = ReverseDigits(max(1, cfg.synthetic_size // 4), seed=1)
        return train, val, DataInfo("reverse", tuple(train.x.shape[1:]), ReverseDigits.VOCAB)
    return _torchvision_dataset(cfg)


# ---------------------------------------------------------------------- samplers and loaders
class TrainSampler(DistributedSampler):
    """DistributedSampler that can begin an epoch part-way: `set_epoch(epoch, start=k)` skips the rank's first k
    indices of that epoch's order. A run resumed from a mid-epoch checkpoint starts its loader where the
    checkpoint stopped, instead of loading and throwing away the batches before it.

    pad=True is DistributedSampler's own rule: when N does not divide the set, every rank's list is filled up to
    ceil(n / N) with repeats of the first samples, so those samples count twice. pad=False leaves holes instead:
    rank r takes perm[r::N] as it falls (shards differ by at most one sample), and `len()` still counts ceil(n / N)
    positions, the same on every rank; build_loader turns a short shard's missing positions into an empty last
    micro-batch, so that every rank runs the same micro-steps (docs/ddp_knobs.md, "Any dataset size")."""

    start = 0
    pad = True

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        super().set_epoch(epoch)
        self.start = start
        if isinstance(self.dataset, PerSampleRNG):  # its augmentations are drawn per (epoch, sample)
            self.dataset.set_epoch(epoch)

    def __iter__(self):
        if self.pad:
            order = super().__iter__()
        else:  # DistributedSampler's permutation of the same seed and epoch, without the repeats it appends
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=g).tolist()[self.rank::self.num_replicas]
        return itertools.islice(order, self.start, None)

    def __len__(self) -> int:
        return self.num_samples - self.start  # positions: pad=False's holes included


class ShardBatches(Sampler):
    """A pad=False TrainSampler's indices in batches, as many batches on every rank: ceil(len(sampler) / batch).
    The batches are the sampler's indices in order; a shard one sample short whose samples end on a batch boundary
    gets one empty batch ([]) at the end, which its rank trains on with weight 0."""

    def __init__(self, sampler: TrainSampler, batch_size: int):
        self.sampler, self.batch_size = sampler, batch_size

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self):
        indices = iter(self.sampler)
        for _ in range(len(self)):
            yield list(itertools.islice(indices, self.batch_size))


def collate_or_empty(dataset: Dataset, samples: list):
    """default_collate, and for no samples the tensors of one sample cut to 0 rows: an empty batch of the right
    shapes and dtypes (a model's forward and backward run on it; every gradient it gives is 0)."""
    if samples:
        return default_collate(samples)
    return [t[:0] for t in default_collate([dataset[0]])]


def train_sampler(dataset: Dataset, seed: int, world_size: int = 1, rank: int = 0, pad: bool = True) -> TrainSampler:
    """The one shuffling rule for every loop: DistributedSampler's permutation, also at world size 1.

    Rank r takes perm[r::world_size], so ranks' k-th batches of size b together are exactly
    perm[k*b*N:(k+1)*b*N], the single process's k-th batch of size N*b. Call set_epoch(epoch)
    every epoch, or every epoch repeats the same order. pad: see TrainSampler (the DDP and ZeRO loops pass False).
    """
    sampler = TrainSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=False)
    sampler.pad = pad
    return sampler


def eval_shard(dataset: Dataset, world_size: int = 1, rank: int = 0) -> Dataset:
    """Rank r's disjoint share of an evaluation set: indices r, r+N, r+2N, ... with no padding.

    DistributedSampler would pad with duplicates to equalise shards, which biases distributed
    validation metrics (Lightning issue 7929); summing per-rank sums and counts is exact instead.
    """
    return dataset if world_size == 1 else Subset(dataset, range(rank, len(dataset), world_size))


def test_dataset(cfg: Config) -> Dataset:
    """The official test set of mnist, fashion-mnist and cifar10 (`python -m manual_train.evaluate --split test`),
    with the validation transforms; the other datasets have none (a one-line error). (The training scripts
    validate on these same files today: val is the test set there, docs/evaluation.md.)"""
    if cfg.dataset not in ("mnist", "fashion-mnist", "cifar10"):
        what = ("its 1797 images are split 1500 train / 297 val" if cfg.dataset == "digits"
                else "a plug-in dataset returns train and val only" if plugins.is_spec(cfg.dataset)
                else "it is generated: train and val only")
        raise UsageError("--split", f"{cfg.dataset} has no test set ({what})", "val")
    return _torchvision_dataset(cfg)[1]  # read from the t10k / test_batch files, with their checks


def limit_val(val: Dataset, cfg: Config) -> Dataset:
    """--limit-val-batches: the first N batches of --eval-batch-size (or a fraction of them), as one subset, so that
    every loop (and every rank's shard of it) evaluates the same samples and the sums stay exact."""
    if cfg.val_limit is None:
        return val
    batches = limited_batches(cfg.val_limit, micro_batches_per_epoch(len(val), cfg.eval_batch_size),
                              "--limit-val-batches")
    return Subset(val, range(min(len(val), batches * cfg.eval_batch_size)))


def limit_train(num_samples: int, cfg: Config, batch_size: int = 0) -> int:
    """--limit-train-batches (--fast-dev-run: 1): the samples of the first N micro-batches of each epoch (this
    rank's, of --batch-size; or all ranks' together, micro-batches of batch_size = N x --batch-size), which the
    loop then counts as its epoch: micro-batches, steps, the last window's weights."""
    batch_size = batch_size or cfg.batch_size
    batches = limited_batches(cfg.train_limit, micro_batches_per_epoch(num_samples, batch_size),
                              "--limit-train-batches")
    return min(num_samples, batches * batch_size)


class SeededLoader(DataLoader):
    """A DataLoader that never draws from the global torch RNG: the base seed of its workers comes from its own
    generator, seeded at every iter() from (--seed, rank, epoch) for the training loader (a TrainSampler), and to 0
    for evaluation (whose batches draw nothing random).

    A DataLoader draws that seed whenever an iterator is made (with no workers too). From the global RNG, a run
    resumed mid-epoch would draw it once more than the uninterrupted run (which drew it at the epoch's start,
    before the checkpoint), and an evaluation (mid-epoch, or at a --max-time stop) would move the stream training
    draws from: every dropout mask after it would differ
    (test_everyday.py::test_mid_epoch_resume_with_dropout_and_workers_is_bitwise). Each rank's training workers
    still get seeds of their own: the rank is part of the key."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, generator=torch.Generator(), **kwargs)

    def __iter__(self):
        s = getattr(self.batch_sampler, "sampler", None)  # a TrainSampler, under a BatchSampler or ShardBatches
        key = [s.seed, s.rank, s.epoch] if isinstance(s, TrainSampler) else [0]
        self.generator.manual_seed(int(np.random.SeedSequence(key).generate_state(1)[0]))
        return super().__iter__()


def seed_worker(worker_id: int) -> None:
    """worker_init_fn: seed `random` and numpy in each worker from torch's per-worker seed.

    torch seeds each worker with base_seed + worker_id (base_seed drawn from the main process's
    torch RNG when the iterator starts), but leaves `random` and numpy alone: without this, forked
    workers share one numpy stream and augmentations repeat across workers.
    """
    worker_seed = torch.initial_seed() % 2 ** 32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


def build_loader(dataset: Dataset, cfg: Config, device: torch.device, *, batch_size: int,
                 sampler=None) -> DataLoader:
    """A DataLoader with the tuning knobs from the CLI. Pinning defaults to on for CUDA devices.

    pin_memory only pays off with `.to(device, non_blocking=True)`: the copy from page-locked
    memory can then overlap compute. persistent_workers saves re-forking workers each epoch;
    prefetch_factor is how many batches each worker keeps ready.
    """
    pin = cfg.pin_memory if cfg.pin_memory is not None else device.type == "cuda"
    workers = {}
    if cfg.num_workers > 0:
        workers = dict(worker_init_fn=seed_worker, persistent_workers=cfg.persistent_workers,
                       prefetch_factor=cfg.prefetch_factor)
    batches = dict(batch_size=batch_size, sampler=sampler, shuffle=False)
    if isinstance(sampler, TrainSampler) and not sampler.pad:  # every rank as many batches, maybe one empty
        batches = dict(batch_sampler=ShardBatches(sampler, batch_size),
                       collate_fn=functools.partial(collate_or_empty, dataset))
    return SeededLoader(dataset, num_workers=cfg.num_workers, pin_memory=pin and device.type == "cuda",
                        **batches, **workers)  # no drop_last: every sample counts (accumulation weights the last batch)


def suggest_num_workers(local_world_size: int = 1) -> int:
    """A starting point for --num-workers: the CPUs this process may use, shared by the local ranks.

    "num_workers = number of CPUs" (the usual tip) is per machine, not per process: under DDP each
    of the local ranks starts its own workers. One CPU per rank is left for the training process.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(0, cpus // max(1, local_world_size) - 1)


class SlowReads(Dataset):
    """Wraps a dataset with a fixed per-sample read latency: an I/O-bound dataset for benchmarks."""

    def __init__(self, dataset: Dataset, latency_s: float):
        self.dataset, self.latency_s = dataset, latency_s

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        time.sleep(self.latency_s)
        return self.dataset[i]


def micro_batches_per_epoch(num_samples: int, batch_size: int) -> int:
    """Micro-batches one epoch of `num_samples` makes without drop_last."""
    return -(-num_samples // batch_size)


def steps_per_epoch(num_samples: int, batch_size: int, accumulate: int) -> int:
    """Optimizer steps per epoch: one per window of `accumulate` micro-batches, the last may be partial."""
    return -(-micro_batches_per_epoch(num_samples, batch_size) // accumulate)


def target_counts(dataset: Dataset) -> Optional[torch.Tensor]:
    """Each sample's number of targets, an (n,) int64 tensor, for a dataset whose samples differ: its attribute
    `targets_per_sample` (text.ByteChunks'; a dataset of yours may set it too). None where every sample has as many
    (a label, or L tokens). Not `targets`: torchvision's datasets keep their labels there (MNIST: a tensor)."""
    counts = getattr(dataset, "targets_per_sample", None)
    return counts if isinstance(counts, torch.Tensor) else None


class Windows:
    """The targets of each micro-batch and of its accumulation window, on every rank alike: token-exact weights.

    A window's gradient must be the mean over every target of the window, on every rank, as one big batch computes
    it: micro-batch i's mean loss weighs (its targets) / (the window's targets). Both counts are properties of the
    sampled indices: every rank draws the same permutation (train_sampler's seed and epoch), so each rank counts
    every rank's samples itself; no all-reduce, O(window) integer work per micro-step. Rank r's micro-batch k is
    perm[k*M + r : (k+1)*M : N] (M = batch x N), the window w perm[w*A*M : (w+1)*A*M], as TrainSampler deals them
    (pad=True: perm followed by its first samples again, up to a multiple of N).
    Where every sample has L targets the counts are L x samples: the weights of window_samples, exactly."""

    def __init__(self, dataset: Dataset, sampler: TrainSampler, cfg: Config):
        self.counts = target_counts(dataset)  # None: every sample has per_sample targets
        self.per_sample = torch.as_tensor(dataset[0][1]).numel() if self.counts is None else 0
        self.sampler, self.accumulate, self.epoch = sampler, cfg.accumulate, None
        self.micro_batch = cfg.batch_size * sampler.num_replicas  # every rank's micro-batches together
        padded = sampler.total_size if sampler.pad else len(dataset)  # pad=True at N > 1 deals repeats too
        self.num_samples = limit_train(padded, cfg, self.micro_batch)  # --limit-train-batches: the epoch's

    def _targets(self, positions: range) -> int:
        """The targets of the epoch's samples at these positions of its permutation (the first num_samples)."""
        positions = range(positions.start, min(positions.stop, self.num_samples), positions.step)
        if self.counts is None:
            return len(positions) * self.per_sample
        if self.epoch != self.sampler.epoch:  # the sampler's permutation of this epoch, once
            g = torch.Generator().manual_seed(self.sampler.seed + self.sampler.epoch)
            perm = torch.randperm(len(self.counts), generator=g)
            perm = perm.repeat(-(-self.num_samples // len(perm)))  # (DistributedSampler's padding: its first again)
            self.in_order, self.epoch = self.counts[perm], self.sampler.epoch
        return int(self.in_order[positions.start:positions.stop:positions.step].sum())

    def count(self, micro_step: int) -> tuple[int, int]:
        """(this rank's targets in micro-batch `micro_step`, every rank's targets in its window)."""
        m, n, first = self.micro_batch, self.sampler.num_replicas, micro_step // self.accumulate * self.accumulate
        mine = self._targets(range(micro_step * m + self.sampler.rank, (micro_step + 1) * m, n))
        window = self._targets(range(first * m, (first + self.accumulate) * m))
        return mine, window


def window_samples(num_samples: int, batch_size: int, accumulate: int, micro_step: int) -> int:
    """How many samples the accumulation window holding micro-batch `micro_step` contains.

    Every window holds accumulate*batch_size samples except the epoch's last, which holds what is
    left. Weighting each micro-batch's mean loss by its samples / this number makes the window's
    gradient the mean over the window's samples, exactly as one big batch would.
    """
    window = micro_step // accumulate
    return min(accumulate * batch_size, num_samples - window * accumulate * batch_size)
