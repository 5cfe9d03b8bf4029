"""CUDA: every kernel against its CPU reference, adasplash's fused alpha-entmax kernels against
the chunked path, bf16 training, cached generation, the chunked loss under autocast, DeepSpeed
on one GPU. Skipped without a GPU (``pytest -m cuda`` selects these; ``bench/gpu_check.py``
runs them first)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mosaics import MosaicsConfig, MosaicsForCausalLM, available_kernels, get_kernel
from mosaics.kernels import adasplash_backend

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
ROOT = Path(__file__).resolve().parents[1]


def _kernel_io(T: int = 96, H: int = 4, hs: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.nn.functional.normalize(torch.randn(2, H, T, hs, generator=g), dim=-1)
    values = torch.randn(2, H, T, hs, generator=g)
    beta = torch.rand(H, generator=g) * 6 + 2
    return keys, values, beta


@pytest.mark.parametrize("name", available_kernels())
def test_kernel_on_cuda_matches_cpu(name: str) -> None:
    keys, values, beta = _kernel_io()
    outs, grads = [], []
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        kernel = get_kernel(name)
        kernel.build(keys.shape[1], keys.shape[-1])
        kernel.to(device)
        # a copy per device: .to("cpu") returns the tensor itself, whose requires_grad would
        # make the CUDA copy a non-leaf without .grad
        k = keys.to(device, copy=True).requires_grad_()
        v = values.to(device, copy=True).requires_grad_()
        out = kernel(k, v, beta.to(device))
        out.square().sum().backward()
        outs.append(out.detach().cpu())
        grads.append((k.grad.cpu(), v.grad.cpu()))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    for cuda_grad, cpu_grad in zip(grads[1], grads[0]):
        torch.testing.assert_close(cuda_grad, cpu_grad, rtol=1e-3, atol=1e-3)
    assert torch.all(outs[1][:, :, 0] == 0)  # row 0 has no memory


FUSED_KERNELS = ["epanechnikov", "biweight", "triweight", "entmax", "relumax",
                 "epanechnikov_fixed", "gaussian_knn", "uniform_knn"]


@pytest.mark.parametrize("name", FUSED_KERNELS)
def test_fused_kernels_bf16_odd_lengths_and_windows(name: str) -> None:
    """The fused CUDA path (bf16 inputs, T 333: several tiles and a ragged one; then windows
    of 40 entries with one bandwidth per query) against the CPU chunked path on the same
    bf16-rounded inputs in fp32."""
    from mosaics.ops.triton_backend import PATHS

    keys, values, beta = _kernel_io(T=333, H=2, hs=64, seed=2)
    keys, values = keys.bfloat16().float(), values.bfloat16().float()
    kernel = get_kernel(name)
    probe = torch.randn(values.shape)
    results = []
    for device in ("cpu", "cuda"):
        k, v = (x.to(device, copy=True).requires_grad_() for x in (keys, values))
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        out = kernel(k.to(dtype), v.to(dtype), beta.to(device))
        (out.float().cpu() * probe).sum().backward()
        results.append((out.detach().float().cpu(), k.grad.cpu(), v.grad.cpu()))
        if device == "cuda":
            assert PATHS[name] == "fused", PATHS[name]
    for cuda_x, cpu_x in zip(results[1], results[0]):
        torch.testing.assert_close(cuda_x, cpu_x, rtol=3e-2, atol=3e-2)
    i = torch.arange(333).view(1, -1)
    rows_beta = torch.linspace(2.0, 9.0, 333).view(1, 1, -1).expand(1, 2, -1)
    outs = [kernel.attend(keys.to(d), keys.to(d), values.to(d), rows_beta.to(d),
                          (i - 40).to(d), (i - 1).to(d)).float().cpu() for d in ("cpu", "cuda")]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-3, atol=1e-3)


ENTMAX_KERNELS = ["epanechnikov", "biweight", "triweight", "entmax"]
needs_adasplash = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("adasplash", "triton")),
    reason="needs adasplash and triton (pip install -e '.[gpu]')")


@needs_adasplash
@pytest.mark.parametrize("name", ENTMAX_KERNELS)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("T", [200])  # one length: adasplash autotunes per new length
def test_adasplash_matches_chunked_path(name: str, precision: str, T: int,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Same retrieval and gradients (keys, values, beta) through adasplash (put first by
    MOSAICS_ADASPLASH=1) and the chunked path (MOSAICS_FUSED=0); bf16: values in bf16 under
    autocast, as a bf16 linear layer hands them over."""
    keys, values, beta = (x.cuda() for x in _kernel_io(T=T, H=4, hs=64, seed=1))
    if precision == "bf16":
        values = values.bfloat16()
    probe = torch.randn(values.shape, device="cuda")
    kernel = get_kernel(name)
    assert adasplash_backend.skip_reason(kernel, keys, values) is None
    results = []
    for fused in (True, False):
        kernel.use_adasplash = fused
        monkeypatch.setenv(adasplash_backend.ENV_SWITCH, "1" if fused else "0")
        monkeypatch.setenv("MOSAICS_FUSED", "1" if fused else "0")
        k, v, b = (x.detach().clone().requires_grad_() for x in (keys, values, beta))
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = kernel(k, v, b)
        assert out.dtype == values.dtype and torch.all(out[:, :, 0] == 0)
        (out.float() * probe).sum().backward()
        results.append((out.detach().float(), k.grad, v.grad.float(), b.grad))
    tol = 2e-2 if precision == "bf16" else 1e-3
    for fused_x, chunked_x in zip(*results):
        torch.testing.assert_close(fused_x, chunked_x, rtol=tol, atol=tol)


def _tiny(kernel: str = "gaussian") -> MosaicsForCausalLM:
    torch.manual_seed(0)
    return MosaicsForCausalLM(MosaicsConfig(vocab_size=97, n_layer=2, n_head=4, n_embd=64,
                                            block_size=128, dropout=0.0, kernel=kernel))


@pytest.mark.parametrize("kernel", ["gaussian", "epanechnikov"])
def test_bf16_autocast_training_step(kernel: str) -> None:
    model = _tiny(kernel).cuda()
    ids = torch.randint(0, 97, (4, 128), device="cuda")
    with torch.no_grad():
        reference = model(input_ids=ids, labels=ids).loss.item()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and abs(loss.item() - reference) < 0.05 * reference
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    opt.step()


@pytest.mark.parametrize("kernel", ["gaussian", "epanechnikov"])
def test_cached_generation_on_cuda_matches_recomputing(kernel: str) -> None:
    model = _tiny(kernel).cuda().eval()
    prompt = torch.randint(1, 97, (2, 40), device="cuda")  # 0 is the pad id
    cached = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=True,
                            pad_token_id=0)
    full = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=False,
                          pad_token_id=0)
    assert torch.equal(cached, full)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_compiled_training_step_on_cuda_matches_eager(precision: str) -> None:
    """torch.compile (inductor) of the v1 gaussian model on CUDA: the loss and gradients of
    the eager step (fp32: 1e-4, bf16 autocast: 3e-2), one graph, no recompile at step 2."""
    import copy

    from torch._dynamo.testing import CompileCounterWithBackend

    eager = _tiny().cuda().train()
    compiled = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("inductor")
    compiled.compile(backend=counter)
    tol = 1e-4 if precision == "fp32" else 3e-2
    for step in range(2):
        ids = torch.randint(0, 97, (4, 128), device="cuda",
                            generator=torch.Generator("cuda").manual_seed(step))
        results = []
        for model in (eager, compiled):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            results.append((loss.detach().float(), {n: p.grad.float().clone() for n, p in
                                                     model.named_parameters()}))
            model.zero_grad(set_to_none=True)
        (loss, grads), (closs, cgrads) = results
        torch.testing.assert_close(closs, loss, rtol=tol, atol=tol)
        for name, grad in grads.items():
            torch.testing.assert_close(cgrads[name], grad, rtol=tol, atol=tol, msg=name)
        assert counter.frame_count == 1


def test_chunked_loss_under_autocast() -> None:
    from mosaics.ops import linear_cross_entropy

    torch.manual_seed(0)
    hidden = torch.randn(300, 64, device="cuda", requires_grad=True)
    weight = torch.randn(97, 64, device="cuda", requires_grad=True)
    target = torch.randint(0, 97, (300,), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, target)
    reference = torch.nn.functional.cross_entropy((hidden @ weight.T).float(), target)
    assert abs(loss.item() - reference.item()) < 2e-2 * reference.item()
    loss.backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_deepspeed_one_gpu_checkpoint_and_resume(tmp_path: Path) -> None:
    settings = ["n_layer=2", "n_head=4", "n_embd=64", "block_size=64", "batch_size=4",
                "max_steps=8", "warmup_steps=2", "num_train_stories=300", "vocab_size=400",
                "eval_interval=4", "eval_windows=8", "eval_batch_size=4", "log_interval=1",
                "dropout=0.0", "progress_bar=false", "sample_tokens=0", "save_final=false",
                "compile=false", "log_with=none", f"data_cache_dir={tmp_path / 'cache'}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")

    def launch(run_dir: Path, *extra: str) -> None:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "configs/accelerate/deepspeed_zero2.yaml"), "--num_processes", "1",
               "--main_process_port", str(29400 + os.getpid() % 500), str(ROOT / "train.py"),
               *settings, f"run_dir={run_dir}", *extra]
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]

    def losses(run_dir: Path) -> dict[int, float]:
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}

    launch(tmp_path / "full", "checkpoint_interval=4")
    target = tmp_path / "resumed" / "checkpoints"
    target.mkdir(parents=True)
    shutil.copytree(tmp_path / "full/checkpoints/step_0000004", target / "step_0000004")
    launch(tmp_path / "resumed", "resume=true", "checkpoint_interval=0")
    full, again = losses(tmp_path / "full"), losses(tmp_path / "resumed")
    assert sorted(again) == [5, 6, 7, 8]
    rows = [json.loads(x) for x in (tmp_path / "full/metrics.jsonl").read_text().splitlines()]
    speed = [r for r in rows if "tokens_per_s" in r]
    assert speed and all(r["flops_per_token"] > 0 and 0 < r.get("mfu", 0.5) < 1 for r in speed)
    for step, value in again.items():
        assert value == pytest.approx(full[step], abs=1e-4)
