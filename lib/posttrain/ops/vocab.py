"""Padded vocabularies: masking and sampling that never reach a padding id.

Embedding and LM-head rows are padded to a multiple of 64 (or more) for fast matmuls and even
sharding; ids >= real_vocab_size do not exist in the tokenizer. Their logits must be -inf before
any softmax, log-prob or sample, so that they carry no probability and no gradient.

Allowed ids: a sampler may also be restricted to windows ``[lo, hi)`` of the vocabulary (the
items of an event vocabulary, `posttrain.train.sequence_rl`). `restrict_head` gives the head's
rows for them, so that the sampler's and the trainer's log-probs are both renormalised over the
same ids.
"""

from __future__ import annotations

import torch

from posttrain.config.rl import TokenRanges, check_token_ranges

__all__ = ["check_token_ranges", "mask_padded_logits", "renumber_tokens", "restrict_head",
           "sample_next_token", "token_range_ids"]


def mask_padded_logits(logits: torch.Tensor, real_vocab_size: int | None) -> torch.Tensor:
    """Logits [..., V_padded] with the columns >= real_vocab_size set to -inf (a new tensor,
    differentiable; the input is returned as is when there is no padding)."""
    padded = logits.shape[-1]
    if real_vocab_size is None or real_vocab_size == padded:
        return logits
    if not 0 < real_vocab_size <= padded:
        raise ValueError(f"real_vocab_size {real_vocab_size} must be in [1, {padded}] "
                         f"(the logits have {padded} columns)")
    is_padding_V = torch.arange(padded, device=logits.device) >= real_vocab_size
    return logits.masked_fill(is_padding_V, float("-inf"))


@torch.no_grad()
def sample_next_token(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0,
                      top_k: int | None = None, generator: torch.Generator | None = None, *,
                      real_vocab_size: int | None = None) -> torch.Tensor:
    """Draw one token id per row from logits [B, V] (or [V]).

    Order, as in transformers' and vLLM's samplers: padded columns -> -inf, divide by
    `temperature`, keep the `top_k` largest, keep the smallest set of most likely tokens whose
    probability reaches `top_p` (the most likely token always stays), renormalise, draw.
    `temperature == 0` is greedy. `top_k` None or 0 and `top_p == 1` switch those filters off.

    Never returns an id >= real_vocab_size (nor any id whose logit is -inf). Returns int64 with
    the leading shape of `logits`.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 or None: off), got {top_k}")
    logits_BV = mask_padded_logits(logits.float(), real_vocab_size)
    squeeze = logits_BV.dim() == 1
    if squeeze:
        logits_BV = logits_BV[None]
    if temperature == 0:
        ids_B = logits_BV.argmax(dim=-1)
        return ids_B[0] if squeeze else ids_B
    logits_BV = logits_BV / temperature
    if top_k and top_k < logits_BV.shape[-1]:
        kth_B1 = logits_BV.topk(top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if top_p < 1:
        sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True)
        probs_BV = sorted_BV.softmax(dim=-1)
        mass_before_BV = probs_BV.cumsum(dim=-1) - probs_BV
        drop_sorted_BV = mass_before_BV >= top_p
        drop_sorted_BV[:, 0] = False
        drop_BV = drop_sorted_BV.scatter(-1, order_BV, drop_sorted_BV)
        logits_BV = logits_BV.masked_fill(drop_BV, float("-inf"))
    ids_B = _draw(logits_BV.softmax(dim=-1), generator)
    return ids_B[0] if squeeze else ids_B


def _draw(probs_BV: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One id per row by inverting the CDF: the first column whose cumulative probability
    exceeds u ~ U[0, total). Exact like `torch.multinomial` (a zero-probability column is never
    drawn: its CDF equals its predecessor's), with one uniform per row instead of multinomial's
    per-row setup or a random number per column: 3-4x faster on CPU, where it was a third of
    a decoding step. u is scaled by the row's own total, so the rounding of the fp32 sum does
    not bias the last columns."""
    cdf_BV = probs_BV.cumsum(dim=-1)
    u_B1 = torch.rand((cdf_BV.shape[0], 1), generator=generator, dtype=cdf_BV.dtype,
                      device=cdf_BV.device) * cdf_BV[:, -1:]
    ids_B = torch.searchsorted(cdf_BV, u_B1, right=True).squeeze(-1)
    return ids_B.clamp_max(cdf_BV.shape[-1] - 1)


# --------------------------------------------------------------------------- allowed ids


def token_range_ids(ranges: TokenRanges, device: torch.device | str | None = None
                    ) -> torch.Tensor:
    """The allowed ids of `ranges`, ascending (int64 [A])."""
    return torch.cat([torch.arange(lo, hi, device=device) for lo, hi in ranges])


def renumber_tokens(tokens: torch.Tensor, ranges: TokenRanges, vocab_size: int, *,
                    ignore_index: int = -100) -> torch.Tensor:
    """`tokens` renumbered to their position among the allowed ids of `ranges` (what column
    of a restricted head scores them), `ignore_index` kept. A token outside the ranges is a
    ValueError: it cannot have been sampled."""
    ids_A = token_range_ids(ranges, tokens.device)
    position_V = torch.full((vocab_size,), -1, dtype=torch.long, device=tokens.device)
    position_V[ids_A] = torch.arange(ids_A.numel(), device=tokens.device)
    kept = tokens != ignore_index
    if bool(((tokens < 0) | (tokens >= vocab_size))[kept].any()):
        raise ValueError(f"tokens outside [0, {vocab_size}) besides the ignore index")
    renumbered = torch.where(kept, position_V[tokens.clamp(0, vocab_size - 1)], tokens)
    outside = kept & (renumbered < 0)
    if bool(outside.any()):
        raise ValueError(f"tokens {tokens[outside][:5].tolist()} are outside the allowed ids "
                         f"{[list(r) for r in ranges]}: they cannot have been sampled")
    return renumbered


def restrict_head(weight_VH: torch.Tensor, bias_V: torch.Tensor | None, tokens: torch.Tensor,
                  ranges: TokenRanges, *, ignore_index: int = -100
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """An LM head restricted to the allowed ids of `ranges`: its rows for them (differentiable:
    the gradient flows back to those rows of `weight_VH`), and `tokens` renumbered to their
    position among them (`renumber_tokens`). A log-softmax over the restricted head is the
    model's distribution renormalised over the allowed ids A,

        log p_A(y) = z_y - log sum_{v in A} exp(z_v)

    which is what a sampler that may only draw ids of A samples from (`sample_next_token` over
    the same rows)."""
    ids_A = token_range_ids(ranges, weight_VH.device)
    tokens = renumber_tokens(tokens, ranges, weight_VH.shape[0], ignore_index=ignore_index)
    return (weight_VH.index_select(0, ids_A),
            None if bias_V is None else bias_V.index_select(0, ids_A), tokens)
