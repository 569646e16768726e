"""`parallel.compile`: inductor-compiled blocks that do not recompile for a new packing.

Compiled blocks get masks a new packing does not recompile (`ops.attention.build_mask(...,
tensors_only=True)`, built once per batch by `Transformer.forward`): on the CPU the
per-document attention runs outside the graphs and reads the lengths there, so twenty packed
batches with twenty different document layouts run the graphs compiled for the first, and give
the eager model's numbers.
"""

from __future__ import annotations

import random

import torch

from posttrain.models.args import ModelArgs
from posttrain.models.transformer import build_model

T = 64


def _layouts(n: int, rows: int, seed: int = 0) -> list[list[list[int]]]:
    """`n` batches of `rows` rows of T tokens, each row cut into 1-5 documents at random."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        batch = []
        for _ in range(rows):
            edges = [0, *sorted(rng.sample(range(1, T), rng.randint(0, 4))), T]
            batch.append([e - s for s, e in zip(edges, edges[1:])])
        out.append(batch)
    return out


def _args(**changes) -> ModelArgs:
    base = dict(family="qwen3", vocab_size=250, hidden_size=64, intermediate_size=128,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)
    return ModelArgs(**{**base, **changes})


def test_inductor_blocks_do_not_recompile_over_20_packings():
    # Gemma-style: sliding and full layers alternate, each kind with its own mask
    args = _args(family="gemma3", sliding_window=8, embed_scale=True, norm_offset=True,
                 sandwich_norm=True, layer_types=("sliding_attention", "full_attention"),
                 rope_local_theta=10_000.0, hidden_act="gelu_pytorch_tanh")
    from torch._inductor.compile_fx import compile_fx

    from posttrain.distributed import apply_compile

    torch._dynamo.reset()
    eager = build_model(args, seed=0)
    model = build_model(args, seed=0)
    graphs: list[int] = []

    def inductor_counting(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return compile_fx(gm, example_inputs)

    apply_compile(model, backend=inductor_counting)
    assert model.compiled_blocks and not eager.compiled_blocks
    gen = torch.Generator().manual_seed(0)
    for i, docs in enumerate(_layouts(20, rows=2)):
        ids = torch.randint(0, args.vocab_size, (2, T), generator=gen)
        losses = []
        for m in (model, eager):
            hidden = m(ids, document_lengths=docs)
            loss = hidden.square().mean()
            loss.backward()
            losses.append(loss.detach())
        if i in (0, 19):   # the numbers are the eager model's (split per document)
            torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
            for (name, p), q in zip(model.named_parameters(), eager.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        if i == 0:
            after_first = len(graphs)
    # per distinct block (a sliding and a full layer differ) the parts before and after the
    # per-document attention, which runs outside the graphs on the CPU; never one per packing
    assert 1 <= after_first <= 4 and len(graphs) == after_first, graphs


def test_qwen3_5_blocks_do_not_recompile_for_new_packings():
    """Gated-DeltaNet layers: the delta rule runs outside the compiled graphs (its chunk layout
    follows the documents), the projections, norms and MLP inside; a new packing reuses them."""
    from torch._inductor.compile_fx import compile_fx

    from posttrain.distributed import apply_compile
    from posttrain.models.args import DeltaNetArgs

    args = _args(family="qwen3_5", norm_offset=True, attn_output_gate=True,
                 partial_rotary_factor=0.25, layer_types=("linear_attention", "full_attention"),
                 linear_attention=DeltaNetArgs(num_k_heads=2, num_v_heads=4, head_k_dim=8,
                                               head_v_dim=8, chunk_size=16))
    torch._dynamo.reset()
    eager, model = build_model(args, seed=0), build_model(args, seed=0)
    graphs: list[int] = []

    def inductor_counting(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return compile_fx(gm, example_inputs)

    apply_compile(model, backend=inductor_counting)
    gen = torch.Generator().manual_seed(0)
    compiled_after: dict[int, int] = {}
    for i, docs in enumerate(_layouts(8, rows=2)):
        ids = torch.randint(0, args.vocab_size, (2, T), generator=gen)
        losses = [m(ids, document_lengths=docs).square().mean() for m in (model, eager)]
        compiled_after[i] = len(graphs)
        if i == 7:            # backward once (its graphs compile here), against eager
            torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
            for loss in losses:
                loss.backward()
            for (name, p), q in zip(model.named_parameters(), eager.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    # the first packing compiled every forward graph; seven other packings added none
    assert compiled_after[0] > 0 and compiled_after[7] == compiled_after[0], compiled_after
