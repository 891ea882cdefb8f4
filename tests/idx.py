"""Write tiny MNIST-format IDX files, so torchvision.datasets.MNIST loads real files with no download."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np


IMAGE_MAGIC, LABEL_MAGIC = 2051, 2049  # unsigned bytes in 3 dimensions / in 1 dimension


def write_idx_images(path: Path, images: np.ndarray, magic: int = IMAGE_MAGIC) -> None:
    """An IDX image file; `magic` other than 2051 writes a corrupt one (for the hostile-input tests)."""
    n, h, w = images.shape
    path.write_bytes(struct.pack(">IIII", magic, n, h, w) + images.astype(np.uint8).tobytes())


def write_idx_labels(path: Path, labels: np.ndarray, magic: int = LABEL_MAGIC) -> None:
    """An IDX label file; `magic` other than 2049 writes a corrupt one."""
    path.write_bytes(struct.pack(">II", magic, len(labels)) + labels.astype(np.uint8).tobytes())


def read_idx(path: Path) -> np.ndarray:
    """The uint8 array an IDX file written here holds (for the tests that corrupt one entry)."""
    raw = Path(path).read_bytes()
    dims = raw[3]
    shape = struct.unpack(f">{dims}I", raw[4:4 + 4 * dims])
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * dims).reshape(shape).copy()


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
