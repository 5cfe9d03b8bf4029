"""Data for pretraining: story corpora, loaders, tokenizers, token streams and samplers.

``prepare_corpus()`` is the one-call entry point; see docs/data.md.
"""

from .corpus import Corpus, default_cache_dir, prepare_corpus
from .loading import MalformedInputError, MissingSplitError, load_texts
from .storygen import (
    Story,
    context_oracle_report,
    generate_stories,
    generate_story_records,
    make_default_corpus,
    write_story_file,
)
from .stream import (
    RandomWindowBatches,
    fixed_validation_windows,
    stream_dtype,
    tokenize_to_stream,
    tokenizer_fingerprint,
)
from .tokenizer import EOT, load_tokenizer, train_bpe_tokenizer

__all__ = [
    "EOT",
    "Corpus",
    "MalformedInputError",
    "MissingSplitError",
    "RandomWindowBatches",
    "Story",
    "context_oracle_report",
    "default_cache_dir",
    "fixed_validation_windows",
    "generate_stories",
    "generate_story_records",
    "load_texts",
    "load_tokenizer",
    "make_default_corpus",
    "prepare_corpus",
    "stream_dtype",
    "tokenize_to_stream",
    "tokenizer_fingerprint",
    "train_bpe_tokenizer",
    "write_story_file",
]
