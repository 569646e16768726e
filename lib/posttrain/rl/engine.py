"""The rollout-engine interface shared by the native generator and (later) vLLM.

A GRPO step asks an engine for `n` completions of each prompt, trains on them, then pushes the
new weights back with `update_weights`. `logprobs` recomputes teacher-forced log-probs, so a
trainer can check that the engine's weights and numerics agree with its own.

Log-prob convention (both `Rollout.logprobs` and `RolloutEngine.logprobs`):

    logp_t = log softmax(z_t / T)[y_t]

where z_t are the model's final logits over the real vocabulary (after Gemma's soft-capping) and
T is the sampling temperature; T == 0 (greedy) is scored at T = 1. top-k / top-p filtering is
*not* applied: the log-prob is the one a trainer gets from `chunked_logprobs(..., temperature=T)`,
which is what the GRPO importance ratio needs. This is vLLM's log-prob of the sampled token with
the temperature applied and no truncation.

Allowed ids (`SamplingConfig.allowed_token_ranges`, ``[lo, hi)`` windows; empty: every id). An
engine given them never samples another id, and its log-probs are renormalised over them:

    logp_t = z_t[y_t] / T - log sum_{v allowed} exp(z_t[v] / T)

the same in `Rollout.logprobs` and in `RolloutEngine.logprobs(..., allowed_token_ranges=...)`,
and the same as a trainer's log-probs over the restricted head (`posttrain.ops.vocab.
restrict_head`), so the importance ratio compares like with like. Sequence RL uses them to keep
completions to the items of an event vocabulary (`posttrain.train.sequence_rl`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch

from posttrain.config.rl import SamplingConfig

__all__ = ["FinishReason", "Rollout", "RolloutEngine", "SamplingConfig", "stop_token_ids"]

FinishReason = Literal["stop", "length"]


@dataclass
class Rollout:
    """One sampled completion. `logprobs[i]` scores `completion_ids[i]` (module docstring).

    `routing` (with `SamplingConfig.record_routing`): the experts each position of prompt +
    completion went through, [T, L_moe, top_k] int16 over the model's MoE layers in order; -1
    rows for positions the engine never ran (the last completion token). None otherwise."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    routing: torch.Tensor | None = None


@runtime_checkable
class RolloutEngine(Protocol):
    """What a GRPO loop needs from a generator.

    For the weight sync (`posttrain.rl.weight_sync`): `parameter_shapes` (native name -> full
    shape; a tied head has no entry), the `dtype` its weights are held in, and whether
    `update_weights` takes any subset of the parameters (`partial_updates`) or needs all of
    them in one call.

    Your own engine: ``rollout.kind: "package.module:Class"`` names a class implementing this
    protocol, which `posttrain.rl.factory` builds wherever it would build the native engine (on
    every trainer rank when colocated, in each engine actor when separate) as

        Class(args=args, hf_dir=hf_dir, device=device, dtype=dtype, seed=seed,
              **rollout.options)

    `args` are the `ModelArgs` of the model the trainer holds (None: a transformers model
    without a native definition), `hf_dir` the starting checkpoint (for an engine that loads it
    itself: the trainer's weights arrive by `update_weights` before the first generation
    anyway), `dtype` the weights' dtype, `seed` the run's. What the loop relies on:

    - `generate`: n rollouts per prompt in order; at most `max_new_tokens` completion ids,
      ending at the first stop id (kept, finish reason ``stop``) or at the budget
      (``length``); only ids of `allowed_token_ranges` when given; log-probs by the module's
      convention (temperature applied, no top-k/top-p truncation, renormalised over the
      allowed ids); the same rollouts for the same prompts, sampling (its seed included), n
      and weights, or a resumed run is not bit-identical to an uninterrupted one;
    - `update_weights`: tensors named and shaped as `parameter_shapes` says (any subset when
      `partial_updates`, else all in one call);
    - `logprobs`: the numbers generation gives for the same tokens (the weight-sync check
      compares them with the trainer's after every update, `sync_check.tolerance`);
    - `release_memory` may keep everything and return False.

    `posttrain.rl.native.NativeEngine` is the reference implementation;
    `tests/steps/test_train_sequence_rl.py` trains with an engine of its own that wraps it.
    """

    parameter_shapes: dict[str, tuple[int, ...]]
    dtype: torch.dtype
    partial_updates: bool

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 n: int = 1) -> list[list[Rollout]]:
        """`n` rollouts per prompt: result[i][j] is sample j of prompts[i]."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full (unsharded) tensors, named as in the native model, into the engine."""
        ...

    def logprobs(self, sequences: list[list[int]], prompt_lens: list[int], *,
                 temperature: float = 1.0, allowed_token_ranges: tuple = ()
                 ) -> list[list[float]]:
        """Teacher-forced log-probs of sequences[i][prompt_lens[i]:], one per token; with
        `allowed_token_ranges`, renormalised over those ids (module docstring). A caller
        passes the keyword only when it is not empty, so an engine for text alone may leave it
        out."""
        ...

    def release_memory(self) -> bool:
        """Give back the memory the engine holds between generations: its KV cache and its
        weights (vLLM's sleep level 2). Returns whether anything was released; if so, the
        engine generates again only after `resume_memory` and a full `update_weights`. A
        colocated trainer calls it between generation and its update."""
        ...

    def resume_memory(self) -> None:
        """Take the memory back (weights undefined until the next full `update_weights`);
        a no-op unless released."""
        ...


def stop_token_ids(tokenizer, stop_tokens: Iterable[str], *,
                   key: str = "sampling.stop_tokens") -> tuple[int, ...]:
    """The Hugging Face `tokenizer`'s eos id plus each of `stop_tokens` (single tokens of its
    vocabulary, e.g. ``<|im_end|>``); a ConfigError naming `key` for one that is not a token."""
    from posttrain.errors import ConfigError
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    vocab = tokenizer.get_vocab()
    for token in stop_tokens:
        if token not in vocab:
            raise ConfigError(f"{key}: {token!r} is not a token of the tokenizer; list single "
                              "tokens such as '<|im_end|>'")
        ids.append(vocab[token])
    return tuple(dict.fromkeys(ids))
