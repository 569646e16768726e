"""Peak memory and time of chunked vs naive cross-entropy (forward + backward); prints one JSON line.

    python bench/loss_memory.py [--tokens 4096] [--hidden 1024] [--vocab 151936] [--chunk-tokens 1024]

Each variant runs in a fresh subprocess. On CPU the extra memory of a variant is its peak resident
set (`getrusage(...).ru_maxrss`) minus its resident set after the inputs are built (torch's CPU
allocations are invisible to tracemalloc); on CUDA it is `torch.cuda.max_memory_allocated` minus
the allocation before the loss. Both variants produce the weight gradient ([V, H] fp32), which is
part of each peak. The losses of the two variants are printed with their absolute difference.
"""

from __future__ import annotations

import argparse
import json

import torch
from _memory import Measured, run_child

from posttrain.ops.cross_entropy import chunked_cross_entropy, naive_cross_entropy



def run_variant(variant: str, tokens: int, hidden: int, vocab: int, chunk_tokens: int,
                device: str) -> dict:
    """Build inputs in place (no temporaries that would raise the high-water mark), then one
    forward + backward of the loss; returns peak extra bytes, seconds and the loss."""
    g = torch.Generator(device=device).manual_seed(0)
    hidden_NH = torch.randn(tokens, hidden, generator=g, device=device).requires_grad_()
    padded = -(-vocab // 64) * 64
    weight_VH = torch.empty(padded, hidden, device=device)
    weight_VH.normal_(0.0, 0.02, generator=g).requires_grad_()
    labels_N = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    labels_N[: tokens // 8] = -100  # a prompt that carries no loss
    with Measured(device) as m:
        if variant == "chunked":
            loss = chunked_cross_entropy(hidden_NH, weight_VH, labels_N, real_vocab_size=vocab,
                                         chunk_tokens=chunk_tokens)
        else:
            loss = naive_cross_entropy(hidden_NH, weight_VH, labels_N, real_vocab_size=vocab)
        loss.backward()
    return {"peak_extra_bytes": m.peak_extra_bytes, "seconds": m.seconds, "loss": loss.item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--chunk-tokens", type=int, default=1024)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--variant", choices=["chunked", "naive"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = (args.tokens, args.hidden, args.vocab, args.chunk_tokens, args.device)
    if args.variant:  # child process
        print(json.dumps(run_variant(args.variant, *sizes)))
        return
    results = {}
    for variant in ("chunked", "naive"):
        results[variant] = run_child(__file__, variant, [
            "--tokens", str(args.tokens), "--hidden", str(args.hidden),
            "--vocab", str(args.vocab), "--chunk-tokens", str(args.chunk_tokens),
            "--device", args.device])
    chunked, naive = results["chunked"], results["naive"]
    mib = 2 ** 20
    print(json.dumps({
        "bench": "loss_memory", "device": args.device, "threads": torch.get_num_threads(),
        "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab,
        "chunk_tokens": args.chunk_tokens, "dtype": "float32",
        "chunked_peak_mib": round(chunked["peak_extra_bytes"] / mib, 1),
        "naive_peak_mib": round(naive["peak_extra_bytes"] / mib, 1),
        "memory_ratio": round(naive["peak_extra_bytes"] / chunked["peak_extra_bytes"], 2),
        "chunked_s": round(chunked["seconds"], 3), "naive_s": round(naive["seconds"], 3),
        "time_ratio": round(chunked["seconds"] / naive["seconds"], 3),
        "chunked_loss": chunked["loss"], "naive_loss": naive["loss"],
        "loss_abs_diff": abs(chunked["loss"] - naive["loss"]),
    }))


if __name__ == "__main__":
    main()
