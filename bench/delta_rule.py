"""The gated delta rule's chunk-to-chunk state passing, the serial loop against the scan: one
rule call forward + backward per layout; prints one JSON line.

    OMP_NUM_THREADS=1 PYTHONPATH=lib python bench/delta_rule.py [--tokens 8192] [--heads 16] \\
        [--dk 128] [--dv 128] [--chunk 64] [--repeats 2] [--device cpu]

Two layouts of one row of `--tokens` tokens: "docs", ~35 documents of lognormal lengths (fixed
seed; `gated_delta_rule` re-spaces them so each starts a chunk and zeroes the state there), and
"one", a single document. Each runs in both forms of `ops/delta_rule.py` ("serial":
`_pass_serially`, one chunk after another; "scan": `_pass_by_scan`, log2 N levels), chosen by
setting the module's `_SERIAL_MAX_CHUNKS`:

- aten_ops: the ATen ops dispatched by forward + backward (a `TorchDispatchMode` counts them,
  views included): host work and, on an accelerator, mostly a kernel launch each, the
  device-independent measure of what a GPU that waits on the host pays.
- saved_mib: what autograd keeps for backward, the distinct storages its saved tensors use
  (saved-tensor hooks), inputs included.
- ms: wall milliseconds of forward + backward, the median of `--repeats` runs with the two forms
  interleaved, after one counted warm-up each. On CUDA also peak_mib, the allocator's peak above
  what was allocated before the call.
- max_abs_diff: the largest difference of the two forms' outputs and input gradients.

Inputs are fp32 (the rule runs in fp32 whatever its inputs). At the default shape (Qwen3.5-0.8B's
heads) this takes ~5 minutes on one CPU thread, most of it the serial form's backward;
bench/results/delta_rule.json holds that run, delta_rule_dk16.json one at --dk 16 --dv 16. On a shared 2-core machine run
with one thread: two OpenMP threads contending with another process made single batched solves
up to 100x slower, which no interleaving averages out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import posttrain.ops.delta_rule as delta_rule

FORMS = {"serial": 10 ** 9, "scan": 0}      # the _SERIAL_MAX_CHUNKS that selects each form


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _lengths(tokens: int, layout: str) -> list[int]:
    """One document, or documents of lognormal lengths (median tokens / 40) filling the row."""
    if layout == "one":
        return [tokens]
    rng = np.random.default_rng(0)
    lengths, left = [], tokens
    while left > 0:
        n = int(np.clip(rng.lognormal(np.log(tokens / 40), 1.0), 16, tokens // 4))
        lengths.append(min(n, left))
        left -= lengths[-1]
    return lengths


def _inputs(a: argparse.Namespace) -> list[torch.Tensor]:
    g = torch.Generator(device=a.device).manual_seed(0)
    T, H = a.tokens, a.heads
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=a.device)
    q, k, v = randn(1, T, H, a.dk), randn(1, T, H, a.dk), randn(1, T, H, a.dv)
    decay = -0.1 * torch.rand(1, T, H, generator=g, device=a.device)
    beta = torch.rand(1, T, H, generator=g, device=a.device)
    return [x.requires_grad_() for x in (q, k, v, decay, beta)]


def _step(inputs: list[torch.Tensor], lengths: list[int], a: argparse.Namespace,
          form: str) -> torch.Tensor:
    """One rule call forward + backward in `form`; returns the output (detached)."""
    delta_rule._SERIAL_MAX_CHUNKS = FORMS[form]
    for x in inputs:
        x.grad = None
    out, _ = delta_rule.gated_delta_rule(*inputs, document_lengths=[lengths],
                                         chunk_size=a.chunk)
    out.sum().backward()
    return out.detach()


def _counted_step(inputs: list[torch.Tensor], lengths: list[int], a: argparse.Namespace,
                  form: str) -> tuple[torch.Tensor, int, int]:
    """`_step`, counting the ATen ops it dispatches and the bytes of the distinct storages
    autograd saves: (output, ops, saved bytes)."""
    storages: dict[int, int] = {}
    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with _CountOps() as counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _step(inputs, lengths, a, form)
    return out, counter.count, sum(storages.values())


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_layout(a: argparse.Namespace, layout: str) -> dict:
    inputs, lengths = _inputs(a), _lengths(a.tokens, layout)
    width = sum(-(-n // a.chunk) * a.chunk for n in lengths)
    result: dict = {"documents": len(lengths), "chunks": width // a.chunk}
    outs, grads = {}, {}
    for form in FORMS:
        outs[form], ops, saved = _counted_step(inputs, lengths, a, form)
        grads[form] = [x.grad.clone() for x in inputs]
        result[f"{form}_aten_ops"] = ops
        result[f"{form}_saved_mib"] = round(saved / 2 ** 20, 1)
    times: dict[str, list[float]] = {form: [] for form in FORMS}
    for _ in range(a.repeats):
        for form in FORMS:
            _sync(a.device)
            if a.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            start = time.perf_counter()
            _step(inputs, lengths, a, form)
            _sync(a.device)
            times[form].append(1000 * (time.perf_counter() - start))
            if a.device == "cuda":
                result[f"{form}_peak_mib"] = round(
                    (torch.cuda.max_memory_allocated() - base) / 2 ** 20, 1)
    for form in FORMS:
        result[f"{form}_ms"] = round(statistics.median(times[form]), 1)
    result["max_abs_diff"] = max(
        (outs["serial"] - outs["scan"]).abs().max().item(),
        *((gs - gn).abs().max().item() for gs, gn in zip(grads["serial"], grads["scan"])))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dk", type=int, default=128)
    parser.add_argument("--dv", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = parser.parse_args()
    line = {"bench": "delta_rule", "device": a.device, "threads": torch.get_num_threads(),
            "tokens": a.tokens, "heads": a.heads, "dk": a.dk, "dv": a.dv, "chunk": a.chunk,
            "dtype": "float32"}
    for layout in ("docs", "one"):
        line[layout] = run_layout(a, layout)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
