"""When the fused Triton kernels run, and how they run on a CPU (Triton's interpreter).

One switch, the environment variable ``MOSAICS_FUSED``:

- ``0``: never; every kernel takes its chunked PyTorch path (the reference);
- unset (default): the fused kernels run on CUDA tensors, the chunked path on CPU;
- ``1``: always; on CPU tensors the Triton kernels run under Triton's interpreter
  (numpy, slow: for checking them without a GPU, at small shapes).

A Triton kernel module (plain ``@triton.jit`` functions at module level) is loaded through
:func:`triton_module`. Triton decides at import whether it interprets its kernels
(``TRITON_INTERPRET=1``), for the whole process; a first fused call on CPU tensors with
``MOSAICS_FUSED=1`` sets that variable itself when nothing has imported Triton yet (the test
suite sets it in ``tests/conftest.py`` on machines without CUDA). A kernel that cannot take
its fused path where the switch asks for it says why once (:func:`note_path`, logged), and the
path each kernel took last is kept for ``bench/gpu_check.py`` (:data:`PATHS`).

Tiles: each fused op has a small set of named launch configurations (:data:`TILES`: block
sizes, warps, stages), each checked against the reference under the interpreter and lowered
to Triton IR (tests/test_ops_tiles.py, tests/test_fused_offsets.py); without an override an
op picks its tiles by its own rule (head size, dtype, device).
``MOSAICS_TILES=power=m128n64w8,knn=m32n64w4`` in the environment, or :func:`use_tiles` in
code, pins one per op (on CPU tensors too, under the interpreter), for timing them against
each other and keeping the fastest.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from torch import Tensor

ENV_SWITCH = "MOSAICS_FUSED"
ENV_TILES = "MOSAICS_TILES"
# op -> {name: launch parameters}. power (the power kernels) and knn: BLOCK_M query rows x
# BLOCK_N keys per tile (knn: BLOCK_N at least the padded k); linear (FSKA's scan): BK
# features per tile of the forward (the backward takes at most BK), the chunk rows C being
# the caller's.
TILES: dict[str, dict[str, dict[str, int]]] = {
    "power": {
        "m64n64w8": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8},
        "m64n32w8": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8},
        "m128n64w8": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8},
        "m128n32w8": {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8},
        "m64n64w4": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4},
    },
    "knn": {
        "m64n64w4": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4},
        "m32n64w4": {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4},
        "m32n32w4": {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4},
        "m64n64w8": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8},
        "m128n64w8": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8},
    },
    "linear": {
        "k32w8s2": {"BK": 32, "num_warps": 8, "num_stages": 2},
        "k16w8s2": {"BK": 16, "num_warps": 8, "num_stages": 2},
        "k32w4s2": {"BK": 32, "num_warps": 4, "num_stages": 2},
        "k16w4s3": {"BK": 16, "num_warps": 4, "num_stages": 3},
    },
}
_PINNED: dict[str, str | None] = {}  # use_tiles() overrides, before the environment's
PATHS: dict[str, str] = {}  # kernel name -> "fused" / "chunked: <why>" of its last retrieval
_LOGGED: set[tuple[str, str]] = set()
logger = logging.getLogger("mosaics.fused")


def fused_setting() -> str:
    """``MOSAICS_FUSED`` as "never", "auto" or "always" (an unknown value is an error)."""
    value = os.environ.get(ENV_SWITCH, "").strip()
    if value in ("", "auto"):
        return "auto"
    if value == "0":
        return "never"
    if value == "1":
        return "always"
    raise ValueError(f"{ENV_SWITCH}={value!r}: use 0 (never), 1 (always; on CPU through "
                     "Triton's interpreter) or leave it unset (on CUDA)")


def triton_available(cpu: bool = False) -> str | None:
    """None when ``triton`` imports (and, ``cpu``, interprets its kernels), else why not."""
    if cpu and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure means no fused path
        return f"triton is not importable ({type(err).__name__}: {err}); pip install triton"
    if not hasattr(triton, "constexpr_function"):  # the kNN kernels' constexpr helpers
        return (f"triton {getattr(triton, '__version__', '?')} is older than 3.5; "
                "pip install 'triton>=3.5'")
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4; earlier, the environment says
    interpreting = (bool(knobs.runtime.interpret) if knobs is not None
                    else os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))
    if cpu and not interpreting:
        return ("triton was imported without its interpreter: start Python with "
                "TRITON_INTERPRET=1 to run the fused kernels on CPU tensors")
    return None


def fused_reason(*tensors: Tensor) -> str | None:
    """None when the fused path should run for these tensors, else the reason it does not
    (the switch, the device, a missing ``triton``)."""
    setting = fused_setting()
    if setting == "never":
        return f"{ENV_SWITCH}=0"
    devices = {t.device.type for t in tensors}
    if len(devices) != 1:
        return f"tensors on several devices {sorted(devices)}"
    device = devices.pop()
    if device not in ("cuda", "cpu"):
        return f"no fused kernels for device {device!r}"
    if device == "cpu" and setting != "always":
        return f"CPU tensors ({ENV_SWITCH}=1 runs the kernels under Triton's interpreter)"
    return triton_available(cpu=device == "cpu")


def note_path(kernel: str, reason: str | None, *, expected: bool = True) -> None:
    """Record the path a kernel took (``reason`` None: fused). A fallback where the switch
    asked for the fused path (``expected``) is logged once per kernel and reason."""
    PATHS[kernel] = "fused" if reason is None else f"chunked: {reason}"
    if reason is not None and expected and (kernel, reason) not in _LOGGED:
        _LOGGED.add((kernel, reason))
        logger.warning("kernel %r takes its chunked path: %s", kernel, reason)


def fused_expected(*tensors: Tensor) -> bool:
    """Whether the switch asks for the fused path on these tensors' device (so that a
    fallback is worth a log line)."""
    setting = fused_setting()
    return setting == "always" or (setting == "auto" and tensors[0].device.type == "cuda")


def _check_tiles(op: str, name: str, source: str) -> str:
    if op not in TILES:
        raise ValueError(f"{source}: no fused op {op!r}; ops: {', '.join(TILES)}")
    if name not in TILES[op]:
        raise ValueError(f"{source}: no tiles {name!r} for {op!r}; choose one of "
                         f"{', '.join(TILES[op])}")
    return name


def _env_tiles() -> dict[str, str]:
    """``MOSAICS_TILES`` as {op: tile name} (an unknown op or name is an error)."""
    chosen = {}
    for item in os.environ.get(ENV_TILES, "").replace(" ", "").split(","):
        if not item:
            continue
        op, sep, name = item.partition("=")
        if not sep:
            raise ValueError(f"{ENV_TILES}: {item!r} is not op=name (e.g. power=m128n64w8)")
        chosen[op] = _check_tiles(op, name, ENV_TILES)
    return chosen


def pinned_tiles(op: str) -> dict[str, int] | None:
    """The launch parameters pinned for ``op`` (:func:`use_tiles`, else ``MOSAICS_TILES``),
    or None: the op's own rule."""
    name = _PINNED[op] if op in _PINNED else _env_tiles().get(op)
    return None if name is None else TILES[op][name]


@contextmanager
def use_tiles(op: str, name: str | None) -> Iterator[None]:
    """Run ``op``'s fused kernels with the tiles ``name`` of :data:`TILES` inside the block
    (None: the op's own rule, whatever the environment says)."""
    if name is not None:
        _check_tiles(op, name, "use_tiles")
    missing = object()
    before = _PINNED.get(op, missing)
    _PINNED[op] = name
    try:
        yield
    finally:
        if before is missing:
            del _PINNED[op]
        else:
            _PINNED[op] = before


def cdiv(a: int, b: int) -> int:
    """ceil(a / b): the launch grid over blocks of b."""
    return -(-a // b)


def pow2_at_least(x: int, least: int) -> int:
    """The smallest power of two >= max(x, least) (Triton block sizes)."""
    return max(least, 1 << max(0, int(x) - 1).bit_length())


def kernel_source(module_file: str, name: str) -> Path:
    """The Triton source ``name`` of the op module at ``module_file``: ``triton_kernels/
    <name>.py`` beside it in the package, or ``ops_triton_kernels_<name>.py`` beside a flat
    copy of the model code (``trust_remote_code``, :mod:`mosaics.remote_code`)."""
    here = Path(module_file).resolve().parent
    packaged = here / "triton_kernels" / f"{name}.py"
    return packaged if packaged.exists() else here / f"ops_triton_kernels_{name}.py"


@functools.cache
def _load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"mosaics.ops._triton_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def triton_module(path: str | Path, device: object = None) -> ModuleType:
    """The Triton kernel module at ``path`` (compiled, or interpreted under
    ``TRITON_INTERPRET=1``), loaded once. ``device`` is accepted for symmetry and unused:
    the mode is the process's."""
    return _load(str(path))
