"""Record transforms the prepare tests name by import path (`input.transform`)."""

from __future__ import annotations

import time
from typing import Any


def title_and_body(record: dict[str, Any]) -> str:
    return f"{record['title']}\n\n{record['body']}"


def question_and_answer(record: dict[str, Any]) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": record["question"]},
        {"role": "assistant", "content": record["answer"]},
    ]


def good_and_bad(record: dict[str, Any]) -> dict[str, str]:
    return {"prompt": record["question"], "chosen": record["good"], "rejected": record["bad"]}


def file_with_its_name(record: dict[str, Any]) -> str:
    return f"# {record['path'].rsplit('/', 1)[-1]}\n{record['text']}"


def fails_on_the_third(record: dict[str, Any]) -> str:
    if record["id"] == 2:
        raise KeyError("summary")
    return record["text"]


def text_then_a_conversation(record: dict[str, Any]) -> Any:
    return record["text"] if record["id"] == 0 else [{"role": "user", "content": record["text"]}]


def a_number(record: dict[str, Any]) -> int:
    return len(record)


NOT_CALLABLE = 3


def stalls_past_the_first_megabyte(record: dict[str, Any]) -> str:
    """Holds the run once its job has started (the first megabyte of records was sent), so
    that a test can interrupt it there."""
    if record["id"] == 1500:
        time.sleep(120)
    return record["text"]
