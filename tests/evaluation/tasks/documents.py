"""The test tasks' documents: a jsonl file beside this one as the `test` split (read here, so
that a task file works from any directory and nothing is downloaded)."""

from pathlib import Path

import datasets


def load(file: str, **_: object) -> datasets.DatasetDict:
    path = Path(__file__).with_name(file)
    return datasets.DatasetDict({"test": datasets.Dataset.from_json(str(path))})
