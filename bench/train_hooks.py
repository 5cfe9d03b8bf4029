"""Overhead of the training loop's hooks: the system metrics (data wait, peak memory) and the
in-loop evaluations, as a ratio of the time per step of the same run without them, in one
process (the variants alternate round by round, so machine noise hits all alike).

    OMP_NUM_THREADS=1 python bench/train_hooks.py --clock cpu       # the default model
    OMP_NUM_THREADS=1 python bench/train_hooks.py --tiny --steps 8  # a smoke run

Variants: ``bare`` (no hooks), ``metrics`` (``system_metrics``), ``evals`` (metrics plus
``position_loss``, ``sample`` and ``recall`` every ``--eval-interval`` steps; their cost is
spread over the steps between), ``watchdog`` (metrics plus the watchdog). Each fit trains
``--steps`` steps on windows of generated stories; the table gives the median seconds per step
over ``--rounds`` rounds (after one discarded warm-up fit) and the ratio to ``bare``, then the
evaluations' own wall seconds per call (``eval/<name>/seconds``) and the ratio their cost
(``evals`` minus ``metrics``) implies when they run every 50 steps. ``--clock cpu`` counts
the process's CPU time (steadier on a shared machine; use one thread).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from timing import add_clock_option, get_clock

from mosaics.data.storygen import generate_stories
from mosaics.data.tokenizer import train_bpe_tokenizer
from mosaics.training.build import build_model, special_token_ids
from mosaics.training.components import build_hooks, stopping
from mosaics.training.config import TrainConfig
from mosaics.training.instrument import LoopProbe
from mosaics.training.trainer import Trainer, make_accelerator


class StoryWindows:
    """Micro-batch i: random windows of a token stream (a pure function of i)."""

    def __init__(self, stream: torch.Tensor, rows: int, length: int) -> None:
        self.stream, self.rows, self.length = stream, rows, length

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(index)
        starts = torch.randint(0, len(self.stream) - self.length, (self.rows,), generator=g)
        ids = torch.stack([self.stream[s:s + self.length] for s in starts.tolist()])
        return {"input_ids": ids, "labels": ids.clone()}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def variant_settings(name: str, interval: int) -> dict:
    evals = {"position_loss": interval, "sample": {"interval": interval, "tokens": 32},
             "recall": {"interval": interval, "prompts": 16}}
    return {"bare": dict(system_metrics=False),
            "metrics": dict(system_metrics=True),
            "evals": dict(system_metrics=True, evals=evals),
            "watchdog": dict(system_metrics=True, watchdog_s=600.0)}[name]


def seconds_per_step(name: str, base: dict, tok, stream: torch.Tensor, work: Path,
                     interval: int, clock) -> tuple[float, dict[str, float]]:
    """(seconds per step of one fit, {evaluation: seconds per call})."""
    cfg = TrainConfig(**base, run_dir=str(work / f"{name}-{time.time_ns()}"),
                      **variant_settings(name, interval))
    torch.manual_seed(0)
    model = build_model(cfg, len(tok), **special_token_ids(tok))
    source = StoryWindows(stream, cfg.batch_size, cfg.block_size)
    probe = LoopProbe(source)
    hooks = build_hooks(cfg, tok, True, probe)
    val = [source.batch(10_000 + i) for i in range(cfg.eval_windows // cfg.batch_size)]
    trainer = Trainer(cfg, model, probe, val, hooks=hooks,
                      accelerator=make_accelerator(cfg, "cpu"))
    probe.attach(trainer)
    trainer.setup()
    start = clock()
    with stopping(hooks):
        trainer.fit()
    seconds = clock() - start
    trainer.close()
    calls: dict[str, list[float]] = {}
    for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines():
        for key, value in json.loads(line).items():
            if key.startswith("eval/") and key.endswith("/seconds"):
                calls.setdefault(key.split("/")[1], []).append(value)
    return seconds / cfg.max_steps, {k: statistics.median(v) for k, v in calls.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--eval-interval", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="1 layer, d 32, T 64")
    parser.add_argument("--variants", nargs="+", default=["bare", "metrics", "evals", "watchdog"])
    add_clock_option(parser)
    args = parser.parse_args()
    clock = get_clock(args.clock)
    texts = generate_stories(400, seed=1)
    tok = train_bpe_tokenizer(texts, vocab_size=512 if args.tiny else 4096)
    stream = torch.tensor(tok(" ".join(texts)).input_ids)
    base = dict(max_steps=args.steps, eval_interval=0, checkpoint_interval=0, log_interval=10,
                progress_bar=False, log_with="none", warmup_steps=1, vocab_size=len(tok))
    if args.tiny:
        base.update(n_layer=1, n_head=2, n_embd=32, block_size=64, batch_size=4)
    times: dict[str, list[float]] = {name: [] for name in args.variants}
    calls: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as work:
        seconds_per_step("bare", dict(base, max_steps=2), tok, stream, Path(work),
                         args.eval_interval, clock)  # warm-up, discarded
        for _ in range(args.rounds):
            for name in args.variants:
                step, evals = seconds_per_step(name, base, tok, stream, Path(work),
                                               args.eval_interval, clock)
                times[name].append(step)
                for key, value in evals.items():
                    calls.setdefault(key, []).append(value)
    cfg = TrainConfig(**base)
    print(f"model: {cfg.n_layer} layers, d {cfg.n_embd}, T {cfg.block_size}, batch "
          f"{cfg.batch_size}; {args.steps} steps x {args.rounds} rounds, evaluations every "
          f"{args.eval_interval} steps; torch threads {torch.get_num_threads()}; "
          f"{args.clock} clock")
    bare = statistics.median(times["bare"]) if "bare" in times else None
    print(f"{'variant':<10} {'s/step':>9} {'ratio':>7}")
    for name, values in times.items():
        step = statistics.median(values)
        ratio = f"{step / bare:.3f}" if bare else "-"
        print(f"{name:<10} {step:>9.4f} {ratio:>7}")
    if calls:
        print("evaluation wall seconds per call: " + ", ".join(
            f"{k} {statistics.median(v):.3f}" for k, v in calls.items()))
    if bare and {"metrics", "evals"} <= times.keys():  # their cost, spread over 50 steps
        extra = statistics.median(times["evals"]) - statistics.median(times["metrics"])
        print(f"evaluations every 50 steps instead: ratio "
              f"{1 + extra * args.eval_interval / 50 / bare:.3f}")


if __name__ == "__main__":
    main()
