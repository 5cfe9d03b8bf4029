"""The ``mosaics`` command (also ``python -m mosaics``).

    mosaics train [--config NAME_OR_PATH] [--print-config] [--nproc N [--deepspeed JSON]]
                  [key=value | --key value ...]
    mosaics eval COMMAND ...               (`mosaics eval --help` lists the commands)
    mosaics convert-reference CKPT OUT_DIR [--tokenizer NAME_OR_PATH]
    mosaics configs {list,show,path,copy} ...
    mosaics bench SCRIPT [args ...]        (from a git checkout only)
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections.abc import Callable
from pathlib import Path

from . import __version__
from .errors import InputError

TRAIN_USAGE = """\
usage: {prog} [--config NAME_OR_PATH] [--print-config] [--nproc N [--deepspeed JSON]]
       [key=value | --key value | --flag ...]

Pretrain a Memory Mosaics model (or the matched GPT-2 baseline).

  {prog}                                    # small model, embedded corpus, CPU
  {prog} --config babistories_124m data_source=/data/babistories
  {prog} max_steps=50 --lr 1e-3 --resume    # key=value, --key value, --flag
  {prog} --nproc 2 batch_size=4             # 2 ranks on this machine (gloo on CPU)
  {prog} --nproc 8 --deepspeed configs/deepspeed/zero2.json --config babistories_124m

--config takes a YAML file or the name of a shipped recipe ({recipes}).
--print-config prints the resolved configuration and exits without training.
--nproc N starts N ranks on this machine and waits for them (--deepspeed CONFIG.json: under
DeepSpeed); a SIGTERM or SIGUSR1 to it reaches every rank once and it exits 75 after their
checkpoint (docs/training.md).
Every field below can be overridden; see docs/training.md for multi-process (accelerate,
torchrun) and DeepSpeed launches.
"""


def _prepare_training_env() -> None:
    import torch

    if not torch.cuda.is_available():  # DeepSpeed otherwise warns on import that it found no GPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _resolve_config_arg(args: list[str]) -> list[str]:
    """Replace the value of ``--config X`` / ``--config=X`` / ``config=X`` by a file path
    (a shipped recipe name becomes its installed path)."""
    from .shipped_configs import resolve_config

    out = list(args)
    for i, arg in enumerate(out):
        for prefix in ("--config=", "config="):
            if arg.startswith(prefix):
                out[i] = prefix + str(resolve_config(arg[len(prefix):]))
        if arg == "--config":
            if i + 1 >= len(out):
                raise InputError("--config needs a value: --config NAME_OR_PATH.")
            out[i + 1] = str(resolve_config(out[i + 1]))
    return out


def train_main(argv: list[str] | None = None, prog: str = "mosaics train") -> int:
    """Parse the training arguments, then train (or print the resolved config)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in args):
        from .shipped_configs import list_recipes
        from .training.config import field_names

        recipes = ", ".join(r for r in list_recipes() if "/" not in r)
        print(TRAIN_USAGE.format(prog=prog, recipes=recipes))
        print("fields:", ", ".join(field_names()))
        return 0
    print_config = "--print-config" in args
    args = [a for a in args if a != "--print-config"]
    _prepare_training_env()
    from .training import config_from_argv, train
    from .training.launch import launch, pop_deepspeed, pop_nproc

    try:
        nproc, args = pop_nproc(args)
        deepspeed, args = pop_deepspeed(args)
        if deepspeed is not None and nproc is None:
            raise InputError("--deepspeed goes with --nproc N (the ranks this command starts); "
                             "under another launcher use its DeepSpeed options.")
        config = config_from_argv(_resolve_config_arg(args))
        if print_config:
            import yaml

            print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
            return 0
        if nproc is not None and (nproc > 1 or deepspeed is not None):
            if os.environ.get("WORLD_SIZE", "1") != "1":
                raise InputError("--nproc starts the ranks itself; drop it when a launcher "
                                 f"(torchrun, accelerate, srun) already did (WORLD_SIZE="
                                 f"{os.environ['WORLD_SIZE']}).")
            return launch(nproc, args, prog, deepspeed)
        from .training.trainer import flush_denormals_early

        flush_denormals_early(config.flush_denormal)  # CPU arithmetic only
        train(config)
    except InputError as err:  # bad data, config or checkpoint: the message says what to do
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    return 0


def eval_main(argv: list[str]) -> int:
    """Hand every argument to ``mosaics.evaluation.cli.main``."""
    from .evaluation import cli as evaluation_cli

    entry: Callable[[list[str] | None], int] | None = getattr(evaluation_cli, "main", None)
    if entry is None:
        print("mosaics eval: error: this install has no evaluation command line "
              "(mosaics.evaluation.cli.main is missing); update the mosaics package, or run "
              "the scripts under eval/ from a checkout.", file=sys.stderr)
        return 2
    return int(entry(argv) or 0)


def _checkout_bench() -> Path | None:
    bench = Path(__file__).resolve().parent.parent / "bench"
    return bench if bench.is_dir() else None


def bench_main(argv: list[str]) -> int:
    """Run ``bench/SCRIPT.py`` of the checkout this package was imported from."""
    bench = _checkout_bench()
    if bench is None:
        print("mosaics bench: error: the benchmark scripts (bench/*.py) exist only in a git "
              "checkout of mosaics, not in an installed wheel; clone the repository and run "
              "`mosaics bench` (or python bench/SCRIPT.py) from there.", file=sys.stderr)
        return 2
    scripts = sorted(p.stem for p in bench.glob("*.py") if not p.name.startswith("_"))
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mosaics bench SCRIPT [args ...]\n\nscripts in "
              f"{bench}: {', '.join(scripts)}\n`mosaics bench SCRIPT --help` for each one.")
        return 0
    name = argv[0].removesuffix(".py")
    if name not in scripts:
        print(f"mosaics bench: error: no script {name!r} in {bench}; choose one of "
              f"{', '.join(scripts)}.", file=sys.stderr)
        return 2
    path = bench / f"{name}.py"
    saved = sys.argv
    sys.argv = [str(path), *argv[1:]]
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        sys.argv = saved
    return 0


def _convert(args: argparse.Namespace) -> int:
    from .convert_reference import convert_reference

    out = convert_reference(args.checkpoint, args.out_dir, tokenizer=args.tokenizer,
                            overwrite=args.overwrite)
    print(f"wrote {out} (load with AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0


def _configs(args: argparse.Namespace) -> int:
    from .shipped_configs import copy_recipes, list_recipes, recipe_path, recipe_root

    if args.action == "list":
        print(f"# recipes in {recipe_root()}")
        print("\n".join(list_recipes()))
    elif args.action == "path":
        print(recipe_path(_need_name(args)))
    elif args.action == "show":
        print(recipe_path(_need_name(args)).read_text(encoding="utf-8"), end="")
    else:
        print(f"copied to {copy_recipes(args.name or '.')}")
    return 0


def _need_name(args: argparse.Namespace) -> str:
    if not args.name:
        raise InputError(f"mosaics configs {args.action} needs a recipe name "
                         "(see `mosaics configs list`).")
    return args.name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mosaics", description="Memory Mosaics language models: train, evaluate, convert.")
    parser.add_argument("--version", action="version", version=f"mosaics {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("train", add_help=False,
                   help="pretrain a model (`mosaics train --help` for its options)")
    sub.add_parser("eval", add_help=False,
                   help="evaluate (`mosaics eval --help` lists its commands)")
    sub.add_parser("bench", add_help=False,
                   help="run a benchmark script of a git checkout (bench/*.py)")
    conv = sub.add_parser(
        "convert-reference",
        help="turn a reference-code ckpt.pt into a Hugging Face model directory",
        description="Convert a checkpoint written by the reference Memory Mosaics code "
                    "(Library/train_memory_mosaics.py or nanoMosaics/train.py) into a Hugging "
                    "Face directory with equal logits. See docs/convert.md.")
    conv.add_argument("checkpoint", help="the reference run's ckpt.pt")
    conv.add_argument("out_dir", help="directory to write (must be new or empty)")
    conv.add_argument("--tokenizer", default=None,
                      help="tokenizer to save alongside (a local directory or a cached hub "
                           "name such as gpt2, which the reference code uses)")
    conv.add_argument("--overwrite", action="store_true",
                      help="replace a non-empty OUT_DIR")
    conv.set_defaults(handler=_convert)
    cfg = sub.add_parser("configs", help="list, show or copy the shipped recipes",
                         description="Shipped recipes: training configs, accelerate and "
                                     "DeepSpeed templates.")
    cfg.add_argument("action", choices=("list", "show", "path", "copy"), nargs="?",
                     default="list", help="list names | show NAME | path NAME | copy [DEST] "
                     "(writes DEST/configs so the templates' relative paths work)")
    cfg.add_argument("name", nargs="?", help="recipe name (or destination folder for copy)")
    cfg.set_defaults(handler=_configs)
    return parser


RAW_COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "train": train_main, "eval": eval_main, "bench": bench_main}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] in RAW_COMMANDS:  # these parse their own arguments
        try:
            return RAW_COMMANDS[args[0]](args[1:])
        except InputError as err:  # a bad file or setting that the command did not catch
            print(f"mosaics {args[0]}: error: {err}", file=sys.stderr)
            return 2
    parser = build_parser()
    ns = parser.parse_args(args)
    if getattr(ns, "handler", None) is None:
        parser.print_help()
        return 0 if not args else 2
    try:
        return ns.handler(ns)
    except InputError as err:
        print(f"mosaics {ns.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
