import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture
def tiny_config():
    from mosaics import MosaicsConfig

    def make(**kw):
        base = dict(vocab_size=61, n_layer=2, n_head=4, n_embd=32, dropout=0.0,
                    leaky_chunk_size=8, block_size=64)
        base.update(kw)
        return MosaicsConfig(**base)

    return make
