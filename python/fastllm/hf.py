"""fastllm models as `transformers` PreTrainedModels, so that `generate()` (with a KV cache)
and the rest of the `transformers` tooling work on them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import torch
from transformers import DynamicCache, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from fastllm.config import BaseModelConfig, build
from fastllm.model import GPTModel


class FastLLMConfig(PretrainedConfig):
    """The `transformers` config of a wrapped model: `base_model` is fastllm's
    `model.base_model` section as plain data; the usual `transformers` names
    (`num_hidden_layers`, `hidden_size`, `num_attention_heads`, `num_key_value_heads`,
    `head_dim`, `vocab_size`) are copied from it for the generation utilities that read them."""

    model_type = "fastllm"

    def __init__(self, base_model: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.base_model = base_model or {}
        # The usual names, which generation utilities (cache sizing) read.
        transformer = self.base_model.get("transformer", {})
        for theirs, ours in (
            ("num_hidden_layers", "num_layers"),
            ("hidden_size", "hidden_size"),
            ("num_attention_heads", "num_attention_heads"),
            ("num_key_value_heads", "head_groups"),
            ("head_dim", "kv_channels"),
        ):
            if ours in transformer:
                kwargs.setdefault(theirs, transformer[ours])
        if "vocab_size" in self.base_model:
            kwargs.setdefault("vocab_size", self.base_model["vocab_size"])
        kwargs.setdefault("tie_word_embeddings", False)  # the wrapped model handles tying
        super().__init__(**kwargs)


class FastLLMForCausalLM(PreTrainedModel, GenerationMixin):
    """A fastllm `GPTModel` as a `transformers` causal language model, so that `generate()`
    (with a `DynamicCache` of keys and values) and the rest of `transformers`' tooling run on
    it. Make one with `wrap`. A batch of prompts of different lengths is left-padded, with an
    `attention_mask` that is 0 on the padding (what a tokenizer with `padding_side="left"`
    gives): each prompt's positions start at 0 after its padding, which no token attends to."""

    config_class = FastLLMConfig
    base_model_prefix = "model"
    _supports_cache_class = True

    def __init__(
        self,
        config: FastLLMConfig,
        model: GPTModel | None = None,
        logits: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        super().__init__(config)
        self.model = (
            model if model is not None else GPTModel(build(BaseModelConfig, config.base_model))
        )
        self._logits = logits

    @classmethod
    def wrap(
        cls, model: GPTModel, logits: Callable[..., torch.Tensor] | None = None, **config: Any
    ) -> FastLLMForCausalLM:
        """`model` as a `transformers` model, on its device and dtype, in eval mode: the weights
        are shared, not copied. `logits` computes the logits in its place, taking what its
        `forward` takes (a model split over pipeline ranks: lm-eval's passes). `config` adds or
        overrides `PretrainedConfig` attributes (`eos_token_id=...`)."""
        wrapper = cls(FastLLMConfig(msgspec.to_builtins(model.config), **config), model, logits)
        parameters = list(model.parameters())
        if any(p.is_meta for p in parameters):  # other pipeline ranks' stages: not to be moved
            return wrapper.eval()
        return wrapper.to(device=parameters[0].device, dtype=parameters[0].dtype).eval()

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embeddings

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
        past_key_values: Any = None,
        use_cache: bool | None = None,
        labels: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        **_: Any,
    ) -> CausalLMOutputWithPast:
        """Logits of `input_ids` (batch, tokens), extending `cache` (or `past_key_values`) when
        `use_cache` is not False; with `labels`, also the mean cross-entropy of each position's
        next-token prediction. `attention_mask` (batch, cached + new tokens) marks left padding
        with 0; a `ValueError` for a 0 after a 1 (right or inner padding). `logits_to_keep` >
        0: the logits of the last that-many positions only (`generate()` asks for 1, so a
        prompt's logits are never all formed)."""
        if labels is not None and logits_to_keep:
            raise ValueError("labels need every position's logits: logits_to_keep must be 0")
        cache = cache if cache is not None else past_key_values  # transformers ≥ 5.24 / older
        if use_cache and cache is None:
            cache = DynamicCache()
        logits = (self.model if self._logits is None else self._logits)(
            input_ids,
            cache=cache if use_cache is not False else None,
            logits_to_keep=logits_to_keep,
            document_ids=_padding_documents(attention_mask),
        )
        loss = None
        if labels is not None:
            shifted = labels[:, 1:].reshape(-1)
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), shifted
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})


def _padding_documents(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Left padding as document ids over the keys: the padding one document (0), the tokens
    after it another (1), so that attention stays within each and positions restart at the
    first token; None when nothing is padded (the unmasked kernels)."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    documents = attention_mask.long()
    if bool((documents[:, 1:] < documents[:, :-1]).any()):
        raise ValueError("attention_mask: only left padding is supported (0s before the 1s)")
    return documents


_CACHE_FIELD = (
    "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
)
