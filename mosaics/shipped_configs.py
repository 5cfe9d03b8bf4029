"""Recipes that ship with the package: YAML training configs, accelerate and DeepSpeed files.

They live in the checkout's top-level ``configs/``; ``mosaics/recipes`` links to it, so the
wheel installs them as the data package ``mosaics.recipes``. A recipe is named by its path below
that folder without the suffix (``babistories_124m``, ``accelerate/gpu_ddp``,
``deepspeed/zero2``).
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from .errors import ConfigError

RECIPE_PACKAGE = "mosaics.recipes"
SUFFIXES = (".yaml", ".yml", ".json")


def recipe_root() -> Path:
    """The folder holding the recipes: ``configs/`` of the checkout this package was imported
    from, else the installed ``mosaics.recipes`` package."""
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / "configs/default.yaml").is_file():
        return checkout / "configs"
    spec = importlib.util.find_spec(RECIPE_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            if (Path(location) / "default.yaml").is_file():
                return Path(location)
    raise ConfigError(f"The shipped recipes ({RECIPE_PACKAGE}) are missing from this install; "
                      "reinstall the mosaics package or pass a config file path.")


def list_recipes() -> list[str]:
    """Names of every shipped recipe, sorted (``accelerate/gpu_ddp``, ``default``, ...)."""
    root = recipe_root()
    return sorted(p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*")
                  if p.is_file() and p.suffix in SUFFIXES)


def recipe_path(name: str) -> Path:
    """The file of the recipe ``name`` (with or without suffix, ``configs/`` prefix allowed)."""
    root = recipe_root()
    rel = name.removeprefix("configs/")
    candidates = [root / rel] if Path(rel).suffix in SUFFIXES else \
        [root / f"{rel}{suffix}" for suffix in SUFFIXES]
    for path in candidates:
        if path.is_file() and path.resolve().is_relative_to(root.resolve()):
            return path
    raise ConfigError(f"No config file or shipped recipe named {name!r}. Pass an existing file "
                      f"or one of: {', '.join(list_recipes())}.")


def resolve_config(name_or_path: str) -> Path:
    """An existing file path wins; otherwise ``name_or_path`` names a shipped recipe."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    return recipe_path(name_or_path)


def copy_recipes(dest: str | Path) -> Path:
    """Copy all recipes to ``dest/configs`` so the templates' relative paths
    (``configs/deepspeed/zero2.json``) work from ``dest``; refuses to overwrite."""
    target = Path(dest) / "configs"
    if target.exists():
        raise ConfigError(f"{target} already exists; remove it or choose another folder.")
    shutil.copytree(recipe_root(), target,
                    ignore=shutil.ignore_patterns("__init__.py", "__pycache__"))
    return target
