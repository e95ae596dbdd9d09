"""DPO against TRL's `DPOTrainer`, the library its users trust: the same Hugging Face Llama as
policy and reference, the same pairs in the same order, the same AdamW (decay, clipping,
constant rate), four steps in fp32. TRL tokenizes the pairs' texts itself; its tokens, losses,
gradient norms, metrics and final weights must be ours."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
import torch
import transformers
import trl
from safetensors.torch import load_file

from fastllm.data import Batch
from fastllm.training import state
from fastllm.training.trainer import Trainer
from tests.training.test_dpo import RECORDS, dpo_config, llamas_and_pairs

STEPS, PAIRS_PER_STEP = 4, 4
BETA, LEARNING_RATE, BETAS, EPSILON, WEIGHT_DECAY, CLIPPING = 0.5, 2e-3, (0.9, 0.95), 1e-7, 0.1, 1.0
OURS = (
    "data.sampling=truncated",  # one pair a sample: PAIRS_PER_STEP pairs a step, TRL's batch
    f"batch.batch_size={PAIRS_PER_STEP}",
    f"training.train_iters={STEPS}",
    f"model.base_model.head.losses.dpo.beta={BETA}",
    f"optimizer.learning_rate.base={LEARNING_RATE}",
    f"optimizer.beta_1={BETAS[0]}",
    f"optimizer.beta_2={BETAS[1]}",
    f"optimizer.epsilon={EPSILON}",
    f"optimizer.weight_decay={WEIGHT_DECAY}",
    f"optimizer.gradient_norm_clipping={CLIPPING}",  # clips the first three steps here
)
# With answers that go on after the prompt's last space or mid-word: TRL tokenizes the prompt
# followed by each answer whole, and the answers start where those tokens leave the prompt's.
PAIRS = [
    *RECORDS[:4],
    {"prompt": "Answer in one word: ", "chosen": "green.", "rejected": "blue."},
    {"prompt": "Capital of Fr", "chosen": "ance? Paris.", "rejected": "ance? Lyon."},
]
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
Pair = tuple[list[int], list[int], list[int]]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return llamas_and_pairs(tmp_path_factory.mktemp("dpo_trl"), PAIRS)


def pairs_of(batch: Batch) -> list[Pair]:
    """The (prompt, chosen, rejected) ids of each pair of a micro-batch, as prepared (the
    prompt's last token starts both answers' parts)."""
    assert batch.parts is not None
    found = []
    for ids, parts, documents in zip(batch.input_ids, batch.parts, batch.document_ids, strict=True):
        for document in documents[parts == 1].unique().tolist():
            mine = documents == document
            prompt, chosen, rejected = (ids[mine & (parts == part)].tolist() for part in range(3))
            assert chosen[0] == rejected[0]
            found.append((prompt + chosen[:1], chosen[1:], rejected[1:]))
    return found


def record_of(pair: Pair, tokenizer: transformers.PreTrainedTokenizerBase) -> dict[str, str]:
    """The record whose texts the pair's tokens decode to (the prompt followed by each answer
    less its EOS)."""
    prompt, chosen, rejected = pair
    texts = [tokenizer.decode(prompt + answer[:-1]) for answer in (chosen, rejected)]
    matches = [
        r for r in PAIRS if [r["prompt"] + r["chosen"], r["prompt"] + r["rejected"]] == texts
    ]
    assert matches, texts
    return matches[0]


def trl_trainer(hf: Path, records: list[dict[str, str]], output: Path) -> trl.DPOTrainer:
    """TRL's trainer of the model in `hf` against a copy of itself, visiting `records` in
    order, PAIRS_PER_STEP a step (one micro-batch), with our optimizer."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    tokenizer.pad_token = tokenizer.eos_token  # right padding, masked: any token does
    model, reference = (
        transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32) for _ in range(2)
    )
    # Our AdamW decays neither norms nor the embeddings (Llama has no biases); the Hugging
    # Face trainer's own would decay the embeddings.
    kept = {n for n, _ in model.named_parameters() if "norm" in n or "embed_tokens" in n}
    groups = [
        {"params": [p for n, p in model.named_parameters() if n not in kept]},
        {"params": [p for n, p in model.named_parameters() if n in kept], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(
        groups, lr=LEARNING_RATE, betas=BETAS, eps=EPSILON, weight_decay=WEIGHT_DECAY
    )
    arguments = trl.DPOConfig(
        output_dir=str(output), per_device_train_batch_size=PAIRS_PER_STEP, max_steps=STEPS,
        learning_rate=LEARNING_RATE, lr_scheduler_type="constant", max_grad_norm=CLIPPING,
        beta=BETA, loss_type=["sigmoid"], max_length=None, train_sampling_strategy="sequential",
        bf16=False, use_cpu=True, activation_checkpointing=False, logging_steps=1,
        save_strategy="no", report_to="none",
    )  # fmt: skip
    return trl.DPOTrainer(
        model=model, ref_model=reference, args=arguments, processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_list(records), optimizers=(optimizer, None),
    )  # fmt: skip


def test_four_steps_match_trl_dpo_trainer(pairs, tmp_path: Path) -> None:
    policy = pairs[0]
    run = Trainer(dpo_config(pairs, tmp_path / "run", *OURS))
    steps = [list(micro_batches) for micro_batches in run.data_loader()]
    ours = [run.engine.train_step(micro_batches) for micro_batches in steps]
    state.export(run, tmp_path / "export", "llama")

    visited = [pair for step in steps for batch in step for pair in pairs_of(batch)]
    assert len(visited) == STEPS * PAIRS_PER_STEP
    tokenizer = transformers.AutoTokenizer.from_pretrained(policy)
    records = [record_of(pair, tokenizer) for pair in visited]
    assert all(record in records for record in PAIRS)
    theirs = trl_trainer(policy, records, tmp_path / "trl")
    tokenized = [
        (r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in theirs.train_dataset
    ]
    assert tokenized == visited  # TRL's tokens of the texts are ours
    theirs.train()
    logged = [record for record in theirs.state.log_history if "loss" in record]

    # fp32 on both sides, summed in other orders (our fused head in chunks, fused q/k/v, the
    # prompt run once for both answers, the optimizer on flat buffers): the losses agree to a
    # few 1e-6 relative after four steps (2e-6 seen), the norms and metrics as closely.
    assert len(logged) == STEPS
    for step, (our, their) in enumerate(zip(ours, logged, strict=True)):
        assert our["loss"] == pytest.approx(their["loss"], rel=1e-5), step
        assert our["grad_norm"] == pytest.approx(their["grad_norm"], rel=2e-5), step
        for key in METRICS:
            assert our[key] == pytest.approx(their[key], rel=2e-5, abs=1e-6), (key, step)
    # The weights agree within 2e-6 (7e-7 seen), where a setting slightly off on one side
    # moves some by 6e-5 (beta_2 0.96) to 2e-3 (a rate 1% higher).
    exported = load_file(tmp_path / "export" / "model.safetensors")
    trained = theirs.model.state_dict()
    assert sorted(exported) == sorted(trained)
    for name, tensor in trained.items():
        torch.testing.assert_close(exported[name], tensor, rtol=1e-4, atol=2e-6, msg=name)
