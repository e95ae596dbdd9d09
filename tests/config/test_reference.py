from __future__ import annotations

from fastllm.config.reference import BEGIN, END, reference
from fastllm.config.trainer import TrainerConfig
from tests.conftest import ROOT


def test_readme_reference_matches_the_config_classes() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split(BEGIN, 1)[1].split(END, 1)[0]
    assert section.strip() == reference(TrainerConfig).strip(), "run `make reference`"


def test_reference_documents_every_field_and_variant() -> None:
    text = reference(TrainerConfig)
    for fragment in (
        "`head_groups`",
        "with `type: llama3`",
        "`scale_factor`",
        "`train_iters`",
        "`weights`",
    ):
        assert fragment in text
    assert "|  |" not in text.replace(" | ", "|"), "a field without documentation"
