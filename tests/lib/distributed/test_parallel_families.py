"""2-D and 3-D parallelism on the native families, on 4 real gloo processes.

For every native family (tiny random configs of `posttrain.models.verify`), each layout below
builds the model the engine's way (meta device, LoRA, parallelize, each rank filling its
shards from the full tensors) and runs one SFT forward and backward over packed rows (document masks, sliding windows where the
family has them) and must give the single-process numbers: each rank's logits of its rows, the
loss, and every parameter's full gradient, within 1e-5 in fp32.

    fsdp x tp      dp_shard=2 x tp=2            FSDP2 over TP (`tp_plan` per family)
    fsdp x tp+lora dp_shard=2 x tp=2, LoRA      adapters split with their base weights
    hsdp           dp_replicate=2 x dp_shard=2  sharded in pairs, replicated across them
    hsdp x tp      dp_replicate=2 x tp=2        replicas of a tensor-parallel model
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

from .ranks import (LossAndLogits, assert_layouts_match, compare, full, randomize_adapters,
                    run_on_ranks, token_batch)

WORLD = 4
T = 16
# 4 packed rows; the data-parallel ranks take contiguous slices of them
DOCS = [[5, 11], [16], [3, 7, 6], [9, 7]]
FAMILIES = ["qwen3", "llama", "gemma3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "gemma4",
            "deepseek_v3"]
LAYOUTS = {
    "fsdp_x_tp": dict(dp_shard=2, tp=2),
    "fsdp_x_tp_lora": dict(dp_shard=2, tp=2),
    "hsdp": dict(dp_replicate=2, dp_shard=2),
    "hsdp_x_tp": dict(dp_replicate=2, dp_shard=1, tp=2),
}
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# MLA's projections: the replicated latent ones, the head-split ones, and the output
MLA_LORA_TARGETS = ("q_a", "q_b", "kv_a", "kv_b", "o", "gate", "up", "down")
ATOL = 1e-5


def _families() -> list[str]:
    from posttrain.models import verify
    return [f for f in FAMILIES + ["gpt_oss"] if f in verify._TINY]


def _args(family: str) -> ModelArgs:
    from posttrain.models.verify import tiny_hf_config
    return args_from_hf_config(tiny_hf_config(family).to_dict())


def _model(family: str, lora: bool, device: str = "cpu") -> nn.Module:
    """The seeded model (with LoRA, B random too); on "meta" the same modules without storage."""
    args = _args(family)
    model = build_model(args, seed=0, device=device)
    if device != "meta":
        with torch.no_grad():       # DeepSeek-V3's router bias: non-zero, so routing reads it
            for _, b in model.named_buffers():
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(3)) * 0.1)
    if lora:
        targets = (MLA_LORA_TARGETS if args.latent_attention is not None
                   else LORA_TARGETS if args.num_experts == 0 else ("q", "k", "v", "o"))
        from posttrain.models.lora import LoraConfig, apply_lora
        apply_lora(model, LoraConfig(rank=4, alpha=8.0, targets=targets))
        if device != "meta":
            randomize_adapters(model)     # B != 0: both adapter factors get gradients
    return model


def _run(family: str, layout: dict | None, lora: bool) -> dict:
    """Loss, this rank's rows' logits and all full gradients (None layout: one process).

    A layout builds the model as the engine does: on the meta device, LoRA, `parallelize`,
    then every rank keeps its shard of each full tensor (`materialize`)."""
    model = _model(family, lora)
    ids, labels = token_batch(len(DOCS), T, model.args.vocab_size)
    tokens = int((labels >= 0).sum())
    if layout is None:
        rows, root = slice(None), LossAndLogits(model, tokens, 1)
    else:
        from posttrain.distributed.materialize import materialize
        cfg = ParallelConfig(**layout)
        mesh = build_mesh(cfg.dp_shard, cfg.tp, cfg.dp_replicate)
        dp = dp_mesh(mesh)
        per = len(DOCS) // dp.size()
        rows = slice(dp.get_local_rank() * per, (dp.get_local_rank() + 1) * per)
        weights = {n: p.detach() for n, p in model.state_dict(keep_vars=True).items()}
        model = _model(family, lora, device="meta")
        root = parallelize(model, mesh, cfg, root=LossAndLogits(model, tokens, dp.size()))
        materialize(root, torch.device("cpu"), weights.items(), prefix="model.")
        model.tie_weights()
    loss, logits = root(ids[rows], labels[rows], DOCS[rows])
    loss.backward()
    loss = loss.detach() / (1 if layout is None else root.ranks)
    if layout is not None:
        dist.all_reduce(loss)   # sum of the ranks' shares of the global mean (x tp)
        loss /= ParallelConfig(**layout).tp
    grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    vocab = model.args.vocab_size    # columns past it are padding (-inf)
    return {"loss": loss.item(), "logits": logits[..., :vocab], "rows": rows, "grads": grads}


def _all_layouts(out_dir: str) -> dict:
    results = {}
    for family in _families():
        refs = {lora: _run(family, None, lora) for lora in (False, True)}
        for name, layout in LAYOUTS.items():
            lora = name.endswith("lora")
            results[(family, name)] = compare(refs[lora], _run(family, layout, lora))
    return results


@pytest.fixture(scope="module")
def four_rank_results(tmp_path_factory):
    return run_on_ranks(_all_layouts, WORLD, tmp_path_factory.mktemp("families"))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", _families())
def test_layout_gives_the_single_process_logits_loss_and_gradients(four_rank_results, family,
                                                                   layout):
    assert_layouts_match(four_rank_results, (family, layout), ATOL)
