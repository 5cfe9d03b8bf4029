"""Kernel forward + backward time and peak memory, against ``gaussian`` and the entmax package.

Every registered kernel (``available_kernels()``, so kernels added later are included) runs
``kernel(keys, values, beta)`` followed by a backward pass on random unit keys of shape
(B, H, T, hs). Baselines in the same run: the ``gaussian`` kernel (fused attention) and the
``entmax`` package (sparsemax, entmax15, entmax_bisect) applied to the dense masked T x T
score matrix, the way public code uses it. Each kernel is compared with the package function
solving the same problem (epanechnikov ~ sparsemax, biweight/entmax ~ entmax15, triweight ~
entmax_bisect(4/3)); kernels without a package counterpart are compared with sparsemax.

Time: the fastest of ``--repeats`` runs (forward and backward taken from that run), and the
fastest over ``--rounds``: each round runs every method once more, so slow spells of a shared
machine hit all methods alike instead of one (the methods of one round run one after
another). ``--clock cpu`` times with the process's CPU time instead of the wall clock: on a
loaded machine it counts the work done rather than the waiting (use it with one thread).
Timed runs use the allocator setting of the memory measurement below, so a kernel pays for
mapping every large temporary it allocates.

Peak memory: every method runs in a fresh Python subprocess (one per method, lengths in
increasing order, after a small warm-up). Before each case the OS high-water mark of resident
memory is reset (``/proc/self/clear_refs``, Linux) and ``VmHWM`` is read after the first
forward + backward; the figure is that peak minus the resident memory just before the run
(inputs and the torch runtime excluded). This counts every byte the run touches, temporaries
and allocator overhead included, without the profiler's overhead; large tensors are mmapped
by the allocator and returned to the OS when freed (the worker fixes glibc's mmap threshold
at 256 KiB: by default it grows after the first large free and later blocks are then served,
already resident, from the heap, which hides them), so one case does not hide the next.
Where clear_refs is unavailable, ``ru_maxrss`` is used (then a lower bound).

    OMP_NUM_THREADS=1 python bench/kernel_speed.py               # T = 256 ... 4096 (8192 fska)
    OMP_NUM_THREADS=1 python bench/kernel_speed.py --lengths 512 2048 --kernels epanechnikov relumax
    OMP_NUM_THREADS=1 python bench/kernel_speed.py --max-length triweight=2048 --repeats 5
    OMP_NUM_THREADS=1 python bench/kernel_speed.py --lengths 1024 4096 --no-package --rounds 3 \
        --clock cpu
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from timing import add_clock_option, get_clock

DEFAULT_LENGTHS = [256, 512, 1024, 2048, 4096, 8192]
DEFAULT_MAX_LENGTH = 4096
MAX_LENGTH = {"fska": 8192, "gaussian": 8192}  # linear time / fused attention go further
PACKAGE = {  # package baseline solving the same problem as the kernel
    "epanechnikov": "pkg:sparsemax",
    "biweight": "pkg:entmax15",
    "entmax": "pkg:entmax15",  # default alpha = 1.5
    "triweight": "pkg:entmax_bisect",
}
PACKAGE_FALLBACK = "pkg:sparsemax"
PACKAGE_METHODS = ["pkg:sparsemax", "pkg:entmax15", "pkg:entmax_bisect"]


# ----------------------------------------------------------------------------- worker side
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_bytes(reset_ok: bool) -> int:
    if reset_ok:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _method_fn(method: str, H: int, hs: int):
    """A callable (keys, values, beta) -> (B, H, T, hs) for a kernel name or package baseline."""
    import torch

    if not method.startswith("pkg:"):
        from mosaics.kernels import get_kernel

        kernel = get_kernel(method)
        if hasattr(kernel, "build"):
            kernel.build(H, hs)
        return kernel

    import entmax

    solver = {
        "pkg:sparsemax": lambda s: entmax.sparsemax(s, dim=-1),
        "pkg:entmax15": lambda s: entmax.entmax15(s, dim=-1),
        "pkg:entmax_bisect": lambda s: entmax.entmax_bisect(s, alpha=4.0 / 3.0, dim=-1),
    }[method]

    def dense(keys, values, beta):
        T = keys.shape[2]
        scores = (keys[:, :, 1:] @ keys[:, :, :-1].transpose(-1, -2)) * beta.view(1, -1, 1, 1)
        mask = torch.ones(T - 1, T - 1, dtype=torch.bool, device=keys.device).tril()
        y = solver(scores.masked_fill(~mask, float("-inf"))) @ values[:, :, :-1]
        return torch.cat([torch.zeros_like(values[:, :, :1]), y], dim=2)

    return dense


def run_case(fn, T: int, B: int, H: int, hs: int, beta: float, repeats: int,
             budget: float, clock=time.perf_counter) -> dict:
    """Time forward and backward (the fastest run) and measure the first run's peak memory."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    keys = F.normalize(torch.randn(B, H, T, hs), dim=-1).requires_grad_()
    values = torch.randn(B, H, T, hs).requires_grad_()
    bw = torch.full((H,), beta, requires_grad=True)
    grad_out = torch.randn(B, H, T, hs)
    fwd, bwd = [], []
    rss0 = _rss_bytes()
    reset_ok = _reset_peak()
    start = time.perf_counter()
    peak = None
    while len(fwd) < max(1, repeats):
        t0 = clock()
        y = fn(keys, values, bw)
        t1 = clock()
        y.backward(grad_out)
        t2 = clock()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
        if peak is None:
            peak = _peak_bytes(reset_ok) - rss0
        keys.grad = values.grad = bw.grad = None
        del y
        if time.perf_counter() - start > budget:
            break
    best = min(range(len(fwd)), key=lambda i: fwd[i] + bwd[i])
    return {"T": T, "fwd_s": fwd[best], "bwd_s": bwd[best], "total_s": fwd[best] + bwd[best],
            "peak_mb": max(peak, 0) / 2**20, "runs": len(fwd)}


def run_method(method: str, lengths: list[int], args: argparse.Namespace) -> None:
    """Worker: one method at increasing T, one JSON line per case (peak reset before each)."""
    fn = _method_fn(method, args.heads, args.head_size)
    clock = get_clock(args.clock)
    run_case(fn, 16, args.batch, args.heads, args.head_size, args.beta, 1, 0.0)  # warm-up
    for T in lengths:
        r = run_case(fn, T, args.batch, args.heads, args.head_size, args.beta, args.repeats,
                     args.budget, clock)
        print(json.dumps({"method": method, **r}), flush=True)


# ----------------------------------------------------------------------------- driver side
def measure(method: str, lengths: list[int], args: argparse.Namespace) -> list[dict]:
    """Run one method at the given lengths in a fresh subprocess; its JSON lines as dicts."""
    cmd = [sys.executable, __file__, "--worker", method, "--lengths", *map(str, lengths),
           "--batch", str(args.batch), "--heads", str(args.heads), "--head-size",
           str(args.head_size), "--beta", str(args.beta), "--repeats", str(args.repeats),
           "--budget", str(args.budget), "--clock", args.clock]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               MALLOC_MMAP_THRESHOLD_="262144")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    rows = []
    for line in proc.stdout:
        if line.startswith("{"):
            r = json.loads(line)
            rows.append(r)
            print(f"  T={r['T']:5d} {method:<20} {1e3 * r['total_s']:9.1f} ms "
                  f"{r['peak_mb']:8.1f} MB ({r['runs']} runs)", flush=True)
    err = proc.stderr.read()
    if proc.wait() != 0:
        print(f"  {method} failed:\n{err.strip()[-2000:]}", file=sys.stderr)
    return rows


def _faster(old: dict | None, new: dict) -> dict:
    """The faster of two measurements of one case, with the larger peak memory of both."""
    if old is None:
        return new
    best = dict(min(old, new, key=lambda r: r["total_s"]))
    best["peak_mb"] = max(old["peak_mb"], new["peak_mb"])
    best["runs"] = old["runs"] + new["runs"]
    return best


def _max_lengths(specs: list[str]) -> dict[str, int]:
    out = dict(MAX_LENGTH)
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep or not value.isdigit():
            raise SystemExit(f"--max-length expects NAME=T (e.g. fska=8192), got {spec!r}")
        out[name] = int(value)
    return out


def _fmt_ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:6.2f}" if a is not None and b not in (None, 0.0) else "     -"


def print_tables(results: dict[tuple[str, int], dict], kernels: list[str], lengths: list[int]):
    for T in lengths:
        rows = [k for k in kernels + ["gaussian"] + PACKAGE_METHODS if (k, T) in results]
        if not rows:
            continue
        g = results.get(("gaussian", T))
        print(f"\nT = {T}")
        print(f"{'method':<20}{'fwd ms':>9}{'bwd ms':>9}{'total ms':>10}{'peak MB':>9}"
              f"{'t/gauss':>9}{'t/pkg':>8}{'mem/pkg':>9}  pkg baseline")
        for name in dict.fromkeys(rows):
            r = results[(name, T)]
            pkg_name = "" if name.startswith("pkg:") else PACKAGE.get(name, PACKAGE_FALLBACK)
            pkg = results.get((pkg_name, T))
            print(f"{name:<20}{1e3 * r['fwd_s']:9.1f}{1e3 * r['bwd_s']:9.1f}"
                  f"{1e3 * r['total_s']:10.1f}{r['peak_mb']:9.1f}"
                  f"{_fmt_ratio(r['total_s'], g and g['total_s']):>9}"
                  f"{_fmt_ratio(r['total_s'], pkg and pkg['total_s']):>8}"
                  f"{_fmt_ratio(r['peak_mb'], pkg and pkg['peak_mb']):>9}  {pkg_name}")


def plot(results: dict[tuple[str, int], dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    methods = dict.fromkeys(m for m, _ in results)
    colors = plt.cm.tab20.colors
    for i, m in enumerate(methods):
        pts = sorted((T, r) for (mm, T), r in results.items() if mm == m)
        style = "--" if m.startswith("pkg:") else ("-." if m == "gaussian" else "-")
        xs, kw = [T for T, _ in pts], {"marker": "o", "label": m, "color": colors[i % 20]}
        axes[0].plot(xs, [r["total_s"] * 1e3 for _, r in pts], style, **kw)
        axes[1].plot(xs, [max(r["peak_mb"], 1e-2) for _, r in pts], style, **kw)
    for ax, title in zip(axes, ["forward + backward time (ms)", "peak memory (MB)"]):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=DEFAULT_LENGTHS)
    p.add_argument("--kernels", nargs="+", default=None,
                   help="registered kernel names (default: all of available_kernels())")
    p.add_argument("--max-length", action="append", default=[], metavar="NAME=T",
                   help=f"longest T for a kernel (default {DEFAULT_MAX_LENGTH}; "
                        f"{MAX_LENGTH} otherwise)")
    p.add_argument("--no-package", action="store_true", help="skip the entmax package baselines")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case (fastest)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every method this many times, one after another (fastest)")
    add_clock_option(p)
    p.add_argument("--budget", type=float, default=20.0,
                   help="stop repeating a case after this many seconds")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-size", type=int, default=32)
    p.add_argument("--beta", type=float, default=7.389, help="bandwidth (e^2: the init value)")
    p.add_argument("--out", type=Path, default=Path("out/bench_kernels"),
                   help="folder for results.json and kernels.png")
    p.add_argument("--worker", metavar="METHOD", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        run_method(args.worker, sorted(args.lengths), args)
        return

    from mosaics.kernels import available_kernels

    registered = available_kernels()
    kernels = args.kernels or [k for k in registered if k != "gaussian"]
    unknown = [k for k in kernels if k not in registered]
    if unknown:
        raise SystemExit(f"unknown kernels {unknown}; registered: {', '.join(registered)}")
    max_len = _max_lengths(args.max_length)
    baselines = ["gaussian"] + ([] if args.no_package else PACKAGE_METHODS)
    results: dict[tuple[str, int], dict] = {}
    for rnd in range(max(1, args.rounds)):
        if args.rounds > 1:
            print(f"round {rnd + 1} of {args.rounds}", flush=True)
        for m in dict.fromkeys(baselines + kernels):
            lengths = [T for T in sorted(args.lengths) if max_len.get(m, DEFAULT_MAX_LENGTH) >= T]
            for r in measure(m, lengths, args):
                results[(m, r["T"])] = _faster(results.get((m, r["T"])), r)
    print(f"\nB={args.batch} H={args.heads} hs={args.head_size} beta={args.beta} "
          f"threads={os.environ.get('OMP_NUM_THREADS', '?')} clock={args.clock} "
          f"rounds={args.rounds}; ratios < 1: faster / smaller than the baseline")
    print_tables(results, kernels, sorted(args.lengths))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(list(results.values()), indent=1))
    plot(results, args.out / "kernels.png")
    print(f"\nwrote {args.out / 'results.json'} and {args.out / 'kernels.png'}")


if __name__ == "__main__":
    main()
