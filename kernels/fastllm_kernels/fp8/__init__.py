"""FP8 compute of linear layers: quantization (quantize.py), a weight's recipe and copies
(weight.py) with the delayed-scaling state (amax_history.py), the linear products
(linear.py), the norm and gated-activation kernels that write the projection's input in fp8
(producers.py), the fused FP8 versions of norm_linear, gated_linear (norm_linear.py,
gated_linear.py) and of the whole gated MLP (gated_mlp.py)."""
