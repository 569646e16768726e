"""What the multi-rank layout tests share: the SFT loss root that also returns the logits, full
tensors of DTensors, and the comparison with the single-process run."""

from __future__ import annotations

import torch
from torch import nn


class LossAndLogits(nn.Module):
    """The SFT root (mean cross-entropy over the step's loss tokens) that also returns the
    logits. FSDP averages gradients over the ranks it shards over (`ranks`): the loss is scaled
    so that their mean is the gradient of the global mean."""

    def __init__(self, model: nn.Module, global_tokens: int, ranks: int):
        super().__init__()
        self.model, self.global_tokens, self.ranks = model, global_tokens, ranks

    def forward(self, ids, labels, docs):
        from posttrain.losses.sft import sft_loss_sum
        hidden = self.model(ids, document_lengths=docs)
        head = self.model.head
        loss_sum = sft_loss_sum(hidden, head.weight, labels, real_vocab_size=head.real_vocab_size,
                                softcap=getattr(head, "softcap", None))
        return loss_sum * self.ranks / self.global_tokens, self.model.logits(hidden).detach()


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def compare(ref: dict, got: dict) -> dict:
    """Differences of a layout's run (`got`: its rows, and with context parallelism its
    positions, of the logits) from the single-process run (`ref`)."""
    ref_logits = ref["logits"][got["rows"]]
    if got.get("positions") is not None:
        ref_logits = ref_logits[:, got["positions"]]
    common = [n for n in ref["grads"] if n in got["grads"]]
    return {"loss": abs(ref["loss"] - got["loss"]),
            "logits": (ref_logits - got["logits"]).abs().max().item(),
            "grads": max((ref["grads"][n] - got["grads"][n]).abs().max().item() for n in common),
            "worst_grad": max(common, key=lambda n: (ref["grads"][n] - got["grads"][n])
                              .abs().max()),
            "grad_names_differ": sorted(set(ref["grads"]) ^ set(got["grads"])),
            "num_grads": len(got["grads"])}
