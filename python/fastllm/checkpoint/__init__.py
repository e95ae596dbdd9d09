"""Model state on disk: fastllm's `distributed` checkpoints and conversion to and from Hugging
Face.

- `distributed`: the `distributed` format (per-rank shards + manifest), its one writer and
  reader of the manifest; `saver`: writing it without stalling training (Rust background
  writer, atomic commit) and finding the newest valid checkpoint; `errors`: what a failed
  write raises.
- `formats`: model directories (fastllm's format and Hugging Face's) read and written as
  (config, tensor stream); `safetensors_io`: sharded safetensors, read lazily.
- `convert`: `fastllm convert` between them.
- `architectures`: the registry of the Hugging Face architectures fastllm converts;
  `hf_config`: their `config.json`; `hf_weights`, `hf_rules`: their tensors, rule by rule.
"""
