"""The user guide's walk-through docs/fine-tuning.md, its `fastllm` commands read from the page
and run one by one, on a tiny Llama and a chat dataset small enough for a CPU
(tests/docs/test_pages_run.py checks that every other line of the page is listed as not run)."""

from __future__ import annotations

import shlex
from pathlib import Path

import torch
import transformers

from tests.data.chat_fixtures import CONVERSATIONS, write_chat_jsonl, write_tokenizer
from tests.data.conftest import run_cli
from tests.docs.pages import DOCS, bash_blocks
from tests.model.hf_models import save_hf_model

# The run is shrunk to the tiny model: 4 steps, short packed sequences, fp32 on the CPU.
TINY_RUN = [
    "training.train_iters=4", "training.export.interval=4", "training.checkpoint.interval=null",
    "training.logs.interval=1", "batch.batch_size=4", "batch.micro_batch_size=2",
    "batch.sequence_length=32", "model.distributed.training_dtype=float32",
    "optimizer.learning_rate.warmup_iterations=1",
]  # fmt: skip


PAGE = DOCS / "fine-tuning.md"


def page_commands() -> list[list[str]]:
    """The `fastllm` commands of the page's ```bash blocks, in order, as argument lists."""
    return [
        shlex.split(line)[1:]
        for block in bash_blocks(PAGE)
        for line in block.splitlines()
        if line.startswith("fastllm ")
    ]


def test_the_fine_tuning_page_runs(tmp_path: Path) -> None:
    hf = write_tokenizer(tmp_path / "hf", "llama3")
    vocab_size = transformers.AutoTokenizer.from_pretrained(hf).vocab_size + 16
    save_hf_model("llama", hf, vocab_size=vocab_size, bos_token_id=1, eos_token_id=4)
    chats = write_chat_jsonl(tmp_path / "chats.jsonl", CONVERSATIONS * 4)
    places = {
        "chats.jsonl": str(chats),
        "hf/Llama-3.2-1B-Instruct": str(hf),
        "data/sft-chat": str(tmp_path / "data"),
        "exp/sft-llama3-1b/export/2000": str(tmp_path / "exp" / "export" / "4"),
        "hf/sft": str(tmp_path / "sft"),
    }
    # The walkthrough's four commands (a later section's 8B example is not for a CPU).
    prepare, train, convert, generate = page_commands()[:4]
    for command in (prepare, convert, generate):
        command[:] = [_substituted(argument, places) for argument in command]
    train += [
        f"pretrained.path={hf}", f"data.path=[{tmp_path / 'data'}]",
        f"run.experiment_dir={tmp_path / 'exp'}", *TINY_RUN,
    ]  # fmt: skip
    for command in (prepare, train, convert):
        result = run_cli(*command)
        assert result.returncode == 0, f"fastllm {shlex.join(command)}\n{result.stderr}"
    result = run_cli(*generate, "--device", "cpu", "--max-new-tokens", "6")
    assert result.returncode == 0, result.stderr

    # transformers, given the converted model, answers the same.
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "sft")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sft").eval()
    prompt = generate[generate.index("--prompt") + 1]
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True,
    )["input_ids"]  # fmt: skip
    eos = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    with torch.no_grad():
        output = model.generate(
            ids, max_new_tokens=6, do_sample=False, eos_token_id=eos, pad_token_id=eos
        )
    reply = tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True)
    assert result.stdout.rstrip("\n") == reply


def _substituted(argument: str, places: dict[str, str]) -> str:
    for placeholder, path in places.items():
        argument = argument.replace(placeholder, path)
    return argument
