"""fastllm_kernels: Triton kernels for LLM training, each with a plain-torch reference.

Depends on torch and triton only; knows nothing of fastllm. An op runs its Triton kernels on
CUDA tensors (and on CPU tensors under TRITON_INTERPRET=1) and its `*_reference` otherwise
(`_dispatch` decides, and holds the launch settings they share).

- `norm`, `norm_linear`, `rotary`, `attention`, `activation`, `cross_entropy`: the
  transformer's ops, forward and backward.
- `linear`: linear layers whose weight gradient goes straight into an fp32 buffer (torch
  matmuls, no Triton); `accumulate`: adding gradients into fp32.
- `moe`: the dropless mixture of experts; `grouped_matmul`: its experts' matmuls.
- `fp8`: quantization; `fp8_linear`: linear layers in FP8 (the per-weight `Fp8Weight`);
  `fp8_fused`, `fp8_mlp`: the fused FP8 variants of norm-linear, gated linear and the MLP.
- `adam`: AdamW over flat buffers; `master_split`: fp32 masters as bf16 plus a remainder.
"""

from fastllm_kernels.accumulate import accumulate_, accumulate_reference_
from fastllm_kernels.activation import (
    gated_activation,
    gated_activation_fused,
    gated_activation_reference,
    gated_linear,
    gated_linear_reference,
)
from fastllm_kernels.adam import adamw_step_, adamw_step_reference_
from fastllm_kernels.attention import attention, attention_reference
from fastllm_kernels.cross_entropy import (
    cross_entropy,
    cross_entropy_reference,
    linear_cross_entropy,
    linear_cross_entropy_reference,
)
from fastllm_kernels.fp8 import quantize, quantize_reference
from fastllm_kernels.fp8_linear import Fp8Weight, fp8_linear
from fastllm_kernels.linear import linear, matmul_into_fp32_, weight_gradient
from fastllm_kernels.moe import (
    SparseMap,
    combine,
    combine_reference,
    dispatch,
    dispatch_reference,
    grouped_linear,
    grouped_linear_reference,
    sparse_map,
)
from fastllm_kernels.norm import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference
from fastllm_kernels.norm_linear import norm_linear, norm_linear_reference
from fastllm_kernels.rotary import (
    apply_rotary,
    apply_rotary_reference,
    split_qkv_rotary,
    split_qkv_rotary_reference,
)

__all__ = [
    "Fp8Weight",
    "SparseMap",
    "accumulate_",
    "accumulate_reference_",
    "adamw_step_",
    "adamw_step_reference_",
    "apply_rotary",
    "apply_rotary_reference",
    "attention",
    "attention_reference",
    "combine",
    "combine_reference",
    "cross_entropy",
    "cross_entropy_reference",
    "dispatch",
    "dispatch_reference",
    "fp8_linear",
    "gated_activation",
    "gated_activation_fused",
    "gated_activation_reference",
    "gated_linear",
    "gated_linear_reference",
    "grouped_linear",
    "grouped_linear_reference",
    "layer_norm",
    "layer_norm_reference",
    "linear",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "matmul_into_fp32_",
    "norm_linear",
    "norm_linear_reference",
    "quantize",
    "quantize_reference",
    "rms_norm",
    "rms_norm_reference",
    "sparse_map",
    "split_qkv_rotary",
    "split_qkv_rotary_reference",
    "weight_gradient",
]
