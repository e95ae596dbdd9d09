"""Whether two ranks can share one GPU for the tensor-parallel tests: which of the collectives
tensor parallelism uses each backend runs on CUDA tensors with both ranks on device 0 (NCCL
refuses two ranks on one device; Gloo supports only some collectives on CUDA tensors).

    torchrun --standalone --nproc-per-node 2 bench/gloo_cuda_probe.py --backend gloo
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="gloo")
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    rank, device = dist.get_rank(), torch.device("cuda", 0)
    torch.cuda.set_device(device)
    x = torch.full((4, 8), float(rank + 1), device=device)
    probes = {
        "all_reduce": lambda: dist.all_reduce(x.clone()),
        "all_reduce_max": lambda: dist.all_reduce(x.clone(), op=dist.ReduceOp.MAX),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
            torch.empty(8, 8, device=device), x.clone()
        ),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            torch.empty(2, 8, device=device), x.clone()
        ),
        "all_gather": lambda: dist.all_gather([torch.empty_like(x) for _ in range(2)], x),
        "broadcast": lambda: dist.broadcast(x.clone(), src=0),
    }
    results = {}
    for name, probe in probes.items():
        try:
            probe()
            torch.cuda.synchronize()
            results[name] = "ok"
        except Exception as error:  # the report is the point
            results[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    if rank == 0:
        print(json.dumps({"backend": args.backend, "collectives": results}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
