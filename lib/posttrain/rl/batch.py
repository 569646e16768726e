"""Rollouts -> packed training micro-batches for the GRPO update.

A GRPO step trains on every sampled sequence (prompt + completion) of the step. The controller
splits them into `mini_batches` (one optimizer step each) and packs each mini-batch into
micro-batches of at most `max_tokens` tokens: one row of whole sequences laid end to end,
separated by document boundaries (`document_lengths`, positions restarting at 0), so attention
never crosses sequences and no padding is computed. The packing is first-fit over sequences by
decreasing length, deterministic for a given input.

Each micro-batch carries what the loss needs in two layouts:

- row layout [1, L] for the model: ``input_ids``, ``position_ids``, ``document_lengths`` and
  ``targets`` (the next token at every position that predicts a completion token, else
  IGNORE_INDEX), so the chunked log-prob only projects completion positions; with routing
  replay ``routing`` [1, L, L_moe, k] int16, the experts the engine chose at each position
  (-1 on the padding document and on samples without a record: the model routes them itself),
  else None;
- sequence layout [S, T] for `posttrain.losses.grpo.grpo_loss`: ``token_index[s, t]`` is the
  row position whose log-prob scores completion token t of sequence s, ``mask[s, t]`` marks
  the completion tokens that carry loss, ``advantages[s]``, ``engine_logp[s, t]`` (the
  sampler's log-probs), ``rewards[s]``. PPO's critic (`posttrain.train.critic`) adds
  ``old_values[s, t]`` and ``returns[s, t]`` and replaces ``advantages`` by per-token ones
  [S, T].

A multi-turn sample's completion is everything after the prompt: the model's turns and the
environment's replies (`posttrain.rl.episodes`). Its `loss_mask` is 1 on the sampled tokens
only; the others are context (their ``targets`` are IGNORE_INDEX, so no log-prob is computed for
them, and ``mask`` is False). Without a loss mask every completion token is trained, and a mask
of all ones gives exactly the batch of no mask.

The global counts of the mini-batch (``global_tokens``: trained completion tokens,
``global_sequences``) ride along, so each micro-batch's loss is its exact share of the mini-batch's
loss however the micro-batches are split over ranks. Under FSDP every rank must run the same number
of forwards and backwards, so the micro-batches are padded to a multiple of the rank count with
dummies (``live = 0``: a real forward whose loss is multiplied by 0).

Data rule: rank r of W trains on micro-batches r, r + W, ... of each mini-batch, as in SFT.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.ops.cross_entropy import IGNORE_INDEX

__all__ = ["Sample", "pack_micro_batches", "split_mini_batches"]


@dataclass(frozen=True)
class Sample:
    """One sampled sequence of the step, with the advantage of its group (and its reward, from
    which PPO's critic computes per-token advantages on the trainer ranks instead)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    engine_logprobs: list[float]
    advantage: float
    loss_mask: list[int] | None = None     # per completion token; None: all trained
    routing: torch.Tensor | None = None    # [len, L_moe, k]: the engine's experts (replay)
    reward: float = 0.0                    # the sequence's scalar reward

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


def split_mini_batches(samples: list[Sample], mini_batches: int) -> list[list[Sample]]:
    """Contiguous, equal-sized slices (samples are prompt-major, so groups stay together when
    the prompt count divides evenly)."""
    if mini_batches < 1 or len(samples) % mini_batches:
        raise ValueError(f"{len(samples)} samples do not split into {mini_batches} equal "
                         "mini-batches")
    size = len(samples) // mini_batches
    return [samples[i * size:(i + 1) * size] for i in range(mini_batches)]


def pack_micro_batches(samples: list[Sample], *, max_tokens: int, num_ranks: int = 1,
                       pack: bool = True, row_multiple: int = 1) -> list[dict]:
    """Pack one mini-batch into micro-batches (module docstring); the count is a multiple of
    `num_ranks`, dummies last. `pack=False` puts one sequence in each micro-batch, for a model
    whose attention cannot keep the documents of a row apart (a transformers architecture
    without a native definition whose masks ignore restarting positions). `row_multiple`: each
    row is filled up to a multiple of it with a padding document that carries no loss (context
    parallelism cuts rows into 2 cp chunks)."""
    if not samples:
        raise ValueError("pack_micro_batches: no samples")
    for i, s in enumerate(samples):
        if not s.completion_ids:
            raise ValueError(f"sample {i} has an empty completion")
        if len(s.engine_logprobs) != len(s.completion_ids):
            raise ValueError(f"sample {i}: {len(s.engine_logprobs)} log-probs for "
                             f"{len(s.completion_ids)} completion tokens")
        if s.loss_mask is not None and len(s.loss_mask) != len(s.completion_ids):
            raise ValueError(f"sample {i}: a loss mask of {len(s.loss_mask)} for "
                             f"{len(s.completion_ids)} completion tokens")
        if s.routing is not None and (s.routing.dim() != 3 or s.routing.shape[0] != len(s)):
            raise ValueError(f"sample {i}: a routing record of shape {tuple(s.routing.shape)} "
                             f"for {len(s)} tokens; expected [{len(s)}, MoE layers, top_k]")
        if len(s) > max_tokens:
            raise ValueError(f"sample {i} has {len(s)} tokens (prompt {len(s.prompt_ids)} + "
                             f"completion {len(s.completion_ids)}), more than "
                             f"train.max_tokens_per_micro_batch={max_tokens}; raise it to at "
                             "least the longest prompt + rollout.max_new_tokens")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(samples)), key=lambda i: (-len(samples[i]), i)):
        for b, free in enumerate(room):
            if pack and len(samples[i]) <= free:
                bins[b].append(i)
                room[b] -= len(samples[i])
                break
        else:
            bins.append([i])
            room.append(max_tokens - len(samples[i]))
    global_tokens = sum(_trained(s) for s in samples)
    batches = [_micro_batch([samples[i] for i in sorted(b)], global_tokens, len(samples),
                            row_multiple) for b in bins]
    while len(batches) % num_ranks:
        batches.append({**batches[-1], "live": False})
    return batches


def _micro_batch(samples: list[Sample], global_tokens: int, global_sequences: int,
                 row_multiple: int = 1) -> dict:
    lengths = [len(s) for s in samples]
    longest = max(len(s.completion_ids) for s in samples)
    input_ids, position_ids, targets = [], [], []
    token_index = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.bool)
    engine_logp = torch.zeros(len(samples), longest, dtype=torch.float32)
    offset = 0
    for s, sample in enumerate(samples):
        tokens = sample.prompt_ids + sample.completion_ids
        p, c = len(sample.prompt_ids), len(sample.completion_ids)
        input_ids += tokens
        position_ids += range(len(tokens))
        # position offset + t predicts tokens[t + 1]; completion token j is tokens[p + j]
        if sample.loss_mask is None:
            targets += [IGNORE_INDEX] * (p - 1) + sample.completion_ids + [IGNORE_INDEX]
            mask[s, :c] = True
        else:
            targets += [IGNORE_INDEX] * (p - 1) + [
                t if m else IGNORE_INDEX
                for t, m in zip(sample.completion_ids, sample.loss_mask)] + [IGNORE_INDEX]
            mask[s, :c] = torch.tensor(sample.loss_mask, dtype=torch.bool)
        token_index[s, :c] = torch.arange(offset + p - 1, offset + p - 1 + c)
        engine_logp[s, :c] = torch.tensor(sample.engine_logprobs, dtype=torch.float32)
        offset += len(tokens)
    fill = -offset % row_multiple
    if fill:                           # a document of its own, never a target or a loss token
        input_ids += [0] * fill
        position_ids += range(fill)
        targets += [IGNORE_INDEX] * fill
        lengths = [*lengths, fill]
    return {
        "input_ids": torch.tensor([input_ids], dtype=torch.long),
        "position_ids": torch.tensor([position_ids], dtype=torch.long),
        "document_lengths": [lengths],
        "targets": torch.tensor([targets], dtype=torch.long),
        "routing": _routing_row(samples, offset + fill),
        "token_index": token_index, "mask": mask,
        "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        "rewards": torch.tensor([s.reward for s in samples], dtype=torch.float64),
        "engine_logp": engine_logp, "old_logp": None, "ref_logp": None,
        "global_tokens": global_tokens, "global_sequences": global_sequences,
        "num_tokens": offset, "live": True,
    }


def _routing_row(samples: list[Sample], row_len: int) -> torch.Tensor | None:
    """The samples' routing records end to end, [1, row_len, L, k] int16, -1 where none."""
    records = [s.routing for s in samples if s.routing is not None]
    if not records:
        return None
    shape = records[0].shape[1:]
    if any(r.shape[1:] != shape for r in records):
        raise ValueError(f"routing records of different shapes in one batch: "
                         f"{sorted({tuple(r.shape[1:]) for r in records})} (MoE layers, top_k)")
    row = torch.full((1, row_len, *shape), -1, dtype=torch.int16)
    offset = 0
    for s in samples:
        if s.routing is not None:
            row[0, offset:offset + len(s)] = s.routing
        offset += len(s)
    return row


def _trained(sample: Sample) -> int:
    """The completion tokens that carry loss."""
    return len(sample.completion_ids) if sample.loss_mask is None else sum(sample.loss_mask)
