"""Reinforcement-learning parts. Rollout engines: `engine` (the `RolloutEngine` interface,
`SamplingConfig`, `Rollout`) and `native` (`NativeEngine`, batched KV-cache sampling from a native
`Transformer`, for CPU and tests; vLLM will sit behind the same interface)."""
