"""Load a text corpus from a file, a folder, a saved dataset or the Hugging Face hub.

``load_texts`` returns a ``datasets.Dataset`` with one column, ``text`` (memory-mapped Arrow,
cached under ``cache_dir``). Accepted sources, detected in this order:

- a directory holding ``traindataset.txt`` / ``valdataset.txt`` (BabiStories layout);
  ``split`` picks the file ("validation"/"val"/"valid"/"test" -> ``valdataset.txt``);
- a directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``;
- any other directory: ``datasets.load_dataset(directory)`` (parquet/csv/json/text files);
- a ``.jsonl`` / ``.json`` file: one JSON object per line holding ``text_column``;
- a ``.txt`` file with a JSON string among its first five non-empty lines: BabiStories
  format, one JSON-encoded story per line;
- any other ``.txt`` file: plain text, one document per paragraph (documents are separated by
  one or more blank lines; the lines inside a paragraph are kept, joined by newlines);
- otherwise a hub id ("owner/name" or "name", optionally "name:config"), through
  ``datasets.load_dataset``. Offline (``HF_HUB_OFFLINE=1``) it only uses the local HF cache;
  when the dataset is not there, or the hub is unreachable, it fails at once with a message
  saying how to get the data onto the machine.

A single-file source has only a "train" split; asking it for another split raises
``MissingSplitError`` (``prepare_corpus`` then carves a validation split out of train).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlparse

import datasets

from ..errors import DataError

__all__ = [
    "DataSourceNotFound",
    "HubUnavailableError",
    "MalformedInputError",
    "MissingSplitError",
    "load_texts",
    "split_file_name",
]

log = logging.getLogger(__name__)

BABI_TRAIN, BABI_VAL = "traindataset.txt", "valdataset.txt"
_VAL_SPLITS = {"validation", "val", "valid", "dev", "test"}


class MalformedInputError(DataError):
    """A line of an input file cannot be read; the message names the file and line."""


class MissingSplitError(DataError):
    """The source has no such split."""


class DataSourceNotFound(DataError, FileNotFoundError):
    """A local data source that does not exist."""


class HubUnavailableError(DataError, ConnectionError):
    """A hub dataset that cannot be loaded here (offline, not cached, unknown id)."""


def _open_text(path: str):
    """Open ``path`` as UTF-8 text, failing as :class:`DataError` when it cannot be read."""
    try:
        return open(path, encoding="utf-8")
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror}); check the path and its "
                        "permissions") from None


def _lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of a UTF-8 text file; a file that is not UTF-8 text (binary, or
    another encoding) raises :class:`DataError` naming the line."""
    lineno = 0
    with _open_text(path) as f:
        try:
            for lineno, line in enumerate(f, 1):  # noqa: B007 (used after the loop)
                yield lineno, line
        except UnicodeDecodeError as e:
            raise DataError(
                f"{path}:{lineno + 1}: not UTF-8 text ({e.reason} at byte {e.start} of the "
                "line); is this a binary or compressed file? Pass a UTF-8 .txt/.jsonl file or "
                "convert it (e.g. `iconv -t utf-8`)."
            ) from None


def _no_documents(path: str, what: str) -> DataError:
    return DataError(f"{path}: no documents found ({what}); pass a file with text in it")


def split_file_name(split: str) -> str:
    """BabiStories file name for a split: "train" -> traindataset.txt, "validation" -> val..."""
    s = split.lower()
    if s == "train":
        return BABI_TRAIN
    if s in _VAL_SPLITS:
        return BABI_VAL
    raise MissingSplitError(f"unknown split {split!r}: use 'train' or 'validation'")


def _file_key(path: Path, *extra: object) -> str:
    """Fingerprint of a local file: path, size and mtime plus the reading options."""
    st = path.stat()
    raw = json.dumps([str(path.resolve()), st.st_size, st.st_mtime_ns, *map(str, extra)])
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


def _malformed(path: str, lineno: int, what: str, skip: bool) -> None:
    if not skip:
        raise MalformedInputError(
            f"{path}:{lineno}: {what}. Fix the line or pass skip_malformed=True "
            "(--skip-malformed) to skip such lines."
        )


def _gen_json_lines(path: str, skip_malformed: bool,
                    extract: Callable[[object], tuple[str | None, str | None]],
                    prefix: str = "") -> Iterator[dict]:
    """``{"text": ...}`` per non-blank JSON line; ``extract(obj)`` gives ``(text, None)`` or
    ``(None, why)``, and a bad line raises (or is skipped and counted) with ``prefix + why``."""
    skipped = kept = 0
    for lineno, line in _lines(path):
        if not line.strip():
            continue
        try:
            text, why = extract(json.loads(line))
        except json.JSONDecodeError as e:
            text, why = None, f"not valid JSON ({e.msg})"
        if text is None:
            _malformed(path, lineno, prefix + why, skip_malformed)
            skipped += 1
            continue
        kept += 1
        yield {"text": text}
    if skipped:
        log.warning("%s: skipped %d malformed line(s)", path, skipped)
    if not kept:
        raise _no_documents(path, f"all {skipped} lines malformed" if skipped
                            else "the file is empty or holds only blank lines")


def _story_text(obj: object) -> tuple[str | None, str | None]:
    if isinstance(obj, str):
        return obj, None
    return None, f"expected a JSON string, got {type(obj).__name__}"


def _gen_babistories(path: str, skip_malformed: bool) -> Iterator[dict]:
    return _gen_json_lines(path, skip_malformed, _story_text, prefix="BabiStories line is ")


def _gen_jsonl(path: str, text_column: str, skip_malformed: bool) -> Iterator[dict]:
    def field(obj: object) -> tuple[str | None, str | None]:
        if isinstance(obj, dict) and isinstance(obj.get(text_column), str):
            return obj[text_column], None
        return None, (f"expected a JSON object with a string field {text_column!r}"
                      f" (got {type(obj).__name__}"
                      + (f" with keys {sorted(obj)[:8]}" if isinstance(obj, dict) else "")
                      + "); choose the field with text_column=/--text-column")

    return _gen_json_lines(path, skip_malformed, field)


def _gen_paragraphs(path: str) -> Iterator[dict]:
    para: list[str] = []
    kept = 0
    for _, line in _lines(path):
        line = line.rstrip("\n").rstrip("\r")
        if line.strip():
            para.append(line)
        elif para:
            kept += 1
            yield {"text": "\n".join(para)}
            para = []
    if para:
        kept += 1
        yield {"text": "\n".join(para)}
    if not kept:
        raise _no_documents(path, "the file is empty or holds only blank lines")


def _is_babistories(path: Path, probe: int = 5) -> bool:
    """True when one of the first ``probe`` non-empty lines is a JSON string (or no lines)."""
    seen = 0
    for _, line in _lines(str(path)):
        if not line.strip():
            continue
        try:
            if isinstance(json.loads(line), str):
                return True
        except json.JSONDecodeError:
            pass
        seen += 1
        if seen == probe:
            return False
    return seen == 0  # an empty file is an empty BabiStories file


def _from_generator(gen, gen_kwargs: dict, key: str, cache_dir: str | None) -> datasets.Dataset:
    features = datasets.Features({"text": datasets.Value("string")})
    try:
        return datasets.Dataset.from_generator(
            gen, features=features, gen_kwargs=gen_kwargs, cache_dir=cache_dir, fingerprint=key
        )
    except datasets.exceptions.DatasetGenerationError as e:
        cause = e.__cause__
        while cause is not None and not isinstance(cause, DataError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise type(cause)(str(cause)) from None
        raise


def _load_file(
    path: Path, split: str, text_column: str, skip_malformed: bool, cache_dir: str | None
) -> datasets.Dataset:
    if split.lower() != "train":
        raise MissingSplitError(f"{path} is a single file: it only has a 'train' split")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        key = _file_key(path, "jsonl", text_column, skip_malformed)
        return _from_generator(
            _gen_jsonl,
            {"path": str(path), "text_column": text_column, "skip_malformed": skip_malformed},
            key,
            cache_dir,
        )
    if _is_babistories(path):
        key = _file_key(path, "babistories", skip_malformed)
        return _from_generator(
            _gen_babistories, {"path": str(path), "skip_malformed": skip_malformed}, key, cache_dir
        )
    key = _file_key(path, "paragraphs")
    return _from_generator(_gen_paragraphs, {"path": str(path)}, key, cache_dir)


def _select_text(ds: datasets.Dataset, text_column: str, where: str) -> datasets.Dataset:
    if text_column not in ds.column_names:
        raise DataError(
            f"{where} has no column {text_column!r} (columns: {ds.column_names}); "
            "choose one with text_column=/--text-column"
        )
    ds = ds.select_columns([text_column])
    if text_column != "text":
        ds = ds.rename_column(text_column, "text")
    return ds


def _pick_split(dd: datasets.DatasetDict, split: str, where: str) -> datasets.Dataset:
    order = ["validation", "valid", "val", "dev", "test"]
    names = [split] + ([n for n in order if n != split] if split in _VAL_SPLITS else [])
    for name in names:
        if name in dd:
            return dd[name]
    raise MissingSplitError(f"{where} has no split {split!r} (splits: {list(dd)})")


def _hub_reachable(timeout: float = 2.0) -> bool:
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def _offline() -> bool:
    flags = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    return any(os.environ.get(f, "").upper() in ("1", "ON", "YES", "TRUE") for f in flags)


def _hub_help(source: str, reason: str) -> str:
    return (
        f"cannot load {source!r} from the Hugging Face hub: {reason}. It is not a local path "
        "either. To use it offline: on a machine with network run "
        f"`python -c \"import datasets; datasets.load_dataset('{source}').save_to_disk('DIR')\"`, "
        "copy DIR here and pass DIR as the source (or pre-fill the HF cache and set "
        "HF_HUB_OFFLINE=1). For BabiStories see data/README.md; with no source at all the "
        "built-in procedural story corpus is used."
    )


def _load_hub(source: str, split: str, text_column: str, cache_dir: str | None) -> datasets.Dataset:
    name, _, config = source.partition(":")
    offline = _offline()
    if not offline and not _hub_reachable():
        raise HubUnavailableError(_hub_help(source, "the hub is unreachable"))
    try:
        dd = datasets.load_dataset(name, config or None, cache_dir=cache_dir)
    except Exception as e:  # offline cache miss, unknown id, auth...
        reason = f"{type(e).__name__}: {e}"
        if offline:
            reason = (
                f"offline mode (HF_HUB_OFFLINE=1) and not usable from the local cache ({reason})"
            )
        raise HubUnavailableError(_hub_help(source, reason)) from None
    return _select_text(_pick_split(dd, split, source), text_column, source)


def load_texts(
    source: str,
    split: str = "train",
    text_column: str = "text",
    skip_malformed: bool = False,
    cache_dir: str | None = None,
) -> datasets.Dataset:
    """Load ``split`` of ``source`` as a Dataset with a single string column ``text``.

    See the module docstring for the accepted sources. Malformed lines raise
    ``MalformedInputError`` naming ``file:line``; with ``skip_malformed=True`` they are skipped
    and their count is logged (warning level) when the file is first read.
    """
    path = Path(os.path.expanduser(str(source)))
    if cache_dir is not None:
        cache_dir = str(Path(cache_dir).expanduser())
    if path.is_dir():
        babi = path / BABI_TRAIN
        if babi.is_file() or (path / BABI_VAL).is_file():
            f = path / split_file_name(split)
            if not f.is_file():
                raise MissingSplitError(f"{path} has no {f.name} for split {split!r}")
            key = _file_key(f, "babistories", skip_malformed)
            return _from_generator(
                _gen_babistories, {"path": str(f), "skip_malformed": skip_malformed}, key, cache_dir
            )
        if (path / "dataset_dict.json").is_file():
            dd = datasets.load_from_disk(str(path))
            return _select_text(_pick_split(dd, split, str(path)), text_column, str(path))
        if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
            if split.lower() != "train":
                raise MissingSplitError(f"{path} is a single saved split: it only has 'train'")
            return _select_text(datasets.load_from_disk(str(path)), text_column, str(path))
        try:
            dd = datasets.load_dataset(str(path), cache_dir=cache_dir)
        except (ValueError, FileNotFoundError, datasets.exceptions.DatasetGenerationError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(
                f"{path}: no readable dataset in this folder ({why}); pass a folder of "
                ".parquet/.csv/.json/.jsonl/.txt files, a saved dataset, or a single file"
            ) from None
        return _select_text(_pick_split(dd, split, str(path)), text_column, str(path))
    if path.is_file():
        return _load_file(path, split, text_column, skip_malformed, cache_dir)
    looks_local = str(source).startswith((".", "/", "~")) or Path(str(source)).suffix in (
        ".txt",
        ".jsonl",
        ".json",
    )
    if looks_local or str(source).count("/") > 1:
        raise DataSourceNotFound(f"{source}: no such file or directory; check data_source")
    return _load_hub(str(source), split, text_column, cache_dir)
