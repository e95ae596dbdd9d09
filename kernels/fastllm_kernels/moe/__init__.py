"""Dropless mixture of experts: the router (routing.py), the sparse layout of its choices
(sparse_map.py), the permutations of tokens into that layout and back (sparse_copy.py), and
the experts' grouped projections (grouped_linear.py) over the grouped matmul kernels
(grouped_matmul.py)."""
