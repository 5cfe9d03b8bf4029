"""Clocks and best-of timing shared by the benchmark scripts (``python bench/<name>.py`` puts
this folder on the import path)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch

Clock = Callable[[], float]
CLOCKS: dict[str, Clock] = {"wall": time.perf_counter, "cpu": time.process_time}


def add_clock_option(parser: argparse.ArgumentParser) -> None:
    """``--clock wall|cpu``; read it back with :func:`get_clock`."""
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall clock, or the process's CPU time (steadier on a loaded "
                        "machine; use with one thread)")


def add_denormal_option(parser: argparse.ArgumentParser) -> None:
    """``--keep-denormals``: leave subnormal floats on (the trainer flushes them on CPU, see
    ``TrainConfig.flush_denormal``); apply with :func:`apply_denormal_option`."""
    parser.add_argument("--keep-denormals", action="store_true",
                        help="do not flush subnormal floats to zero (the trainer does on CPU)")


def apply_denormal_option(args: argparse.Namespace) -> str:
    """Flush subnormals unless ``--keep-denormals``; returns a label for the table header."""
    flushed = not args.keep_denormals and torch.set_flush_denormal(True)
    return "denormals flushed" if flushed else "denormals kept"


def get_clock(name: str) -> Clock:
    return CLOCKS[name]


def best_of(fn: Callable[[], object], repeats: int, clock: Clock = time.perf_counter) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``fn``."""
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def summarize(times: Sequence[float], clock: Clock) -> float:
    """The fastest time with the CPU clock (load only adds to it), the median with the wall
    clock (robust to a few slow outliers)."""
    return min(times) if clock is time.process_time else statistics.median(times)


def sync(device: str) -> None:
    """Wait for the device's queued work (CUDA); nothing on CPU."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_on(fn: Callable[[], object], device: str, warmup: int,
             repeats: int) -> tuple[float, float | None]:
    """(median ms, peak MB on CUDA) of ``fn`` on ``device``, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else None
    return 1e3 * statistics.median(times), peak
