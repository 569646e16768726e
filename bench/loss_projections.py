"""What SFT's loss saves by projecting each chunk once; prints one JSON line.

    python bench/loss_projections.py [--tokens 4096] [--hidden 256] [--vocab 8192] [--repeats 12]

`chunked_cross_entropy` forms its gradients in the forward pass, while each chunk's logits
exist, and only scales them in backward: one LM-head projection per chunk. The log-prob kernel
(`chunked_logprobs`, which DPO, GRPO and distillation need, since their losses are not a plain
sum of log-probs) keeps only the log-sum-exp and projects each chunk again in backward.
Before commit 0077bff SFT's loss went through the second path. Both paths run here on the same
inputs, alternating in one process (the machine is shared: the ratio is what to read), with a
summed loss; the result reports medians after two warm-up rounds and the largest differences
of the loss and both gradients.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from posttrain.ops import cross_entropy as ce


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096, help="loss tokens (after ignored ones)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--chunk-tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(a.tokens, a.hidden, generator=g).requires_grad_()
    weight = (torch.randn(a.vocab, a.hidden, generator=g) * 0.02).requires_grad_()
    labels = torch.randint(0, a.vocab, (a.tokens,), generator=g)

    def once_per_chunk() -> torch.Tensor:
        return ce.chunked_cross_entropy(hidden, weight, labels, reduction="sum",
                                        chunk_tokens=a.chunk_tokens)

    def twice_per_chunk() -> torch.Tensor:
        return -ce.chunked_logprobs(hidden, weight, labels,
                                    chunk_tokens=a.chunk_tokens).sum()

    variants = {"once_per_chunk": once_per_chunk, "twice_per_chunk": twice_per_chunk}
    seconds: dict[str, list[float]] = {k: [] for k in variants}
    results = {}
    for _ in range(a.repeats + 2):
        for name, loss_fn in variants.items():
            hidden.grad = weight.grad = None
            t0 = time.perf_counter()
            loss = loss_fn()
            loss.backward()
            seconds[name].append(time.perf_counter() - t0)
            results[name] = (loss.item(), hidden.grad.clone(), weight.grad.clone())
    med = {k: statistics.median(v[2:]) for k, v in seconds.items()}
    (l1, h1, w1), (l2, h2, w2) = results["once_per_chunk"], results["twice_per_chunk"]
    print(json.dumps({
        "bench": "loss_projections", "tokens": a.tokens, "hidden": a.hidden, "vocab": a.vocab,
        "chunk_tokens": a.chunk_tokens, "threads": a.threads, "repeats": a.repeats,
        "seconds_fwd_bwd": {k: round(v, 4) for k, v in med.items()},
        "twice_over_once": round(med["twice_per_chunk"] / med["once_per_chunk"], 3),
        "loss": l1, "max_abs_diff": {"loss": abs(l1 - l2),
                                     "grad_hidden": (h1 - h2).abs().max().item(),
                                     "grad_weight": (w1 - w2).abs().max().item()},
    }))


if __name__ == "__main__":
    main()
