import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
if not torch.cuda.is_available():  # the fused Triton kernels' tests run them interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def tiny_config():
    from mosaics import MosaicsConfig

    def make(**kw):
        base = dict(vocab_size=61, n_layer=2, n_head=4, n_embd=32, dropout=0.0,
                    leaky_chunk_size=8, block_size=64)
        base.update(kw)
        return MosaicsConfig(**base)

    return make


# Two tiers. The default run (``pytest tests``) is the fast tier: library code in this
# process. ``pytest -m integration tests`` runs the rest: tests that start processes
# (training and evaluation CLIs, distributed launches, kill-and-resume), build or time the
# bench scripts, or train end to end. A test joins the integration tier by its marker or by
# living in one of these modules.
INTEGRATION_MODULES = {"test_distributed", "test_eval_cli", "test_gpu_check", "test_robustness"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if item.module else ""
        if module in INTEGRATION_MODULES or item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.integration)
    if config.getoption("markexpr"):
        return  # an explicit -m chooses
    fast = [i for i in items if not i.get_closest_marker("integration")]
    config.hook.pytest_deselected(items=[i for i in items if i not in fast])
    items[:] = fast
