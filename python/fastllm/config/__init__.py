"""fastllm's typed configuration: YAML files plus `a.b.c=value` overrides, checked up front.

- `section`: the base of every section, `ConfigError` and `MachineError`; `schema`: a raw
  mapping made typed and checked; `loading`: files and overrides in, a config out
  (`overrides`, `yaml_io`, which bounds a file's nesting and aliases); `bounds`: the sizes a
  run can hold.
- `trainer`: the root of a training config, made of `model`, `data`, `training` (run,
  training, batch, optimizer) and `schedule`; `resume_changes`: what a resumed run changed.
- `prepare`, `convert`: the configs of `fastllm prepare`, `tokenizer train` and `convert`;
  `formats`: the model formats fastllm reads and writes.
- `registry`: the components every `type:` chooses among, fastllm's and other packages'
  (extension points, entry points, import paths).
- `reference`: the generated reference pages (the config keys from the field docs, the
  `layout.COMPATIBILITY` table).

Importing this package must stay cheap: it never imports torch.
"""

from fastllm.config.data import DataConfig
from fastllm.config.loading import load_config, load_raw
from fastllm.config.model import BaseModelConfig, ModelConfig, TransformerConfig
from fastllm.config.schema import build
from fastllm.config.section import ConfigError, MachineError, Section
from fastllm.config.trainer import TrainerConfig
from fastllm.config.yaml_io import dump_yaml

__all__ = [
    "BaseModelConfig",
    "ConfigError",
    "DataConfig",
    "MachineError",
    "ModelConfig",
    "Section",
    "TrainerConfig",
    "TransformerConfig",
    "build",
    "dump_yaml",
    "load_config",
    "load_raw",
]
