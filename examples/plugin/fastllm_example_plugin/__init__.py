"""An example fastllm plugin: `config` holds the components' configs (no torch, so that
validating a config stays instant), `block`, `mlp`, `loss` and `source` their runtime
parts."""
