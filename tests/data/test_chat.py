"""`fastllm prepare` on conversations and on text with loss-masking spans, checked against
`transformers`' `apply_chat_template` and against `tokenizers` directly; the sidecar of masked
spans, and the masks' way through sampling and the loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from fastllm.config import ConfigError
from fastllm.config.data import DataConfig
from fastllm.data import DataLoader, SampleStream, TokenDataset
from tests.data.chat_fixtures import (
    CONVERSATIONS,
    TEMPLATES,
    conversations_for,
    write_chat_jsonl,
    write_tokenizer,
)
from tests.data.conftest import prepare, run_cli


@pytest.fixture(scope="session")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat_tokenizers")
    return {name: write_tokenizer(root / name, name) for name in TEMPLATES}


@pytest.fixture(scope="session")
def prepared(
    tokenizers: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Every template's conversations, prepared with train_on: assistant."""
    root = tmp_path_factory.mktemp("chat_datasets")
    datasets = {}
    for name, tokenizer in tokenizers.items():
        inputs = write_chat_jsonl(root / f"{name}.jsonl", conversations_for(name))
        datasets[name] = prepare(inputs, tokenizer, root / name)
    return datasets


def trained_mask(dataset: TokenDataset, index: int) -> list[int]:
    mask = [1] * len(dataset[index])
    for begin, end in dataset.loss_spans(index):
        mask[begin:end] = [0] * (end - begin)
    return mask


def assistant_turn_mask(hf, conversation: list[dict]) -> list[int]:
    """The tokens of what each assistant turn adds after the generation prompt, from
    transformers' renderings of the conversation up to that turn."""
    text = hf.apply_chat_template(conversation, tokenize=False)
    spans = []
    for k, message in enumerate(conversation):
        if message["role"] == "assistant":
            prompt = hf.apply_chat_template(
                conversation[:k], tokenize=False, add_generation_prompt=True
            )
            through = hf.apply_chat_template(conversation[: k + 1], tokenize=False)
            assert text.startswith(through) and through.startswith(prompt)
            spans.append((len(prompt), len(through)))
    offsets = hf(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return [int(any(end > a and start < b for a, b in spans)) for start, end in offsets]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_conversations_tokenize_as_apply_chat_template(
    name: str, tokenizers: dict[str, Path], prepared: dict[str, Path]
) -> None:
    hf = AutoTokenizer.from_pretrained(tokenizers[name])
    dataset = TokenDataset(prepared[name])
    conversations = conversations_for(name)
    assert len(dataset) == len(conversations)
    assert dataset.metadata["format"] == "chat"
    assert dataset.metadata["train_on"] == "assistant"
    trained = 0
    for i, conversation in enumerate(conversations):
        if name == "chatml_generation":
            expected = hf.apply_chat_template(
                conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            ids, mask = expected["input_ids"], expected["assistant_masks"]
        else:
            ids = hf.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"]
            mask = assistant_turn_mask(hf, conversation)
        assert dataset[i].tolist() == ids, f"conversation {i}"
        assert trained_mask(dataset, i) == mask, f"conversation {i}"
        trained += sum(mask)
    assert dataset.metadata["trained_tokens"] == trained


def test_train_on_last_assistant_and_all(tokenizers: dict[str, Path], tmp_path: Path) -> None:
    tokenizer = tokenizers["chatml_generation"]
    hf = AutoTokenizer.from_pretrained(tokenizer)
    inputs = write_chat_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS)
    last = TokenDataset(
        prepare(inputs, tokenizer, tmp_path / "last", "input.train_on=last_assistant")
    )
    every = TokenDataset(prepare(inputs, tokenizer, tmp_path / "all", "input.train_on=all"))
    for i, conversation in enumerate(CONVERSATIONS):
        full = hf.apply_chat_template(
            conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )["assistant_masks"]
        # The last assistant turn alone: the tokens of the last run of the full mask.
        ends = [k for k in range(len(full)) if full[k] and (k == 0 or not full[k - 1])]
        expected = [int(bool(m) and k >= ends[-1]) for k, m in enumerate(full)]
        assert trained_mask(last, i) == expected
        assert every.loss_spans(i) == []
    assert every.metadata["trained_tokens"] == every.metadata["tokens"]


def test_text_with_loss_masking_spans_tokenizes_each_part_apart_as_fast_llm(
    tokenizers: dict[str, Path], tmp_path: Path
) -> None:
    tokenizer_dir = tokenizers["qwen2"]
    records = [
        {"text": "Question: why? Answer: because.", "spans": [[0, 14]]},
        {"text": "no spans at all", "spans": []},
        {"text": "a😀b c d e", "spans": [[6, 6], [1, 2]]},  # unsorted, a 4-byte character
    ]
    path = tmp_path / "spans.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    dataset = TokenDataset(
        prepare(path, tokenizer_dir, tmp_path / "out", "input.loss_masking_spans=spans")
    )
    encoder = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = encoder.token_to_id("<|im_end|>")

    def encode(text: str) -> list[int]:
        return encoder.encode(text, add_special_tokens=False).ids

    assert dataset.metadata["format"] == "text" and dataset.metadata["loss_masking_spans"]
    for i, record in enumerate(records):
        text, ids, masked, position = record["text"], [], [], 0
        for begin, end in sorted(record["spans"]):
            ids += encode(text[position:begin])
            masked.append((len(ids), len(ids) + len(encode(text[begin : end + 1]))))
            ids += encode(text[begin : end + 1])
            position = end + 1
        ids += [*encode(text[position:]), eos]
        assert dataset[i].tolist() == ids
        assert dataset.loss_spans(i) == [m for m in masked if m[0] < m[1]]


def test_spans_out_of_range_or_overlapping_are_bad_records(
    tokenizers: dict[str, Path], tmp_path: Path
) -> None:
    records = [
        {"text": "four chars", "spans": [[0, 3]]},
        {"text": "short", "spans": [[2, 5]]},
        {"text": "overlapping spans", "spans": [[0, 4], [4, 6]]},
        {"text": "not pairs", "spans": [[1, 2, 3]]},
    ]
    path = tmp_path / "spans.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    output = prepare(path, tokenizers["qwen2"], tmp_path / "out", "input.loss_masking_spans=spans")
    report = json.loads((output / "metadata.json").read_text())
    assert report["documents"] == 1 and report["bad_records"] == 3
    assert report["first_bad_records"] == [
        f"{path}:2: loss-masking span [2, 5] is out of range for a text of 5 characters",
        f"{path}:3: loss-masking span [4, 6] overlaps another",
        f'{path}:4: field "spans" is not a list of [begin, end] character positions',
    ]


def test_bad_records_are_reported_as_file_and_line(
    tokenizers: dict[str, Path], tmp_path: Path
) -> None:
    good = CONVERSATIONS[0]
    lines = [
        {"messages": good},
        {"messages": [{"content": "no role"}]},
        {"messages": [{"role": "user", "content": ["not", "a", "string"]}]},
        {"messages": [good[0], {"role": "tool", "content": "mistral knows no tool role"}]},
        {"messages": [{"role": "user", "content": "no answer"}]},
        {"messages": "not a list"},
        {"messages": good},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    tokenizer = tokenizers["mistral"]
    report = json.loads((prepare(path, tokenizer, tmp_path / "out") / "metadata.json").read_text())
    assert report["documents"] == 2 and report["bad_records"] == 5
    quoted = report["first_bad_records"]
    assert [record.split(": ", 1)[0] for record in quoted] == [
        f"{path}:{n}" for n in (2, 3, 4, 5, 6)
    ]
    assert "has no role" in quoted[0] and "content is not a string" in quoted[1]
    assert "Only user and assistant roles are supported!" in quoted[2]
    assert "nothing to train on" in quoted[3] and "not a list" in quoted[4]

    result = run_cli(
        "prepare", f"input.path={path}", f"tokenizer.path={tokenizer}",
        f"output.path={tmp_path / 'strict'}", "--strict",
    )  # fmt: skip
    assert result.returncode == 2 and f"{path}:2: message 0 has no role" in result.stderr
    assert not (tmp_path / "strict").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_template_that_cannot_render_is_an_error(
    tokenizers: dict[str, Path], tmp_path: Path
) -> None:
    path = write_chat_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS)
    template = tmp_path / "broken.jinja"
    template.write_text("{% for message in messages %}{{ message.content }")
    result = run_cli(
        "prepare", f"input.path={path}", f"tokenizer.path={tokenizers['qwen2']}",
        f"output.path={tmp_path / 'out'}", f"input.chat_template={template}",
    )  # fmt: skip
    assert result.returncode == 2 and f"{template}: not a valid chat template" in result.stderr
    assert not (tmp_path / "out").exists()


# ChatML that spins for ever on a user turn "spin" and writes 10 GB on one of "flood".
UNBOUNDED = (
    "{%- for message in messages %}"
    "{%- if message['content'] == 'spin' %}"
    "{%- for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{%- elif message['content'] == 'flood' %}"
    "{%- for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}"
    "{% endgeneration %}{% else %}{{ message['content'] }}{% endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
)


def test_a_template_that_loops_without_end_or_floods_is_a_bad_record_within_its_limit(
    tokenizers: dict[str, Path], tmp_path: Path
) -> None:
    template = tmp_path / "unbounded.jinja"
    template.write_text(UNBOUNDED)
    answer = {"role": "assistant", "content": "Fine."}
    conversations = [
        [{"role": "user", "content": "Hi"}, answer],
        [{"role": "user", "content": "spin"}, answer],
        [{"role": "user", "content": "flood"}, answer],
        [{"role": "user", "content": "Bye"}, answer],
    ]
    path = write_chat_jsonl(tmp_path / "chat.jsonl", conversations)
    chat_template = f"input.chat_template={template}"
    output = prepare(path, tokenizers["qwen2"], tmp_path / "out", chat_template)
    report = json.loads((output / "metadata.json").read_text())
    assert report["documents"] == 2 and report["bad_records"] == 2
    for line, quoted in zip((2, 3), report["first_bad_records"], strict=True):
        assert quoted.startswith(f"{path}:{line}: the chat template exceeds its limit"), quoted
    result = run_cli(
        "prepare", f"input.path={path}", f"tokenizer.path={tokenizers['qwen2']}", chat_template,
        f"output.path={tmp_path / 'strict'}", "--strict",
    )  # fmt: skip
    assert result.returncode == 2
    assert f"{path}:2: the chat template exceeds its limit" in result.stderr


def test_loader_labels_are_masked_token_by_token_as_assistant_masks(
    tokenizers: dict[str, Path], prepared: dict[str, Path], tmp_path: Path
) -> None:
    """Truncated sampling: one conversation per sample, padded; label t trains token t + 1
    exactly where transformers' assistant mask is 1."""
    hf = AutoTokenizer.from_pretrained(tokenizers["chatml_generation"])
    dataset = prepared["chatml_generation"]
    expected = {}
    for conversation in CONVERSATIONS:
        out = hf.apply_chat_template(
            conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        expected[tuple(out["input_ids"])] = out["assistant_masks"]
    length = max(len(ids) for ids in expected) + 3
    stream = SampleStream(
        [str(dataset)], DataConfig(sampling="truncated"), sequence_length=length,
        num_samples=8, seed=1, cache_dir=tmp_path / "cache",
    )  # fmt: skip
    loader = DataLoader(stream, batch_size=8, micro_batch_size=8, pin_memory=False)
    (batch,) = next(iter(loader))
    for input_ids, labels in zip(batch.input_ids.tolist(), batch.labels.tolist(), strict=True):
        ids = next(ids for ids in expected if input_ids[: len(ids)] == list(ids))
        mask = expected[ids]
        trained = [int(label != -100) for label in labels]
        assert trained == mask[1:] + [0] * (length - len(ids) + 1)
        assert [label for label in labels if label != -100] == [
            ids[t + 1] for t in range(len(ids) - 1) if mask[t + 1]
        ]


def test_packed_samples_without_a_trained_token_are_skipped(
    tokenizers: dict[str, Path], tmp_path: Path
) -> None:
    """Long prompts and short answers: many packed samples hold prompt tokens only."""
    conversations = [
        [
            {"role": "user", "content": f"question {i} " + "words of context " * 30},
            {"role": "assistant", "content": f"answer {i}"},
        ]
        for i in range(20)
    ]
    inputs = write_chat_jsonl(tmp_path / "chat.jsonl", conversations)
    dataset = prepare(inputs, tokenizers["qwen2"], tmp_path / "out")
    stream = SampleStream(
        [str(dataset)], DataConfig(), sequence_length=16, num_samples=40, seed=3,
        cache_dir=tmp_path / "cache",
    )  # fmt: skip
    assert stream.skipped_samples > 0
    samples = stream.read(0, len(stream))
    assert (samples.loss_mask[:, 1:].sum(axis=1) > 0).all()
    # Masked tokens are the prompts': the answers' words are the only trained text.
    tokenizer = Tokenizer.from_file(str(tokenizers["qwen2"] / "tokenizer.json"))
    trained_text = tokenizer.decode(
        samples.tokens[samples.loss_mask == 1].tolist(), skip_special_tokens=True
    )
    assert "context" not in trained_text and "answer" in trained_text


def test_a_truncated_or_mismatched_sidecar_is_refused_naming_it(
    prepared: dict[str, Path], tmp_path: Path
) -> None:
    import shutil

    dataset = tmp_path / "copy"
    shutil.copytree(prepared["llama3"], dataset)
    sidecar = dataset / "shard_00000.spans"
    data = sidecar.read_bytes()
    sidecar.write_bytes(data[:-4])
    with pytest.raises(ValueError, match=f"{sidecar}: file is .* bytes but its header implies"):
        TokenDataset(dataset)
    sidecar.write_bytes(prepared["qwen2"].joinpath("shard_00000.spans").read_bytes())
    with pytest.raises(
        ValueError, match=f"{sidecar}: written for 4 documents of .* but the index has"
    ):
        TokenDataset(dataset)
    sidecar.unlink()
    with pytest.raises(ConfigError, match=f"{sidecar} is missing"):
        SampleStream(
            [str(dataset)], DataConfig(), sequence_length=8, num_samples=1, seed=0,
            cache_dir=tmp_path / "cache",
        )  # fmt: skip


def test_fim_on_a_dataset_with_loss_spans_is_refused(
    prepared: dict[str, Path], tmp_path: Path
) -> None:
    from fastllm.config.data import FimConfig

    with pytest.raises(ConfigError, match=r"data.fim: data.path\[0\]: .* has loss-masking spans"):
        SampleStream(
            [str(prepared["qwen2"])], DataConfig(fim=FimConfig()), sequence_length=8,
            num_samples=1, seed=0, cache_dir=tmp_path,
        )  # fmt: skip


def test_chat_options_on_other_formats_are_refused_naming_the_keys() -> None:
    from fastllm.config import load_config
    from fastllm.config.prepare import PrepareConfig

    base = ["input.path=[x]", "tokenizer.path=t", "output.path=o"]
    with pytest.raises(ConfigError, match=r"input.loss_masking_spans: .*not with format: chat"):
        load_config(PrepareConfig, [], [*base, "input.format=chat", "input.loss_masking_spans=s"])
    with pytest.raises(
        ConfigError, match=r"input.train_on: applies to chat inputs, not to format: parquet"
    ):
        load_config(PrepareConfig, [], [*base, "input.format=parquet", "input.train_on=all"])
