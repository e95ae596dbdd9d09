"""`make demo`: the whole pipeline on the built-in example, through the public command line.

1. train a byte-level BPE tokenizer (with FIM tokens) on the Python standard library sources;
2. `fastllm prepare` the standard library with it;
3. `fastllm train` a tiny StarCoder2-style model with fill-in-the-middle (examples/tiny.yaml);
4. `fastllm convert` its export to a Hugging Face StarCoder2 checkpoint;
5. load that with `transformers` and complete a code prompt;
6. plot the loss curve.
Everything lands under exp/demo/, which each run starts afresh.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEMO = Path("exp/demo")
PROMPT = "def fibonacci(n):\n    "


def fastllm(*arguments: str) -> None:
    print(f"\n$ fastllm {shlex.join(arguments)}", flush=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fastllm.cli", *arguments], check=True, cwd=ROOT)
    print(f"  ({time.perf_counter() - start:.0f}s)", flush=True)


def complete(model_dir: Path) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        output = model.generate(
            ids, max_new_tokens=48, do_sample=False, pad_token_id=tokenizer.eos_token_id
        )
    return tokenizer.decode(output[0], skip_special_tokens=True)


def plot_losses(metrics: Path, image: Path) -> tuple[float, float]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    losses = [r["loss"] for r in records if "loss" in r]
    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot(steps, losses)
    axes.set(
        xlabel="step",
        ylabel="training loss",
        title="fastllm demo: tiny StarCoder2-style model with FIM",
    )
    axes.grid(alpha=0.3)
    figure.savefig(image, dpi=120, bbox_inches="tight")
    return losses[0], losses[-1]


def main() -> None:
    stdlib = sysconfig.get_paths()["stdlib"]
    shutil.rmtree(ROOT / DEMO, ignore_errors=True)
    print(
        f"fastllm demo: code model on the Python standard library ({stdlib}); artifacts in {DEMO}/"
    )
    fastllm(
        "tokenizer", "train", f"input.path={stdlib}", "input.extensions=[.py]",
        f"output={DEMO}/tokenizer", "vocab_size=4096", "max_documents=1500",
    )  # fmt: skip
    fastllm(
        "prepare", f"input.path={stdlib}", "input.extensions=[.py]",
        f"tokenizer.path={DEMO}/tokenizer", f"output.path={DEMO}/dataset",
    )  # fmt: skip
    fastllm("train", "-c", "examples/tiny.yaml")
    export = DEMO / "run" / "export" / "200"
    fastllm(
        "convert", "gpt", "input.format=distributed", f"input.path={export}",
        "output.type=starcoder2", f"output.path={DEMO}/hf",
    )  # fmt: skip
    print(
        f"\n$ transformers: AutoModelForCausalLM.from_pretrained('{DEMO}/hf').generate({PROMPT!r})"
    )
    print(complete(ROOT / DEMO / "hf"))
    first, last = plot_losses(ROOT / DEMO / "run" / "metrics.jsonl", ROOT / DEMO / "loss.png")
    print(f"\nloss {first:.3f} → {last:.3f}")
    print("artifacts:")
    for what, path in (
        ("tokenizer", "tokenizer/tokenizer.json"),
        ("dataset", "dataset/metadata.json"),
        ("metrics", "run/metrics.jsonl"),
        ("checkpoints", "run/checkpoint/"),
        ("export (distributed)", "run/export/200/"),
        ("Hugging Face model", "hf/"),
        ("loss curve", "loss.png"),
    ):
        print(f"  {what:22} {DEMO / path}")


if __name__ == "__main__":
    main()
