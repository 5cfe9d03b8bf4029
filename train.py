"""Pretrain a Memory Mosaics model (or the matched GPT-2 baseline).

    python train.py                                   # small model, embedded corpus, CPU
    python train.py --config configs/babistories_124m.yaml data_source=/data/babistories
    python train.py max_steps=50 --lr 1e-3 --resume   # key=value, --key value, --flag

The same as ``mosaics train`` (``--config`` also takes a recipe name, ``--print-config`` shows
the resolved configuration). Every field of ``mosaics.training.TrainConfig`` can be overridden;
see docs/training.md for multi-process (accelerate, torchrun) and DeepSpeed launches.
"""

from __future__ import annotations

import sys

from mosaics.cli import train_main


def main(argv: list[str] | None = None) -> int:
    return train_main(sys.argv[1:] if argv is None else argv, prog="train.py")


if __name__ == "__main__":
    sys.exit(main())
