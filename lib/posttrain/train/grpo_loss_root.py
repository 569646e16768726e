"""The GRPO loss root (`GRPOLoss`): the FSDP root that runs the model over a packed
micro-batch (layout in `posttrain.rl.batch`), takes the chunked log-probs of the completion
tokens at the sampling temperature (over the ids the engine may sample, when restricted), lays
them out per sequence (whole rows under context parallelism) and applies
`posttrain.losses.grpo.grpo_loss`. With ``score_only`` it returns the log-probs (old-policy
and reference passes, the weight-sync probe) through the same code. The trainer rank that
drives it is `posttrain.train.grpo.GRPOWorker`.
"""

from __future__ import annotations

import torch
from torch import nn

from posttrain.config.grpo import AlgorithmConfig
from posttrain.losses.grpo import (aggregation_weights, grpo_loss, grpo_token_objective,
                                   head_gradients_in_forward)
from posttrain.models.routing_replay import routing_replay_counts, set_routing_replay
from posttrain.models.transformer import Transformer
from posttrain.ops.cross_entropy import IGNORE_INDEX, chunked_logprob_objective, chunked_logprobs
from posttrain.ops.vocab import restrict_head

__all__ = ["GRPOLoss", "TOKEN_STATS"]

# stats the root returns as sums over response tokens; the worker divides by the token count
TOKEN_STATS = ("pg_loss", "clip_fraction_low", "clip_fraction_high", "ratio_mean", "kl",
               "is_weight_mean", "is_truncated_fraction", "entropy", "logprob_gap")


class GRPOLoss(nn.Module):
    """FSDP root over a packed micro-batch (layout in `posttrain.rl.batch`).

    Returns ``(loss, stats)``: `loss` is this micro-batch's share of the mini-batch loss
    (already divided by the mini-batch's global counts, times ``live``), `stats` are sums over
    its response tokens (see `TOKEN_STATS`).
    """

    input_keys = ("input_ids", "position_ids", "document_lengths", "targets", "token_index",
                  "mask", "advantages", "engine_logp", "old_logp", "ref_logp",
                  "global_tokens", "global_sequences", "live", "routing")
    # cut by context parallelism
    row_keys = ("input_ids", "position_ids", "targets", "routing")

    def __init__(self, model: Transformer, algo: AlgorithmConfig, temperature: float,
                 constant_norm: float | None, chunk_tokens: int = 1024,
                 allowed_token_ranges: tuple = (), fuse_head: bool = True):
        super().__init__()
        # False: the head projects each chunk again in backward (the reference path of tests)
        self.fuse_head = fuse_head
        self.model, self.algo = model, algo
        self.temperature, self.constant_norm = temperature, constant_norm
        self.chunk_tokens = chunk_tokens
        # the ids the engine may sample (`SamplingConfig.allowed_token_ranges`; empty: all):
        # log-probs over the head's rows for them, as the engine computes its own
        self.allowed_token_ranges = allowed_token_ranges
        self._replaying = False

    def replay(self, routing: torch.Tensor | None) -> None:
        """Route this call's forwards (and their recomputation in the backward) through the
        recorded experts `routing` [1, L, L_moe, k] of the batch, or the model's own (None)."""
        if routing is not None or self._replaying:
            set_routing_replay(self.model, routing)
            self._replaying = routing is not None

    def sequence_logprobs(self, input_ids, position_ids, document_lengths, targets,
                          token_index, mask, with_entropy: bool = False, objective=None
                          ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(log-probs [S, T] of the completion tokens, 0 off the mask; with `with_entropy` the
        summed entropy of the sampling distribution over the targeted positions, from the same
        chunked logits, else None; the loss of a token-separable `objective` over the row's
        positions (`chunked_logprob_objective`: the log-probs are then detached, the loss
        carries the gradients, formed in the forward), else None)."""
        hidden = self.model(input_ids, position_ids, document_lengths)
        head = self.model.head
        weight, bias, real = head.weight, getattr(head, "bias", None), head.real_vocab_size
        if self.allowed_token_ranges:
            weight, bias, targets = restrict_head(weight, bias, targets,
                                                  self.allowed_token_ranges)
            real = weight.shape[0]
        kw = dict(real_vocab_size=real, chunk_tokens=self.chunk_tokens,
                  softcap=getattr(head, "softcap", None), bias=bias,
                  temperature=self.temperature, return_entropy=with_entropy)
        loss = None
        if objective is not None:
            loss, logp, entropy = chunked_logprob_objective(hidden, weight, targets, objective,
                                                            **kw)
        else:
            out = chunked_logprobs(hidden, weight, targets, **kw)
            logp, entropy = out if with_entropy else (out, None)
        logp_flat = self._whole_row(logp.reshape(-1))
        return (logp_flat[token_index].where(mask, 0.0),
                None if entropy is None else entropy.sum(), loss)

    def _objective(self, targets, token_index, mask, advantages, old_logp, ref_logp, terms,
                   norms, context_parallel: bool):
        """`grpo_loss`'s loss (its per-token `terms`, aggregation `norms`) as a token-separable
        objective over the row's positions (`grpo_token_objective`), or None where the head's
        gradients cannot be formed in the forward (`head_gradients_in_forward`: not with GSPO's
        ratio or context parallelism; the last check fails only for a batch that trains a
        token whose log-prob is not projected)."""
        positions = token_index[mask]              # the row positions of the trained tokens
        if (not self.fuse_head or not head_gradients_in_forward(self.algo.ratio, context_parallel)
                or not torch.is_grad_enabled()
                or bool((targets.reshape(-1)[positions] == IGNORE_INDEX).any())):
            return None
        n = targets.numel()

        def on_row(x_BT: torch.Tensor | None) -> torch.Tensor | None:
            if x_BT is None:
                return None
            x_BT = x_BT[:, None].expand(mask.shape) if x_BT.dim() == 1 else x_BT
            return x_BT.new_zeros(n).index_put_((positions,), x_BT[mask])

        weights = aggregation_weights(mask.bool(), **norms)
        return grpo_token_objective(
            on_row(old_logp), on_row(advantages.float()), on_row(mask.bool()), on_row(weights),
            clip_low=terms["clip_low"], clip_high=terms["clip_high"], kl_coef=terms["kl_coef"],
            engine_logp=on_row(terms["engine_logp_BT"]), is_cap=terms["is_cap"],
            ref_logp=on_row(ref_logp))

    def _whole_row(self, local_flat: torch.Tensor) -> torch.Tensor:
        """Per-position values of this rank's tokens of the row placed at their positions in
        the whole row (0 at the others' positions); unchanged without context parallelism,
        where `token_index` addresses this rank's row as it is."""
        shard = self.model.context_shard(local_flat.shape[0]) if hasattr(
            self.model, "context_shard") else None
        if shard is None:
            return local_flat
        whole = local_flat.new_zeros(shard.seq_len)
        return whole.index_copy(0, shard.positions().to(local_flat.device), local_flat)

    def held(self, token_index: torch.Tensor, local_len: int) -> torch.Tensor | None:
        """[S, T] bool: the response tokens whose positions this rank holds under context
        parallelism (None without it)."""
        shard = self.model.context_shard(local_len) if hasattr(self.model,
                                                               "context_shard") else None
        if shard is None:
            return None
        mine = torch.zeros(shard.seq_len, dtype=torch.bool, device=token_index.device)
        mine[shard.positions().to(token_index.device)] = True
        return mine[token_index]

    def forward(self, input_ids, position_ids, document_lengths, targets, token_index, mask,
                advantages, engine_logp, old_logp=None, ref_logp=None, global_tokens=None,
                global_sequences=None, live=True, routing=None, *, score_only: bool = False):
        seq_args = (input_ids, position_ids, document_lengths, targets, token_index, mask)
        self.replay(routing)         # every pass: old policy, reference, update (None: own)
        if score_only:
            return self.sequence_logprobs(*seq_args)[0].detach()
        algo = self.algo
        if algo.reference == "lora_base":
            from posttrain.models.lora import disable_adapters
            with torch.no_grad(), disable_adapters(self.model):
                ref_logp = self.sequence_logprobs(*seq_args)[0]
        held = self.held(token_index, input_ids.shape[1])
        use_engine, aggregation = algo.use_engine_logprobs, algo.aggregation
        terms = dict(clip_low=algo.clip_low, clip_high=algo.clip_high, kl_coef=algo.kl_coef,
                     engine_logp_BT=engine_logp if use_engine else None,
                     is_cap=algo.is_cap if use_engine else None)
        norms = dict(aggregation=aggregation,
                     constant_norm=self.constant_norm if aggregation == "constant" else None,
                     global_tokens=global_tokens if aggregation == "token_mean" else None,
                     global_sequences=None if aggregation == "token_mean" else global_sequences)
        # without context parallelism the head's gradients are formed in the forward (one
        # projection per chunk); `grpo_loss` below then gives the metrics from detached
        # log-probs, and the objective's loss is the loss
        objective = self._objective(targets, token_index, mask, advantages, old_logp, ref_logp,
                                    terms, norms, context_parallel=held is not None)
        logp, entropy_sum, fused = self.sequence_logprobs(
            *seq_args, with_entropy=self.algo.log_entropy, objective=objective)
        old = old_logp if old_logp is not None else logp.detach()
        loss, m = grpo_loss(logp, old, advantages, mask, ref_logp_BT=ref_logp, held_BT=held,
                            ratio=algo.ratio, **terms, **norms)
        if fused is not None:
            loss = fused
        if held is not None:
            mask = mask & held
        n = mask.sum()
        stats = {k: v * n for k, v in m.items() if k != "ratio_max"}
        with torch.no_grad():
            stats["logprob_gap"] = (old - engine_logp).abs().where(mask, 0.0).sum()
            if entropy_sum is not None:
                stats["entropy"] = entropy_sum
            if routing is not None:
                replayed, mismatched = routing_replay_counts(self.model).tolist()
                stats["routing_replayed"] = torch.tensor(float(replayed))
                stats["routing_mismatched"] = torch.tensor(float(mismatched))
        if not live:                       # a dummy micro-batch: collectives, no contribution
            return loss * 0.0, {k: torch.zeros_like(v) for k, v in stats.items()}
        return loss, stats
