"""Argument types and checks shared by the ``mosaics eval`` subcommands
(:mod:`mosaics.evaluation.cli` and :mod:`mosaics.evaluation.analysis.commands`)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any


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


def setting_arg(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE read as YAML (numbers, lists, null)."""
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip().replace("-", "_"), yaml.safe_load(value)
    except yaml.YAMLError as err:
        raise argparse.ArgumentTypeError(f"{text}: {err}") from None


def labelled_path(arg: str) -> tuple[str, Path]:
    label, sep, path = arg.partition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"expected LABEL=path/to/perplexity.json, got {arg!r}")
    return label, Path(path)


def check_model_dirs(parser: argparse.ArgumentParser, dirs: list[str] | None,
                     changes: list[tuple[str, Any]] | None = None) -> None:
    if changes and not dirs:
        parser.error("--model-set changes the config of saved models: pass them with --model")
    for d in dirs or []:
        if not os.path.isfile(os.path.join(d, "config.json")):
            parser.error(f"--model {d}: not a saved model directory (no config.json)")


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
