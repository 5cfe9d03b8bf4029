"""Bring checkpoints of the reference Memory Mosaics code into this project's HF format.

Three source layouts are recognised from the checkpoint's keys (docs/convert.md):

* ``library-eft``: ``Library/memory_mosaics/models/memory_mosaics_eft.py`` (what the
  reference ``train_memory_mosaics.py`` trains). Keys come from the WKV leaky average
  ``LeakyAverageCuda``: ``blocks.{i}.attn.leaky_average.linear.weight`` (W_k) and
  ``...leaky_average.leaky_beta_w_under`` (p). With its gate k = 0, u = |10 p| and
  w = -|10 p|, the CUDA recurrence gives, with lambda = exp(-10 |p|),
  ``y_t = (sum_{s<=t} lambda^(t-s) x_s) / (sum_{s<=t} lambda^(t-s))``: this project's
  leaky sum divided by a positive scalar, which the L2 normalisation of the key removes.
* ``library``: ``Library/memory_mosaics/models/memory_mosaics.py``: W_k is a width-1
  ``Conv1d`` (``k_featurizer.conv.weight``, (d, d, 1)) and the leaky average a matrix with
  entries (1 - lambda) lambda^(t-s), again a positive multiple of the leaky sum.
* ``nanomosaics``: ``nanoMosaics/mosaic_model.py``. Its logits carry no 1/sqrt(d) factor
  (folded into ``ln_f.weight``), its persistent-memory key scale exp(min(20 s, ln 65535))
  is folded into the slot keys (bandwidth set to 1), and its contextual key scale
  exp(2 min(10 s, ln 65535)) equals this model's bandwidth exp(2 min(10 b, 5)) while
  10 s <= 5.

Checkpoints are read with ``torch.load(weights_only=True)``; only ``argparse.Namespace`` is
allowed in addition to tensors and plain containers (the reference may store its arguments
as one).
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .configuration_mosaics import MosaicsConfig
from .errors import InputError

ORIG_MOD_PREFIX = "_orig_mod."
REFERENCE_LICENSE = "apache-2.0"  # the reference code's; the card's default for its weights
NANO_KEY_SCALE_LOG_CAP = math.log(2**16 - 1)  # nanoMosaics: exp(min(scale, ln 65535))
BANDWIDTH_LOG_CAP = 5.0  # this model: beta = exp(2 min(10 b, 5))

# reference option -> the only value this model can express
LIBRARY_REQUIRED_OPTIONS: dict[str, Any] = {
    "k_fe_type": "linearconv",
    "v_fe_type": "lowrlinearconv",
    "k_kernel_size": 1,
    "v_kernel_size": 2,
    "v_shift": 1,
    "bias": False,
    "attn_only": False,
    "pmem_count": 1,
    "pre_ln": True,
    "weight_tying": True,
}
NANO_REQUIRED_OPTIONS: dict[str, Any] = {"bias": False, "pmem_count": 1}


class ReferenceFormatError(InputError):
    """The checkpoint is not a reference Memory Mosaics checkpoint this converter supports."""


def load_reference_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read ``ckpt.pt`` without unpickling arbitrary objects (tensors, plain containers and
    ``argparse.Namespace`` only)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"Checkpoint not found: {path}; pass the reference run's ckpt.pt.")
    not_a_checkpoint = (f"{path} is not a PyTorch checkpoint (torch.save's zip or pickle "
                        "format); pass the reference run's ckpt.pt.")
    try:
        with open(path, "rb") as handle:
            head = handle.read(4)
    except OSError as err:
        raise InputError(f"Cannot read {path}: {err.strerror or err}.") from None
    if head[:2] != b"PK" and not head.startswith(b"\x80"):  # a zip archive, or a raw pickle
        raise InputError(not_a_checkpoint)
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        text = str(err).strip()
        if "Unsupported global" not in text:  # garbage opcodes: not a pickle of anything
            raise InputError(not_a_checkpoint[:-1] + f" (unreadable: {_first_line(err)}).") \
                from None
        raise InputError(
            f"{path} holds Python objects other than tensors, plain values and "
            f"argparse.Namespace ({_unsupported(text)}); refusing to unpickle it. Re-save only "
            "its 'model' state dict and 'model_args' dict with torch.save.") from None
    except Exception as err:  # noqa: BLE001 (a damaged file fails anywhere in the unpickler)
        raise InputError(f"Cannot read {path} as a PyTorch checkpoint (truncated or damaged? "
                         f"{type(err).__name__}: {_first_line(err)}); pass the reference "
                         "run's ckpt.pt.") from None
    if not isinstance(ckpt, Mapping) or "model" not in ckpt or "model_args" not in ckpt:
        keys = sorted(ckpt) if isinstance(ckpt, Mapping) else type(ckpt).__name__
        raise ReferenceFormatError(
            f"{path} is not a reference training checkpoint: expected a dict with 'model' and "
            f"'model_args' (as train_memory_mosaics.py / nanoMosaics train.py write), got {keys}.")
    return dict(ckpt)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _unsupported(text: str) -> str:
    """The offending global of torch's weights-only error (its first lines are advice)."""
    for line in text.splitlines():
        if "Unsupported global" in line:
            return line.strip().removeprefix("WeightsUnpickler error: ")
    return text.splitlines()[0]


def strip_compile_prefix(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Drop the ``_orig_mod.`` prefix ``torch.compile`` adds to parameter names."""
    return {(k[len(ORIG_MOD_PREFIX):] if k.startswith(ORIG_MOD_PREFIX) else k): v
            for k, v in state_dict.items()}


def model_args_dict(model_args: Any) -> dict[str, Any]:
    if isinstance(model_args, argparse.Namespace):
        return vars(model_args)
    if isinstance(model_args, Mapping):
        return dict(model_args)
    raise ReferenceFormatError(f"'model_args' must be a dict or argparse.Namespace, got "
                               f"{type(model_args).__name__}.")


def detect_format(state_dict: Mapping[str, Tensor]) -> str:
    """``"library-eft"``, ``"library"`` or ``"nanomosaics"`` from the parameter names."""
    if "mosaic.wte.weight" in state_dict:
        return "nanomosaics"
    if "blocks.0.attn.leaky_average.linear.weight" in state_dict:
        return "library-eft"
    if "blocks.0.attn.k_featurizer.conv.weight" in state_dict:
        return "library"
    sample = ", ".join(sorted(state_dict)[:6])
    raise ReferenceFormatError(
        "Not a Memory Mosaics checkpoint of the reference code: none of 'mosaic.wte.weight' "
        "(nanoMosaics), 'blocks.0.attn.leaky_average.linear.weight' (memory_mosaics_eft) or "
        f"'blocks.0.attn.k_featurizer.conv.weight' (memory_mosaics) is present (keys: {sample}, "
        "...).")


def _refuse_unsupported(args: Mapping[str, Any], required: Mapping[str, Any], source: str
                        ) -> None:
    bad = [f"{name}={args[name]!r} (need {want!r})" for name, want in required.items()
           if name in args and args[name] != want]
    if bad:
        raise ReferenceFormatError(
            f"This {source} checkpoint uses reference options this model cannot express: "
            f"{', '.join(bad)}. Only the default Memory Mosaics architecture converts.")


class _Keys:
    """Takes tensors out of a state dict by name, so leftovers can be reported."""

    def __init__(self, state_dict: Mapping[str, Tensor]) -> None:
        self.left = dict(state_dict)

    def take(self, name: str) -> Tensor:
        if name not in self.left:
            raise ReferenceFormatError(f"Checkpoint lacks the parameter {name!r}; it was not "
                                       "written by the reference model this layout names.")
        return self.left.pop(name)

    def drop(self, *names: str) -> None:
        for name in names:
            self.left.pop(name, None)

    def finish(self) -> None:
        if self.left:
            raise ReferenceFormatError(
                "Checkpoint holds parameters this model has no place for: "
                f"{', '.join(sorted(self.left))} (an unsupported reference option, e.g. bias).")


def _heads(t: Tensor) -> Tensor:
    """(1, H, 1, 1) or (H,) per-head scalars -> (H,)."""
    return t.reshape(-1)


def _tied(keys: _Keys, emb: str, head: str) -> Tensor:
    wte = keys.take(emb)
    if head in keys.left:
        lm = keys.take(head)
        if not torch.equal(lm, wte):
            raise ReferenceFormatError(
                f"{head} differs from {emb}: untied output weights are not supported.")
    return wte


def _convert_library(sd: Mapping[str, Tensor], args: Mapping[str, Any], eft: bool
                     ) -> tuple[dict[str, Any], dict[str, Tensor]]:
    source = "memory_mosaics_eft" if eft else "memory_mosaics"
    _refuse_unsupported(args, LIBRARY_REQUIRED_OPTIONS, source)
    keys = _Keys(sd)
    out: dict[str, Tensor] = {}
    wte = _tied(keys, "emb.weight", "head.weight")
    out["model.wte.weight"] = wte
    out["model.ln_f.weight"] = keys.take("ln_out.weight")
    n_layer = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))

    def key_features(src: str, dst: str) -> None:
        if eft:
            w = keys.take(f"{src}.leaky_average.leaky_beta_w_under")
            u = keys.left.pop(f"{src}.leaky_average.leaky_beta_u_under", w)
            if not torch.equal(u, w):
                raise ReferenceFormatError(
                    f"{src}.leaky_average has separate u and w decays (sep_w_on_t=True); only "
                    "the shared decay of memory_mosaics_eft converts.")
            out[f"{dst}.k_proj.weight"] = keys.take(f"{src}.leaky_average.linear.weight")
            out[f"{dst}.leaky_p"] = _heads(w)
        else:
            conv = keys.take(f"{src}.k_featurizer.conv.weight")
            if conv.dim() != 3 or conv.shape[-1] != 1:
                raise ReferenceFormatError(f"{src}.k_featurizer.conv.weight has shape "
                                           f"{tuple(conv.shape)}: a key kernel size > 1 is not "
                                           "supported (need k_kernel_size=1).")
            out[f"{dst}.k_proj.weight"] = conv[:, :, 0]
            out[f"{dst}.leaky_p"] = _heads(keys.take(f"{src}.leaky_key_beta"))

    for i in range(n_layer):
        src, dst = f"blocks.{i}", f"model.blocks.{i}"
        out[f"{dst}.ln_1.weight"] = keys.take(f"{src}.ln1.weight")
        out[f"{dst}.ln_2.weight"] = keys.take(f"{src}.ln2.weight")
        key_features(f"{src}.attn", f"{dst}.cmem")
        out[f"{dst}.cmem.v_proj.weight"] = keys.take(f"{src}.attn.v_featurizer.linear.weight")
        out[f"{dst}.cmem.lookahead_c"] = _heads(keys.take(f"{src}.attn.v_featurizer.coef"))
        out[f"{dst}.cmem.bandwidth_b"] = _heads(keys.take(f"{src}.attn.kernel_beta"))
        out[f"{dst}.cmem.value_q"] = _heads(keys.take(f"{src}.attn.value_beta"))
        out[f"{dst}.cmem.c_proj.weight"] = keys.take(f"{src}.attn.c_proj.weight")
        key_features(f"{src}.pmem", f"{dst}.pmem")
        out[f"{dst}.pmem.mem_keys"] = keys.take(f"{src}.pmem.pmem.M_k0")[0]
        out[f"{dst}.pmem.mem_values"] = keys.take(f"{src}.pmem.pmem.M_v0")[0]
        out[f"{dst}.pmem.bandwidth_b"] = _heads(keys.take(f"{src}.pmem.kernel_beta"))
        out[f"{dst}.pmem.value_q"] = _heads(keys.take(f"{src}.pmem.value_beta"))
        out[f"{dst}.pmem.c_proj.weight"] = keys.take(f"{src}.pmem.c_proj.weight")
    keys.finish()
    d = wte.shape[1]
    n_head = out["model.blocks.0.cmem.leaky_p"].numel()
    config = dict(vocab_size=wte.shape[0], n_layer=n_layer, n_head=n_head, n_embd=d,
                  pmem_size=out["model.blocks.0.pmem.mem_keys"].shape[1],
                  block_size=int(args.get("block_size", 512)),
                  dropout=float(args.get("hd_dropout", 0.0)),
                  attn_dropout=float(args.get("ic_dropout", 0.0)))
    return config, out


def _convert_nanomosaics(sd: Mapping[str, Tensor], args: Mapping[str, Any]
                         ) -> tuple[dict[str, Any], dict[str, Tensor]]:
    _refuse_unsupported(args, NANO_REQUIRED_OPTIONS, "nanoMosaics")
    keys = _Keys(sd)
    out: dict[str, Tensor] = {}
    wte = _tied(keys, "mosaic.wte.weight", "lm_head.weight")
    d = wte.shape[1]
    out["model.wte.weight"] = wte
    # nanoMosaics computes ln_f(x) W^T; this model d^-1/2 ln_f(x) W^T: fold sqrt(d) into ln_f
    out["model.ln_f.weight"] = keys.take("mosaic.ln_f.weight") * math.sqrt(d)
    n_layer = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("mosaic.h."))
    for i in range(n_layer):
        src, dst = f"mosaic.h.{i}", f"model.blocks.{i}"
        out[f"{dst}.ln_1.weight"] = keys.take(f"{src}.ln_1.weight")
        out[f"{dst}.ln_2.weight"] = keys.take(f"{src}.ln_2.weight")
        for part, mem in (("attn", "cmem"), ("mlp", "pmem")):
            kf = f"{src}.{part}.k_featurizer"
            out[f"{dst}.{mem}.k_proj.weight"] = keys.take(f"{kf}.W_k.weight")
            out[f"{dst}.{mem}.leaky_p"] = _heads(keys.take(f"{kf}.leaky_avg.leaky_key_beta"))
            keys.drop(f"{kf}.leaky_avg.coef")
            out[f"{dst}.{mem}.c_proj.weight"] = keys.take(f"{src}.{part}.c_proj.weight")
        scale = _heads(keys.take(f"{src}.attn.k_featurizer.key_scale"))
        if (10 * scale).max() > BANDWIDTH_LOG_CAP:
            raise ReferenceFormatError(
                f"{src}.attn.k_featurizer.key_scale reaches 10 s = {10 * scale.max():.3f} > 5: "
                "nanoMosaics scales the contextual scores by exp(2 min(10 s, ln 65535)), "
                "this model at exp(2 min(10 b, 5)); a bandwidth-cap option would be needed.")
        out[f"{dst}.cmem.bandwidth_b"] = scale
        v = f"{src}.attn.v_featurizer"
        out[f"{dst}.cmem.v_proj.weight"] = keys.take(f"{v}.W_v.weight")
        out[f"{dst}.cmem.lookahead_c"] = _heads(keys.take(f"{v}.coef"))
        out[f"{dst}.cmem.value_q"] = _heads(keys.take(f"{v}.val_scale"))
        keys.drop(f"{src}.attn.bias")  # the causal mask buffer
        # persistent memory: softmax(exp(min(20 s, ln 65535)) k . P_k): fold the scale into
        # the slot keys and set this model's bandwidth to exp(0) = 1
        pscale = _heads(keys.take(f"{src}.mlp.k_featurizer.key_scale"))
        factor = torch.exp(torch.clamp(20 * pscale.double(), max=NANO_KEY_SCALE_LOG_CAP))
        p_k, p_v = keys.take(f"{src}.mlp.P_k"), keys.take(f"{src}.mlp.P_v")
        if p_k.shape[0] != 1:
            raise ReferenceFormatError(f"{src}.mlp.P_k holds {p_k.shape[0]} banks "
                                       "(pmem_count > 1): only pmem_count=1 converts.")
        out[f"{dst}.pmem.mem_keys"] = (p_k[0, 0].double() * factor.view(-1, 1, 1)).to(p_k.dtype)
        out[f"{dst}.pmem.mem_values"] = p_v[0, 0]
        out[f"{dst}.pmem.bandwidth_b"] = torch.zeros_like(pscale)
        out[f"{dst}.pmem.value_q"] = _heads(keys.take(f"{src}.mlp.out_scale"))
    keys.finish()
    n_head = out["model.blocks.0.cmem.leaky_p"].numel()
    config = dict(vocab_size=wte.shape[0], n_layer=n_layer, n_head=n_head, n_embd=d,
                  pmem_size=out["model.blocks.0.pmem.mem_keys"].shape[1],
                  block_size=int(args.get("block_size", 1024)),
                  dropout=float(args.get("dropout", 0.0)), attn_dropout=0.0)
    return config, out


CONVERTERS: dict[str, Callable[..., tuple[dict[str, Any], dict[str, Tensor]]]] = {
    "library-eft": lambda sd, args: _convert_library(sd, args, eft=True),
    "library": lambda sd, args: _convert_library(sd, args, eft=False),
    "nanomosaics": _convert_nanomosaics,
}


def convert_state_dict(checkpoint: Mapping[str, Any]
                       ) -> tuple[str, MosaicsConfig, dict[str, Tensor]]:
    """(source layout, config, this model's state dict) from a loaded reference checkpoint."""
    state_dict = strip_compile_prefix(checkpoint["model"])
    args = model_args_dict(checkpoint["model_args"])
    fmt = detect_format(state_dict)
    config_kwargs, weights = CONVERTERS[fmt](state_dict, args)
    config = MosaicsConfig(**config_kwargs)
    weights = {k: v.detach().to(torch.float32).contiguous() for k, v in weights.items()}
    return fmt, config, weights


def build_model(config: MosaicsConfig, weights: Mapping[str, Tensor]) -> torch.nn.Module:
    """A ``MosaicsForCausalLM`` holding ``weights`` (every parameter must be given)."""
    from .modeling_mosaics import MosaicsForCausalLM

    model = MosaicsForCausalLM(config)
    expected = {k for k in model.state_dict() if k != "lm_head.weight"}
    missing, extra = expected - set(weights), set(weights) - expected
    if missing or extra:
        raise ReferenceFormatError(f"Converted weights do not fit the model: missing "
                                   f"{sorted(missing)}, unexpected {sorted(extra)}.")
    model.load_state_dict(dict(weights), strict=False)
    return model.eval()


def convert_reference(checkpoint_path: str | os.PathLike, out_dir: str | os.PathLike,
                      tokenizer: str | None = None, overwrite: bool = False) -> Path:
    """Write ``out_dir`` (config, safetensors weights, model card, optional tokenizer) from a
    reference ``ckpt.pt``; the directory appears only once complete."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise InputError(f"{out_dir} exists and is not empty; choose a new directory or pass "
                         "--overwrite.")
    ckpt = load_reference_checkpoint(checkpoint_path)
    fmt, config, weights = convert_state_dict(ckpt)
    tok = None
    if tokenizer is not None:
        from transformers import AutoTokenizer
        try:
            tok = AutoTokenizer.from_pretrained(tokenizer)
        except (OSError, ValueError) as err:
            raise InputError(f"Cannot load tokenizer {tokenizer!r} ({err}); pass a local "
                             "tokenizer directory or a name already in the HF cache.") from None
        config.eos_token_id = tok.eos_token_id
        config.bos_token_id = tok.bos_token_id
    model = build_model(config, weights)
    args = model_args_dict(ckpt["model_args"])
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out_dir.name}-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        if tok is not None:
            tok.save_pretrained(tmp)
        from .model_card import write_model_card
        iters = ckpt.get("iter_num")
        run_config = ckpt.get("config") if isinstance(ckpt.get("config"), Mapping) else {}
        dataset = args.get("dataset") or run_config.get("dataset")
        write_model_card(tmp, config, source=_SOURCE_NAMES[fmt],
                         steps=int(iters) if isinstance(iters, int) else None,
                         datasets=[str(dataset)] if dataset else None,
                         license=REFERENCE_LICENSE,
                         tokenizer=tokenizer or "not saved here: the reference code uses the "
                         "GPT-2 BPE (tiktoken gpt2); convert with --tokenizer to include one")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


_SOURCE_NAMES = {
    "library-eft": "the reference code's Library/memory_mosaics/models/memory_mosaics_eft.py",
    "library": "the reference code's Library/memory_mosaics/models/memory_mosaics.py",
    "nanomosaics": "the reference code's nanoMosaics/mosaic_model.py",
}
