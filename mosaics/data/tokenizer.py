"""Byte-level BPE tokenizers: train one on the corpus, or load a saved one.

The trained tokenizer follows GPT-2's conventions: byte-level pre-tokenisation (no unknown
characters, no prefix space), one special token ``<|endoftext|>`` (id 0) that is the eos, bos,
unk *and* pad token. Documents are separated by eos in the token stream; padding, where a
caller needs it, must be masked with an attention mask (pad == eos).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..errors import DataError

__all__ = ["EOT", "load_tokenizer", "train_bpe_tokenizer"]

EOT = "<|endoftext|>"


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int = 4096, save_dir: str | os.PathLike | None = None
):
    """Train a byte-level BPE with ``vocab_size`` entries (256 bytes + merges + ``EOT``).

    Returns a ``transformers.PreTrainedTokenizerFast`` (eos = bos = unk = pad = ``EOT``), saved
    to ``save_dir`` (tokenizer.json + tokenizer_config.json) when given.
    """
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 257 or vocab_size > 2**32:
        raise ValueError(f"vocab_size must be in [257, 2**32] (256 bytes + EOT), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOT, bos_token=EOT, unk_token=EOT, pad_token=EOT
    )
    if save_dir is not None:
        fast.save_pretrained(str(Path(save_dir).expanduser()))
    return fast


def _looks_like_path(name: str) -> bool:
    """A file-system path rather than a hub id (``gpt2``, ``org/name``)."""
    return name.startswith((".", "~", os.sep)) or name.count("/") > 1 or os.sep != "/" and \
        os.sep in name


def load_tokenizer(name_or_path: str | os.PathLike):
    """Load a tokenizer with ``AutoTokenizer``: a local folder, or a hub id (``gpt2``), which
    comes from the local HF cache or is downloaded (never with ``HF_HUB_OFFLINE=1``).

    Offline without the files, the error names both ways out: a local folder holding the
    tokenizer, or ``tokenizer=null`` (a byte-level BPE trained on the corpus). A tokenizer
    without an eos token gets none added: callers need ``tokenizer.eos_token_id``.
    """
    from transformers import AutoTokenizer

    name = str(name_or_path)
    path = Path(name).expanduser()
    fix = ("Pass a folder holding tokenizer.json (e.g. a saved model or one written by "
           "train_bpe_tokenizer), or a hub id such as gpt2; leave it unset (null) to "
           "train a byte-level BPE on the corpus.")
    if path.is_dir() and not any(
        (path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")
    ):
        raise DataError(f"tokenizer folder {path} has no tokenizer files (tokenizer.json, "
                        f"tokenizer_config.json or vocab.json). {fix}")
    if not path.exists() and _looks_like_path(name):
        raise DataError(f"tokenizer folder {path} does not exist. {fix}")
    try:
        if path.exists():
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        else:  # a hub id: the local cache, else a download unless HF_HUB_OFFLINE=1
            tok = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as e:
        if path.exists():
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"cannot load tokenizer {name!r} locally ({why}). {fix}") from None
        raise DataError(
            f"cannot get tokenizer {name!r} from the Hugging Face hub (offline or unreachable, "
            f"and not in the local cache): set tokenizer= to a local folder with its files "
            f"(tokenizer.json; save one with AutoTokenizer.from_pretrained({name!r})"
            f".save_pretrained(DIR) where the hub is reachable), or tokenizer=null to train a "
            f"byte-level BPE on the corpus offline.") from None
    if tok.eos_token_id is None:
        raise DataError(
            f"tokenizer {name!r} has no eos token; documents are separated by eos in the token "
            "stream, so set one (tokenizer.eos_token = ...) and save it again."
        )
    return tok
