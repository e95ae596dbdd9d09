"""fastllm_kernels: Triton kernels for LLM training, each with a plain-torch reference.

Depends on torch and triton only; knows nothing of fastllm. An op runs its Triton kernels on
CUDA tensors (and on CPU tensors under TRITON_INTERPRET=1) and its `*_reference` otherwise
(`_dispatch` decides, and holds the launch settings they share).

One op per module, imported from it (`from fastllm_kernels.norm import rms_norm`); this package
re-exports nothing, so `fastllm_kernels.<name>` is always the module of that name, never an op
named like it. What the projection ops know of a weight besides its values (FP8, a gradient
sink) comes to them as one `WeightRecipe` argument (`recipe`), never as attributes on it.

- `norm`, `norm_linear`, `rotary`, `attention`, `activation`, `gated_linear`, `gated_mlp`,
  `cross_entropy`: the transformer's ops, forward and backward.
- `preference` (sequence log-probabilities, DPO) and `distillation`: the head's other losses,
  chunked like `cross_entropy`, their gradients formed in forward (`precomputed_gradients`).
- `linear`: linear layers whose weight gradient goes straight into an fp32 buffer (torch
  matmuls, no Triton); `accumulate`: adding gradients into fp32; `recipe`: `WeightRecipe`.
- `row_helpers`: the @triton.jit helpers that kernels of several ops inline.
- `moe/`: the dropless mixture of experts (routing, sparse map, dispatch and combine copies,
  grouped linear and its matmul).
- `fp8/`: quantization, amax histories, the per-weight `Fp8Weight`, and the FP8 linear, norm-
  linear, gated-linear and MLP products.
- `adam`: AdamW over flat buffers; `master_split`: fp32 masters as bf16 plus a remainder.
"""
