"""The engine: turns a described model into a trained one. It alone lays out the parameters in
flat buffers, shards, reduces and gathers them, schedules the step and runs the optimizer; the
model declares its parameters' metadata and calls the autograd collectives of `parallel`.

- `build`: `build(config)`, every plug-in applied in one listed order → `engine.Engine`
  (`train_step`, `evaluate`, `state_dict` / `load_state_dict`, `describe`);
  `checkpointing`: the training state as plain data and as a checkpoint.
- `batch`: a step's micro-batches prepared once (chunks, documents, pieces, loss weights).
- `stages`: stage arithmetic (which model positions, which pipeline rank, which stages a step
  reads); `model_stages`: `ModelStages`, the model's parameters as views of per-stage flat
  buffers, one group of buffers for the dense parameters and one for the experts;
  `parameter_group`: a group with its gradient hooks and movers; `buffers`: a group's buffers
  (`_native.BufferLayout`), `gradient_buffers`: their fp32 gradients; `tied_weights`: the tied
  embedding and head on different pipeline ranks; `weights_io`: whole weights in and out.
- `data_parallel`, `gradient_reducer`, `weight_refresh`, `weight_gatherer`, `fp8_gather`:
  ZeRO 1-3 over the data group: gradients reduced into shards, weights gathered back.
- `optimizer`, `learning_rate`, `precision`: AdamW over the shards, the learning-rate
  schedules, the training dtypes and loss scaling.
- `recompute`, `activation_offload`, `compile`, `fp8`: applied to a plain model from the outside.
- `micro_sequences`: sequences cut into pieces that run one after another.
- `replicated_check`: the check that tensor-replicated parameters stay identical.
- `schedule/`: the static schedule of a step, the runner of every step (one stage for the
  whole model, or the pipeline's) and the simulator.
"""
