"""What "Sparse Attention as Compact Kernel Regression" reports (its RegBench and length
extrapolation tables), to print beside this project's measurements.

Rows are keyed by kernel name; ``"transformer"`` is the paper's transformer (GPT-2 on
RegBench; for extrapolation a standard causal transformer, whose stand-in here is the
rotary-position Llama). RegBench cells are (accuracy, TVD) as fractions by training automata;
extrapolation cells are exact match by test length as a multiple of the training length 64.
"""

from __future__ import annotations

TRAIN_LENGTH = 64

REGBENCH: dict[str, dict[int, tuple[float, float]]] = {
    "transformer": {1000: (.545, .626), 5000: (.927, .189), 10000: (.948, .157),
                    40000: (.955, .139)},
    "gaussian": {1000: (.939, .341), 5000: (.946, .177), 10000: (.950, .159),
                 40000: (.954, .142)},
    "gaussian_knn": {1000: (.934, .333), 5000: (.944, .172), 10000: (.948, .160),
                     40000: (.950, .149)},
    "uniform_knn": {1000: (.846, .411), 5000: (.861, .272), 10000: (.862, .264),
                    40000: (.864, .264)},
    "epanechnikov_fixed": {1000: (.843, .436), 5000: (.901, .246), 10000: (.916, .217),
                           40000: (.933, .186)},
    "epanechnikov": {1000: (.942, .325), 5000: (.944, .171), 10000: (.949, .159),
                     40000: (.954, .140)},
    "relumax": {1000: (.938, .368), 5000: (.943, .178), 10000: (.949, .157),
                40000: (.954, .141)},
    "biweight": {1000: (.938, .330), 5000: (.947, .166), 10000: (.952, .157),
                 40000: (.955, .138)},
    "triweight": {1000: (.939, .329), 5000: (.948, .162), 10000: (.949, .161),
                  40000: (.953, .144)},
}

EXTRAPOLATION: dict[str, dict[str, dict[int, float]]] = {
    "mqmtar": {
        "transformer": {1: 1.00, 8: .09, 16: .01, 32: .00, 64: .00},
        "gaussian": {1: .99, 8: .85, 16: .64, 32: .14, 64: .00},
        "gaussian_knn": {1: .99, 8: .84, 16: .68, 32: .27, 64: .05},
        "uniform_knn": {1: .04, 8: .00, 16: .00, 32: .00, 64: .00},
        "epanechnikov_fixed": {1: 1.00, 8: .66, 16: .44, 32: .33, 64: .31},
        "relumax": {1: 1.00, 8: .92, 16: .74, 32: .42, 64: .12},
        "epanechnikov": {1: 1.00, 8: .98, 16: .86, 32: .63, 64: .31},
        "biweight": {1: 1.00, 8: .95, 16: .75, 32: .51, 64: .23},
        "triweight": {1: 1.00, 8: .97, 16: .89, 32: .61, 64: .25},
        # the position-bias ablation: the paper reports epanechnikov + ALiBi at 64x only
        "epanechnikov+alibi": {64: .14},
    },
    "sort": {
        "transformer": {1: 1.00, 2: .00, 4: .00},
        "gaussian": {1: 1.00, 2: .06, 4: .00},
        "gaussian_knn": {1: 1.00, 2: .80, 4: .01},
        "uniform_knn": {1: 1.00, 2: .00, 4: .00},
        "epanechnikov_fixed": {1: 1.00, 2: .05, 4: .00},
        "relumax": {1: 1.00, 2: .80, 4: .30},
        "epanechnikov": {1: 1.00, 2: .92, 4: .29},
        "biweight": {1: 1.00, 2: .39, 4: .26},
        "triweight": {1: 1.00, 2: .98, 4: .07},
    },
}


def paper_row(label: str) -> str | None:
    """The paper's row for a sweep label (``mosaics/<kernel>`` possibly with kernel
    arguments, ``gpt2``, ``llama``); None for models the paper does not have (v2)."""
    model = label.split(" ", 1)[0]
    if model in ("gpt2", "llama"):
        return "transformer"
    arch, _, kernel = model.partition("/")
    if arch != "mosaics" or kernel not in REGBENCH:
        return None
    return f"{kernel}+alibi" if label.endswith(" +alibi") else kernel


def regbench_cell(label: str, size: int) -> tuple[float, float] | None:
    row = paper_row(label)
    return None if row is None else REGBENCH.get(row, {}).get(size)


def extrapolation_cell(task: str, label: str, length: int) -> float | None:
    row = paper_row(label)
    if row is None or length % TRAIN_LENGTH:
        return None
    return EXTRAPOLATION.get(task, {}).get(row, {}).get(length // TRAIN_LENGTH)
