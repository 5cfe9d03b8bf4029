"""Atomic training checkpoints and exact resume.

Layout of ``<run_dir>/checkpoints/step_XXXXXXX/``::

    model.safetensors        weights (safetensors: nothing is unpickled on load)
    optimizer.pt, scheduler.pt
                             state dicts of tensors and numbers, read with weights_only=True
    deepspeed/state/         instead of model and optimizer under DeepSpeed: the engine's own
                             checkpoint (ZeRO shards one file per process)
    rank_<r>.pt              RNG states of process r (torch, CUDA, numpy, python)
    rank_<r>.json            data-sampler state of process r
    trainer_state.json       step, tokens seen, world size, accumulation, DeepSpeed or not,
                             the training config and the model config
    manifest.json            written last: size and SHA-256 of every other file

Every file of a save goes through :func:`write_file` (and the final rename through
:func:`rename`); a failure there (full disk, I/O error, permissions) removes the temporary
folder and raises :class:`CheckpointWriteError`, leaving every earlier checkpoint as it was.

A checkpoint is written into ``.tmp-step_XXXXXXX``, every file is fsynced, the manifest is
written, and only then is the folder renamed into place (and the parent fsynced). A folder
without the manifest is never loaded: an interrupted save leaves at most a ``.tmp-`` folder,
which the next save removes. Resume checks every file against the manifest and falls back to
the newest intact checkpoint when the newest one is damaged (truncated, altered, missing files).

DeepSpeed reads its own files with ``torch.load(weights_only=False)``, which unpickles: resume
a DeepSpeed run only from a run directory you wrote. DDP checkpoints unpickle nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model

from ..errors import CheckpointError

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (disk full, I/O error, permissions)."""


def write_file(path: Path, write: Callable[[str], Any]) -> None:
    """Write one file of a checkpoint with ``write(str(path))``: every file of a save goes
    through here. torch's and safetensors' writers report a failed write (full disk, file
    too large) as their own errors; they are raised as ``OSError`` naming ``path``."""
    try:
        write(str(path))
    except OSError:
        raise
    except (RuntimeError, SafetensorError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise OSError(0, f"write failed ({first.strip()})", str(path)) from err


def rename(src: Path, dst: Path) -> None:
    """``os.replace``: the rename that publishes a finished checkpoint."""
    os.replace(src, dst)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def tmp_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return checkpoint_root(run_dir) / f".tmp-{step_dir_name(step)}"


def is_complete(path: str | os.PathLike) -> bool:
    """A finished save (its manifest exists); see :func:`verify` for whether it is intact."""
    return (Path(path) / MANIFEST).is_file()


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints as (step, path), oldest first; incomplete folders are skipped."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir() and is_complete(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


# --- integrity --------------------------------------------------------------------------------

def _sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: Path) -> Path:
    """Record size and SHA-256 of every file under ``folder`` in ``manifest.json``."""
    entries = {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
               for p in _files(folder)}
    path = folder / MANIFEST
    text = json.dumps({"files": entries}, indent=1)
    write_file(path, lambda name: Path(name).write_text(text))
    return path


def verify(path: str | os.PathLike) -> str | None:
    """``None`` if every file of the checkpoint matches its manifest, else what is wrong
    (naming the first bad file)."""
    path = Path(path)
    try:
        entries = json.loads((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"{MANIFEST} is missing (the save did not finish)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{MANIFEST} is unreadable ({err})"
    for name, entry in entries.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != entry["size"]:
            return f"{name} has {size} bytes, {entry['size']} were written (truncated or altered)"
        if _sha256(file) != entry["sha256"]:
            return f"{name} does not match its checksum (altered or corrupted)"
    return None


def find_resumable(run_dir: str | os.PathLike) -> tuple[Path | None, list[str]]:
    """The newest intact checkpoint of ``run_dir`` (or ``None``), and one warning line per
    newer checkpoint skipped because it is damaged or incomplete."""
    root = checkpoint_root(run_dir)
    candidates = []
    if root.is_dir():
        for path in root.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and path.is_dir():
                candidates.append((int(match.group(1)), path))
    skipped = []
    for _, path in sorted(candidates, reverse=True):
        problem = verify(path)
        if problem is None:
            return path, skipped
        skipped.append(f"checkpoint {path} is damaged: {problem}; trying an older one")
    return None, skipped


_NOT_MODEL = {"transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype",
              "auto_map", "initializer_seed", "output_hidden_states", "return_dict",
              "output_attentions", "use_cache", "id2label", "label2id"}


def model_config_dict(config: Any) -> dict[str, Any]:
    """The parts of a Hugging Face config that define the model's shape and math (as JSON
    reads them back)."""
    return json.loads(json.dumps({k: v for k, v in config.to_dict().items()
                                  if k not in _NOT_MODEL}, default=str))


def check_model_config(path: Path, config: Any) -> None:
    """Refuse a checkpoint written for a different model, saying what differs."""
    state = json.loads((path / "trainer_state.json").read_text())
    saved = state.get("model_config")
    if saved is None:
        return
    now = model_config_dict(config)
    diffs = [f"{k}: {saved.get(k)!r} in the checkpoint, {now.get(k)!r} now"
             for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    if diffs:
        raise CheckpointError(
            f"{path} was written for a different model ({'; '.join(diffs)}). Resume with the "
            "settings it was written with, start a fresh run in another run_dir, or pass "
            "fresh_start=true to move the earlier run aside.")


# --- random number generators -------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    """All RNG states as tensors and plain numbers (loadable with weights_only=True)."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_meta": [int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": _python_state_to_tensor(random.getstate()),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    pos, has_gauss, cached = state["numpy_meta"]
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), pos,
                         has_gauss, cached))
    random.setstate(_python_state_from_tensor(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _python_state_to_tensor(state: tuple) -> torch.Tensor:
    version, internal, _ = state
    return torch.tensor([version, *internal], dtype=torch.int64)


def _python_state_from_tensor(tensor: torch.Tensor) -> tuple:
    values = [int(v) for v in tensor.tolist()]
    return (values[0], tuple(values[1:]), None)


# --- save / load ----------------------------------------------------------------------------

def prepare_save(run_dir: str | os.PathLike, step: int) -> Path:
    """Main process: a fresh, empty temporary folder for the checkpoint of ``step``."""
    tmp = tmp_dir(run_dir, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def save_rank_state(tmp: Path, rank: int, data_state: dict[str, Any]) -> None:
    """Every process: its RNG and data-sampler states."""
    rng, text = rng_state(), json.dumps(data_state)
    write_file(tmp / f"rank_{rank}.pt", lambda name: torch.save(rng, name))
    write_file(tmp / f"rank_{rank}.json", lambda name: Path(name).write_text(text))


def save_main_state(tmp: Path, model: torch.nn.Module | None,
                    optimizer: torch.optim.Optimizer | None, scheduler: Any,
                    trainer_state: dict[str, Any]) -> None:
    """Main process: weights and optimizer (unless DeepSpeed wrote them: ``None``), scheduler
    and trainer state."""
    if model is not None:
        write_file(tmp / "model.safetensors", lambda name: save_model(model, name))
    if optimizer is not None:
        write_file(tmp / "optimizer.pt", lambda name: torch.save(optimizer.state_dict(), name))
    write_file(tmp / "scheduler.pt", lambda name: torch.save(scheduler.state_dict(), name))
    text = json.dumps(trainer_state, indent=1)
    write_file(tmp / "trainer_state.json", lambda name: Path(name).write_text(text))


def finalize_save(run_dir: str | os.PathLike, step: int, keep: int = 0) -> Path:
    """Main process, after every process wrote its files: fsync, marker, rename, prune."""
    tmp = tmp_dir(run_dir, step)
    for path in sorted(tmp.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_file():
            _fsync_file(path)
        else:
            _fsync_dir(path)
    manifest = write_manifest(tmp)
    _fsync_file(manifest)
    _fsync_dir(tmp)
    final = checkpoint_root(run_dir) / step_dir_name(step)
    replaced = final.with_name(f".old-{final.name}")
    if final.exists():  # the same step again: keep the old copy until the new one is in place
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    rename(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(replaced, ignore_errors=True)
    if keep > 0:
        for _, old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoint_bytes(path: Path) -> int:
    """Bytes of a complete checkpoint, from its manifest."""
    entries = json.loads((path / MANIFEST).read_text())["files"]
    return sum(int(e["size"]) for e in entries.values())


def _size(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def save_failure_message(run_dir: str | os.PathLike, step: int, err: OSError,
                         estimate: int) -> str:
    """One line: what failed, the space free and needed, and how to continue."""
    target = checkpoint_root(run_dir) / step_dir_name(step)
    done = list_checkpoints(run_dir)
    try:
        free = shutil.disk_usage(checkpoint_root(run_dir)).free
        free_text = f"{_size(free)} free there"
    except OSError:
        free_text = "free space unknown"
    where = f" ({err.filename})" if err.filename else ""
    resume = f"from {done[-1][1].name}" if done else "from the start (no checkpoint yet)"
    return (f"cannot write checkpoint {target}: {err.strerror or err}{where}; {free_text}, a "
            f"checkpoint needs about {_size(estimate)}. Earlier checkpoints are "
            f"intact: free space (or fix permissions) and run the same command again to resume "
            f"{resume}.")


def read_trainer_state(path: Path) -> dict[str, Any]:
    """``trainer_state.json`` of a checkpoint."""
    return json.loads((path / "trainer_state.json").read_text())


def _read_states(path: Path, rank: int, world_size: int | None, deepspeed: bool,
                 universal: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Trainer state and this rank's data-source state, after checking the checkpoint fits
    (``world_size=None``: the writer's process count). A DDP checkpoint resumes on any
    number of processes (the data source then checks the global batch); a DeepSpeed one only
    on the number that wrote it, unless it was converted to DeepSpeed's universal form
    (``universal``), since its optimizer state is partitioned."""
    if not is_complete(path):
        raise CheckpointError(f"{path} has no {MANIFEST}: it is incomplete and cannot be loaded.")
    trainer_state = read_trainer_state(path)
    written_by_ds = bool(trainer_state.get("deepspeed", False))
    if written_by_ds != deepspeed:
        writer, reader = (("DeepSpeed", "DDP or one process") if written_by_ds
                          else ("DDP or one process", "DeepSpeed"))
        raise CheckpointError(f"{path} was written by a {writer} run and cannot be resumed under "
                              f"{reader} (the optimizer state is laid out differently); resume "
                              f"with the launcher that wrote it, or start a fresh run.")
    written = trainer_state.get("world_size")
    if deepspeed and not universal and world_size is not None and written != world_size:
        raise CheckpointError(
            f"{path} holds DeepSpeed ZeRO optimizer state partitioned over {written} processes "
            f"and this run has {world_size}; resume with {written} processes, or let the "
            f"trainer convert it to DeepSpeed's universal checkpoint.")
    same = world_size is None or written == world_size
    rank_json = path / f"rank_{rank if same else 0}.json"
    if not rank_json.is_file():
        raise CheckpointError(f"{path} has no data state for process {rank if same else 0} "
                              f"({rank_json.name} is missing).")
    return trainer_state, json.loads(rank_json.read_text())


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any, rank: int,
                    world_size: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore a complete checkpoint into ``model``/``optimizer``/``scheduler`` and, when the
    process count is the writer's, this process's RNG. Returns (trainer state, this rank's
    data-source state)."""
    trainer_state, data_state = _read_states(path, rank, world_size, deepspeed=False)
    try:
        missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
    except Exception as err:  # safetensors raises its own error types
        raise CheckpointError(f"{path}/model.safetensors cannot be read ({err}).") from err
    if unexpected or missing:
        raise CheckpointError(f"{path}/model.safetensors does not match the model: missing "
                              f"{missing}, unexpected {unexpected}. Resume with the same config.")
    optimizer.load_state_dict(_load_tensors(path / "optimizer.pt"))
    scheduler.load_state_dict(_load_tensors(path / "scheduler.pt"))
    if world_size is None or trainer_state.get("world_size") == world_size:
        set_rng_state(_load_tensors(path / f"rank_{rank}.pt"))
    return trainer_state, data_state


def _load_tensors(path: Path) -> Any:
    """``torch.load(weights_only=True)``: tensors and plain containers only, never code."""
    try:
        return torch.load(path, weights_only=True)
    except Exception as err:  # unpickling errors, truncated zip archives...
        raise CheckpointError(f"{path} cannot be read ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''}).") from err


DEEPSPEED_DIR, DEEPSPEED_TAG = "deepspeed", "state"


def save_deepspeed_state(tmp: Path, engine: Any) -> None:
    """Every process (a collective): the DeepSpeed engine's weights and optimizer shards."""
    engine.save_checkpoint(str(tmp / DEEPSPEED_DIR), tag=DEEPSPEED_TAG, save_latest=False)


def load_deepspeed_checkpoint(path: Path, engine: Any, scheduler: Any, rank: int,
                              world_size: int,
                              universal: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every process (a collective): restore a DeepSpeed checkpoint into the prepared engine,
    ``scheduler`` and (same process count) this process's RNG; ``universal`` reads the
    process-count independent form made by :func:`universal_checkpoint` (the engine must have
    been configured with ``checkpoint.load_universal``). Returns (trainer state, data-source
    state)."""
    trainer_state, data_state = _read_states(path, rank, world_size, deepspeed=True,
                                             universal=universal)
    folder = path / DEEPSPEED_DIR / (UNIVERSAL_DIR if universal else "")
    loaded, _ = engine.load_checkpoint(str(folder), tag=DEEPSPEED_TAG,
                                       load_optimizer_states=True,
                                       load_lr_scheduler_states=False)
    if loaded is None:
        raise CheckpointError(f"DeepSpeed could not load {folder / DEEPSPEED_TAG}.")
    scheduler.load_state_dict(_load_tensors(path / "scheduler.pt"))
    if trainer_state.get("world_size") == world_size:
        set_rng_state(_load_tensors(path / f"rank_{rank}.pt"))
    return trainer_state, data_state


UNIVERSAL_DIR = "universal"


def universal_checkpoint(path: Path) -> Path:
    """Main process: convert the DeepSpeed state of checkpoint ``path`` to DeepSpeed's
    universal checkpoint (``deepspeed.checkpoint.ds_to_universal``: every parameter's weights
    and optimizer moments unpartitioned, loadable on any process count), once, atomically,
    into ``path/deepspeed/universal``."""
    import argparse
    import contextlib
    import io

    from deepspeed.checkpoint.ds_to_universal import main as convert

    target = path / DEEPSPEED_DIR / UNIVERSAL_DIR
    if (target / DEEPSPEED_TAG / "zero").is_dir():
        return target
    tmp = path / DEEPSPEED_DIR / f".tmp-{UNIVERSAL_DIR}"
    shutil.rmtree(tmp, ignore_errors=True)
    args = argparse.Namespace(input_folder=str(path / DEEPSPEED_DIR / DEEPSPEED_TAG),
                              output_folder=str(tmp / DEEPSPEED_TAG), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=True)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its progress chatter
            convert(args)
    except Exception as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{path}: DeepSpeed could not convert its state to a universal "
                              f"checkpoint ({type(err).__name__}: {err}); resume with the "
                              "process count that wrote it.") from err
    os.replace(tmp, target)
    return target
