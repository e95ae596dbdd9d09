"""The engine: turns a described model into a trained one. It alone lays out the parameters in
flat buffers, shards, reduces and gathers them, schedules the step and runs the optimizer; the
model declares its parameters' metadata and calls the autograd collectives listed below.

- `process_group`, `mesh`: where this process runs; the tensor × data × pipeline mesh and its
  process groups (sequence-data, expert and expert-data sub-groups included).
- `tensor_parallel`, `sequence_data_parallel`, `expert_parallel`, `point_to_point`: the
  autograd collectives the model calls, and the transfers between pipeline ranks.
- `flat_model`: the parameters as views of per-stage flat buffers (`_native.BufferLayout`);
  `gradient_buffers`: their fp32 gradients.
- `data_parallel`, `gradient_reducer`, `weight_refresh`, `weight_gatherer`, `fp8_gather`:
  ZeRO 1-3 over the data group: gradients reduced into shards, weights gathered back.
- `optimizer`, `learning_rate`, `precision`: AdamW over the shards, the learning-rate
  schedules, the training dtypes and loss scaling.
- `recompute`, `activation_offload`, `compile`, `fp8`: applied to a plain model from the outside.
- `micro_sequences`: sequences cut into pieces that run one after another.
- `replicated_check`: the check that tensor-replicated parameters stay identical.
- `pipeline/`: the static schedule of a step, its runner and its simulator.
"""
