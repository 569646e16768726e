"""Peak memory and time of chunked vs naive distillation loss (forward + backward); one JSON line.

    python bench/distill_memory.py [--tokens 2048] [--hidden 512] [--vocab 151936]
                                   [--chunk-tokens 1024] [--kind forward_kl]

Variants, each in a fresh subprocess:

* ``chunked``: `distill_loss`, the custom autograd function that recomputes each chunk's logits
  in backward (what the library uses);
* ``checkpoint``: the alternative, the plain formula on each chunk under
  `torch.utils.checkpoint` (autograd keeps only the chunk's inputs, recomputes its graph in
  backward);
* ``naive``: `naive_distill_loss`, full [N, V] logits for both models.

On CPU the extra memory of a variant is its peak resident set (`getrusage(...).ru_maxrss`) minus
its resident set after the inputs are built; on CUDA it is `torch.cuda.max_memory_allocated`
minus the allocation before the loss. Every variant produces the student's weight gradient
([V, H] fp32), part of each peak. The teacher has its own head and hidden states (frozen).
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
from _memory import Measured, run_child
from torch.utils.checkpoint import checkpoint

from posttrain.losses.distill import distill_loss, naive_distill_loss

VARIANTS = ("chunked", "checkpoint", "naive")



def checkpointed_distill_loss(h_s, w_s, h_t, w_t, labels, *, kind, real_vocab_size,
                              chunk_tokens):
    """The alternative design: per-chunk plain formula under activation checkpointing."""
    keep = labels != -100
    h_s, h_t, labels = h_s[keep], h_t[keep], labels[keep]
    fn = partial(naive_distill_loss, kind=kind, real_vocab_size=real_vocab_size)
    total = h_s.new_zeros((), dtype=torch.float32)
    for start in range(0, h_s.shape[0], chunk_tokens):
        sl = slice(start, start + chunk_tokens)
        chunk_mean = checkpoint(fn, h_s[sl], w_s, h_t[sl], w_t, labels[sl], use_reentrant=False)
        total = total + chunk_mean * h_s[sl].shape[0]
    return total / max(h_s.shape[0], 1)


def run_variant(variant: str, tokens: int, hidden: int, vocab: int, chunk_tokens: int,
                kind: str, device: str) -> dict:
    """Build inputs in place (no temporaries that would raise the high-water mark), then one
    forward + backward of the loss; returns peak extra bytes, seconds and the loss."""
    g = torch.Generator(device=device).manual_seed(0)
    padded = -(-vocab // 64) * 64
    h_s = torch.randn(tokens, hidden, generator=g, device=device).requires_grad_()
    w_s = torch.empty(padded, hidden, device=device).normal_(0.0, 0.02, generator=g)
    w_s.requires_grad_()
    h_t = torch.randn(tokens, hidden, generator=g, device=device)
    w_t = torch.empty(padded, hidden, device=device).normal_(0.0, 0.03, generator=g)
    labels = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    labels[: tokens // 8] = -100  # a prompt that carries no loss
    with Measured(device) as m:
        if variant == "chunked":
            loss, _ = distill_loss(h_s, w_s, h_t, w_t, labels, kind=kind, real_vocab_size=vocab,
                                   chunk_tokens=chunk_tokens)
        elif variant == "checkpoint":
            loss = checkpointed_distill_loss(h_s, w_s, h_t, w_t, labels, kind=kind,
                                             real_vocab_size=vocab, chunk_tokens=chunk_tokens)
        else:
            loss = naive_distill_loss(h_s, w_s, h_t, w_t, labels, kind=kind, real_vocab_size=vocab)
        loss.backward()
    return {"peak_extra_bytes": m.peak_extra_bytes, "seconds": m.seconds, "loss": loss.item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--chunk-tokens", type=int, default=1024)
    parser.add_argument("--kind", default="forward_kl", choices=["forward_kl", "reverse_kl", "jsd"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = (args.tokens, args.hidden, args.vocab, args.chunk_tokens, args.kind, args.device)
    if args.variant:  # child process
        print(json.dumps(run_variant(args.variant, *sizes)))
        return
    results = {}
    for variant in VARIANTS:
        results[variant] = run_child(__file__, variant, [
            "--tokens", str(args.tokens), "--hidden", str(args.hidden),
            "--vocab", str(args.vocab), "--chunk-tokens", str(args.chunk_tokens),
            "--kind", args.kind, "--device", args.device])
    chunked, ckpt, naive = (results[v] for v in VARIANTS)
    mib = 2 ** 20
    print(json.dumps({
        "bench": "distill_memory", "device": args.device, "threads": torch.get_num_threads(),
        "kind": args.kind, "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab,
        "chunk_tokens": args.chunk_tokens, "dtype": "float32",
        "chunked_peak_mib": round(chunked["peak_extra_bytes"] / mib, 1),
        "checkpoint_peak_mib": round(ckpt["peak_extra_bytes"] / mib, 1),
        "naive_peak_mib": round(naive["peak_extra_bytes"] / mib, 1),
        "memory_ratio": round(naive["peak_extra_bytes"] / chunked["peak_extra_bytes"], 2),
        "chunked_s": round(chunked["seconds"], 3), "checkpoint_s": round(ckpt["seconds"], 3),
        "naive_s": round(naive["seconds"], 3),
        "chunked_loss": chunked["loss"], "checkpoint_loss": ckpt["loss"],
        "naive_loss": naive["loss"], "loss_abs_diff": abs(chunked["loss"] - naive["loss"]),
    }))


if __name__ == "__main__":
    main()
