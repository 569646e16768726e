"""Per-document log-probs of a native model over packed rows, and a few generated samples.

Used after training on the exported checkpoint (single process): the numbers are what the
exported model does, not what the trainer believed. Generation here re-runs the full prefix
per token (no KV cache) and is meant for a handful of samples; the rollout engines of the RL
layer are the fast path.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from posttrain.data.packing import IGNORE_INDEX, Packer, PackingConfig, Sample, collate
from posttrain.data.stream import ListStream
from posttrain.models.transformer import Transformer
from posttrain.ops.cross_entropy import chunked_logprobs
from posttrain.ops.vocab import sample_next_token


def packed_rows(documents: list[tuple[Any, Any]], *, max_tokens_per_forward: int = 4096,
                pad_token_id: int = 0, device: torch.device | str = "cpu"
                ) -> Iterator[tuple[dict, Any]]:
    """(one-row batch on `device`, its packed row) over documents (input ids, loss mask), packed
    into rows of `max_tokens_per_forward` tokens (longer when a document is) with document
    boundaries; a row's `sample_ids` are the documents' indices."""
    if not documents:
        return
    longest = max(len(ids) for ids, _ in documents)
    cfg = PackingConfig(max_tokens_per_pack=max(max_tokens_per_forward, longest),
                        buffer_samples=len(documents), pad_token_id=pad_token_id)
    samples = [Sample(np.asarray(ids, np.int32), np.asarray(mask, np.bool_), sample_id=i)
               for i, (ids, mask) in enumerate(documents)]
    for row in Packer(ListStream(samples), cfg):
        batch = collate([row])
        yield {k: v.to(device) if isinstance(v, torch.Tensor) else v
               for k, v in batch.items()}, row


@torch.no_grad()
def sequence_logps(model: Transformer, documents: list[tuple[Any, Any]], *,
                   max_tokens_per_forward: int = 4096, pad_token_id: int = 0
                   ) -> list[tuple[float, int]]:
    """Per document (input ids, loss mask): (sum of log p of its target tokens, their number).

    Target tokens are those with ``loss_mask == 1`` (each predicted from the tokens before it).
    Documents are packed into rows of `max_tokens_per_forward` tokens (longer when a document
    is) with document boundaries, so no token sees another document.
    """
    if not documents:
        return []
    device, head = model.embed.weight.device, model.head
    out: list[tuple[float, int] | None] = [None] * len(documents)
    for batch, row in packed_rows(documents, max_tokens_per_forward=max_tokens_per_forward,
                                  pad_token_id=pad_token_id, device=device):
        labels_T = batch["labels"][0]
        hidden = model(batch["input_ids"], batch["position_ids"], batch["document_lengths"])
        logp_T = chunked_logprobs(hidden[0], head.weight, labels_T,
                                  real_vocab_size=head.real_vocab_size,
                                  softcap=getattr(head, "softcap", None))
        start = 0
        for sample_id, n in zip(row.sample_ids, row.document_lengths):
            piece = slice(start, start + n)
            out[sample_id] = (float(logp_T[piece].sum()),
                              int((labels_T[piece] != IGNORE_INDEX).sum()))
            start += n
    assert all(o is not None for o in out), "the packer dropped a document"
    return out  # type: ignore[return-value]


@torch.no_grad()
def generate(model: Transformer, prompt_ids: list[int], *, max_new_tokens: int,
             stop_ids: set[int], temperature: float = 0.0, seed: int = 0) -> list[int]:
    """Continue `prompt_ids` until a stop id or `max_new_tokens` (greedy at temperature 0)."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    out: list[int] = []
    for _ in range(max_new_tokens):
        hidden = model(torch.tensor([ids]))
        logits = model.logits(hidden[:, -1])
        nxt = int(sample_next_token(logits, temperature=temperature, generator=gen,
                                    real_vocab_size=model.head.real_vocab_size)[0])
        out.append(nxt)
        if nxt in stop_ids:
            break
        ids.append(nxt)
    return out


def sample_table(model: Transformer, tokenizer, conversations: list[list[dict[str, Any]]], *,
                 max_new_tokens: int) -> list[dict[str, str]]:
    """Prompt with each conversation minus its last assistant turn; compare with the reference."""
    stop = {i for i in (tokenizer.end_of_turn_token_id, tokenizer.eos_token_id) if i is not None}
    rows = []
    for messages in conversations:
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompt = tokenizer.encode_prompt(messages[:last])
        completion = generate(model, prompt, max_new_tokens=max_new_tokens, stop_ids=stop)
        rows.append({"prompt": messages[last - 1]["content"],
                     "reference": messages[last]["content"],
                     "generated": tokenizer.hf.decode(completion, skip_special_tokens=True)})
    return rows
