"""A folder of images as a plug-in dataset: `--dataset manual_train.examples.image_folder:build --data-root DIR`
(docs/your-model.md).

    DIR/train/<class>/*.png     DIR/val/<class>/*.png     (torchvision.datasets.ImageFolder's layout)

    python launch/single.py --dataset manual_train.examples.image_folder:build --data-root my_images --model cnn

The folder is the existing --data-root flag (it is stored in checkpoints with the rest of the config, so --resume
and `python -m manual_train.evaluate` find the same images). Class ids are the sorted folder names of train/; val/
must hold the same classes. Images are read as RGB (ImageFolder's loader), or as one channel where the environment
variable MANUAL_TRAIN_GRAYSCALE=1 is set, scaled to [-1, 1]; every image must have the size of the first (no
resizing here: a transform of yours goes in `transform` below).

The contract it meets: `build(cfg)` takes the run's Config and returns (train, val, info) with info a dict of
num_classes and input_shape (one sample's C, H, W).
"""
from __future__ import annotations

import os
from pathlib import Path

from manual_train.errors import UsageError


def build(cfg):
    from torchvision import datasets
    from torchvision import transforms as T

    root = Path(cfg.data_root)
    steps = [T.Grayscale()] if os.environ.get("MANUAL_TRAIN_GRAYSCALE") == "1" else []
    transform = T.Compose(steps + [T.ToTensor(), T.Normalize(0.5, 0.5)])  # ToTensor: [0, 1]; then [-1, 1]
    splits = []
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise UsageError("--data-root", f"{root / split} is not a folder",
                             "DIR with train/<class>/ and val/<class>/")
        try:
            splits.append(datasets.ImageFolder(str(root / split), transform=transform))
        except (FileNotFoundError, OSError) as e:  # no class folders, or no images in them
            raise UsageError("--data-root", f"{root / split}: {str(e).splitlines()[0]}") from None
    train, val = splits
    if val.classes != train.classes:
        raise UsageError("--data-root", f"{root}/val's classes {val.classes} differ from train's {train.classes}")
    return train, val, dict(num_classes=len(train.classes), input_shape=tuple(train[0][0].shape))
