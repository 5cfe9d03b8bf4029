"""Reference checkpoints -> HF directories: logits against transcriptions of the reference
forwards (float64), refusals of what the model cannot express, safe loading."""

from __future__ import annotations

import argparse
import datetime
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import mosaics  # noqa: F401  (registers the Auto classes)
from mosaics.convert_reference import convert_reference, load_reference_checkpoint
from mosaics.errors import InputError

V, L, H, D, P, BLOCK = 37, 2, 2, 8, 5, 16
HS = D // H


def _layer_norm(x, w, b=None):
    return F.layer_norm(x, w.shape, w, b, 1e-5)


# --- the reference's Library models (memory_mosaics_eft.py, memory_mosaics.py) -------------

def library_args(**changes) -> dict:
    """``conf.__dict__`` as train_memory_mosaics.py stores it (defaults of its parser)."""
    args = dict(seed=1337, out_dir="results/debug", dtype="float16", compile=True,
                dataset="BabiStories", batch_size=8, learning_rate=5e-3, max_iters=80000,
                milestone=[10000], block_size=BLOCK, n_layer=L, n_head=H, n_embd=D, v_shift=1,
                att_shift=0, pmem_size=P, pmem_count=1, ic_dropout=0.05, hd_dropout=0.05,
                bias=False, weight_tying=True, pre_ln=True, k_kernel_size=1, v_kernel_size=2,
                k_fe_type="linearconv", v_fe_type="lowrlinearconv", skip_tokens=0,
                gradient_accumulation_steps=1, attn_only=False, vocab_size=V)
    args.update(changes)
    return args


def library_state_dict(eft: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the exact keys ``StackAssoMem.state_dict()`` writes (float32)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    head = rnd(V, D)
    sd = {"emb.weight": head}  # tied: the same tensor under both names
    for i in range(L):
        b = f"blocks.{i}"
        sd[f"{b}.ln1.weight"] = 1 + rnd(D, scale=0.1)
        for part in ("attn", "pmem"):
            leaky = torch.linspace(0.5, 5, H) / 10 + rnd(H, scale=0.05)
            if eft:
                sd[f"{b}.{part}.leaky_average.leaky_beta_w_under"] = leaky
                sd[f"{b}.{part}.leaky_average.leaky_beta_u_under"] = leaky  # same Parameter
                sd[f"{b}.{part}.leaky_average.linear.weight"] = rnd(D, D, scale=D**-0.5)
            else:
                sd[f"{b}.{part}.k_featurizer.conv.weight"] = rnd(D, D, 1, scale=D**-0.5)
                sd[f"{b}.{part}.leaky_key_beta"] = leaky
            # one head above the bandwidth cap 10 b = 5
            sd[f"{b}.{part}.kernel_beta"] = torch.tensor([0.1, 0.62]) + rnd(H, scale=0.05)
            sd[f"{b}.{part}.value_beta"] = -0.05 + rnd(H, scale=0.05)
            sd[f"{b}.{part}.c_proj.weight"] = rnd(D, D, scale=(D * L) ** -0.5)
        sd[f"{b}.attn.v_featurizer.linear.weight"] = rnd(D, D, scale=D**-0.5)
        sd[f"{b}.attn.v_featurizer.coef"] = torch.rand(H, generator=g)
        sd[f"{b}.ln2.weight"] = 1 + rnd(D, scale=0.1)
        sd[f"{b}.pmem.pmem.M_k0"] = rnd(1, H, P, HS, scale=HS**-0.5)
        sd[f"{b}.pmem.pmem.M_v0"] = rnd(1, H, P, HS, scale=HS**-0.5)
    sd["ln_out.weight"] = 1 + rnd(D, scale=0.1)
    sd["head.weight"] = head
    return sd


def wkv_leaky_average(x, beta_w, beta_u):
    """``LeakyAverageCuda.forward`` with its WKV kernel (cuda/wkv_cuda.cu, kernel_forward)
    written out: gate k = 0, w = -|10 beta_w|, u = |10 beta_u| per channel, running sums p, q
    kept divided by exp(o)."""
    B, T, C = x.shape
    w = -(10 * beta_w).repeat_interleave(C // beta_w.numel()).abs()
    u = (10 * beta_u).repeat_interleave(C // beta_u.numel()).abs()
    k = torch.zeros_like(x)
    p = torch.zeros(B, C, dtype=x.dtype)
    q = torch.zeros(B, C, dtype=x.dtype)
    o = torch.full((B, C), -1e38, dtype=x.dtype)
    y = torch.empty_like(x)
    for i in range(T):
        no = torch.maximum(o, u + k[:, i])
        a, b = torch.exp(o - no), torch.exp(u + k[:, i] - no)
        y[:, i] = (a * p + b * x[:, i]) / (a * q + b)
        no = torch.maximum(w + o, k[:, i])
        a, b = torch.exp(w + o - no), torch.exp(k[:, i] - no)
        p, q, o = a * p + b * x[:, i], a * q + b, no
    return y


def library_matrix_leaky_average(k, leaky_key_beta):
    """memory_mosaics.py: coef[t, s] = exp(-(t - s) a) (1 - exp(-a)) for s <= t, a = 10|p|."""
    T = k.shape[2]
    lag = torch.arange(T).view(T, 1) - torch.arange(T).view(1, T)
    a = (10 * leaky_key_beta.abs()).view(1, H, 1, 1)
    coef = torch.exp(-lag.to(k.dtype) * a) * (1 - torch.exp(-a))
    coef = coef.masked_fill(lag < 0, 0)
    return coef @ k


def library_keys(sd, prefix, x, eft):
    B, T, _ = x.shape
    if eft:
        la = f"{prefix}.leaky_average"
        k = wkv_leaky_average(x @ sd[f"{la}.linear.weight"].T, sd[f"{la}.leaky_beta_w_under"],
                              sd[f"{la}.leaky_beta_u_under"])
        k = k.view(B, T, H, HS).transpose(1, 2)
    else:
        conv = F.conv1d(x.transpose(1, 2), sd[f"{prefix}.k_featurizer.conv.weight"])
        k = conv.view(B, H, HS, T).transpose(2, 3)
        k = library_matrix_leaky_average(k, sd[f"{prefix}.leaky_key_beta"])
    return k / k.norm(dim=-1, keepdim=True)


def library_forward(sd, idx, eft):
    """``StackAssoMem.forward(idx, targets)`` logits in eval mode (float64 copies)."""
    sd = {k: v.double() for k, v in sd.items()}
    x = sd["emb.weight"][idx]
    B, T, _ = x.shape
    mask = torch.tril(torch.ones(BLOCK + 1, BLOCK + 1))[:BLOCK, 1:][:T, :T] != 0
    for i in range(L):
        b = f"blocks.{i}"
        h = _layer_norm(x, sd[f"{b}.ln1.weight"])
        k = library_keys(sd, f"{b}.attn", h, eft)
        beta = torch.exp(torch.clamp(sd[f"{b}.attn.kernel_beta"] * 10, max=5)).view(1, H, 1, 1)
        k = k * beta
        v = (h @ sd[f"{b}.attn.v_featurizer.linear.weight"].T).transpose(1, 2)
        shifted = F.pad(v, (-1, 1)).view(B, H, HS, T).transpose(2, 3)
        c = sd[f"{b}.attn.v_featurizer.coef"].view(1, H, 1, 1)
        v = shifted * (1 - c) + v.reshape(B, H, HS, T).transpose(2, 3) * c
        v = v / v.norm(dim=-1, keepdim=True)
        v = v * torch.exp(sd[f"{b}.attn.value_beta"] * 10).view(1, H, 1, 1)
        y = torch.zeros_like(v)
        y[:, :, 1:] = F.scaled_dot_product_attention(k[:, :, 1:], k, v,
                                                     attn_mask=mask[1:T, :T], scale=1)
        x = x + y.transpose(1, 2).reshape(B, T, D) @ sd[f"{b}.attn.c_proj.weight"].T
        h = _layer_norm(x, sd[f"{b}.ln2.weight"])
        k = library_keys(sd, f"{b}.pmem", h, eft)
        k = k * (torch.exp(torch.clamp(sd[f"{b}.pmem.kernel_beta"] * 10, max=5)) ** 2
                 ).view(1, H, 1, 1)
        mk = sd[f"{b}.pmem.pmem.M_k0"].expand(B, H, P, HS)
        mv = sd[f"{b}.pmem.pmem.M_v0"].expand(B, H, P, HS)
        y = F.scaled_dot_product_attention(k, mk, mv, scale=1)
        y = y * torch.exp(sd[f"{b}.pmem.value_beta"] * 10).view(1, H, 1, 1)
        x = x + y.transpose(1, 2).reshape(B, T, D) @ sd[f"{b}.pmem.c_proj.weight"].T
    x = _layer_norm(x, sd["ln_out.weight"])
    return (1 / math.sqrt(D)) * x @ sd["head.weight"].T


# --- nanoMosaics/mosaic_model.py ------------------------------------------------------------

def nano_args(**changes) -> dict:
    args = dict(n_layer=L, n_head=H, n_embd=D, block_size=BLOCK, bias=False, vocab_size=V,
                dropout=0.0, pmem_count=1, pmem_size=P)
    args.update(changes)
    return args


def nano_state_dict(seed: int = 0, pmem_count: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    head = rnd(V, D, scale=0.3)
    coef = torch.zeros(BLOCK, BLOCK)
    for i in range(BLOCK):
        coef = torch.diagonal_scatter(coef, -torch.ones(BLOCK - i) * i, -i)
    sd = {"mosaic.wte.weight": head}
    for i in range(L):
        b = f"mosaic.h.{i}"
        sd[f"{b}.ln_1.weight"] = 1 + rnd(D, scale=0.1)
        for part, scale in (("attn", 0.45), ("mlp", 0.7)):  # the pmem scale is above the cap
            kf = f"{b}.{part}.k_featurizer"
            sd[f"{kf}.W_k.weight"] = rnd(D, D, scale=D**-0.5)
            sd[f"{kf}.leaky_avg.coef"] = coef.clone()
            sd[f"{kf}.leaky_avg.leaky_key_beta"] = (torch.linspace(0.5, 5, H) / 10
                                                    + rnd(H, scale=0.05)).view(1, H, 1, 1)
            sd[f"{kf}.key_scale"] = (torch.tensor([0.1, scale]) + rnd(H, scale=0.02)
                                     ).view(1, H, 1, 1)
        sd[f"{b}.attn.v_featurizer.W_v.weight"] = rnd(D, D, scale=D**-0.5)
        sd[f"{b}.attn.v_featurizer.coef"] = torch.rand(1, H, 1, 1, generator=g)
        sd[f"{b}.attn.v_featurizer.val_scale"] = (-0.05 + rnd(H, scale=0.05)).view(1, H, 1, 1)
        sd[f"{b}.attn.c_proj.weight"] = rnd(D, D, scale=0.1)
        sd[f"{b}.attn.bias"] = torch.tril(torch.ones(BLOCK, BLOCK), diagonal=-1).view(
            1, 1, BLOCK, BLOCK).bool()
        sd[f"{b}.ln_2.weight"] = 1 + rnd(D, scale=0.1)
        sd[f"{b}.mlp.P_k"] = rnd(pmem_count, 1, H, P, HS, scale=HS**-0.5)
        sd[f"{b}.mlp.P_v"] = rnd(pmem_count, 1, H, P, HS, scale=HS**-0.5)
        sd[f"{b}.mlp.out_scale"] = (-0.05 + rnd(H, scale=0.05)).view(1, H, 1, 1)
        sd[f"{b}.mlp.c_proj.weight"] = rnd(D, D, scale=0.1)
    sd["mosaic.ln_f.weight"] = 1 + rnd(D, scale=0.1)
    sd["lm_head.weight"] = head
    return sd


def nano_keys(sd, kf, x, scale_pow):
    B, T, _ = x.shape
    k = (x @ sd[f"{kf}.W_k.weight"].T).transpose(1, 2).view(B, H, HS, T).transpose(2, 3)
    beta = sd[f"{kf}.leaky_avg.leaky_key_beta"].abs() * 10
    k = torch.exp(sd[f"{kf}.leaky_avg.coef"][:T, :T].view(1, 1, T, T) * beta).tril() @ k
    k = k / (k.norm(dim=-1, keepdim=True) + 1e-10)
    return k * (scale_pow * 10 * sd[f"{kf}.key_scale"]).clamp(max=math.log(2**16 - 1)).exp()


def nano_forward(sd, idx):
    """``MemoryMosaic.forward(idx, targets)`` logits in eval mode (float64 copies)."""
    sd = {k: (v.double() if v.is_floating_point() else v) for k, v in sd.items()}
    x = sd["mosaic.wte.weight"][idx]
    B, T, _ = x.shape
    for i in range(L):
        b = f"mosaic.h.{i}"
        h = _layer_norm(x, sd[f"{b}.ln_1.weight"])
        k = nano_keys(sd, f"{b}.attn.k_featurizer", h, 1)
        vf = f"{b}.attn.v_featurizer"
        v = (h @ sd[f"{vf}.W_v.weight"].T).transpose(1, 2).view(B, H, HS, T)
        v = (1 - sd[f"{vf}.coef"]) * F.pad(v, (-1, 1)) + sd[f"{vf}.coef"] * v
        v = v.transpose(2, 3)
        v = v / (v.norm(dim=-1, keepdim=True) + 1e-10) * (10 * sd[f"{vf}.val_scale"]).exp()
        y = torch.zeros_like(v)
        y[:, :, 1:] = F.scaled_dot_product_attention(
            k[:, :, 1:], k, v, attn_mask=sd[f"{b}.attn.bias"][:, :, 1:T, :T], scale=1)
        x = x + y.transpose(1, 2).reshape(B, T, D) @ sd[f"{b}.attn.c_proj.weight"].T
        h = _layer_norm(x, sd[f"{b}.ln_2.weight"])
        k = nano_keys(sd, f"{b}.mlp.k_featurizer", h, 2)
        y = F.scaled_dot_product_attention(k, sd[f"{b}.mlp.P_k"][0], sd[f"{b}.mlp.P_v"][0],
                                           scale=1)
        y = y * (10 * sd[f"{b}.mlp.out_scale"]).exp()
        x = x + y.transpose(1, 2).reshape(B, T, D) @ sd[f"{b}.mlp.c_proj.weight"].T
    x = _layer_norm(x, sd["mosaic.ln_f.weight"])
    return x @ sd["lm_head.weight"].T


# --- checkpoints as the reference writes them -------------------------------------------------

def save_checkpoint(path, state_dict, model_args, compiled=False):
    """torch.save of the dict train_memory_mosaics.py / nanoMosaics train.py write."""
    model = {(f"_orig_mod.{k}" if compiled else k): v for k, v in state_dict.items()}
    params = [torch.nn.Parameter(torch.randn(3, 2))]
    opt = torch.optim.AdamW(params)
    params[0].grad = torch.ones(3, 2)
    opt.step()
    torch.save({"model": model, "optimizer": opt.state_dict(), "model_args": model_args,
                "iter_num": 1200, "best_val_loss": torch.tensor(1.5)}, path)
    return path


def converted_logits(ckpt, out_dir, idx):
    convert_reference(ckpt, out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir).double().eval()
    with torch.no_grad():
        return model(idx).logits


IDS = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("eft", [True, False], ids=["eft-wkv", "matrix-leaky"])
@pytest.mark.parametrize("compiled", [False, True], ids=["plain", "orig_mod"])
def test_library_checkpoint_logits_equal_reference(tmp_path, eft, compiled):
    sd = library_state_dict(eft)
    ckpt = save_checkpoint(tmp_path / "ckpt.pt", sd, library_args(), compiled)
    ours = converted_logits(ckpt, tmp_path / "hf", IDS)
    ref = library_forward(sd, IDS, eft)
    assert ref.abs().max() > 0.1  # not a degenerate comparison
    torch.testing.assert_close(ours, ref, rtol=1e-7, atol=1e-7)


def test_nanomosaics_checkpoint_logits_equal_reference(tmp_path):
    sd = nano_state_dict()
    ckpt = save_checkpoint(tmp_path / "ckpt.pt", sd, nano_args(), compiled=True)
    ours = converted_logits(ckpt, tmp_path / "hf", IDS)
    ref = nano_forward(sd, IDS)
    assert ref.abs().max() > 0.1
    # ln_f * sqrt(d) and the folded slot-key scale are rounded to float32
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_wkv_transcription_is_a_normalised_leaky_sum():
    """Independent check of the algebra the converter relies on: the WKV output is the
    leaky sum sum_s lambda^(t-s) x_s divided by sum_s lambda^(t-s)."""
    torch.manual_seed(0)
    x = torch.randn(2, 9, 4, dtype=torch.float64)
    beta = torch.tensor([0.07, -0.3], dtype=torch.float64)
    y = wkv_leaky_average(x, beta, beta)
    lam = torch.exp(-10 * beta.abs()).repeat_interleave(2)
    s, z = torch.zeros(2, 4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    for t in range(9):
        s, z = lam * s + x[:, t], lam * z + 1
        torch.testing.assert_close(y[:, t], s / z)


def test_namespace_model_args_load_safely(tmp_path):
    sd = library_state_dict(eft=True)
    ckpt = save_checkpoint(tmp_path / "ckpt.pt", sd, argparse.Namespace(**library_args()))
    loaded = load_reference_checkpoint(ckpt)
    assert isinstance(loaded["model_args"], argparse.Namespace)
    ours = converted_logits(ckpt, tmp_path / "hf", IDS)
    torch.testing.assert_close(ours, library_forward(sd, IDS, True), rtol=1e-7, atol=1e-7)


def test_other_pickled_objects_are_refused(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"model": library_state_dict(True), "model_args": library_args(),
                "when": datetime.date(2024, 1, 1)}, path)
    with pytest.raises(InputError, match="refusing to unpickle"):
        load_reference_checkpoint(path)


@pytest.mark.parametrize("changes,named", [
    (dict(k_kernel_size=2), "k_kernel_size=2"),
    (dict(bias=True), "bias=True"),
    (dict(attn_only=True), "attn_only=True"),
    (dict(pmem_count=2), "pmem_count=2"),
    (dict(pre_ln=False, weight_tying=False), "pre_ln=False.*weight_tying=False"),
])
def test_unsupported_library_options_are_named(tmp_path, changes, named):
    ckpt = save_checkpoint(tmp_path / "ckpt.pt", library_state_dict(False),
                           library_args(**changes))
    with pytest.raises(InputError, match=named):
        convert_reference(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_unsupported_nanomosaics_options_are_named(tmp_path):
    ckpt = save_checkpoint(tmp_path / "a.pt", nano_state_dict(pmem_count=2),
                           nano_args(pmem_count=2))
    with pytest.raises(InputError, match="pmem_count=2"):
        convert_reference(ckpt, tmp_path / "hf")
    sd = nano_state_dict()
    sd["mosaic.h.1.attn.k_featurizer.key_scale"][0, 1] = 0.8
    ckpt = save_checkpoint(tmp_path / "b.pt", sd, nano_args())
    with pytest.raises(InputError, match="key_scale.*bandwidth-cap"):
        convert_reference(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_unknown_layout_and_leftover_keys_are_refused(tmp_path):
    ckpt = save_checkpoint(tmp_path / "a.pt", {"transformer.wte.weight": torch.zeros(3, 2)},
                           library_args())
    with pytest.raises(InputError, match="Not a Memory Mosaics checkpoint"):
        convert_reference(ckpt, tmp_path / "hf")
    sd = library_state_dict(True)
    sd["blocks.0.attn.c_proj.bias"] = torch.zeros(D)
    ckpt = save_checkpoint(tmp_path / "b.pt", sd, library_args())
    with pytest.raises(InputError, match=r"blocks\.0\.attn\.c_proj\.bias"):
        convert_reference(ckpt, tmp_path / "hf")


def test_existing_output_directory_is_kept(tmp_path):
    ckpt = save_checkpoint(tmp_path / "ckpt.pt", library_state_dict(True), library_args())
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(InputError, match="not empty"):
        convert_reference(ckpt, out)
    assert (out / "keep.txt").read_text() == "x"
    convert_reference(ckpt, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "README.md").is_file()


def test_tokenizer_is_saved_alongside(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(V - 1)} | {"<|endoftext|>": V - 1}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>",
                            bos_token="<|endoftext|>").save_pretrained(tmp_path / "tok")
    ckpt = save_checkpoint(tmp_path / "ckpt.pt", library_state_dict(True), library_args())
    out = convert_reference(ckpt, tmp_path / "hf", tokenizer=str(tmp_path / "tok"))
    assert AutoTokenizer.from_pretrained(out)("w3 w5").input_ids == [3, 5]
    assert AutoModelForCausalLM.from_pretrained(out).config.eos_token_id == V - 1
    with pytest.raises(InputError, match="Cannot load tokenizer"):
        convert_reference(ckpt, tmp_path / "hf2", tokenizer=str(tmp_path / "no_such_tok"))
    assert not (tmp_path / "hf2").exists()
