"""Context parallelism on 4 real gloo processes: rows cut over "cp", attention exact across the cut.

Each layout builds the model the engine's way (meta device, [LoRA,] `parallelize` with the
cp mesh, each rank filling its shards from the full tensors), gives every rank its rows' tokens
of its two chunks (`CPShard.local`) and the whole rows' document lengths, and must give the
single-process numbers: each rank's logits at its positions, the loss, and every parameter's
full gradient, within 1e-5 in fp32. The packed rows have documents that cross chunk and rank
boundaries, windows shorter than a document (Gemma 3, GPT-OSS) and sinks (GPT-OSS).

    cp4           cp=4                     one row's four quarters on four ranks
    fsdp_x_cp     dp_shard=2 x cp=2        FSDP over dp_shard x cp; the two dp ranks see other rows
    cp_x_tp       cp=2 x tp=2              heads split over tp, tokens over cp
    fsdp_x_cp_lora                          LoRA adapters, as fsdp_x_cp
    replay        as fsdp_x_cp (GPT-OSS), every token routed through recorded random experts
                  (routing replay: the record is cut over "cp" like the tokens)

What it catches: a mask that ignores documents or windows across the cut (logits differ at the
first document that spans two chunks), positions not cut like the tokens (RoPE), a K/V gather
whose backward does not sum the group's uses (key/value projection gradients), gradients not
reduced over the cp ranks (every gradient off by a factor).
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from torch import nn

from posttrain.distributed import ParallelConfig, build_mesh, parallelize
from posttrain.distributed.env import dp_mesh
from posttrain.models.args import ModelArgs
from posttrain.models.families import args_from_hf_config
from posttrain.models.transformer import build_model
from posttrain.ops.context_parallel import CPShard

from .ranks import (LossAndLogits, assert_layouts_match, compare, full, randomize_adapters,
                    run_on_ranks, token_batch)

WORLD = 4
T = 32
# 4 packed rows: documents crossing the chunk boundaries (chunks of 4 at cp=4, 8 at cp=2)
DOCS = [[5, 13, 14], [32], [3, 7, 6, 16], [20, 12]]
FAMILIES = ["qwen3", "llama", "gemma3", "gpt_oss"]
LAYOUTS = {
    "cp4": dict(dp_shard=1, cp=4),
    "fsdp_x_cp": dict(dp_shard=2, cp=2),
    "cp_x_tp": dict(dp_shard=1, cp=2, tp=2),
    "fsdp_x_cp_lora": dict(dp_shard=2, cp=2),
}
ATOL = 1e-5


def _args(family: str) -> ModelArgs:
    from posttrain.models.verify import tiny_hf_config
    return args_from_hf_config(tiny_hf_config(family).to_dict())


def _model(family: str, lora: bool, device: str = "cpu") -> nn.Module:
    model = build_model(_args(family), seed=0, device=device)
    if lora:
        from posttrain.models.lora import LoraConfig, apply_lora
        apply_lora(model, LoraConfig(rank=4, alpha=8.0, targets=("q", "k", "v", "o")))
        if device != "meta":
            randomize_adapters(model)
    return model


def _replayed_routing(model: nn.Module) -> torch.Tensor:
    """Random distinct experts [rows, T, MoE layers, k] for every token (routing replay)."""
    from posttrain.models.routing_replay import moe_blocks
    gen = torch.Generator().manual_seed(5)
    E, k = model.args.num_experts, model.args.num_experts_per_tok
    picks = [torch.randperm(E, generator=gen)[:k]
             for _ in range(len(DOCS) * T * len(moe_blocks(model)))]
    return torch.stack(picks).view(len(DOCS), T, -1, k).to(torch.int16)


def _run(family: str, layout: dict | None, lora: bool, replay: bool = False) -> dict:
    """With `replay`, every token routed through recorded random experts, the record cut over
    "cp" like the tokens (as the GRPO root's `row_keys` are)."""
    from posttrain.models.routing_replay import moe_blocks, set_routing_replay
    model = _model(family, lora)
    ids, labels = token_batch(len(DOCS), T, model.args.vocab_size)
    routing = _replayed_routing(model) if replay else None
    tokens = int((labels >= 0).sum())
    positions = torch.arange(T)
    if layout is None:
        rows, root = slice(None), LossAndLogits(model, tokens, 1)
        ids_r, labels_r = ids, labels
    else:
        from posttrain.distributed.materialize import materialize
        cfg = ParallelConfig(**layout)
        mesh = build_mesh(cfg.dp_shard, cfg.tp, cfg.dp_replicate, cfg.cp)
        dp = dp_mesh(mesh)
        per = len(DOCS) // dp.size()
        rows = slice(dp.get_local_rank() * per, (dp.get_local_rank() + 1) * per)
        weights = {n: p.detach() for n, p in model.named_parameters()}
        model = _model(family, lora, device="meta")
        root = parallelize(model, mesh, cfg, root=LossAndLogits(model, tokens,
                                                                 dp.size() * cfg.cp))
        materialize(root, torch.device("cpu"), weights.items(), prefix="model.")
        model.tie_weights()
        shard = CPShard(mesh["cp"].get_local_rank(), cfg.cp, T)
        ids_r, labels_r = shard.local(ids[rows]), shard.local(labels[rows])
        positions = shard.positions()
        routing = None if routing is None else shard.local(routing[rows])
    set_routing_replay(model, routing)
    loss, logits = root(ids_r, labels_r, DOCS[rows])
    if routing is not None:           # each rank's tokens went through their recorded experts
        chosen = torch.stack([b.expert_NK for b in moe_blocks(model)], dim=1)
        assert torch.equal(chosen, routing.reshape(chosen.shape).long())
    loss.backward()
    loss = loss.detach()
    if layout is not None:
        cfg = ParallelConfig(**layout)
        loss = loss / (dp.size() * cfg.cp)
        dist.all_reduce(loss)
        loss /= cfg.tp
    grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    vocab = model.args.vocab_size
    return {"loss": loss.item(), "logits": logits[..., :vocab], "rows": rows,
            "positions": positions, "grads": grads}


def _all_layouts(out_dir: str) -> dict:
    results = {}
    for family in FAMILIES:
        refs = {lora: _run(family, None, lora) for lora in (False, True)}
        for name, layout in LAYOUTS.items():
            lora = name.endswith("lora")
            results[(family, name)] = compare(refs[lora], _run(family, layout, lora))
    replay = LAYOUTS["fsdp_x_cp"]
    results["replay"] = compare(_run("gpt_oss", None, False, replay=True),
                                _run("gpt_oss", replay, False, replay=True))
    return results


@pytest.fixture(scope="module")
def four_rank_results(tmp_path_factory):
    return run_on_ranks(_all_layouts, WORLD, tmp_path_factory.mktemp("cp"))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_cp_layout_gives_the_single_process_numbers(four_rank_results, family, layout):
    assert_layouts_match(four_rank_results, (family, layout), ATOL)


def test_replayed_routing_is_cut_with_the_tokens(four_rank_results):
    """Routing replay under fsdp_x_cp (GPT-OSS): each rank's tokens go through their recorded
    experts (asserted on every rank), and the numbers equal the single-process replay's."""
    assert_layouts_match(four_rank_results, "replay", ATOL)


def test_split_is_balanced_and_covers_every_token():
    shards = [CPShard(r, 4, 32) for r in range(4)]
    held = torch.cat([s.positions() for s in shards])
    assert sorted(held.tolist()) == list(range(32))
    # every rank holds one early and one late chunk: the same causal work per rank
    work = [int((s.positions() + 1).sum()) for s in shards]
    assert len(set(work)) == 1
    with pytest.raises(ValueError, match="multiple of 8"):
        CPShard(0, 4, 36)
