"""Write tiny MNIST-format IDX files, so torchvision.datasets.MNIST loads real files with no download."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np


def write_idx_images(path: Path, images: np.ndarray) -> None:
    n, h, w = images.shape
    path.write_bytes(struct.pack(">IIII", 2051, n, h, w) + images.astype(np.uint8).tobytes())


def write_idx_labels(path: Path, labels: np.ndarray) -> None:
    path.write_bytes(struct.pack(">II", 2049, len(labels)) + labels.astype(np.uint8).tobytes())


def write_tiny_mnist(root: Path, n_train: int = 256, n_test: int = 64, folder: str = "MNIST") -> Path:
    """Learnable 28x28 digits-like images: class c lights up a bar at row band c (plus noise)."""
    raw = Path(root) / folder / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, n)
        images = rng.integers(0, 60, (n, 28, 28))
        for i, c in enumerate(labels):
            images[i, 2 + 2 * c: 4 + 2 * c, 4:24] = 255
        write_idx_images(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx_labels(raw / f"{prefix}-labels-idx1-ubyte", labels)
    return Path(root)
