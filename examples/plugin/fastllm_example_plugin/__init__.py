"""An example fastllm plugin: `config` holds the components' configs (no torch, so that
validating a config stays instant), `mlp` and `loss` their runtime parts."""
