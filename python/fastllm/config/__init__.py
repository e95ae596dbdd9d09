"""fastllm's typed configuration: YAML files plus `a.b.c=value` overrides, checked up front.

Importing this package must stay cheap: it never imports torch.
"""

from fastllm.config.data import DataConfig
from fastllm.config.loading import load_config, load_raw
from fastllm.config.model import BaseModelConfig, ModelConfig, TransformerConfig
from fastllm.config.schema import build
from fastllm.config.section import ConfigError, Section
from fastllm.config.trainer import TrainerConfig
from fastllm.config.yaml_io import dump_yaml

__all__ = [
    "BaseModelConfig",
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "Section",
    "TrainerConfig",
    "TransformerConfig",
    "build",
    "dump_yaml",
    "load_config",
    "load_raw",
]
