"""Pretrain a Memory Mosaics model (or the matched GPT-2 baseline).

    python train.py                                   # small model, embedded corpus, CPU
    python train.py --config configs/babistories_124m.yaml data_source=/data/babistories
    python train.py max_steps=50 --lr 1e-3 --resume   # key=value, --key value, --flag

Every field of ``mosaics.training.TrainConfig`` can be overridden; see docs/training.md for
multi-process (accelerate, torchrun) and DeepSpeed launches.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():  # DeepSpeed otherwise warns on import that it found no GPU
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

from mosaics.errors import InputError  # noqa: E402
from mosaics.training import config_from_argv, train  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        from mosaics.training.config import field_names
        print("fields:", ", ".join(field_names()))
        return 0
    try:
        train(config_from_argv(args))
    except InputError as err:  # bad data, config or checkpoint: the message says what to do
        print(f"train.py: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
