"""The plugin's components as the config sees them: a type name (the tag), fields with their
docs (the reference shows them), checks, and the import path of the runtime part."""

from __future__ import annotations

from typing import ClassVar

from fastllm.config.data import DataSourceConfig
from fastllm.config.model import BlockConfig, LossConfig, MLPBaseConfig, TransformerConfig
from fastllm.config.section import ConfigError, check_positive


class SquaredReLUMLPConfig(MLPBaseConfig, tag="squared_relu"):
    """layer_2(relu(layer_1 x)²), no biases (Primer, So et al. 2021): an ungated MLP whose
    activation is the square of the ReLU."""

    implementation = "fastllm_example_plugin.mlp:SquaredReLUMLP"

    ffn_hidden_size: int | None = None
    """Width of the MLP; default the transformer's ffn_hidden_size."""

    def validate(self) -> None:
        check_positive(self.ffn_hidden_size, "ffn_hidden_size")

    def width(self, transformer: TransformerConfig) -> int:
        width = self.ffn_hidden_size or transformer.ffn_hidden_size
        assert width is not None, "validate() first"
        return width

    def num_parameters(self, transformer: TransformerConfig, *, active: bool = False) -> int:
        return 2 * transformer.hidden_size * self.width(transformer)


class ParallelBlockConfig(BlockConfig, tag="parallel"):
    """x + mixer(norm(x)) + mlp(norm(x)) (GPT-J, PaLM): the mixer and the MLP read the same
    input through one shared norm, side by side instead of one after the other."""

    implementation = "fastllm_example_plugin.block:ParallelBlock"
    unsupported_settings: ClassVar[dict[str, str]] = {
        "model.base_model.transformer.normalization_placement": "it has one norm, of its input"
    }

    def num_norm_parameters(self, transformer: TransformerConfig) -> int:
        return transformer.normalization.num_parameters(transformer.hidden_size)


class LabelSmoothingLossConfig(LossConfig, tag="label_smoothing"):
    """Label-smoothed next-token cross-entropy (Szegedy et al. 2016): the cross-entropy
    against (1 - smoothing) on the label plus smoothing spread evenly over the vocabulary,
    averaged over the trained tokens."""

    implementation = "fastllm_example_plugin.loss:label_smoothing_loss"
    unsupported_settings: ClassVar[dict[str, str]] = {
        "model.distributed.tensor_parallel": "it computes the logits over the whole vocabulary"
    }

    smoothing: float = 0.1
    """The probability mass spread over the vocabulary (0: the label loss)."""

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.smoothing < 1.0:
            raise ConfigError("smoothing", f"must be in [0, 1), got {self.smoothing}")


class ArithmeticSourceConfig(DataSourceConfig, tag="arithmetic"):
    """Synthetic arithmetic exercises, `12 + 345 = 357`, drawn from the run's seed and
    tokenized as they are read; the question is not trained on (a loss-masking span), only
    the answer and the end-of-document token."""

    implementation = "fastllm_example_plugin.source:ArithmeticSource"

    tokenizer: str
    """A Hugging Face `tokenizer.json` (a prepared dataset keeps one)."""
    max_operand: int = 999
    """The largest operand."""
    end_of_document: str = "<|endoftext|>"
    """The token after each exercise."""

    def validate(self) -> None:
        check_positive(self.max_operand, "max_operand")
