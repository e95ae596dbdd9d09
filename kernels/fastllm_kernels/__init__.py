"""fastllm_kernels: Triton kernels for LLM training, each with a plain-torch reference.

Depends on torch and triton only; knows nothing of fastllm.
"""
