"""Real text for the GPT: the reference manual every CPython ships, as byte-level language modelling (docs/gpt.md).

`pydoc_data.topics` holds the text of Python's language reference, one document per topic (79 on Python 3.11,
~465k characters; other versions have a few more or fewer). Nobody here wrote it and nothing is downloaded.

    tokens ......... the UTF-8 bytes (0..255), and BOS = 256: each document starts with it, so its first byte is
                     predicted too, and it fills the inputs past a document's end (vocabulary 257)
    split .......... by document, by a fixed rule (crc32 of the topic's name % 10 == 0: validation), so no
                     document is in both and a Python that adds topics moves none of the others
    samples ........ consecutive chunks of at most --block-size targets inside one document, never across two: a
                     document's last chunk is short, its missing targets are IGNORE (-100, F.cross_entropy's
                     ignore_index), so samples carry different numbers of targets; the shortest documents first
Every target is one byte: the mean loss per target in nats / ln 2 is bits per byte (val_bpb), exp of it perplexity.
"""
from __future__ import annotations

import math
import zlib

import torch
from torch.utils.data import Dataset

from manual_train.config import UsageError
from manual_train.models import IGNORE, DataInfo

BOS = 256  # a document's start, and the inputs' padding after its end (causal attention: it changes no target)
VOCAB = 257


def documents() -> dict[str, bytes]:
    """The topics of pydoc_data, name -> UTF-8 bytes, sorted by name (a fixed order on every Python)."""
    try:
        from pydoc_data.topics import topics
    except ImportError as e:
        raise UsageError("--dataset", f"pydoc: this Python has no pydoc_data module ({e}); some distributions "
                                      "package it apart (Debian: libpython3-stdlib)", "digits, reverse") from None
    docs = {name: text.encode("utf-8") for name, text in sorted(topics.items()) if text}
    if not docs:
        raise UsageError("--dataset", "pydoc: pydoc_data.topics holds no text", "digits, reverse")
    return docs


def is_val(name: str) -> bool:
    """The split rule: a topic is validation when crc32 of its name is 0 mod 10 (about a tenth of the text)."""
    return zlib.crc32(name.encode("utf-8")) % 10 == 0


class ByteChunks(Dataset):
    """Documents cut into samples: x[i] (T,) int64 input tokens, y[i] (T,) int64 targets (IGNORE past the end).

    Chunk k of a document with tokens t = BOS b1 b2 ... bD is x = t[kT : kT+T], y = t[kT+1 : kT+T+1]: every byte is
    a target exactly once. `targets_per_sample` holds each sample's number of real targets (data.Windows reads it)."""

    def __init__(self, docs: list[bytes], block_size: int, limit: int = 0):
        xs, ys = [], []
        for doc in docs:
            t = torch.tensor([BOS, *doc], dtype=torch.int64)
            for k in range(0, len(doc), block_size):
                x, y = t[k:k + block_size], t[k + 1:k + 1 + block_size]
                xs.append(torch.cat([x, x.new_full((block_size - len(x),), BOS)]))
                ys.append(torch.cat([y, y.new_full((block_size - len(y),), IGNORE)]))
        self.x, self.y = torch.stack(xs)[:limit or None], torch.stack(ys)[:limit or None]  # limit: the first samples
        self.targets_per_sample = (self.y != IGNORE).sum(1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def pydoc_datasets(block_size: int, train_samples: int = 0) -> tuple[ByteChunks, ByteChunks, DataInfo]:
    """(train, val, info) as data.build_datasets returns them, the documents shortest first. train_samples > 0: the
    first that many training samples only, a slice for quick runs and tests that holds many documents (and many
    short last chunks)."""
    docs = sorted(documents().items(), key=lambda item: (len(item[1]), item[0]))  # the shortest first
    train = ByteChunks([d for name, d in docs if not is_val(name)], block_size, train_samples)
    val = ByteChunks([d for name, d in docs if is_val(name)], block_size)
    return train, val, DataInfo("pydoc", (block_size,), VOCAB)


def decode(tokens) -> str:
    """Token ids as text: the bytes (BOS dropped), decoded as UTF-8 (a cut multi-byte character shows as U+FFFD)."""
    return bytes(int(t) for t in tokens if 0 <= int(t) < 256).decode("utf-8", errors="replace")


def encode(text: str) -> list[int]:
    """A prompt as tokens: BOS, then its UTF-8 bytes (how every document starts)."""
    return [BOS, *text.encode("utf-8")]


def bits_per_byte(loss_per_byte: float) -> float:
    """The mean loss per target (nats; every target is one byte) in bits per byte."""
    return loss_per_byte / math.log(2)
