"""Data plumbing: the fixed digits split, loaders, worker seeding, sampler order, torchvision IDX files."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import make_cfg
from idx import write_tiny_mnist

from manual_train import data
from manual_train.config import UsageError
from manual_train.loops.single import train


def test_digits_split_is_fixed_and_seed_independent(tmp_path):
    train_a, val_a = data.load_digits_split()
    train_b, val_b = data.load_digits_split()
    assert len(train_a) == 1500 and len(val_a) == 297
    assert torch.equal(train_a.tensors[0], train_b.tensors[0]) and torch.equal(val_a.tensors[1], val_b.tensors[1])
    torch.manual_seed(123)  # the global seed must not move the split
    train_c, _ = data.load_digits_split()
    assert torch.equal(train_a.tensors[1], train_c.tensors[1])
    x, y = train_a.tensors
    assert x.shape == (1500, 1, 8, 8) and x.min() >= -1 and x.max() <= 1
    assert set(y.tolist()) == set(range(10))
    # train and val are disjoint images: no val row appears in train
    train_rows = {tuple(r) for r in x.flatten(1).tolist()}
    overlap = sum(tuple(r) in train_rows for r in val_a.tensors[0].flatten(1).tolist())
    assert overlap < 5  # a handful of digits are pixel-identical duplicates in the source data



def test_digits_read_from_the_file_are_scikit_learns_load_digits():
    """data.py reads scikit-learn's digits file itself (importing sklearn.datasets costs ~1.3 s of CPU in every
    process); the split must be what load_digits' images and targets give, element for element."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0
    order = torch.randperm(len(digits.target), generator=torch.Generator().manual_seed(data.DIGITS_SPLIT_KEY))
    (x_train, y_train), (x_val, y_val) = (ds.tensors for ds in data.load_digits_split())
    assert torch.equal(x_train, images[order[:data.DIGITS_TRAIN]]) and torch.equal(x_val, images[order[data.DIGITS_TRAIN:]])
    assert torch.equal(y_train, torch.tensor(digits.target)[order[:data.DIGITS_TRAIN]])
    assert torch.equal(y_val, torch.tensor(digits.target)[order[data.DIGITS_TRAIN:]])
    assert y_train.dtype == torch.int64

def batches(loader, epochs=2):
    out = []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        out += [(x.clone(), y.clone()) for x, y in loader]
    return out


@pytest.mark.parametrize("workers", [2])
def test_workers_give_the_same_batches_as_the_main_process(tmp_path, workers):
    cfg0 = make_cfg(tmp_path)
    cfgw = make_cfg(tmp_path, num_workers=workers, persistent_workers=True, prefetch_factor=3)
    train_ds, _, _ = data.build_datasets(cfg0)
    cpu = torch.device("cpu")
    ref = batches(data.build_loader(train_ds, cfg0, cpu, batch_size=64, sampler=data.train_sampler(train_ds, 7)))
    got = batches(data.build_loader(train_ds, cfgw, cpu, batch_size=64, sampler=data.train_sampler(train_ds, 7)))
    assert len(ref) == len(got) == 2 * 24
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(ref, got))
    assert not torch.equal(ref[0][1], ref[24][1]), "set_epoch must change the order between epochs"


def test_worker_seeding_makes_random_augmentation_reproducible(tmp_path):
    """seed_worker seeds numpy/random per worker from torch's seed: two runs draw the same numbers."""
    import numpy as np

    class NumpyNoise(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.tensor(np.random.rand()), i

    cfg = make_cfg(tmp_path, num_workers=2)

    def draw():
        torch.manual_seed(0)  # the main process's torch RNG fixes each worker's base seed
        loader = data.build_loader(NumpyNoise(), cfg, torch.device("cpu"), batch_size=2)
        return torch.cat([x for x, _ in loader])

    a, b = draw(), draw()
    assert torch.equal(a, b)
    assert len(set(a.tolist())) == 8, "workers must not share one numpy stream"


def test_sampler_order_is_shared_across_world_sizes():
    """Rank r's k-th batch of b, over N ranks, together = the single process's k-th batch of N*b."""
    ds = torch.utils.data.TensorDataset(torch.arange(1500))
    for n, b in ((2, 16), (4, 8), (3, 10)):
        single = list(data.train_sampler(ds, seed=3))
        ranks = [list(data.train_sampler(ds, seed=3, world_size=n, rank=r)) for r in range(n)]
        for k in range(len(ranks[0]) // b):
            union = sorted(i for r in ranks for i in r[k * b:(k + 1) * b])
            assert union == sorted(single[k * n * b:(k + 1) * n * b])


def test_eval_shards_are_disjoint_and_complete():
    ds = torch.utils.data.TensorDataset(torch.arange(297))
    shards = [data.eval_shard(ds, 4, r) for r in range(4)]
    seen = sorted(int(s[i][0]) for s in shards for i in range(len(s)))
    assert seen == list(range(297))


def test_window_samples_covers_the_partial_last_window():
    # 1500 samples, batch 16, K=4: 94 micro-batches, 23 full windows of 64 and a last one of 28 = 16 + 12
    assert data.steps_per_epoch(1500, 16, 4) == 24
    assert data.window_samples(1500, 16, 4, 0) == 64
    assert data.window_samples(1500, 16, 4, 92) == 28 and data.window_samples(1500, 16, 4, 93) == 28
    sizes = [min(16, 1500 - i * 16) for i in range(94)]
    weights = [s / data.window_samples(1500, 16, 4, i) for i, s in enumerate(sizes)]
    for w in range(24):
        assert sum(weights[4 * w:4 * w + 4]) == pytest.approx(1.0)


def test_suggest_num_workers_divides_cpus_among_local_ranks(monkeypatch):
    monkeypatch.setattr(data.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert data.suggest_num_workers(1) == 15
    assert data.suggest_num_workers(4) == 3
    assert data.suggest_num_workers(32) == 0


def test_synthetic_and_reverse_are_deterministic(tmp_path):
    a = data.SyntheticImages(10, (3, 8, 8), 4, seed=0)
    b = data.SyntheticImages(10, (3, 8, 8), 4, seed=0)
    assert all(torch.equal(a[i][0], b[i][0]) and a[i][1] == b[i][1] for i in range(10))
    r = data.ReverseDigits(5, length=6, seed=1)
    x, y = r[0]
    assert torch.equal(y, x[0].flip(0))
    assert x[1, 0] == data.ReverseDigits.BOS and torch.equal(x[1, 1:], y[:-1])


def test_trains_through_torchvision_mnist_from_idx_files(tmp_path):
    root = write_tiny_mnist(tmp_path / "data")
    cfg = make_cfg(tmp_path, dataset="mnist", data_root=str(root), model="mlp", epochs=3, batch_size=32,
                   optimizer="adamw", lr=3e-3)
    summary = train(cfg)
    assert summary["samples_seen"] == 3 * 256
    assert summary["final_val_acc"] >= 0.9  # the bars are learnable: well above chance (0.1)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["final_val_acc"] == summary["final_val_acc"]


def test_missing_data_root_is_a_usage_error_that_says_how_to_fix_it(tmp_path):
    cfg = make_cfg(tmp_path, dataset="fashion-mnist", data_root=str(tmp_path / "nothing"))
    with pytest.raises(UsageError) as e:
        data.build_datasets(cfg)
    assert e.value.flag == "--data-root" and "--download" in str(e.value)


def test_the_banner_suggests_workers_from_the_ranks_on_this_node(monkeypatch, capsys, tmp_path):
    """Several nodes: 2 ranks per node of 8 in all share this node's CPUs (2), not 8 (a bug once)."""
    from conftest import make_cfg

    from manual_train.loops import single

    monkeypatch.setattr(data.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="8", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="29500").items():
        monkeypatch.setenv(name, value)  # rank 0 of 8, on a node of 2, as torchrun sets them
    single.train(make_cfg(tmp_path, model="mlp", max_steps=1))
    assert "(suggested here: 7)" in capsys.readouterr().out  # 16 CPUs / 2 local ranks - 1


@pytest.mark.parametrize("pad", [False, True])
def test_uneven_shards_give_every_rank_as_many_batches_and_pad_false_an_empty_last_one(tmp_path, pad):
    """9 samples on 2 ranks, batches of 2: rank 0 holds 5, rank 1 holds 4 (pad=False, the DDP loops') and still runs
    3 micro-batches, its last empty, so no rank waits in an all-reduce the other never joins; pad=True (torch's own
    rule) fills rank 1 with a repeat instead: 5 and 5."""
    ds = torch.utils.data.TensorDataset(torch.arange(9.0).view(9, 1), torch.arange(9))
    cfg = make_cfg(tmp_path)
    sizes = []
    for rank in (0, 1):
        sampler = data.train_sampler(ds, seed=0, world_size=2, rank=rank, pad=pad)
        loader = data.build_loader(ds, cfg, torch.device("cpu"), batch_size=2, sampler=sampler)
        sizes.append([len(y) for _, y in loader])
    assert sizes == ([[2, 2, 1], [2, 2, 0]] if not pad else [[2, 2, 1], [2, 2, 1]]), sizes


def test_target_counts_are_a_datasets_tensor_of_them_and_nothing_else():
    class Chunks(torch.utils.data.Dataset):
        targets_per_sample = torch.tensor([3, 1, 2])

    class Listed(torch.utils.data.Dataset):
        targets_per_sample = [3, 1, 2]  # not a tensor: not taken

    assert torch.equal(data.target_counts(Chunks()), torch.tensor([3, 1, 2]))
    assert data.target_counts(Listed()) is None and data.target_counts(torch.utils.data.TensorDataset()) is None


def test_reverse_is_token_rows_for_the_gpt_and_digit_pairs_for_the_seq2seq(tmp_path):
    from manual_train import tokens

    gpt_train, _, gpt_info = data.build_datasets(make_cfg(tmp_path, dataset="reverse", model="gpt"))
    s2s_train, _, s2s_info = data.build_datasets(make_cfg(tmp_path, dataset="reverse", model="seq2seq"))
    assert isinstance(gpt_train, tokens.ReverseLM) and isinstance(s2s_train, data.ReverseDigits)
    assert gpt_info != s2s_info
