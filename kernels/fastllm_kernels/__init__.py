"""fastllm_kernels: Triton kernels for LLM training, each with a plain-torch reference.

Depends on torch and triton only; knows nothing of fastllm. Every op runs its Triton kernels on
CUDA tensors (and on CPU tensors under TRITON_INTERPRET=1) and its `*_reference` otherwise.

One op per module, imported from it (`from fastllm_kernels.norm import rms_norm`); this package
re-exports nothing, so `fastllm_kernels.<name>` is always the module of that name, never an op
named like it. FP8 compute lives in the `fp8` subpackage, the mixture-of-experts ops in `moe`,
the @triton.jit helpers that kernels of several ops inline in `row_helpers`. What the
projection ops know of a weight besides its values (FP8, a gradient sink) comes to them as one
`WeightRecipe` argument (`recipe`), never as attributes on the weight.
"""
