"""The one transformer (Llama, Mistral, Mixtral, StarCoder2, Qwen2 and their kin).

- `gpt`: the model: embedding, blocks, final norm, head (logits or fused loss).
- `block`: the `decoder` block (the block point's built-in); `attention`: self-attention with
  rotary (`rotary`: its tables); `mlp`: the dense MLP or the mixture of experts.
- `parameters`: the metadata each layer declares for the engine; `init`: initialization.
"""

from fastllm.model.gpt import GPTModel
from fastllm.model.init import initialize

__all__ = ["GPTModel", "initialize"]
