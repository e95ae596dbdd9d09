"""How long a checkpoint blocks training: fastllm's (copy to host memory, then Rust writes,
checksums and fsyncs in the background) against a plain synchronous `torch.save` of the same
state (fp32 masters and both Adam moments) followed by fsync. Writes JSON and prints a table.

    python bench/checkpoint_bench.py --out bench/results/checkpoint_cpu2.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from fastllm.config import TrainerConfig, load_config
from fastllm.training import Trainer

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fastllm-checkpoint-bench-"))
    overrides = [
        f"run.experiment_dir={work / 'run'}",
        f"model.base_model.transformer.hidden_size={args.hidden}",
        f"model.base_model.transformer.num_layers={args.layers}",
        f"model.base_model.transformer.num_attention_heads={args.hidden // 64}",
        "model.base_model.transformer.ffn_hidden_size=null",
        "model.base_model.transformer.window_size=null",
        "model.base_model.vocab_size=32000",
    ]
    trainer = Trainer(load_config(TrainerConfig, [ROOT / "examples" / "tiny.yaml"], overrides))
    state = {
        f"{kind}.{i}": getattr(shard, kind)
        for i, shard in trainer.engine.stages.dense.buffers.shards.items()
        for kind in ("master", "exp_avg", "exp_avg_sq")
    }
    state_bytes = sum(t.numel() * t.element_size() for t in state.values())
    rows = []
    for repeat in range(args.repeats):
        start = time.perf_counter()
        trainer.engine.state.step = repeat + 1
        trainer.save_checkpoint()
        blocked = time.perf_counter() - start
        trainer.wait_for_checkpoints()
        total = time.perf_counter() - start
        start = time.perf_counter()
        file = work / f"torch_{repeat}.pt"
        torch.save(state, file)
        with open(file, "rb+") as handle:
            os.fsync(handle.fileno())
        plain = time.perf_counter() - start
        rows.append({"fastllm_blocked_s": blocked, "fastllm_total_s": total, "torch_save_s": plain})
        file.unlink()
    shutil.rmtree(work, ignore_errors=True)
    median = {key: sorted(r[key] for r in rows)[len(rows) // 2] for key in rows[0]}
    result = {
        "commit": subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "parameters": sum(numel for _, numel, *_ in trainer.engine.stages.dense.buffers.specs),
        "state_bytes": state_bytes,
        "runs": rows,
        "median": median,
        "blocked_fraction_of_torch_save": median["fastllm_blocked_s"] / median["torch_save_s"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"state {state_bytes / 2**30:.2f} GiB ({result['parameters'] / 1e6:.0f}M parameters)")
    print("| | seconds |\n|---|---|")
    print(f"| fastllm: training blocked | {median['fastllm_blocked_s']:.3f} |")
    print(
        f"| fastllm: written, fsynced, committed (background) | {median['fastllm_total_s']:.3f} |"
    )
    print(f"| torch.save + fsync (blocking) | {median['torch_save_s']:.3f} |")


if __name__ == "__main__":
    main()
