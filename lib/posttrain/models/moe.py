"""Sparse mixture-of-experts MLP (Qwen3-MoE, GPT-OSS) and its load-balancing loss.

Module tree of one MoE layer (names are the contract for LoRA, sharding and the HF name maps
of `families/qwen3_moe.py` and `families/gpt_oss.py`):

    layers[i].mlp.router        nn.Linear [num_experts, hidden], bias with `router_bias`
    layers[i].mlp.experts.gate  Parameter [E, I, H]
    layers[i].mlp.experts.up    Parameter [E, I, H]
    layers[i].mlp.experts.down  Parameter [E, H, I]
    layers[i].mlp.experts.{gate,up,down}_bias   [E, I], [E, I], [E, H] with `expert_bias`
    layers[i].mlp.shared.{gate,up,down}  a dense gated MLP every token runs (Qwen3.5-MoE),
                                         with `shared_expert_intermediate_size`
    layers[i].mlp.shared_gate   nn.Linear [1, hidden]: the shared expert's output is scaled by
                                sigmoid(shared_gate(x)) (`shared_expert_gate`)
    layers[i].mlp.e_score_correction_bias   buffer [num_experts] fp32 (DeepSeek-V3's routing)
    layers[i].mlp.router_scale  Parameter [hidden]: with `router_input_scale`
    layers[i].mlp.expert_scale  Parameter [num_experts]: with `router_expert_scale`

Gemma 4 runs this block beside its dense MLP, as `layers[i].moe` (`models/gemma4.py`; the two
scales are its router's).

Routing per token x, by `moe_routing`:

    logits = router(x)                                   (model dtype)
    "softmax_topk" (Qwen3-MoE): p = softmax(logits) in fp32;  w, e = top_k(p);
        w = w / sum(w) if norm_topk_prob;  w cast back to the model dtype
    "topk_softmax" (GPT-OSS): l, e = top_k(logits);  w = softmax(l) in the model dtype
    "sigmoid_group_topk" (DeepSeek-V3, arXiv:2412.19437 §2.1.2): logits in fp32 (the router
        weight and bias held in fp32, as transformers does); s = sigmoid(logits);
        c = s + e_score_correction_bias (for choosing only); the experts form `moe_num_groups`
        equal groups, each scored by the sum of its two largest c; e = top_k of c over the
        `moe_topk_groups` best groups; w = s[e], / sum(w) if norm_topk_prob, times
        `routed_scaling_factor` (w stays fp32, as transformers multiplies)
    y = sum_j w_j * down_{e_j}(glu(gate_{e_j}(x), up_{e_j}(x)))

Gemma 4 (`router_input_scale`, `router_expert_scale`) routes "softmax_topk" on
rms_norm(x) * router_scale * hidden ** -0.5 (a norm without weight), multiplies each chosen
weight by its expert's `expert_scale` and keeps the weights in fp32; its experts read another
input than the router (`MoEBlock.forward(x, expert_x)`: the block's second pre-MLP norm of x).

The gated unit `glu(g, u)` is act(g) * u (`hidden_act`), or with `swiglu_limit` GPT-OSS's
clamped SwiGLU: g = min(g, limit), u = clamp(u, -limit, limit), (u + 1) * g * sigmoid(alpha g).
Expert biases are added per sorted row, gathered by the row's expert id.

Dispatch sorts the (token, expert) pairs by expert and runs every expert over exactly its tokens
(`index_select` in, `index_add` out): an expert with no tokens costs nothing, and the FLOPs are
those of top_k dense MLPs of width I per token. The three projections are grouped matmuls
(`torch._grouped_mm`: one kernel for all experts, the groups given by the tokens' offsets)
where the device and dtype support it, forward and backward (probed once per device and
dtype); elsewhere a loop over the experts, whose stacked weights are `unbind`-ed once per
projection so that the backward writes each expert's gradient into one stacked buffer. Both give
the same numbers within 1e-5 (`tests/lib/models/test_moe.py`); `Experts.impl` forces one. Each
projection goes through `Experts.project`, the hook stacked LoRA adapters override.

Routing replay (`models/routing_replay.py`): with `replay_NK` set, a block uses those recorded
expert ids instead of its own top-k and weighs them from its own router logits (`gate_weights`,
as `route` weighs its own choice), counting the selections where its own choice differs.

Every MoE block keeps its last router logits (`router_logits_NE`, with their graph), from which
`moe_balance.load_balancing_loss` computes the Switch-Transformer auxiliary loss exactly as transformers'
`load_balancing_loss_func` does (GPT-OSS's too: it also pools softmax(logits) over all experts,
router bias included); `moe_aux_loss(model)` scales it by `router_aux_loss_coef`;
`router_z_loss` is ST-MoE's. Sigmoid routing (DeepSeek-V3) balances its own way
(`models/moe_balance.py`: the sequence-wise loss and the score-correction bias's update). The engine adds both to the training loss with the configured
coefficients (`ModelConfig.moe_aux_loss_coef`, `moe_z_loss_coef`; `posttrain.train.engine`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.errors import ConfigError
from posttrain.models.args import ModelArgs
from posttrain.models.layers import FeedForward, rms_norm
from posttrain.ops.compiler import outside_graphs
from posttrain.ops.gated import ACTIVATIONS, gated

__all__ = ["Experts", "MoEBlock", "build_moe", "clamped_swiglu", "expert_group",
           "grouped_mm_available", "grouped_mm_flops", "local_tensor", "router_logits"]

ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid_group_topk")


_GROUPED_OK: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs forward and backward here (probed once, on tiny
    tensors with an empty group): CPU in recent torch; CUDA needs bf16 on sm90+."""
    key = (device.type, dtype)
    if key not in _GROUPED_OK:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                ok = _probe_grouped_mm(device, dtype)
            except (RuntimeError, NotImplementedError):
                ok = False
        _GROUPED_OK[key] = ok
    return _GROUPED_OK[key]


@outside_graphs
def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    # The first MoE forward may run under no_grad or inference_mode, inside an activation-
    # checkpointed block (whose saved-tensor hooks would count the probe's tensors as the
    # block's, and recomputation would then find fewer) or a compiled one: probe outside all
    # of them. No random numbers (the global RNG drives dropout).
    keep = (lambda t: t, lambda t: t)
    with (torch.inference_mode(False), torch.enable_grad(),
          torch.autograd.graph.saved_tensors_hooks(*keep)):
        x = torch.ones(6, 16, device=device, dtype=dtype, requires_grad=True)
        w = torch.ones(3, 16, 16, device=device, dtype=dtype, requires_grad=True)
        offs = torch.tensor([2, 2, 6], device=device, dtype=torch.int32)
        y = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
        y.backward(torch.ones_like(y))
        return w.grad is not None and x.grad is not None


def grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of `torch._grouped_mm(a, b, offs)`, for `FlopCounterMode(custom_mapping=...)`,
    which has no formula for it: every row of `a` meets one group's [k, n] block (or, grouped
    along the inner dim, every product is made once), 2 * numel(a) * n."""
    rows = 1
    for d in a_shape:
        rows *= d
    return 2 * rows * b_shape[-1]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter sharded by expert (a DTensor under expert parallelism)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _gmm(x_NH: torch.Tensor, w_EOH: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Rows of group e of `x_NH` (by `offs_E`, cumulative ends) times w[e]^T."""
    y = torch._grouped_mm(x_NH, w_EOH.transpose(1, 2), offs=offs_E)
    if y.requires_grad:
        # its backward refuses an expanded (stride-0) gradient, e.g. that of a sum
        y.register_hook(lambda g: g.contiguous())
    return y


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float,
                   alpha: float = 1.702) -> torch.Tensor:
    """GPT-OSS's expert unit: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
    g = min(gate, limit)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class Experts(nn.Module):
    """`num_experts` gated MLPs stored as stacked tensors (grouped matmuls, expert sharding).

    The unit is act(gate) * up, or `clamped_swiglu` when `swiglu_limit` is set; `bias` adds
    `gate_bias`, `up_bias` [E, I] and `down_bias` [E, H].
    `impl`: "auto" (grouped matmuls where available, else the loop), "grouped" or "loop".
    """

    impl: str = "auto"
    # expert parallelism (`parallelize.apply_expert_parallel`): (rank, size, group) of the
    # expert group, whose ranks each hold E / size of the experts (the stacked weights are
    # DTensors sharded on dim 0); None runs every expert here
    ep: tuple | None = None

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 hidden_act: str, *, bias: bool = False, swiglu_limit: float | None = None,
                 swiglu_alpha: float = 1.702):
        super().__init__()
        if swiglu_limit is None and hidden_act not in ACTIVATIONS:
            raise ConfigError(f"hidden_act '{hidden_act}' is not supported; "
                              f"use one of {sorted(ACTIVATIONS)}")
        self.hidden_act = hidden_act
        self.swiglu_limit, self.swiglu_alpha = swiglu_limit, swiglu_alpha
        self.num_experts = num_experts
        self.gate = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.up = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        if bias:
            self.gate_bias = nn.Parameter(torch.empty(num_experts, intermediate_size))
            self.up_bias = nn.Parameter(torch.empty(num_experts, intermediate_size))
            self.down_bias = nn.Parameter(torch.empty(num_experts, hidden_size))
        else:
            self.gate_bias = self.up_bias = self.down_bias = None

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        for p in (self.gate, self.up, self.down):
            nn.init.normal_(p, std=std)
        for p in (self.gate_bias, self.up_bias, self.down_bias):
            if p is not None:
                nn.init.zeros_(p)

    def _glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.swiglu_limit is not None:
            return clamped_swiglu(gate, up, self.swiglu_limit, self.swiglu_alpha)
        return gated(gate, up, self.hidden_act)

    def forward(self, x_NH: torch.Tensor, expert_NK: torch.Tensor,
                weight_NK: torch.Tensor) -> torch.Tensor:
        """x [N, H], chosen experts [N, k] and their weights [N, k] -> [N, H]."""
        k = expert_NK.shape[1]
        flat_expert = expert_NK.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)          # pairs grouped by expert
        token_idx = order // k
        counts_E = torch.bincount(flat_expert, minlength=self.num_experts)
        x_sorted = x_NH.index_select(0, token_idx)
        if self.ep is None:
            y_sorted = self.run_sorted(x_sorted, flat_expert[order], counts_E)
        else:            # the owners of the experts run them (`posttrain.ops.expert_parallel`)
            from posttrain.ops.expert_parallel import run_on_owners
            y_sorted = run_on_owners(self.run_sorted, x_sorted, counts_E, self.ep)
        # weights in fp32 (Gemma 4) sum the experts in fp32 and round once, as transformers'
        # grouped experts do; weights in the model dtype keep the sum in it
        y_sorted = y_sorted * weight_NK.reshape(-1)[order, None]
        out = x_NH.new_zeros(x_NH.shape, dtype=y_sorted.dtype).index_add(0, token_idx, y_sorted)
        return out.to(x_NH.dtype)

    def run_sorted(self, x_sorted: torch.Tensor, expert_sorted: torch.Tensor,
                   counts_E: torch.Tensor) -> torch.Tensor:
        """The experts this module holds over rows sorted by expert (`expert_sorted`: each
        row's index among them, `counts_E` rows per expert) -> their outputs, same order."""
        grouped = self.impl == "grouped" or (
            self.impl == "auto" and grouped_mm_available(x_sorted.device, self.gate.dtype))
        groups = torch.cumsum(counts_E, 0).to(torch.int32) if grouped else counts_E.tolist()
        gate, up = self.project("gate", x_sorted, groups), self.project("up", x_sorted, groups)
        if self.gate_bias is not None:          # the three biases come together
            gate = gate + local_tensor(self.gate_bias).index_select(0, expert_sorted)
            up = up + local_tensor(self.up_bias).index_select(0, expert_sorted)
        y_sorted = self.project("down", self._glu(gate, up), groups)
        if self.down_bias is not None:
            y_sorted = y_sorted + local_tensor(self.down_bias).index_select(0, expert_sorted)
        return y_sorted

    def project(self, name: str, x_sorted: torch.Tensor,
                groups: torch.Tensor | list[int]) -> torch.Tensor:
        """The rows of `x_sorted` (sorted by expert) times their expert's `name` weight ("gate",
        "up", "down"). Adapters join the dispatch here (`posttrain.models.lora.LoRAExperts`)."""
        return self.expert_matmul(x_sorted, local_tensor(getattr(self, name)), groups)

    @staticmethod
    def expert_matmul(x_sorted: torch.Tensor, w_EOI: torch.Tensor,
                      groups: torch.Tensor | list[int]) -> torch.Tensor:
        """Row block e of `x_sorted` [N, I] times w[e]^T -> [N, O]. `groups`: the blocks'
        cumulative ends (int32 tensor: one grouped matmul) or their sizes (list: a loop over the
        experts that skips empty blocks)."""
        if isinstance(groups, torch.Tensor):
            return _gmm(x_sorted, w_EOI, groups)
        w_e = w_EOI.unbind(0)
        outs = [F.linear(x_e, w_e[e]) for e, x_e in enumerate(x_sorted.split(groups))
                if x_e.shape[0]]
        return torch.cat(outs) if outs else x_sorted.new_zeros(0, w_EOI.shape[1])

    def extra_repr(self) -> str:
        e, i, h = self.gate.shape
        unit = "act*up" if self.swiglu_limit is None else f"clamped_swiglu({self.swiglu_limit})"
        return (f"num_experts={e}, hidden={h}, intermediate={i}, unit={unit}, "
                f"bias={self.gate_bias is not None}")


def _check_groups(args: ModelArgs) -> None:
    """The group-limited routing's shape: equal groups of >= 2 experts (a group scores by its
    top two), enough experts in the chosen groups for top_k."""
    groups, chosen = args.moe_num_groups, args.moe_topk_groups
    if groups < 1 or args.num_experts % groups or args.num_experts // groups < 2:
        raise ConfigError(f"n_group={groups} must split n_routed_experts={args.num_experts} "
                          "into equal groups of at least 2 experts")
    if not 0 < chosen <= groups or args.num_experts_per_tok > chosen * (args.num_experts
                                                                       // groups):
        raise ConfigError(f"topk_group={chosen} must be in [1, n_group={groups}] and its "
                          f"groups must hold num_experts_per_tok={args.num_experts_per_tok} "
                          "experts")


class MoEBlock(nn.Module):
    """Top-k router + experts; keeps the last router logits (for the auxiliary loss) and the
    experts it chose (for the expert loads)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        if not 0 < args.num_experts_per_tok <= args.num_experts:
            raise ConfigError(f"num_experts_per_tok={args.num_experts_per_tok} must be between 1 "
                              f"and num_experts={args.num_experts}")
        if args.moe_intermediate_size <= 0:
            raise ConfigError("a mixture-of-experts layer needs moe_intermediate_size > 0")
        if args.moe_routing not in ROUTINGS:
            raise ConfigError(f"moe_routing '{args.moe_routing}' is not one of {list(ROUTINGS)}")
        if (args.router_input_scale or args.router_expert_scale) and (
                args.moe_routing != "softmax_topk"):
            raise ConfigError("router_input_scale / router_expert_scale route with "
                              f"'softmax_topk', not '{args.moe_routing}'")
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.routing = args.moe_routing
        self.eps = args.rms_norm_eps
        self.router = nn.Linear(args.hidden_size, args.num_experts, bias=args.router_bias)
        self.router_scale = (nn.Parameter(torch.ones(args.hidden_size))
                             if args.router_input_scale else None)
        self.expert_scale = (nn.Parameter(torch.ones(args.num_experts))
                             if args.router_expert_scale else None)
        self.experts = Experts(args.num_experts, args.hidden_size, args.moe_intermediate_size,
                               args.hidden_act, bias=args.expert_bias,
                               swiglu_limit=args.swiglu_limit, swiglu_alpha=args.swiglu_alpha)
        self.router_logits_NE: torch.Tensor | None = None
        self.expert_NK: torch.Tensor | None = None
        # routing replay (`routing_replay.set_routing_replay`): expert ids [N, k] to use
        # instead of the top-k, -1 rows keep their own; and the last forward's (replayed,
        # mismatched) selections
        self.replay_NK: torch.Tensor | None = None
        self.replay_counts: torch.Tensor | None = None
        # tensors held in fp32 whatever the model's dtype (`Transformer.fp32_names`)
        self.keep_fp32: tuple[str, ...] = ()
        if self.routing == "sigmoid_group_topk":
            _check_groups(args)
            self.num_groups, self.topk_groups = args.moe_num_groups, args.moe_topk_groups
            self.routed_scaling_factor = args.routed_scaling_factor
            # added to the scores for choosing only; moved by `moe_balance.update_score_bias`,
            # not by gradients: a buffer (replicated, checkpointed, exported, synced)
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(args.num_experts, dtype=torch.float32))
            self.keep_fp32 = ("router.weight", "e_score_correction_bias")
        self.shared = self.shared_gate = None
        if args.shared_expert_intermediate_size > 0:
            self.shared = FeedForward(args, intermediate_size=args.shared_expert_intermediate_size)
            if args.shared_expert_gate:
                self.shared_gate = nn.Linear(args.hidden_size, 1, bias=False)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """The router scales and the score-correction bias (the router and experts are
        initialised as modules of their own)."""
        for p in (self.router_scale, self.expert_scale):
            if p is not None:
                nn.init.ones_(p)
        if self.routing == "sigmoid_group_topk":
            self.e_score_correction_bias.zero_()

    def route(self, x_NH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (router logits [N, E], chosen experts [N, k], their weights [N, k])."""
        if self.routing == "sigmoid_group_topk":
            return self._route_sigmoid(x_NH)
        if self.router_scale is not None:
            x_NH = rms_norm(x_NH, self.eps) * self.router_scale * x_NH.shape[-1] ** -0.5
        logits = self.router(x_NH)
        if self.routing == "topk_softmax":
            top, expert = torch.topk(logits, self.top_k, dim=-1)
            return logits, expert, torch.softmax(top, dim=-1, dtype=top.dtype)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weight, expert = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        if self.expert_scale is not None:
            return logits, expert, weight * self.expert_scale[expert]
        return logits, expert, weight.to(logits.dtype)

    def _route_sigmoid(self, x_NH: torch.Tensor,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """DeepSeek-V3 (module docstring): sigmoid scores in fp32, the bias added for choosing
        only, group-limited top-k, weights from the unbiased scores."""
        logits = self.router(x_NH.to(self.router.weight.dtype)).float()
        scores = torch.sigmoid(logits)
        choice = scores + self.e_score_correction_bias
        N, E = choice.shape
        group_NG = choice.view(N, self.num_groups, -1).topk(2, dim=-1).values.sum(-1)
        kept_NG = torch.zeros_like(group_NG).scatter_(
            1, group_NG.topk(self.topk_groups, dim=-1, sorted=False).indices, 1.0)
        kept_NE = kept_NG.bool().repeat_interleave(E // self.num_groups, dim=1)
        expert = choice.masked_fill(~kept_NE, float("-inf")).topk(
            self.top_k, dim=-1, sorted=False).indices
        weight = scores.gather(1, expert)
        if self.norm_topk_prob:
            weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, expert, weight * self.routed_scaling_factor

    def gate_weights(self, logits: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """The weights [N, k] of the experts `expert` [N, k] from the router logits [N, E],
        as `route` weighs the experts it chooses (module docstring, routing replay)."""
        if self.routing == "sigmoid_group_topk":
            weight = torch.sigmoid(logits).gather(1, expert)
            if self.norm_topk_prob:
                weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
            return weight * self.routed_scaling_factor
        if self.routing == "topk_softmax":
            top = logits.gather(1, expert)
            return torch.softmax(top, dim=-1, dtype=top.dtype)
        weight = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, expert)
        if self.norm_topk_prob:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        if self.expert_scale is not None:
            return weight * self.expert_scale[expert]
        return weight.to(logits.dtype)

    def replayed(self, logits: torch.Tensor, own_NK: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts, weights) with the recorded `replay_NK` in place of the own choice
        `own_NK` where recorded; counts the selections replayed and mismatched."""
        replay = self.replay_NK
        if replay.shape != own_NK.shape:
            raise ValueError(f"routing replay: {tuple(replay.shape)} recorded expert ids for "
                             f"{tuple(own_NK.shape)} (tokens x top-k) in this MoE layer")
        replay = replay.to(own_NK.device, own_NK.dtype)
        recorded = replay[:, 0] >= 0
        expert = torch.where(recorded[:, None], replay, own_NK)
        differs = (own_NK.sort(dim=-1).values != expert.sort(dim=-1).values).any(dim=-1)
        self.replay_counts = torch.stack([recorded.sum(), differs.sum()]).detach()
        return expert, self.gate_weights(logits, expert)

    def forward(self, x: torch.Tensor, expert_x: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., H] -> [..., H]. `expert_x`: what the experts read when it is not what the
        router reads (Gemma 4); the shared expert reads x."""
        x_NH = x.reshape(-1, x.shape[-1])
        logits, expert, weight = self.route(x_NH)
        if self.replay_NK is not None:
            expert, weight = self.replayed(logits, expert)
        self.router_logits_NE = logits
        self.expert_NK = expert.detach()
        experts_in = x_NH if expert_x is None else expert_x.reshape(-1, x.shape[-1])
        y = self.experts(experts_in, expert, weight)
        if self.shared is not None:
            shared = self.shared(x_NH)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x_NH)) * shared
            y = y + shared
        return y.view_as(x)


def build_moe(args: ModelArgs, layer_id: int) -> nn.Module:
    """The MoE MLP of layer `layer_id` (called by `transformer.default_mlp_factory`)."""
    assert args.is_moe_layer(layer_id), layer_id
    return MoEBlock(args)


def router_logits(model: nn.Module) -> list[torch.Tensor]:
    """The last forward's router logits [B*T, E] of every MoE block, in layer order."""
    out = []
    for module in model.modules():
        if isinstance(module, MoEBlock):
            if module.router_logits_NE is None:
                raise RuntimeError("MoE router logits are read before any forward pass")
            out.append(module.router_logits_NE)
    return out


def expert_group(model: nn.Module) -> Any:
    """The process group of `model`'s expert parallelism, or None (experts all local)."""
    for module in model.modules():
        if isinstance(module, Experts) and module.ep is not None:
            return module.ep[2]
    return None
