"""The reverse task as decoder-only language modelling: the token task that `--model gpt` trains (docs/gpt.md).

A sample is one row of tokens: the digits, a separator, then the digits reversed,

    x = d1 d2 ... dL SEP dL ... d2      (2L tokens: the prompt, then the answer shifted right by one)
    y =                  dL ... d2 d1   (L tokens: the answer)

and the GPT (manual_train/models.py, n_predict=L) predicts the token after each of x's last L positions: the
answer, one digit at a time, each from the prompt and the answer's digits before it (causal attention). Only
the answer has targets: the prompt is random digits, which no model can predict, so a loss on it would be a
floor of log(10) and its accuracy 10% whatever the model learnt. Every sample has exactly L targets, so
weighting a batch by its samples (accumulation, micro-batches) is weighting it by its tokens: the baseline's
exact arithmetic holds unchanged.

The digits are ReverseDigits' (manual_train/data.py: the same seeds give the same sequences as the seq2seq
task), so the two models learn the same task from the same data. Nothing is downloaded.
"""
from __future__ import annotations

import torch
from torch.utils.data import Dataset

from manual_train.models import DataInfo

SEP = 10  # after the digits 0..9
VOCAB = 11


class ReverseLM(Dataset):
    """x[i]: (2L,) int64 tokens, prompt and shifted answer; y[i]: (L,) int64, the reversed digits."""

    def __init__(self, size: int, length: int = 8, seed: int = 0):
        g = torch.Generator().manual_seed(seed)  # ReverseDigits' draw: the same digits for the same seed
        src = torch.randint(0, 10, (size, length), generator=g)
        self.y = src.flip(1)
        sep = torch.full((size, 1), SEP, dtype=torch.int64)
        self.x = torch.cat([src, sep, self.y[:, :-1]], dim=1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def reverse_lm_datasets(train_size: int) -> tuple[ReverseLM, ReverseLM, DataInfo]:
    """(train, val, info) as data.build_datasets returns them: validation a quarter the size, another seed."""
    train, val = ReverseLM(train_size, seed=0), ReverseLM(max(1, train_size // 4), seed=1)
    return train, val, DataInfo("reverse", tuple(train.x.shape[1:]), VOCAB, predict=train.y.shape[1])
