"""Errors caused by what a user gave us (files, data, configs, checkpoints).

Command-line entry points catch :class:`InputError` and print its message as one line, with no
traceback: the message itself names the file (and line, where there is one) and the fix.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class InputError(ValueError):
    """Bad user input; the message names the offending file or setting and the fix."""


class ConfigError(InputError):
    """A configuration file or setting cannot be used."""


class DataError(InputError):
    """A data source, data file or tokenizer cannot be used."""


class CheckpointError(InputError):
    """A checkpoint cannot be resumed from (damaged, or written by a different setup)."""
