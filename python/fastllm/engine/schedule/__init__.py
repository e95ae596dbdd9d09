"""The step's schedule: every step runs one rank's program, built before training; with
pipeline parallelism stage s runs on pipeline rank s mod P and micro-batches flow through the
stages.

- `program`: the static order of a step (breadth-first or depth-first) and each rank's
  `Program` derived from it, checked deadlock-free.
- `runner`: `StepRunner`, which runs every step (one stage spanning the whole model without
  pipelining): one rank's program, its stages' passes, transfers, ZeRO gathers and reductions,
  and the loss weighted by each piece's share of the batch's trained tokens.
- `simulator`: `fastllm schedule`, the same programs timed under a cost model.
"""
