"""Write the model's code beside a checkpoint so ``trust_remote_code=True`` loads it.

transformers copies a custom model's file and its relative imports only when they are flat
modules in one folder (it cannot follow ``from .kernels.gaussian import``). So the modules
the model needs are written flat: ``kernels/gaussian.py`` becomes ``kernels_gaussian.py``,
``kernels/__init__.py`` becomes ``kernels.py``, and relative imports are rewritten to match.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
TOP_LEVEL = ["configuration_mosaics.py", "modeling_mosaics.py", "memory.py",
             "persistent_memory.py", "recall.py", "positions.py", "cache.py", "compilation.py",
             "remote_code.py"]
SUBPACKAGES = ["kernels", "ops", "ops/triton_kernels"]  # the last: the fused kernels' sources


def _flat_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return "_".join(parts)


def _rewrite(source: str, subpackage: str | None) -> str:
    def sub_from(match: re.Match) -> str:
        dots, target = match.group(2), match.group(3)
        if subpackage is None or dots == "..":  # top-level module: .kernels.x -> .kernels_x
            flat = target.replace(".", "_")
        else:  # .base inside kernels/ -> .kernels_base
            flat = f"{subpackage}_{target.replace('.', '_')}"
        return f"{match.group(1)}from .{flat} import"

    return re.sub(r"^(\s*)from\s+(\.{1,2})([\w.]+)\s+import", sub_from, source, flags=re.M)


def flat_sources() -> dict[str, str]:
    """{flat file name: source} of every module the model needs."""
    files = {name: _rewrite((PACKAGE_DIR / name).read_text(), None) for name in TOP_LEVEL}
    for sub in SUBPACKAGES:
        for path in sorted((PACKAGE_DIR / sub).glob("*.py")):
            rel = path.relative_to(PACKAGE_DIR)
            files[f"{_flat_name(rel)}.py"] = _rewrite(path.read_text(), sub.replace("/", "_"))
    return files


def save_model_code(directory: str | os.PathLike) -> list[str]:
    """Write the flat model code into ``directory``; returns the file names."""
    directory = Path(directory)
    if (PACKAGE_DIR / "modeling_mosaics.py").exists() is False:
        return []
    if Path(__file__).resolve().parent == directory.resolve():
        return []  # already running from a flat copy
    written = []
    for name, text in flat_sources().items():
        tmp = directory / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, directory / name)
        written.append(name)
    return written
