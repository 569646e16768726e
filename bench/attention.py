"""Document-masked attention vs full causal and block-diagonal-mask SDPA; prints one JSON line.

    python bench/attention.py [--seq-len 8192] [--docs 30] [--heads 8] [--kv-heads 8] [--head-dim 64]

One packed row of skewed document lengths (a few long documents, many short ones, drawn from a
Pareto law with a fixed seed). Forward + backward time (median of `--repeats` after a warm-up) of

- `attention(..., document_lengths=...)` with the backend chosen for the device ("split" on CPU),
- plain causal SDPA over the whole row (wrong across documents; the speed baseline),
- SDPA with a dense block-diagonal causal mask (the obvious correct alternative),

all measured in the same run, with ratios to the causal baseline and to the masked SDPA, and the
largest difference between the document-masked outputs of the two correct methods.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from posttrain.ops.attention import attention


def skewed_lengths(total: int, docs: int, seed: int = 0) -> list[int]:
    """`docs` positive lengths summing to `total`, heavy-tailed and shuffled."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.empty(docs).exponential_(generator=g).mul_(1.2).exp_()  # Pareto, alpha ~0.8
    lengths = (weights / weights.sum() * (total - docs)).floor().long() + 1
    lengths[int(weights.argmax())] += total - int(lengths.sum())
    return lengths.tolist()


def time_fwd_bwd(fn: Callable[[], torch.Tensor], inputs: tuple[torch.Tensor, ...],
                 repeats: int) -> float:
    def once() -> float:
        for t in inputs:
            t.grad = None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn().sum().backward()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start

    once()  # warm-up (and compilation on GPU)
    return statistics.median(once() for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--docs", type=int, default=30)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    lengths = skewed_lengths(args.seq_len, args.docs)
    g = torch.Generator(device=args.device).manual_seed(0)
    shape_q = (1, args.heads, args.seq_len, args.head_dim)
    shape_kv = (1, args.kv_heads, args.seq_len, args.head_dim)
    q = torch.randn(shape_q, generator=g, device=args.device).requires_grad_()
    k = torch.randn(shape_kv, generator=g, device=args.device).requires_grad_()
    v = torch.randn(shape_kv, generator=g, device=args.device).requires_grad_()
    gqa = args.heads != args.kv_heads

    def documents() -> torch.Tensor:
        return attention(q, k, v, document_lengths=[lengths])

    def causal() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    def block_mask_sdpa() -> torch.Tensor:
        return attention(q, k, v, document_lengths=[lengths], backend="masked_sdpa")

    with torch.no_grad():
        max_diff = (documents() - block_mask_sdpa()).abs().max().item()
    seconds = {name: time_fwd_bwd(fn, (q, k, v), args.repeats)
               for name, fn in [("documents", documents), ("causal", causal),
                                ("block_mask_sdpa", block_mask_sdpa)]}
    print(json.dumps({
        "bench": "attention", "device": args.device, "threads": torch.get_num_threads(),
        "seq_len": args.seq_len, "docs": len(lengths), "longest_doc": max(lengths),
        "shortest_doc": min(lengths), "heads": args.heads, "kv_heads": args.kv_heads,
        "head_dim": args.head_dim, "dtype": "float32", "repeats": args.repeats,
        "documents_s": round(seconds["documents"], 4), "causal_s": round(seconds["causal"], 4),
        "block_mask_sdpa_s": round(seconds["block_mask_sdpa"], 4),
        "documents_vs_causal": round(seconds["documents"] / seconds["causal"], 3),
        "documents_vs_block_mask_sdpa": round(seconds["documents"] / seconds["block_mask_sdpa"], 3),
        "max_abs_diff_vs_block_mask_sdpa": max_diff,
    }))


if __name__ == "__main__":
    main()
