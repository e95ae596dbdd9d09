"""DPO against a reference model on preference pairs: the loss and gradients of the shared-prefix
pairs against DPO's formula on a `transformers` model with each answer computed apart, the
first step's loss log 2, TRL's metrics logged, preference data refused without DPO, the
reference's log-probabilities precomputed (the in-step losses, an exact resume, files keyed and
checked, two data ranks), and two ranks against one process (of the same
`reference_log_probs`)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import torch
import torch.nn.functional as F
import transformers
import yaml

import fastllm
from fastllm.config import BaseModelConfig, ConfigError, TrainerConfig, build, load_config
from fastllm.config.data import DataConfig
from fastllm.config.loading import load_raw
from fastllm.config.model import DPOLossConfig
from fastllm.data import DataLoader, SampleStream
from fastllm.engine.batch import _pair_spans
from fastllm.engine.engine import Engine
from fastllm.engine.reference import ReferenceModel
from fastllm.model.head_losses import HeadTargets, Teacher, head_losses, sequence_log_probs
from fastllm.parallel.mesh import ParallelMesh
from fastllm.training.setup import check_inputs, with_pretrained_architecture
from fastllm.training.trainer import Stopped, Trainer
from tests.conftest import ROOT
from tests.data.chat_fixtures import write_tokenizer
from tests.data.conftest import prepare
from tests.data.test_preference import write_pairs
from tests.kernels.test_attention import plan_tensors
from tests.model.hf_models import save_hf_model
from tests.training.test_expert_parallel import MOE_MODEL

RECORDS = [
    {"prompt": "What is 2 + 2?", "chosen": " 4, of course.", "rejected": " 5."},
    {"prompt": "Capital of France?", "chosen": " Paris.", "rejected": " Lyon, I think."},
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    {"prompt": "Say hello", "chosen": " Hello!", "rejected": " No."},
] * 4


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return llamas_and_pairs(tmp_path_factory.mktemp("dpo"))


def llamas_and_pairs(root: Path, records: list[dict] = RECORDS) -> tuple[Path, Path, Path]:
    """A tokenizer, a tiny Llama of its vocabulary (with the tokenizer's files, as a Hugging
    Face directory), another of other weights, and `records` prepared."""
    tokenizer = write_tokenizer(root / "tokenizer", "qwen2")
    vocab = transformers.AutoTokenizer.from_pretrained(tokenizer).vocab_size + 16
    policy, other = root / "policy", root / "other"
    for seed, directory in ((0, policy), (1, other)):
        save_hf_model("llama", directory, seed=seed, vocab_size=vocab)
        for file in tokenizer.iterdir():
            shutil.copy(file, directory)
    data = prepare(write_pairs(root / "pairs.jsonl", records), tokenizer, root / "data")
    return policy, other, data


def micro_batch(data: Path, cache: Path, length: int = 48):
    stream = SampleStream(
        [str(data)], DataConfig(sampling="packed"), sequence_length=length, num_samples=2,
        seed=3, cache_dir=cache,
    )  # fmt: skip
    return next(iter(DataLoader(stream, batch_size=2, micro_batch_size=2, pin_memory=False)))[0]


def answer_log_probs(model, batch, row: int, document: int, part: int) -> torch.Tensor:
    """log p(answer | prompt) of one pair's answer, computed on `prompt + answer` alone."""
    mine = (batch.document_ids[row] == document) & (
        (batch.parts[row] == 0) | (batch.parts[row] == part)
    )
    tokens, labels = batch.input_ids[row][mine], batch.labels[row][mine]
    keep = (batch.parts[row][mine] == part) & (labels != -100)
    logits = model(input_ids=tokens[None]).logits[0].float()
    return F.log_softmax(logits, -1)[keep].gather(-1, labels[keep][:, None]).sum()


def test_shared_prefix_pairs_give_dpo_of_each_answer_computed_apart(pairs, tmp_path: Path) -> None:
    policy_dir, reference_dir, data = pairs
    batch = micro_batch(data, tmp_path)
    assert batch.parts is not None and batch.position_ids is not None
    spans, rows, _ = _pair_spans(batch)
    count = rows.numel()
    assert count >= 2

    ours = fastllm.load_model(policy_dir)
    ours.config = build(BaseModelConfig, msgspec.to_builtins(ours.config))
    reference = fastllm.load_model(reference_dir)
    losses = {"dpo": DPOLossConfig(beta=0.5, reference_model="reference")}

    def context(model):
        return model.context(
            batch.input_ids, document_ids=batch.document_ids,
            position_ids=batch.position_ids, branch_ids=batch.parts.long(),
        )  # fmt: skip

    with torch.no_grad():
        hidden, _ = reference.run_positions(0, 3, batch.input_ids, context(reference))
        reference_log_probs = sequence_log_probs(reference, hidden, batch.labels, spans, 2 * count)
    hidden, _ = ours.run_positions(0, 3, batch.input_ids, context(ours))
    targets = HeadTargets(
        batch.labels, {"reference": Teacher(log_probs=reference_log_probs)}, spans
    )
    total, values, metrics = head_losses(ours, hidden, targets, losses, {"dpo": 1.0})
    total.backward()

    # DPO's formula on transformers' models, each answer on its own `prompt + answer`.
    theirs = transformers.AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    theirs_reference = transformers.AutoModelForCausalLM.from_pretrained(
        reference_dir, dtype=torch.float32
    )
    keys = sorted(
        {(r, int(d)) for r in range(2) for d in batch.document_ids[r][batch.parts[r] == 1].tolist()}
    )
    assert len(keys) == count
    terms, chosen_rewards = [], []
    for row, document in keys:
        pi_c, pi_r = (answer_log_probs(theirs, batch, row, document, part) for part in (1, 2))
        with torch.no_grad():
            ref_c, ref_r = (
                answer_log_probs(theirs_reference, batch, row, document, part) for part in (1, 2)
            )
        terms.append(-F.logsigmoid(0.5 * ((pi_c - ref_c) - (pi_r - ref_r))))
        chosen_rewards.append(0.5 * (pi_c - ref_c).detach())
    expected = torch.stack(terms).mean()
    expected.backward()
    assert values["dpo"].item() == pytest.approx(expected.item(), rel=1e-5)
    assert metrics["rewards/chosen"].item() == pytest.approx(
        torch.stack(chosen_rewards).mean().item(), rel=1e-4, abs=1e-6
    )
    # The gradients of every weight: q/k/v and the MLP's are fused in ours.
    grads = {n: p.grad for n, p in theirs.named_parameters()}
    our = dict(ours.named_parameters())
    torch.testing.assert_close(
        our["embeddings.weight"].grad, grads["model.embed_tokens.weight"], rtol=1e-4, atol=1e-6
    )
    torch.testing.assert_close(
        our["layers.1.mlp.layer_2.weight"].grad,
        grads["model.layers.1.mlp.down_proj.weight"],
        rtol=1e-4,
        atol=1e-6,
    )
    q = our["layers.0.attention.query_key_value.weight"].grad[
        : grads["model.layers.0.self_attn.q_proj.weight"].shape[0]
    ]
    torch.testing.assert_close(
        q, grads["model.layers.0.self_attn.q_proj.weight"], rtol=1e-4, atol=1e-6
    )


def test_micro_batches_of_pairs_come_with_their_attention_plan(pairs, tmp_path, monkeypatch):
    import fastllm.engine.batch as batch_module
    import fastllm_kernels.branch_attention as branch

    mesh = ParallelMesh.single()
    preparer = batch_module.BatchPreparer(
        data=mesh.data, sequence_data=mesh.sequence_data, splits=1,
        cross_document_attention=False, device=torch.device("cpu"),
    )  # fmt: skip
    batch = micro_batch(pairs[2], tmp_path)
    assert batch.parts is not None
    want = branch._build(batch.document_ids.numpy(), batch.parts.numpy(), "cpu")
    assert want is not None
    monkeypatch.setattr(batch_module, "plans_taken_on", lambda device: True)  # as on CUDA
    (prepared,) = preparer.prepare([batch])
    assert prepared.pairs is not None

    def no_build(*args):
        raise AssertionError("planned in the first layer")

    monkeypatch.setattr(branch, "_build", no_build)
    got = branch.branch_plan(prepared.pieces[0][2], prepared.pairs.parts)
    assert got is not None and type(got.form) is type(want.form)
    for a, b in zip(plan_tensors(got.form), plan_tensors(want.form), strict=True):
        assert torch.equal(a, b)


def dpo_config(pairs, experiment: Path, *extra: str) -> TrainerConfig:
    policy, _, data = pairs
    config = {
        "run": {"experiment_dir": str(experiment)},
        "pretrained": {"path": str(policy), "format": "llama"},
        "reference_models": {"reference": {"pretrained": {"path": str(policy), "format": "llama"}}},
        "model": {
            "base_model": {
                "head": {
                    "losses": {"dpo": {"type": "dpo", "beta": 0.1, "reference_model": "reference"}}
                }
            },
            "distributed": {"training_dtype": "float32", "seed": 1},
        },
        "training": {"train_iters": 4, "logs": {"interval": 1}, "checkpoint": {"interval": None}},
        "batch": {"batch_size": 4, "sequence_length": 48, "micro_batch_size": 2},
        "data": {"path": [str(data)], "sampling": "packed"},
        "optimizer": {"learning_rate": {"base": 1e-3}, "weight_decay": 0.0},
    }
    path = experiment.parent / f"{experiment.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return build(TrainerConfig, with_pretrained_architecture(load_raw([str(path)], list(extra))))


def test_dpo_starts_at_log_2_and_logs_trl_metrics(pairs, tmp_path: Path) -> None:
    config = dpo_config(pairs, tmp_path / "run")
    check_inputs(config)
    run = Trainer(config)
    assert run.fit() is None
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in records if "loss" in r]
    assert steps[0]["loss"] == pytest.approx(math.log(2), rel=1e-5)  # the policy is the reference
    assert steps[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    for key in (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
    ):
        assert key in steps[-1]
    assert steps[-1]["rewards/margins"] > 0 and steps[-1]["loss"] < math.log(2)


def test_preference_pairs_and_dpo_go_together(pairs, tmp_path: Path, dataset: Path) -> None:
    config = dpo_config(
        pairs, tmp_path / "run", "model.base_model.head.losses={}", "reference_models={}"
    )
    with pytest.raises(ConfigError, match="holds preference pairs") as caught:
        check_inputs(config)
    assert caught.value.path == "data.path[0]"
    config = dpo_config(pairs, tmp_path / "run", f"data.path=[{dataset}]")
    with pytest.raises(ConfigError, match="needs preference pairs") as caught:
        check_inputs(config)
    assert caught.value.path == "model.base_model.head.losses.dpo"


PRECOMPUTED = "model.base_model.head.losses.dpo.reference_log_probs=precomputed"


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the reference models built outside the step (`Engine.build_reference`);
    each must be gone (its weights freed) by the time the next one is built, and when the test
    ends."""
    names: list[str] = []
    models: list[weakref.ref] = []
    build_reference = Engine.build_reference

    def counted(engine: Engine, name: str):
        assert all(model() is None for model in models)
        names.append(name)
        reference = build_reference(engine, name)
        models.append(weakref.ref(reference.model))
        return reference

    monkeypatch.setattr(Engine, "build_reference", counted)
    yield names
    assert all(model() is None for model in models)


def logged_steps(experiment: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (experiment / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "loss" in r}


def test_precomputed_reference_log_probs_give_the_in_step_losses_and_resume_exactly(
    pairs, tmp_path: Path, built: list[str]
) -> None:
    _, other, _ = pairs
    against = f"reference_models.reference.pretrained.path={other}"  # not the policy: no log 2

    def fit(experiment: Path, *extra: str) -> Trainer:
        run = Trainer(dpo_config(pairs, experiment, against, *extra))
        assert run.fit() is None
        return run

    fit(tmp_path / "in_step")
    assert built == []
    whole = fit(tmp_path / "whole", PRECOMPUTED)
    assert built == ["reference"] and whole.engine.references == {}
    (file,) = (tmp_path / "whole" / "cache" / "reference_log_probs").iterdir()
    assert file.suffix == ".npz"  # renamed into place: no staging file left beside it
    expected, got = logged_steps(tmp_path / "in_step"), logged_steps(tmp_path / "whole")
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]
    keys = ("loss", "rewards/margins", "rewards/chosen", "logps/chosen", "logps/rejected")
    assert expected[1]["rewards/margins"] != 0.0
    for step, record in expected.items():
        for key in keys:
            assert got[step][key] == pytest.approx(record[key], rel=1e-5, abs=1e-7), (step, key)

    # Two steps, then resumed to four: the second launch reads the file, never the reference.
    fit(tmp_path / "resumed", PRECOMPUTED, "training.train_iters=2")
    fit(tmp_path / "resumed", PRECOMPUTED)
    assert built == ["reference"] * 2
    resumed = logged_steps(tmp_path / "resumed")
    for step, record in logged_steps(tmp_path / "whole").items():
        assert {k: resumed[step][k] for k in keys} == {k: record[k] for k in keys}, step


def test_precomputed_reference_log_probs_are_never_read_stale_or_damaged(
    pairs, tmp_path: Path, built: list[str]
) -> None:
    policy, other, _ = pairs
    cache = tmp_path / "run" / "cache" / "reference_log_probs"

    def table(reference: Path) -> torch.Tensor:
        path = f"reference_models.reference.pretrained.path={reference}"
        run = Trainer(dpo_config(pairs, tmp_path / "run", PRECOMPUTED, path))
        (loader,) = run.data_loader().loaders
        assert loader.reference_log_probs is not None
        return loader.reference_log_probs

    first = table(other)
    (file,) = cache.iterdir()
    assert table(policy).ne(first).any()  # another reference: another file
    assert len(built) == 2 and len(list(cache.iterdir())) == 2
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])  # damaged
    assert torch.equal(table(other), first) and len(built) == 3
    assert torch.equal(table(other), first) and len(built) == 3  # whole again: read


def test_a_signal_during_the_reference_precomputation_stops_it_before_its_next_step(
    pairs, tmp_path: Path, built: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A whole epoch of the reference over a large preference dataset takes minutes: a SIGTERM
    # during it stops the run before the next step of it, writing nothing (the reference
    # freed, `built` checks), instead of at its end.
    steps: list[int] = []
    teacher = ReferenceModel.teacher

    def counted(reference: ReferenceModel, *arguments, **options):
        steps.append(1)
        return teacher(reference, *arguments, **options)

    monkeypatch.setattr(ReferenceModel, "teacher", counted)
    Trainer(dpo_config(pairs, tmp_path / "whole", PRECOMPUTED)).data_loader()
    assert len(steps) > 1, "a precomputation of one step could not show the stop"

    def signalled(reference: ReferenceModel, *arguments, **options):
        if not steps:
            os.kill(os.getpid(), signal.SIGTERM)
        steps.append(1)
        return teacher(reference, *arguments, **options)

    steps.clear()
    monkeypatch.setattr(ReferenceModel, "teacher", signalled)
    run = Trainer(dpo_config(pairs, tmp_path / "run", PRECOMPUTED))
    assert run.fit() == Stopped(signal.SIGTERM, 0)
    assert len(steps) == 1, "no step of the precomputation after the signal"
    assert not (tmp_path / "run" / "cache" / "reference_log_probs").exists()
    assert not (tmp_path / "run" / "checkpoint").exists() or not any(
        (tmp_path / "run" / "checkpoint").iterdir()
    )


# Run on each rank by tests.run_in_sequence: rank 0 alone gets SIGTERM, at its first step of
# the reference precomputation, or while it builds its sampling index (which it leaves, as a
# stopped build does, while rank 1 goes on into the precomputation's collectives).
STOPPED_ON_RANK_0 = """
import os, signal
import torch.distributed as dist
from fastllm.cli import main
from fastllm.data.errors import BuildStopped
from fastllm.engine.reference import ReferenceModel
from fastllm.training.trainer import Trainer

def signal_rank_0():
    if dist.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGTERM)

if {during!r} == "precomputation":
    teacher = ReferenceModel.teacher
    def signalled(reference, *arguments, **options):
        signal_rank_0()
        return teacher(reference, *arguments, **options)
    ReferenceModel.teacher = signalled
else:
    sample_stream = Trainer.sample_stream
    def stopped(trainer, paths, num_samples, key, stop=None, **options):
        signal_rank_0()
        if stop is not None and stop():
            raise BuildStopped(key)
        return sample_stream(trainer, paths, num_samples, key, stop, **options)
    Trainer.sample_stream = stopped
raise SystemExit(main({arguments!r}))
"""


@pytest.mark.parametrize("during", ["precomputation", "index"])
def test_a_signal_to_one_rank_before_the_first_step_stops_every_rank_with_143(
    pairs, tmp_path: Path, during: str
) -> None:
    # The ranks agree on the stop before the reference's first collective and between the
    # steps of its precomputation; no rank waits in a collective the other left.
    dpo_config(pairs, tmp_path / "run", PRECOMPUTED)  # writes run.yaml
    arguments = ["train", "-c", str(tmp_path / "run.yaml"), PRECOMPUTED]
    launch = tmp_path / "launch"
    launch.mkdir()
    spec = launch / "runs.json"
    script = STOPPED_ON_RANK_0.format(during=during, arguments=arguments)
    spec.write_text(json.dumps({"directory": str(launch), "runs": {"train": script}}))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--no-python", sys.executable, "-m", "tests.run_in_sequence", str(spec),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
    for rank in range(2):
        stderr = (launch / f"train.rank{rank}.stderr").read_text()
        assert (launch / f"train.rank{rank}.code").read_text() == "143", stderr + result.stderr
        assert "Traceback" not in stderr, stderr
    assert not (tmp_path / "run" / "cache" / "reference_log_probs").exists()


def test_precomputed_reference_log_probs_free_a_reference_no_other_loss_reads() -> None:
    losses = (
        "model.base_model.head.losses={dpo: {type: dpo, reference_log_probs: precomputed}, "
        "kd: {type: distillation, reference_model: reference}}"
    )
    with pytest.raises(
        ConfigError, match=r"frees reference_models.reference .* \['kd'\]"
    ) as caught:
        load_config(
            TrainerConfig, ["examples/tiny.yaml"],
            [losses, "reference_models.reference.pretrained.path=x"],
        )  # fmt: skip
    assert caught.value.path == "model.base_model.head.losses.dpo.reference_log_probs"


def preference_dataset(root: Path) -> Path:
    """The pairs prepared with a tokenizer of fewer tokens than the tests' tiny model's 512."""
    if not (root / "pairs" / "data").is_dir():
        tokenizer = write_tokenizer(root / "pairs" / "tokenizer", "qwen2")
        prepare(
            write_pairs(root / "pairs" / "pairs.jsonl", RECORDS), tokenizer, root / "pairs" / "data"
        )
    return root / "pairs" / "data"


DPO_LAYOUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # name: (the policy's and the reference's architecture, the layout)
    "zero3": ((), ("model.multi_stage.zero_stage=3",)),
    # Each data rank computes the reference's log-probabilities of its share of the pairs.
    "zero3_precomputed": ((), ("model.multi_stage.zero_stage=3", PRECOMPUTED)),
    "tensor": (
        (),
        ("model.distributed.tensor_parallel=2", "model.distributed.sequence_tensor_parallel=true"),
    ),
    # Each rank holds a chunk of every pair's tokens: the answers' log-probabilities are
    # summed over the two chunks, the policy's and the reference's.
    "sequence_data": ((), ("model.distributed.sequence_data_parallel=2",)),
    "sequence_data_precomputed": ((), ("model.distributed.sequence_data_parallel=2", PRECOMPUTED)),
    # A mixture-of-experts policy and reference, each rank holding two of their four experts.
    "expert": (MOE_MODEL, ("model.distributed.expert_parallel=2",)),
    # Four stages of the policy and of the reference looped over two pipeline ranks, each
    # rank's reference stages run with its policy stages, their outputs sent with theirs; the
    # reference's head (stage 3, rank 1) reads a copy of its embedding (stage 0, rank 0).
    "pipeline_looped": (
        ("model.base_model.transformer.num_layers=4",),
        ("model.distributed.pipeline_parallel=2", "schedule.breadth_first_micro_batches=2"),
    ),
    # The precomputation runs the reference's stages on their pipeline ranks too, and the
    # last stage's rank gives the others its log-probabilities.
    "pipeline_precomputed": (
        ("model.base_model.transformer.num_layers=4",),
        ("model.distributed.pipeline_parallel=2", PRECOMPUTED),
    ),
}


def dpo_run(dataset: Path, reference: Path) -> tuple[str, ...]:
    """The tiny model (drawn from the seed) trained by DPO against `reference`."""
    return (
        f"data.path=[{dataset}]", "data.sampling=packed", "data.fim=null", "training.train_iters=3",
        "model.base_model.head.losses={dpo: {type: dpo, beta: 0.5, reference_model: reference}}",
        f"reference_models.reference.pretrained.path={reference}",
    )  # fmt: skip


def reference_of(one_process: Callable[..., Path], architecture: tuple[str, ...]) -> Path:
    from tests.training.test_distillation import TEACHER_RUN

    return one_process(*architecture, *TEACHER_RUN) / "export" / "4"


def layouts(dataset: Path, one_process, root: Path) -> dict:
    from tests.training.conftest import Layout

    pairs_data = preference_dataset(root)
    return {
        f"dpo_{name}": Layout(
            2,
            (
                *architecture,
                *dpo_run(pairs_data, reference_of(one_process, architecture)),
                *layout,
            ),
        )
        for name, (architecture, layout) in DPO_LAYOUTS.items()
    }


@pytest.mark.parametrize("layout", sorted(DPO_LAYOUTS))
def test_two_ranks_training_dpo_match_one_process(launched, one_process, layout: str) -> None:
    double = launched[f"dpo_{layout}"].succeeded()
    dataset = double.parent / "pairs" / "data"
    from tests.training.test_distillation import logged

    architecture, options = DPO_LAYOUTS[layout]
    precomputed = tuple(option for option in options if option == PRECOMPUTED)
    reference = reference_of(one_process, architecture)
    single = one_process(*architecture, *dpo_run(dataset, reference), *precomputed)
    # The gradient's norm too: AdamW's steps hardly change when it is scaled.
    for key in ("loss", "rewards/margins", "logps/chosen", "grad_norm"):
        expected, got = logged(single, key), logged(double, key)
        assert sorted(got) == sorted(expected) == [1, 2, 3]
        for step, value in expected.items():
            assert got[step] == pytest.approx(value, rel=1e-4, abs=1e-6), (key, step)
