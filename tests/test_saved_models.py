"""Model directories written by earlier releases load and give the logits they gave then.

``tests/data/*`` are tiny models saved by an earlier version of the package, with inputs and
the logits that version computed (``expected.safetensors``); their state-dict keys and config
fields are the format this package must keep reading.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import mosaics  # noqa: F401  (registers the Auto classes)

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("name", ["v1_gaussian", "v2_epanechnikov"])
def test_earlier_model_directories_give_their_logits(name):
    expected = load_file(DATA / name / "expected.safetensors")
    model = AutoModelForCausalLM.from_pretrained(DATA / name).eval()
    ids = expected["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected["logits"], rtol=1e-5, atol=1e-5)
        out = model(ids[:, :10], use_cache=True)  # and decoding continues them
        steps = [out.logits]
        for t in range(10, ids.shape[1]):
            out = model(ids[:, t:t + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), expected["logits"], rtol=1e-4, atol=1e-4)
