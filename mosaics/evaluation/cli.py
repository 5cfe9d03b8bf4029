"""Argument helpers shared by the evaluation entry points under ``eval/``."""

from __future__ import annotations

import argparse
import json
import os


def kernel_kwargs_arg(text: str) -> dict:
    """Parse ``--kernel-kwargs '{"k": 8}'`` into a dict."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"--kernel-kwargs must be a JSON object: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--kernel-kwargs must be a JSON object, e.g. '{\"k\": 8}'")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def check_kernels(parser: argparse.ArgumentParser, kernels: list[str]) -> None:
    """Exit with the list of registered kernels if any name is unknown."""
    from mosaics import available_kernels

    unknown = [k for k in kernels if k not in available_kernels()]
    if unknown:
        parser.error(f"unknown kernel(s) {', '.join(unknown)}; registered kernels: "
                     f"{', '.join(available_kernels())}")


def check_model_dirs(parser: argparse.ArgumentParser, dirs: list[str] | None) -> None:
    for d in dirs or []:
        if not os.path.isfile(os.path.join(d, "config.json")):
            parser.error(f"--model {d}: not a saved model directory (no config.json)")


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def offline() -> None:
    """Never reach the network at run time."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
