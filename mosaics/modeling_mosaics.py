"""Memory Mosaics language model as a Hugging Face ``PreTrainedModel``.

Stack (no positional encoding: the leaky averages carry order)::

    x = wte(ids)
    for each block:  x += ContextualMemory(LN(x));  x += PersistentMemory(LN(x))
    logits = (LN(x) @ wte^T) / sqrt(d)          # tied head, the reference's logit scale
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils import ModelOutput

from .cache import LayerState, MosaicsCache
from .configuration_mosaics import MosaicsConfig
from .kernels import Kernel
from .memory import AdaptiveBandwidth, ContextualMemory, ShortLongMemory
from .ops import linear_cross_entropy
from .persistent_memory import PersistentMemory, SwiGLUMemory
from .positions import Positions, call_positions
from .remote_code import save_model_code


class _CacheAlias:
    """``past_key_values``: the decoding cache under its older transformers name."""

    @property
    def past_key_values(self) -> MosaicsCache | None:
        return self.cache


@dataclass
class MosaicsModelOutput(_CacheAlias, ModelOutput):
    """Backbone output. ``cache`` (alias ``past_key_values``): the decoding state when
    ``use_cache``; ``aux_loss``: mean kernel regularizer over layers (e.g. FSKA's KL)."""

    last_hidden_state: Tensor | None = None
    cache: MosaicsCache | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    aux_loss: Tensor | None = None


@dataclass
class MosaicsCausalLMOutput(_CacheAlias, ModelOutput):
    """LM output. ``loss = lm_loss + regularization_weight * aux_loss`` when labels are given;
    ``cache`` (alias ``past_key_values``) as in :class:`MosaicsModelOutput`."""

    loss: Tensor | None = None
    logits: Tensor | None = None
    cache: MosaicsCache | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    lm_loss: Tensor | None = None
    aux_loss: Tensor | None = None


def _one_cache(cache: MosaicsCache | None,
               past_key_values: MosaicsCache | None) -> MosaicsCache | None:
    """The decoding cache, given as ``cache`` (the transformers >= 5.2x name, used by its
    ``generate``) or as ``past_key_values`` (the older name)."""
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("got two different decoding caches (cache= and past_key_values=); "
                         "pass one")
    return past_key_values if cache is None else cache


class MosaicsBlock(GradientCheckpointingLayer):
    """Pre-LN block: contextual memory then persistent memory, each on the residual stream."""

    def __init__(self, config: MosaicsConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=False)
        self.cmem = (ShortLongMemory(config, layer_idx) if config.three_level_memory
                     else ContextualMemory(config, layer_idx))
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=False)
        self.pmem = (SwiGLUMemory(config.n_embd, config.swiglu_hidden, config.dropout)
                     if config.persistent_memory == "swiglu" else PersistentMemory(config))

    def forward(self, x: Tensor, pos: Positions | None = None, state: LayerState | None = None,
                use_cache: bool = False) -> tuple[Tensor, LayerState | None]:
        """x += cmem(LN(x)); x += pmem(LN(x)); ``state``/``use_cache``: continue / return the
        decoding state (see :meth:`ContextualMemory.forward`)."""
        context = None
        if state is not None:
            context = state.context if len(state.context) > 1 else state.context[0]
        y, cstate = self.cmem(self.ln_1(x), pos, context, use_cache)
        x = x + y
        y, pstate = self.pmem(self.ln_2(x), pos, None if state is None else state.persistent,
                              use_cache)
        x = x + y
        if not use_cache:
            return x, None
        return x, LayerState(context=cstate if isinstance(cstate, tuple) else (cstate,),
                             persistent=pstate)


class MosaicsPreTrainedModel(PreTrainedModel):
    config_class = MosaicsConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["MosaicsBlock"]
    _supports_sdpa = True

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model builds its own MosaicsCache

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Reference init: Linear N(0, 1/fan_in), c_proj N(0, 1/(fan_in n_layer)), wte N(0, s^2)
        with s = ``config.embedding_init_std`` (1 by default)."""
        if isinstance(module, nn.Linear):
            fan_in = module.weight.shape[1]
            nn.init.normal_(module.weight, mean=0.0, std=1.0 / math.sqrt(fan_in))
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.embedding_init_std)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, (ContextualMemory, PersistentMemory)):
            module.reset_scalars()
            fan_in = module.c_proj.weight.shape[1]
            std = 1.0 / math.sqrt(fan_in * self.config.n_layer)
            nn.init.normal_(module.c_proj.weight, mean=0.0, std=std)
            if isinstance(module, PersistentMemory):
                module.reset_banks()
        elif isinstance(module, AdaptiveBandwidth):
            module.reset_parameters()
        elif isinstance(module, SwiGLUMemory):  # output layer scaled like c_proj
            fan_in = module.w2.weight.shape[1]
            std = 1.0 / math.sqrt(fan_in * self.config.n_layer)
            nn.init.normal_(module.w2.weight, mean=0.0, std=std)

    def save_pretrained(self, save_directory, *args, **kwargs):  # noqa: ANN001
        """Save weights and config, plus this model's code for ``trust_remote_code=True``."""
        self.config.auto_map = {
            "AutoConfig": "configuration_mosaics.MosaicsConfig",
            "AutoModel": "modeling_mosaics.MosaicsModel",
            "AutoModelForCausalLM": "modeling_mosaics.MosaicsForCausalLM",
        }
        out = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            save_model_code(save_directory)
        return out


class MosaicsModel(MosaicsPreTrainedModel):
    """The backbone: embeddings, blocks, final LayerNorm."""

    def __init__(self, config: MosaicsConfig) -> None:
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(MosaicsBlock(config, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=False)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.wte = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        cache: MosaicsCache | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: MosaicsCache | None = None,
        document_ids: Tensor | None = None,
        **kwargs,
    ) -> MosaicsModelOutput | tuple:
        """Backbone forward; ``cache`` (or ``past_key_values``) continues a decoding state.
        ``document_ids`` (B, T): with ``document_masking``, documents where the id changes
        (instead of after each separator token)."""
        cache = _one_cache(cache, past_key_values)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if use_cache is None:  # a training forward builds no decoding state unless asked
            use_cache = self.config.use_cache and not self.training
        if self.gradient_checkpointing and self.training:
            use_cache = False
        if use_cache and cache is None:
            cache = MosaicsCache(self.config.n_layer)
        if not use_cache:
            cache = None
        output_hidden_states = (output_hidden_states if output_hidden_states is not None
                                else self.config.output_hidden_states)
        x = self.wte(input_ids) if inputs_embeds is None else inputs_embeds
        pos = self.positions(input_ids, document_ids, x.shape[:2], cache, x.device,
                             attention_mask)
        hidden = []
        for i, block in enumerate(self.blocks):
            if output_hidden_states:
                hidden.append(x)
            x, state = block(x, pos, None if cache is None else cache.layers[i],
                             cache is not None)
            if cache is not None:
                cache.layers[i] = state
        x = self.ln_f(x)
        if output_hidden_states:
            hidden.append(x)
        if cache is not None:
            cache.seen_tokens += x.shape[1]
        regs = []  # (a loop, not a comprehension with :=, which torch.compile cannot trace)
        for kernel in self.kernels():
            reg = kernel.regularization()
            if reg is not None:
                regs.append(reg)
        aux = torch.stack(regs).mean() if regs else None
        out = MosaicsModelOutput(last_hidden_state=x, cache=cache,
                                 hidden_states=tuple(hidden) if output_hidden_states else None,
                                 aux_loss=aux)
        return out if (return_dict if return_dict is not None else self.config.return_dict) \
            else out.to_tuple()


    def kernels(self) -> list[Kernel]:
        """The contextual memories' kernels, in layer order (found once, not walked per
        decoding step)."""
        found = self.__dict__.get("_kernels")
        if found is None:
            found = [m for m in self.blocks.modules() if isinstance(m, Kernel)]
            self.__dict__["_kernels"] = found
        return found

    def positions(self, input_ids: Tensor | None, document_ids: Tensor | None,
                  shape: torch.Size, cache: MosaicsCache | None, device: torch.device,
                  attention_mask: Tensor | None = None) -> Positions | None:
        """Where the tokens of this call sit (:func:`~mosaics.positions.call_positions`); the
        cache remembers the document in progress between decoding calls."""
        pos, documents = call_positions(self.config, input_ids, document_ids, shape, cache,
                                        device, attention_mask, self.training)
        if cache is not None:
            cache.documents = documents
        return pos


class MosaicsForCausalLM(MosaicsPreTrainedModel, GenerationMixin):
    """Memory Mosaics with a tied language-modelling head."""

    _tied_weights_keys = {"lm_head.weight": "model.wte.weight"}

    def __init__(self, config: MosaicsConfig) -> None:
        super().__init__(config)
        self.model = MosaicsModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.logit_scale = 1.0 / math.sqrt(config.n_embd)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.wte = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    @property
    def regularization_weight(self) -> float:
        return float(self.model.kernels()[0].regularization_weight)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        cache: MosaicsCache | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
        num_items_in_batch: int | Tensor | None = None,
        past_key_values: MosaicsCache | None = None,
        document_ids: Tensor | None = None,
        **kwargs,
    ) -> MosaicsCausalLMOutput | tuple:
        """Causal LM forward. ``labels`` are the input ids (shifted inside); -100 is ignored.
        ``cache`` (or ``past_key_values``) continues a decoding state; ``use_cache`` returns it."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         inputs_embeds=inputs_embeds, cache=_one_cache(cache, past_key_values),
                         use_cache=use_cache, document_ids=document_ids,
                         output_hidden_states=output_hidden_states, return_dict=True)
        h = out.last_hidden_state
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        # scaling the (B, T, d) input of the head is cheaper than scaling (B, T, V) logits
        h = h * self.logit_scale
        logits = loss = lm_loss = shift_labels = None
        if labels is not None:
            # shift the labels, not the logits: no (B, T, V) copy
            shift_labels = F.pad(labels[:, 1:], (0, 1), value=-100).to(h.device)
        reduction = "mean" if num_items_in_batch is None else "sum"
        if shift_labels is not None and self._chunked_loss(logits_to_keep):
            lm_loss = linear_cross_entropy(h.flatten(0, 1), self.lm_head.weight,
                                           shift_labels.flatten(), -100, reduction,
                                           self.config.loss_chunk_size)
        else:
            logits = self.lm_head(h)
            if shift_labels is not None:
                lm_loss = F.cross_entropy(logits.flatten(0, 1).float(), shift_labels.flatten(),
                                          ignore_index=-100, reduction=reduction)
        if lm_loss is not None:
            if num_items_in_batch is not None:
                lm_loss = lm_loss / num_items_in_batch
            loss = lm_loss
            if out.aux_loss is not None:
                weight = self.regularization_weight
                if num_items_in_batch is not None:  # summed over micro-batches by the caller
                    weight = weight * (shift_labels != -100).sum() / num_items_in_batch
                loss = lm_loss + weight * out.aux_loss
        result = MosaicsCausalLMOutput(loss=loss, logits=logits, cache=out.cache,
                                       hidden_states=out.hidden_states, lm_loss=lm_loss,
                                       aux_loss=out.aux_loss)
        return result if (return_dict if return_dict is not None else self.config.return_dict) \
            else result.to_tuple()

    def _chunked_loss(self, logits_to_keep: int) -> bool:
        """Training with gradients: skip the logits (DeepSpeed ZeRO-3 partitions the tied
        weight and gathers it only around module calls, so it keeps the plain head)."""
        return (self.config.loss_chunk_size > 0 and self.training and torch.is_grad_enabled()
                and not logits_to_keep and not hasattr(self.lm_head.weight, "ds_id"))

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor,
                                      cache: MosaicsCache | None = None,
                                      attention_mask: Tensor | None = None,
                                      inputs_embeds: Tensor | None = None,
                                      use_cache: bool | None = None,
                                      past_key_values: MosaicsCache | None = None,
                                      **kwargs) -> dict:
        """Feed only the tokens the cache has not absorbed yet (``generate`` passes the cache
        as ``cache``, or as ``past_key_values`` in older transformers)."""
        cache = _one_cache(cache, past_key_values)
        inputs: dict = {"cache": cache, "use_cache": use_cache, "attention_mask": attention_mask}
        seen = cache.get_seq_length() if cache is not None else 0
        if inputs_embeds is not None and seen == 0:
            inputs["inputs_embeds"] = inputs_embeds
        else:
            inputs["input_ids"] = input_ids[:, seen:].contiguous()
        if "logits_to_keep" in kwargs:
            inputs["logits_to_keep"] = kwargs["logits_to_keep"]
        return inputs
