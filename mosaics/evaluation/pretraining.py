"""The ``pretrain`` task of the experiment engine: pretrain a language model with one kernel
(``mosaics train``), save it, then its recall report (``mosaics eval needle``: the needle grid,
the corpus's own question, the loss by position).

A job resumes: training from its newest checkpoint, the report from the cells on disk.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from .protocols import PretrainProtocol

V2_BLOCK = dict(gated_keys=True, adaptive_bandwidth=True, three_level_memory=True,
                persistent_memory="swiglu", document_masking=True)


def train_config(arch: str, kernel: str | None, proto: PretrainProtocol, seed: int,
                 kernel_kwargs: dict[str, Any] | None, run_dir: Path, cache_dir: Path):
    """The ``TrainConfig`` of one pretraining job (v2: :data:`V2_BLOCK` with the protocol's
    window and gaps; the transformer baselines at ``proto.transformer_lr``)."""
    from ..training.config import TrainConfig

    model_kwargs: dict[str, Any] = {}
    if arch == "mosaics-v2":
        model_kwargs = dict(V2_BLOCK)
        for key, value in (("short_term_window", proto.v2_window),
                           ("long_term_gap", proto.v2_gap),
                           ("long_term_gap_range", proto.v2_gap_range)):
            if value is not None:
                model_kwargs[key] = list(value) if isinstance(value, tuple) else value
    extra = dict(proto.train)
    model_kwargs.update(extra.pop("model_kwargs", {}))
    if not arch.startswith("mosaics") and proto.transformer_lr is not None:
        extra.setdefault("lr", proto.transformer_lr)
    return TrainConfig(
        run_dir=str(run_dir), data_source=proto.data_source, tokenizer=proto.tokenizer,
        data_cache_dir=str(cache_dir),
        model_type="mosaics" if arch.startswith("mosaics") else arch,
        kernel=kernel or "gaussian", kernel_kwargs=dict(kernel_kwargs or {}),
        model_kwargs=model_kwargs, n_layer=proto.n_layer, n_embd=proto.n_embd,
        n_head=proto.n_head, block_size=proto.block_size, batch_size=proto.batch_size,
        max_steps=proto.max_steps, warmup_steps=proto.warmup_steps,
        eval_interval=proto.eval_interval, checkpoint_interval=proto.eval_interval,
        seed=seed, progress_bar=False, **extra)


def run_pretrain(arch: str, kernel: str | None, proto: PretrainProtocol, seed: int = 0,
                 kernel_kwargs: dict[str, Any] | None = None, device: str = "cpu",
                 out_dir: str | Path = "runs/pretrain", model_dir: str | None = None,
                 label: str | None = None) -> dict[str, Any]:
    """Pretrain (or take the saved ``model_dir``), then probe. Returns the JSON-ready results
    ``{task, protocol, seed, runs: [{label, train, recall}]}``."""
    from ..training.pretrain import train
    from .recall_probe import probe

    work = Path(out_dir)
    run: dict[str, Any] = {"label": label or (f"{arch}/{kernel}" if kernel else arch)}
    if model_dir is None:
        cfg = train_config(arch, kernel, proto, seed, kernel_kwargs, work / "run",
                           work.parent.parent / "datacache")
        result = train(cfg)
        if result.final_dir is None:
            raise RuntimeError(f"pretraining stopped before the final model "
                               f"({result.stop_signal or 'no final model'}); run again to resume")
        model_dir = str(result.final_dir)
        run["train"] = {"steps": result.steps, "train_loss": result.train_loss,
                        "val_loss": (result.val_loss if result.val_loss is not None
                                     else _last_val_loss(work / "run" / "metrics.jsonl")),
                        "best_val_loss": result.best_val_loss,
                        "seconds": result.wall_seconds,
                        "resumed_seconds": result.resumed_seconds,
                        "tokens": result.steps * proto.batch_size * proto.block_size,
                        "tokens_per_s": _tokens_per_s(result.history)}
    run["model_dir"] = model_dir
    run["recall"] = probe(
        model_dir, work / "recall", proto.data_source, proto.multipliers, proto.depths,
        proto.prompts, proto.facts, seed, device=device, own_prompts=proto.own_prompts,
        loss_multiplier=proto.loss_multiplier, progress=False, block_size=proto.block_size,
        label=f"{run['label']}, seed {seed}")
    return {"task": "pretrain", "protocol": asdict(proto), "seed": seed, "runs": [run]}


def _tokens_per_s(history: list[dict[str, float]]) -> float | None:
    rates = [h["tokens_per_s"] for h in history if "tokens_per_s" in h]
    return sum(rates) / len(rates) if rates else None


def _last_val_loss(metrics: Path) -> float | None:
    """The last validation loss in a run's metrics.jsonl (a resumed finished run reports none)."""
    import json

    last = None
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                last = json.loads(line).get("val/loss", last)
            except json.JSONDecodeError:
                continue
    return last
