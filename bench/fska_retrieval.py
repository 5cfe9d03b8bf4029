"""How sharply can each FSKA positive map attend? (retrieval of an exact key match)

For each bandwidth beta, T - 1 random unit keys are stored with one-hot values and the last
query is an exact copy of one of them. The table prints the weight put on that key times
(T - 1): 1 means uniform attention. The reference is the Gaussian (softmax) kernel at the
same beta, computed exactly; FSKA uses its initial (identity) flow, so both random-feature
maps estimate a kernel proportional to exp(beta cos) + 1 with the same frequencies.

    OMP_NUM_THREADS=1 python bench/fska_retrieval.py [--head-size 32] [--features 96]
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from mosaics.kernels import get_kernel


def sharpness(kernel_name: str, beta: float, T: int, hs: int, trials: int, seed: int,
              **kwargs) -> float:
    """Mean (T - 1) x weight on the matching key, over ``trials`` sequences."""
    torch.manual_seed(seed)
    kernel = get_kernel(kernel_name, **kwargs)
    kernel.build(1, hs)
    kernel.eval()
    keys = F.normalize(torch.randn(trials, 1, T, hs), dim=-1)
    target = torch.randint(0, T - 1, (trials,))
    rows = torch.arange(trials)
    keys[:, 0, -1] = keys[rows, 0, target]
    values = F.one_hot(torch.arange(T), T).float().expand(trials, 1, T, T)
    with torch.no_grad():
        y = kernel(keys, values, torch.tensor([beta]))
    return float(y[rows, 0, -1, target].mean()) * (T - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head-size", type=int, default=32)
    parser.add_argument("--features", type=int, default=96, help="M frequency pairs")
    parser.add_argument("--length", type=int, default=256, help="T (keys + query)")
    parser.add_argument("--trials", type=int, default=64)
    parser.add_argument("--log-betas", type=float, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    common = dict(T=args.length, hs=args.head_size, trials=args.trials, seed=args.seed)
    print(f"retrieval sharpness = (T-1) x weight on the exact match; T={args.length}, "
          f"head_size={args.head_size}, M={args.features}, uniform = 1")
    print(f"{'log beta':>8} {'gaussian':>10} {'fska elu1':>10} {'fska exp':>10} "
          f"{'exp/elu1':>9} {'exp/gauss':>9}")
    for lb in args.log_betas:
        beta = math.exp(lb)
        gauss = sharpness("gaussian", beta, **common)
        elu1, exp = (sharpness("fska", beta, **common, num_features=args.features,
                               positive=p) for p in ("elu1", "exp"))
        print(f"{lb:8.1f} {gauss:10.2f} {elu1:10.4f} {exp:10.2f} {exp / elu1:9.2f} "
              f"{exp / gauss:9.3f}")


if __name__ == "__main__":
    main()
