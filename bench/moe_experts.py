"""MoE expert compute: grouped matmuls (`torch._grouped_mm`) against the loop over experts.

The native Qwen3-MoE (`posttrain.models.moe`) on random weights, with `Experts.impl` set to
"loop" and to "grouped" in turn, alternating, best of `--repeats` each, in this one process (so
the ratio is measured under the same machine load):

* ``experts``: forward + backward of the first MoE layer's experts alone, on `--tokens` tokens
  routed by its router (the code the choice changes);
* ``model``: forward + backward of the whole model over a packed row of `--tokens` tokens
  (documents of 256), where attention, norms and the dense layers take their share.

Two shapes: the tiny test config (hidden 64, 8 experts of width 32, top-2) and a small one
(hidden 256, 16 experts of width 128, top-4).

Run: ``python bench/moe_experts.py [--tokens 2048] [--repeats 5]``. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _model(shape: dict):
    from posttrain.models import args_from_hf_config, build_model
    from posttrain.models.verify import tiny_hf_config
    args = args_from_hf_config(tiny_hf_config("qwen3_moe", **shape).to_dict())
    torch.manual_seed(0)
    model = build_model(args, device="cpu")
    model.init_weights()
    return model


def _experts_s(block, x_NH: torch.Tensor) -> float:
    _, expert, weight = block.route(x_NH)
    t0 = time.perf_counter()
    block.experts(x_NH, expert.detach(), weight.detach()).square().mean().backward()
    block.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _step_s(model, ids: torch.Tensor, docs: list[list[int]]) -> float:
    t0 = time.perf_counter()
    hidden = model(ids, document_lengths=docs)
    hidden.float().square().mean().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    from posttrain.models.moe import Experts, grouped_mm_available
    shapes = {"tiny": {},
              "small": {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "head_dim": 64, "num_experts": 16, "num_experts_per_tok": 4,
                        "moe_intermediate_size": 128}}
    out: dict[str, object] = {"bench": "moe_experts", "tokens": a.tokens,
                              "threads": torch.get_num_threads(),
                              "grouped_available": grouped_mm_available(torch.device("cpu"),
                                                                        torch.float32)}
    for name, shape in shapes.items():
        model = _model(shape)
        ids = torch.randint(0, model.args.vocab_size, (1, a.tokens),
                            generator=torch.Generator().manual_seed(0))
        docs = [[256] * (a.tokens // 256)]
        block = next(m.mlp for m in model.layers if hasattr(m.mlp, "experts"))
        x = torch.randn(a.tokens, model.args.hidden_size,
                        generator=torch.Generator().manual_seed(1))
        cases = {"experts": lambda: _experts_s(block, x),
                 "model": lambda: _step_s(model, ids, docs)}
        out[name] = {}
        for case, run in cases.items():
            best = {"loop": float("inf"), "grouped": float("inf")}
            for _ in range(a.repeats + 1):                 # the first round warms up
                for impl in best:
                    Experts.impl = impl
                    best[impl] = min(best[impl], run())
            Experts.impl = "auto"
            out[name][case] = {"loop_ms": round(best["loop"] * 1e3, 2),
                               "grouped_ms": round(best["grouped"] * 1e3, 2),
                               "speedup": round(best["loop"] / best["grouped"], 3)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
