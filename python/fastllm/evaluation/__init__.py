"""Downstream evaluation: lm-evaluation-harness's model interface on a fastllm model
(`lm_eval_model.FastLLMLM`) and its tasks run on it (`tasks.run_tasks`), for `fastllm evaluate`
and for evaluation inside training."""
