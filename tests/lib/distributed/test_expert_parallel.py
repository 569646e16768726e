"""Expert parallelism on 4 real gloo processes: experts split over "ep", tokens sent to them and back.

Each layout builds the model the engine's way (meta device, [LoRA,] `parallelize` with
`ParallelConfig(ep=...)`, each rank filling its shards from the full tensors), gives every
data-parallel rank its own row, and must give the single-process numbers within 1e-5 (fp32):
the logits of its row, the loss (cross-entropy plus the load-balancing loss, whose f_e is the
expert group's), and every parameter's full gradient: router, experts (and their adapters),
the rest. Short rows make some experts receive no token from some rank, and GPT-OSS's last
expert, which its router never picks, none at all (asserted, not assumed).

    ep4          dp_shard=4, ep=4    each rank holds E/4 experts; one group of four
    fsdp_x_ep    dp_shard=4, ep=2    two groups of two; FSDP shards experts over "dp_outer"
    ep2_lora     as fsdp_x_ep, with stacked LoRA adapters on the experts (and on q, v)
    replay       as fsdp_x_ep (Qwen3-MoE), every token routed through recorded random experts
                 (routing replay, `posttrain.models.routing_replay`)

What it catches: tokens returned to the wrong rows or regrouped by the wrong expert (logits),
an all-to-all whose backward does not send gradients back (router and input gradients), the
load-balancing counts not all-reduced over "ep" (router gradients: each rank's f_e would be its
own tokens'), expert gradients divided by "dp_outer" instead of every data-parallel rank (every
expert gradient off by ep).

`test_checkpoint_reshards_across_ep` saves a trained ep=2 model and its AdamW state with
`CheckpointManager` and loads it at ep=1 and ep=4: every parameter and moment equal the saved
ones bit for bit, and the next step's loss and weights equal ep=2's within 1e-5 (the expert
groups sum their gradients in another order; the load-balancing loss is left out there, as
its groups, so its objective, change with ep).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from posttrain.distributed import ParallelConfig, build_mesh, parallelize
from posttrain.models.args import ModelArgs
from posttrain.models.families import args_from_hf_config
from posttrain.models.moe import MoEBlock, expert_group, router_logits
from posttrain.models.moe_balance import load_balancing_loss
from posttrain.models.transformer import build_model

from .ranks import (LossAndLogits, assert_layouts_match, compare, full, randomize_adapters,
                    run_on_ranks, token_batch)

WORLD = 4
T = 8
DOCS = [[8], [3, 5], [8], [2, 6]]          # one row per rank
FAMILIES = ["qwen3_moe", "gpt_oss"]
LAYOUTS = {"ep4": dict(dp_shard=4, ep=4), "fsdp_x_ep": dict(dp_shard=4, ep=2),
           "ep2_lora": dict(dp_shard=4, ep=2)}
AUX_COEF = 0.1
ATOL = 1e-5


class LossAuxAndLogits(LossAndLogits):
    """`LossAndLogits` plus `AUX_COEF` x the load-balancing loss. Distributed: each rank's
    expert-group-aware value (`load_balancing_loss(group=...)`). Single process: the mean over
    the expert groups (`groups` equal blocks of rows) of each group's loss."""

    def __init__(self, model: nn.Module, global_tokens: int, ranks: int, groups: int = 1):
        super().__init__(model, global_tokens, ranks)
        self.groups = groups

    def forward(self, ids, labels, docs):
        loss, logits = super().forward(ids, labels, docs)
        k = self.model.args.num_experts_per_tok
        group = expert_group(self.model)
        router = router_logits(self.model)
        if group is not None or self.groups == 1:
            aux = load_balancing_loss(router, k, group=group)
        else:
            B = ids.shape[0]
            blocks = [r.view(B, -1, r.shape[-1]).chunk(self.groups) for r in router]
            aux = sum(load_balancing_loss([b[g].reshape(-1, b[g].shape[-1]) for b in blocks], k)
                      for g in range(self.groups)) / self.groups
        return loss + AUX_COEF * aux, logits


def _args(family: str) -> ModelArgs:
    from posttrain.models.verify import tiny_hf_config
    return args_from_hf_config(tiny_hf_config(family).to_dict())


def _model(family: str, lora: bool, device: str = "cpu") -> nn.Module:
    model = build_model(_args(family), seed=0, device=device)
    if family == "gpt_oss" and device != "meta":
        with torch.no_grad():          # no token chooses the last expert: it gets no rows
            for block in (m for m in model.modules() if isinstance(m, MoEBlock)):
                block.router.bias[-1] = -100.0
    if lora:
        from posttrain.models.lora import LoraConfig, apply_lora
        apply_lora(model, LoraConfig(rank=4, alpha=8.0, targets=(
            "q", "v", "experts.gate", "experts.up", "experts.down")))
        if device != "meta":
            randomize_adapters(model)
    return model


def _sharded(family: str, layout: dict, lora: bool, weights: dict, tokens: int,
             aux: bool = True) -> tuple[nn.Module, nn.Module]:
    from posttrain.distributed.materialize import materialize
    cfg = ParallelConfig(**layout)
    mesh = build_mesh(cfg.dp_shard, cfg.tp, cfg.dp_replicate, cfg.cp)
    model = _model(family, lora, device="meta")
    # each rank's own load-balancing loss: expert-group-aware, or its own tokens' at ep=1
    root_cls = LossAuxAndLogits if aux else LossAndLogits
    root = parallelize(model, mesh, cfg, root=root_cls(model, tokens, WORLD))
    materialize(root, torch.device("cpu"), weights.items(), prefix="model.")
    model.tie_weights()
    return model, root


def _empty_experts(model: nn.Module) -> dict:
    """Whether, in the last forward, some expert got no pair from this rank, and some expert
    no pair from any rank of its group (the counts summed over the group)."""
    from posttrain.models.moe import Experts
    counts = []
    for block in (m for m in model.modules() if isinstance(m, MoEBlock)):
        experts = next(m for m in block.modules() if isinstance(m, Experts))
        counts.append(torch.bincount(block.expert_NK.reshape(-1),
                                     minlength=experts.num_experts))
    local = torch.stack(counts)
    group = expert_group(model)
    total = local.clone()
    dist.all_reduce(total, group=group)
    return {"from_rank": bool((local == 0).any()), "at_all": bool((total == 0).any())}


def _replayed_routing(model: nn.Module) -> torch.Tensor:
    """Random distinct experts [rows, T, MoE layers, k] for every token (routing replay)."""
    gen = torch.Generator().manual_seed(5)
    E, k = model.args.num_experts, model.args.num_experts_per_tok
    layers = sum(isinstance(m, MoEBlock) for m in model.modules())
    picks = [torch.randperm(E, generator=gen)[:k] for _ in range(len(DOCS) * T * layers)]
    return torch.stack(picks).view(len(DOCS), T, layers, k).to(torch.int16)


def _run(family: str, layout: dict, lora: bool, sharded: bool, replay: bool = False) -> dict:
    """The layout's run, or (not `sharded`) the single-process run with its expert groups'
    load-balancing loss; with `replay`, every token routed through recorded random experts."""
    from posttrain.models.routing_replay import set_routing_replay
    model = _model(family, lora)
    ids, labels = token_batch(len(DOCS), T, model.args.vocab_size)
    routing = _replayed_routing(model) if replay else None
    tokens = int((labels >= 0).sum())
    groups = WORLD // layout["ep"]
    if not sharded:
        rows, root = slice(None), LossAuxAndLogits(model, tokens, 1, groups)
    else:
        weights = {n: p.detach() for n, p in model.named_parameters()}
        model, root = _sharded(family, layout, lora, weights, tokens)
        r = dist.get_rank()
        rows = slice(r, r + 1)
    set_routing_replay(model, None if routing is None else routing[rows])
    loss, logits = root(ids[rows], labels[rows], DOCS[rows])
    if routing is not None:          # dispatched to their owners: the recorded experts
        chosen = torch.stack([m.expert_NK for m in model.modules() if isinstance(m, MoEBlock)],
                             dim=1)
        assert torch.equal(chosen, routing[rows].reshape(chosen.shape).long())
    loss.backward()
    loss = loss.detach()
    empty = None
    if sharded:
        loss = loss / WORLD
        dist.all_reduce(loss)
        empty = _empty_experts(model)
    grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    vocab = model.args.vocab_size
    return {"loss": loss.item(), "logits": logits[..., :vocab], "rows": rows,
            "grads": grads, "empty": empty}


def _train_step(root: nn.Module, opt: torch.optim.Optimizer, ids, labels) -> float:
    r = dist.get_rank()
    loss, _ = root(ids[r:r + 1], labels[r:r + 1], DOCS[r:r + 1])
    loss.backward()
    opt.step()
    opt.zero_grad()
    loss = loss.detach() / WORLD
    dist.all_reduce(loss)
    return loss.item()


def _full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        out[name] = full(p.detach()).clone()
        for key, value in opt.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and value.dim():
                out[f"{name}:{key}"] = full(value).clone()
    return out


def _reshard(out_dir: str) -> dict:
    """Train one step at ep=2, save; load at ep=1, 2 (the reference continuation) and 4."""
    from posttrain.train.checkpoint import CheckpointConfig, CheckpointManager
    family = "qwen3_moe"
    model = _model(family, False)
    weights = {n: p.detach() for n, p in model.named_parameters()}
    ids, labels = token_batch(len(DOCS), T, model.args.vocab_size)
    tokens = int((labels >= 0).sum())
    manager = CheckpointManager(CheckpointConfig(dir=os.path.join(out_dir, "ckpt")),
                                rank=dist.get_rank(), world_size=WORLD)
    # without the load-balancing loss, whose groups (so whose objective) change with ep
    model, root = _sharded(family, dict(dp_shard=4, ep=2), False, weights, tokens, aux=False)
    opt = torch.optim.AdamW(root.parameters(), lr=1e-2)
    _train_step(root, opt, ids, labels)
    manager.save(1, root, opt)
    saved = _full_state(model, opt)
    out = {}
    for ep in (1, 2, 4):
        model, root = _sharded(family, dict(dp_shard=4, ep=ep), False, weights, tokens,
                               aux=False)
        opt = torch.optim.AdamW(root.parameters(), lr=1e-2)
        manager.load(root, opt)
        state = _full_state(model, opt)
        mismatched = sorted(k for k in saved if k not in state or not torch.equal(saved[k],
                                                                                 state[k]))
        loss = _train_step(root, opt, ids, labels)
        out[ep] = {"mismatched": mismatched, "keys": len(state), "loss": loss,
                   "weights": {n: full(p.detach()).clone() for n, p in model.named_parameters()}}
    return out


def _all_layouts(out_dir: str) -> dict:
    results = {}
    for family in FAMILIES:
        for name, layout in LAYOUTS.items():
            lora = name.endswith("lora")
            ref = _run(family, layout, lora, sharded=False)
            got = _run(family, layout, lora, sharded=True)
            results[(family, name)] = {**compare(ref, got), "empty": got["empty"]}
    results["replay"] = compare(_run("qwen3_moe", LAYOUTS["fsdp_x_ep"], False, False, True),
                                _run("qwen3_moe", LAYOUTS["fsdp_x_ep"], False, True, True))
    reshard = _reshard(out_dir)
    ref = reshard[2]
    results["reshard"] = {
        ep: {"mismatched": r["mismatched"], "keys": r["keys"], "loss": abs(r["loss"] - ref["loss"]),
             "weights": max((r["weights"][n] - w).abs().max().item()
                            for n, w in ref["weights"].items())}
        for ep, r in reshard.items()}
    return results


@pytest.fixture(scope="module")
def four_rank_results(tmp_path_factory):
    return run_on_ranks(_all_layouts, WORLD, tmp_path_factory.mktemp("ep"))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_ep_layout_gives_the_single_process_numbers(four_rank_results, family, layout):
    assert_layouts_match(four_rank_results, (family, layout), ATOL)
    # the batch exercises empty dispatches: an expert with no pair from some rank, and (GPT-OSS,
    # whose last expert no token chooses) one with no pair from its whole group
    empty = [r[(family, layout)]["empty"] for r in four_rank_results]
    assert any(e["from_rank"] for e in empty), empty
    assert family != "gpt_oss" or all(e["at_all"] for e in empty), empty


def test_replayed_routing_dispatches_to_the_recorded_experts(four_rank_results):
    """Routing replay (`posttrain.models.routing_replay`) under fsdp_x_ep: the recorded experts
    are the ones dispatched to (asserted on every rank), and logits, loss and gradients equal
    the single-process replay's."""
    assert_layouts_match(four_rank_results, "replay", ATOL)


def test_checkpoint_reshards_across_ep(four_rank_results):
    for rank, results in enumerate(four_rank_results):
        for ep, d in results["reshard"].items():
            where = f"ep={ep} rank {rank}: {d}"
            assert d["keys"] > 0 and not d["mismatched"], where
            assert d["loss"] <= ATOL and d["weights"] <= ATOL, where
