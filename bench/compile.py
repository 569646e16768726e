"""`parallel.compile` on the CPU: inductor-compiled blocks against the eager model.

A native Qwen3-shaped model on random weights (`--hidden`, `--layers`), forward + backward of
one packed batch (`--rows` rows of `--tokens` tokens, each row cut into documents of random
lengths, a new layout every step), eager and compiled alternating step by step in this one
process, so the ratio is measured under the same machine load. Eager runs the per-document
`split` attention; compiled blocks get the batch's mask as a tensor (`ops.attention.build_mask(
tensors_only=True)`), which is what keeps them from recompiling for every new packing: the
number of graphs compiled over the whole run is reported.

Run: ``python bench/compile.py [--tokens 512] [--steps 10]``. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch


def _layout(rng: random.Random, rows: int, tokens: int) -> list[list[int]]:
    out = []
    for _ in range(rows):
        edges = [0, *sorted(rng.sample(range(1, tokens), rng.randint(1, 6))), tokens]
        out.append([e - s for s, e in zip(edges, edges[1:])])
    return out


def _step_s(model, ids: torch.Tensor, docs: list[list[int]]) -> float:
    t0 = time.perf_counter()
    model(ids, document_lengths=docs).square().mean().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    from torch._inductor.compile_fx import compile_fx

    from posttrain.distributed import apply_compile
    from posttrain.models.args import ModelArgs
    from posttrain.models.transformer import build_model

    heads = a.hidden // 64
    args = ModelArgs(family="qwen3", vocab_size=1000, hidden_size=a.hidden,
                     intermediate_size=3 * a.hidden, num_layers=a.layers, num_heads=heads,
                     num_kv_heads=max(1, heads // 2), head_dim=64, qk_norm=True)
    eager = build_model(args, seed=0)
    compiled = build_model(args, seed=0)
    graphs: list[int] = []

    def inductor(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return compile_fx(gm, example_inputs)

    apply_compile(compiled, backend=inductor)
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    _step_s(compiled, torch.randint(0, 1000, (a.rows, a.tokens), generator=gen),
            _layout(rng, a.rows, a.tokens))
    compile_s = time.perf_counter() - t0
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(a.steps):
        ids = torch.randint(0, 1000, (a.rows, a.tokens), generator=gen)
        docs = _layout(rng, a.rows, a.tokens)
        times["eager"].append(_step_s(eager, ids, docs))
        times["compiled"].append(_step_s(compiled, ids, docs))
    best = {k: min(v) for k, v in times.items()}
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(json.dumps({
        "bench": "compile_cpu", "torch": torch.__version__, "threads": torch.get_num_threads(),
        "shape": {"hidden": a.hidden, "layers": a.layers, "rows": a.rows, "tokens": a.tokens},
        "steps": a.steps, "first_step_with_compile_s": round(compile_s, 2),
        "graphs_compiled": len(graphs), "new_layout_every_step": True,
        "eager_step_s": {"best": round(best["eager"], 4), "median": round(med["eager"], 4)},
        "compiled_step_s": {"best": round(best["compiled"], 4),
                            "median": round(med["compiled"], 4)},
        "speedup_median": round(med["eager"] / med["compiled"], 3),
        "tokens_per_s": {k: round(a.rows * a.tokens / med[k], 1) for k in med},
    }))


if __name__ == "__main__":
    main()
