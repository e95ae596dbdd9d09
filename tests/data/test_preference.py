"""`fastllm prepare` of preference pairs (strings and chat messages, explicit and implicit
prompts) checked against a plain-Python reading of TRL's rules on `tokenizers` and
`transformers`; the stored spans, bad records, whole-pair sampling and the loader's parts,
positions and labels."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from fastllm.config import ConfigError
from fastllm.config.data import DataConfig, FimConfig
from fastllm.config.prepare import InputConfig
from fastllm.data import DataLoader, SampleStream, TokenDataset
from fastllm.data.dataset import is_preference_dataset
from fastllm.data.loader import pair_positions
from fastllm.data.samples import CHOSEN, PADDING, PROMPT, REJECTED
from tests.data.chat_fixtures import write_tokenizer
from tests.data.conftest import prepare, run_cli, write_jsonl

USER = {"role": "user", "content": "What colour is the sky?"}
SYSTEM = {"role": "system", "content": "You answer in one word."}
RECORDS = [
    {"prompt": "What is 2 + 2?", "chosen": " 4, of course.", "rejected": " 5."},
    {"chosen": "The sky is blue.", "rejected": "The sky is green."},  # implicit prompt
    {"prompt": "Traduis « café »", "chosen": " coffee ☕", "rejected": " tea"},
    {
        "prompt": [USER],
        "chosen": [{"role": "assistant", "content": "Blue."}],
        "rejected": [{"role": "assistant", "content": "Green, mostly, on a clear day."}],
    },
    {  # implicit prompt: whole conversations sharing their start
        "chosen": [SYSTEM, USER, {"role": "assistant", "content": "Blue."}],
        "rejected": [SYSTEM, USER, {"role": "assistant", "content": "Red."}],
    },
    # The prompt's last space goes with the answers: TRL tokenizes the prompt and each answer
    # together, the answers starting where those tokens leave the prompt's.
    {"prompt": "Answer in one word: ", "chosen": "green.", "rejected": "blue."},
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small BPE with Qwen2's ChatML template, `<|im_end|>` its end of document."""
    return write_tokenizer(tmp_path_factory.mktemp("pref_tokenizer"), "qwen2")


def write_pairs(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def expected_pair(record: dict, tok: Tokenizer, hf, eos: int) -> tuple[list, list, list]:
    """Prompt, chosen and rejected ids as TRL's DPOTrainer (1.x) makes them: extract_prompt
    and maybe_apply_chat_template make the texts, then the prompt alone and the prompt
    followed by each answer are tokenized whole (strings framed by EOS after each answer,
    messages by the template alone), the answers starting where those tokens part."""
    chosen, rejected = record["chosen"], record["rejected"]
    prompt = record.get("prompt")
    if prompt is None:  # TRL's extract_prompt
        shared = 0
        while chosen[shared] == rejected[shared]:
            shared += 1
        if isinstance(chosen, str) and chosen[shared - 1] == " ":
            shared -= 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    if isinstance(chosen, list):
        whole_chosen = hf.apply_chat_template(prompt + chosen, tokenize=False)
        whole_rejected = hf.apply_chat_template(prompt + rejected, tokenize=False)
        prompt = hf.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        framing = []
    else:
        whole_chosen, whole_rejected, framing = prompt + chosen, prompt + rejected, [eos]

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    prompt_ids = ids(prompt)
    chosen_ids, rejected_ids = ids(whole_chosen) + framing, ids(whole_rejected) + framing
    shared = min(common_start(prompt_ids, chosen_ids), common_start(prompt_ids, rejected_ids))
    return prompt_ids[:shared], chosen_ids[shared:], rejected_ids[shared:]


def common_start(a: list[int], b: list[int]) -> int:
    shared = 0
    while shared < min(len(a), len(b)) and a[shared] == b[shared]:
        shared += 1
    return shared


@pytest.fixture(scope="module")
def pairs(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """RECORDS prepared, and each pair's (prompt, chosen, rejected) ids."""
    root = tmp_path_factory.mktemp("pairs")
    dataset = prepare(write_pairs(root / "pairs.jsonl", RECORDS), tokenizer_dir, root / "data")
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = tok.token_to_id("<|im_end|>")
    return dataset, [expected_pair(r, tok, hf, eos) for r in RECORDS]


def test_a_pair_is_one_document_prompt_once_then_chosen_then_rejected(
    pairs, tokenizer_dir: Path
) -> None:
    path, expected = pairs
    metadata = json.loads((path / "metadata.json").read_text())
    assert metadata["format"] == "preference" and metadata["documents"] == len(RECORDS)
    assert metadata["bad_records"] == 0 and not metadata["loss_masking_spans"]
    assert metadata["trained_tokens"] == sum(len(c) + len(r) for _, c, r in expected)
    assert is_preference_dataset(path)
    dataset = TokenDataset(path)
    assert dataset.is_preference and not dataset.has_loss_spans
    for index, (prompt, chosen, rejected) in enumerate(expected):
        assert dataset[index].tolist() == prompt + chosen + rejected, index
        p, c = len(prompt), len(chosen)
        assert dataset.preference_spans(index) == ((p, p + c), (p + c, p + c + len(rejected)))
    # The template framed the messages' answers, EOS the strings'.
    assert expected[3][1][-2:] == expected[3][2][-2:]
    # The whole text has " g" where the prompt alone ends with " ": the space goes with the
    # answers (tokenized apart, the chosen one would start with "g").
    prompt, chosen, _ = expected[-1]
    decode = AutoTokenizer.from_pretrained(tokenizer_dir).decode
    assert decode(prompt) == "Answer in one word:" and decode(chosen[:1]) == " g"


def test_a_text_dataset_is_not_a_preference_dataset(tmp_path: Path, tokenizer_dir: Path) -> None:
    inputs = write_jsonl(tmp_path / "text.jsonl", ["some text", "more text"])
    path = prepare(inputs, tokenizer_dir, tmp_path / "text")
    assert not is_preference_dataset(path) and not TokenDataset(path).is_preference


def layout(prompt: list, chosen: list, rejected: list) -> dict[str, list]:
    """The positions a pair takes in a batch row, as `Batch` documents them."""
    last = prompt[-1:]
    tokens = prompt[:-1] + last + chosen + last + rejected
    parts = [PROMPT] * (len(prompt) - 1) + [CHOSEN] * (len(chosen) + 1)
    parts += [REJECTED] * (len(rejected) + 1)
    positions = list(range(len(prompt) - 1))
    positions += list(range(len(prompt) - 1, len(prompt) + len(chosen)))
    positions += list(range(len(prompt) - 1, len(prompt) + len(rejected)))
    labels = [-100] * (len(prompt) - 1) + chosen + [-100] + rejected + [-100]
    return {"tokens": tokens, "parts": parts, "positions": positions, "labels": labels}


@pytest.mark.parametrize("sampling", ["truncated", "packed"])
def test_loader_rows_hold_whole_pairs_with_parts_positions_and_labels(
    pairs, sampling: str, tmp_path: Path
) -> None:
    path, expected = pairs
    layouts = [layout(*pair) for pair in expected]
    longest = max(len(pair["tokens"]) for pair in layouts)
    length = longest + 5
    stream = SampleStream(
        [str(path)], DataConfig(sampling=sampling), sequence_length=length, num_samples=12,
        seed=4, cache_dir=tmp_path / "cache",
    )  # fmt: skip
    assert stream.is_preference and stream.skipped_pairs == 0
    loader = DataLoader(stream, batch_size=12, micro_batch_size=4, pin_memory=False)
    seen, per_row = [], []
    for batch in next(iter(loader)):
        assert batch.parts is not None and batch.position_ids is not None
        for row in range(batch.input_ids.shape[0]):
            ids, parts = batch.document_ids[row].tolist(), batch.parts[row].tolist()
            pairs_in_row = max(ids) if parts[-1] == PADDING else max(ids) + 1
            per_row.append(pairs_in_row)
            for pair in range(pairs_in_row):
                where = [t for t, d in enumerate(ids) if d == pair]
                assert where == list(range(where[0], where[-1] + 1))
                got = {
                    "tokens": batch.input_ids[row, where].tolist(),
                    "parts": batch.parts[row, where].tolist(),
                    "positions": batch.position_ids[row, where].tolist(),
                    "labels": batch.labels[row, where].tolist(),
                }
                assert got in layouts, (row, pair)
                seen.append(layouts.index(got))
            padding = [t for t, part in enumerate(parts) if part == PADDING]
            assert all(ids[t] == pairs_in_row for t in padding)
            assert (batch.labels[row, padding] == -100).all()
    assert sorted(seen[: len(RECORDS)]) == list(range(len(RECORDS)))  # an epoch: each pair once
    if sampling == "truncated":
        assert per_row == [1] * 12
    else:
        assert max(per_row) > 1


def test_pairs_longer_than_the_sequence_are_left_out_and_counted(
    pairs, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pair takes one position more than it stores; the longest one does not fit."""
    path, expected = pairs
    layouts = [layout(*pair) for pair in expected]
    sizes = sorted(len(pair["tokens"]) for pair in layouts)
    stream = SampleStream(
        [str(path)], DataConfig(), sequence_length=sizes[-2], num_samples=8, seed=0,
        cache_dir=tmp_path / "cache",
    )  # fmt: skip
    assert stream.skipped_pairs == 1
    assert "1 preference pair(s) longer than the sequence" in capsys.readouterr().out
    samples = stream.read(0, 8)
    assert samples.parts is not None
    fitting = [pair["tokens"] for pair in layouts if len(pair["tokens"]) < sizes[-1]]
    for tokens, ids, parts in zip(samples.tokens, samples.document_ids, samples.parts, strict=True):
        for pair in set(ids[parts != PADDING].tolist()):
            assert tokens[ids == pair].tolist() in fitting
    with pytest.raises(ConfigError, match=f"none of the {len(RECORDS)} preference pairs fits"):
        SampleStream(
            [str(path)], DataConfig(), sequence_length=sizes[0] - 1, num_samples=1, seed=0,
            cache_dir=tmp_path / "cache",
        )  # fmt: skip


def test_bad_records_are_reported_as_file_and_line(tokenizer_dir: Path, tmp_path: Path) -> None:
    answer = [{"role": "assistant", "content": "Blue."}]
    lines = [
        RECORDS[0],
        {"prompt": "Q", "chosen": "yes"},
        {"prompt": "Q", "chosen": "", "rejected": "no"},
        {"prompt": "Q", "chosen": 5, "rejected": "no"},
        {"prompt": "Q", "chosen": answer, "rejected": "no"},
        {
            "chosen": [SYSTEM, USER, *answer],
            "rejected": [SYSTEM, {**USER, "content": "x"}, *answer],
        },
        {"prompt": "Q" * 300, "chosen": "a long answer", "rejected": "b"},
        {"prompt": ["not", "messages"], "chosen": answer, "rejected": answer},
        {"prompt": "W", "chosen": "hat?", "rejected": "hat."},  # "What" is one token
        RECORDS[3],
    ]
    path = write_pairs(tmp_path / "pairs.jsonl", lines)
    out = prepare(path, tokenizer_dir, tmp_path / "out", "input.max_pair_tokens=200")
    report = json.loads((out / "metadata.json").read_text())
    assert report["documents"] == 2 and report["bad_records"] == 8
    quoted = report["first_bad_records"]
    assert [record.split(": ", 1)[0] for record in quoted] == [f"{path}:{n}" for n in range(2, 10)]
    reasons = [record.split(": ", 1)[1] for record in quoted]
    assert reasons[0] == 'no field "rejected"'
    assert reasons[1] == "the chosen answer is empty"
    assert reasons[2] == reasons[3]
    assert reasons[2] == "chosen and rejected must both be strings or both lists of messages"
    assert reasons[4].startswith("the prompt parts differ: message 1 is a user message")
    assert "more than max_pair_tokens 200" in reasons[5]
    assert "message 0" in reasons[6]
    assert reasons[7].startswith("the prompt has no tokens of its own")

    result = run_cli(
        "prepare", f"input.path={path}", f"tokenizer.path={tokenizer_dir}",
        f"output.path={tmp_path / 'strict'}", "--strict",
    )  # fmt: skip
    assert result.returncode == 2 and f'{path}:2: no field "rejected"' in result.stderr
    assert not (tmp_path / "strict").exists()


def test_preference_keys_and_mixtures_are_refused_naming_them(
    pairs, tokenizer_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="chosen_text: applies to preference inputs"):
        InputConfig(path=["x"], format="chat", chosen_text="good").validate()
    with pytest.raises(ConfigError, match=r"train_on: .* \(a pair trains on both answers\)"):
        InputConfig(path=["x"], format="preference", train_on="all").validate()
    InputConfig(path=["x"], format="preference", chat_template="t.jinja").validate()

    text = write_jsonl(tmp_path / "text.jsonl", ["plain text"])
    pair_file = write_pairs(tmp_path / "pairs.jsonl", RECORDS[:1])
    result = run_cli(
        "prepare", f"input.path=[{pair_file},{text}]", f"tokenizer.path={tokenizer_dir}",
        f"output.path={tmp_path / 'mixed'}",
    )  # fmt: skip
    assert result.returncode == 2 and "a dataset is made of pairs only" in result.stderr

    path, _ = pairs
    text_dataset = prepare(text, tokenizer_dir, tmp_path / "text")
    with pytest.raises(ConfigError, match="a blend is of pairs only or of none"):
        SampleStream(
            [str(path), str(text_dataset)], DataConfig(), sequence_length=64, num_samples=2,
            seed=0, cache_dir=tmp_path / "cache",
        )  # fmt: skip
    with pytest.raises(ConfigError, match=r"data.fim: .* holds preference pairs"):
        SampleStream(
            [str(path)], DataConfig(fim=FimConfig()), sequence_length=64, num_samples=2,
            seed=0, cache_dir=tmp_path / "cache",
        )  # fmt: skip
    (path.parent / "bare").mkdir()
    for name in ("metadata.json", "shard_00000.bin", "shard_00000.idx"):
        (path.parent / "bare" / name).write_bytes((path / name).read_bytes())
    with pytest.raises(ConfigError, match=r"shard_00000\.preference is missing"):
        SampleStream(
            [str(path.parent / "bare")], DataConfig(), sequence_length=64, num_samples=2,
            seed=0, cache_dir=tmp_path / "cache",
        )  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 6), st.integers(1, 5), st.integers(1, 5)), min_size=1, max_size=5
    ),
    st.integers(0, 4),
)
def test_pair_positions_restart_per_part_after_the_prompt(lengths, padding: int) -> None:
    ids, parts, expected = [], [], []
    for document, (p, c, r) in enumerate(lengths):
        pair = layout(list(range(p)), list(range(c)), list(range(r)))
        ids += [document] * len(pair["parts"])
        parts += pair["parts"]
        expected += pair["positions"]
    ids += [len(lengths)] * padding
    parts += [PADDING] * padding
    expected += list(range(padding))
    got = pair_positions(np.array([ids]), np.array([parts], dtype=np.int8))
    assert got.tolist() == [expected]
