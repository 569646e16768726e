"""The per-rank training engine shared by every recipe (SFT, DPO, reward, distillation, GRPO).

One `Engine` lives in each trainer process (a Ray actor, a spawned process, or inline). It
builds the model the sharded way, owns the optimizer, scheduler and checkpoints, and runs one
optimizer step over the micro-batches it is given:

    build:  meta model (HF config) -> LoRA -> parallelize (TP, AC, compile, FSDP2) over the
            loss module -> to_empty -> stream the HF tensors, each rank keeping its shard
            (`posttrain.train.build`)
    step:   for each micro-batch: loss_sum(batch) * dp_size / N_global -> backward
            clip grad norm -> optimizer.step -> scheduler.step -> zero_grad

`N_global` is the number of loss units in the whole step across data-parallel ranks (loss
tokens for SFT, pairs for DPO and reward models), so the gradient is the one of a single big
batch however the step is split (FSDP averages gradients over the data-parallel ranks, hence the
`* dp_size`).

Data goes by *data-parallel* rank (`Engine.dp`, `posttrain.distributed.data_parallel`): the
ranks of one tensor-parallel group hold different slices of the same weights, so they must see
the same micro-batches; a step's micro-batches are dealt out over the "dp" dim of the mesh
(`dp.share`), and sums over the data (losses, stats, eval) are taken over that dim only
(`dp.sum`). With `tp=1` the data-parallel rank is the global rank.

The loss module (the FSDP root, made by `loss_factory`) is called with the batch fields named
in its `input_keys`, in that order (default: those of `CausalLMLoss`), and returns the loss
*sum* over its units, or ``(loss_sum, stats)`` with `stats` detached per-batch sums (e.g.
correct pairs) that the engine adds up over micro-batches and ranks and reports divided by
`N_global`. The engine never sees a data loader: the recipe's worker decides which
micro-batches this rank gets, so the data rule lives in one place.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from posttrain.config.model import LoraSettings, ModelConfig, ModelInitConfig
from posttrain.config.train import EngineConfig
from posttrain.distributed.data_parallel import DataParallel, all_reduce_max, all_reduce_sum
from posttrain.distributed.env import build_mesh, get_device
from posttrain.distributed.parallelize import count_params
from posttrain.errors import ConfigError
from posttrain.models.args import ModelArgs
from posttrain.models.random_init import write_random_hf_model
from posttrain.models.transformer import Transformer
from posttrain.train.build import build_sharded
from posttrain.train.checkpoint import CheckpointConfig, CheckpointManager
from posttrain.train.host_heap import HostHeap, release_after_blocks
from posttrain.train.optim import build_optimizer, build_scheduler

__all__ = ["all_reduce_max", "all_reduce_sum", "build_sharded", "CausalLMLoss", "DataParallel",
           "Engine", "EngineConfig", "LoraSettings", "ModelConfig", "ModelInitConfig",
           "write_random_hf_model"]

log = logging.getLogger(__name__)


class CausalLMLoss(nn.Module):
    """The FSDP root: its forward runs the model and the chunked loss (sum over targets).

    The LM head weight is read directly by the chunked loss, so under FSDP2 the loss must be
    computed inside the root's forward, where the root's parameters are gathered.
    """

    input_keys = ("input_ids", "labels", "position_ids", "document_lengths")
    # the per-token fields of the packed rows [B, T]: context parallelism cuts these
    row_keys = ("input_ids", "labels", "position_ids")

    def __init__(self, model: Transformer, chunk_tokens: int = 1024):
        super().__init__()
        self.model = model
        self.chunk_tokens = chunk_tokens

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                position_ids: torch.Tensor | None = None,
                document_lengths: list[list[int]] | None = None) -> torch.Tensor:
        from posttrain.losses.sft import sft_loss_sum
        hidden = self.model(input_ids, position_ids, document_lengths)
        head = self.model.head
        return sft_loss_sum(hidden, head.weight, labels, real_vocab_size=head.real_vocab_size,
                            chunk_tokens=self.chunk_tokens, softcap=getattr(head, "softcap", None))


def _lora_module():
    from posttrain.models import lora
    return lora


def _moe_balance():
    from posttrain.models import moe_balance
    return moe_balance


class Engine:
    """Model + optimizer + scheduler + checkpoints of one rank (see the module docstring).

    The caller joins the process group first (`posttrain.distributed.env.init_process_group`)
    and seeds the global RNG if anything random runs in training (LoRA dropout); the engine
    does neither. The global RNG state is saved in and restored from its checkpoints.
    """

    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig, hf_dir: str, run_dir: str,
                 *, loss_factory: Callable[[Transformer], nn.Module] | None = None,
                 vocab_size: int | None = None, added_tokens: Sequence[int] = (),
                 host_budget: int | None = None):
        # `host_budget`: on a CPU, the bytes this rank may keep resident before its heap gives
        # freed pages back (`posttrain.train.host_heap.HostHeap`; None: at every phase)
        # `added_tokens`: the ids the tokenizer added (`tokenizer_added_ids`); with LoRA,
        # `model_cfg.lora.trainable_tokens` resolves to ids here (the export reads them back)
        if model_cfg.lora is not None:
            model_cfg = replace(model_cfg, lora=replace(
                model_cfg.lora, trainable_tokens=model_cfg.lora.token_ids(added_tokens)))
        self.model_cfg, self.cfg = model_cfg, cfg
        self.vocab_size = vocab_size
        self.hf_dir, self.run_dir = hf_dir, run_dir
        if not dist.is_initialized():
            # one code path for every layout: a plain process joins a group of one, so FSDP2
            # (mixed precision, sharded checkpoints) and the same numerics apply inline too;
            # joining is the caller's act, not a side effect of building an engine
            raise RuntimeError("Engine needs a process group: call posttrain.distributed.env."
                               "init_process_group() first (a plain process joins a group of "
                               "one)")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = get_device()
        # on a CPU, freed transients leave the heap after each block and phase (`host_heap`)
        self.heap = (HostHeap(host_budget) if cfg.parallel.release_host_heap
                     and self.device.type == "cpu" else None)
        self.mesh = build_mesh(cfg.parallel.dp_shard, cfg.parallel.tp,
                               cfg.parallel.dp_replicate, cfg.parallel.cp)
        self.dp = DataParallel.of_mesh(self.mesh)
        # context parallelism: the ranks of a "cp" group see the same micro-batches and each
        # runs its share of every row's tokens (`posttrain.ops.context_parallel`)
        self.cp_size = cfg.parallel.cp
        self.cp_group = self.mesh["cp"].get_group() if self.cp_size > 1 else None
        self.cp_rank = self.mesh["cp"].get_local_rank() if self.cp_size > 1 else 0
        self.model, self.root = build_sharded(
            model_cfg, cfg.parallel, hf_dir, self.device,
            loss_factory or (lambda m: CausalLMLoss(m, model_cfg.loss_chunk_tokens)),
            vocab_size=vocab_size, init_missing=self._init_missing, mesh=self.mesh,
            added_tokens=added_tokens)
        # None for a transformers model (no native definition): see `posttrain.train.fallback_build`
        self.args: ModelArgs | None = getattr(self.model, "args", None)
        if self.heap is not None:
            release_after_blocks(self.model, self.heap.phase_done)
        self.optimizer = build_optimizer(self.root, cfg.optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg.max_steps, cfg.scheduler)
        self.checkpoints = CheckpointManager(
            CheckpointConfig(dir=f"{run_dir.rstrip('/')}/checkpoints",
                             every_steps=cfg.checkpoint_every_steps,
                             keep_last=cfg.keep_checkpoints),
            rank=self.rank, world_size=self.world)
        self.step = 0
        self.num_params = count_params(self.model)
        self.num_trainable = count_params(self.model, trainable_only=True)
        # (load-balancing, z-loss) coefficients of an MoE model's router losses; () otherwise
        moe = self.args is not None and self.args.num_experts > 0
        aux = (self.args.router_aux_loss_coef if model_cfg.moe_aux_loss_coef is None
               else model_cfg.moe_aux_loss_coef) if moe else 0.0
        self.router_coefs: tuple[float, float] = ((aux, model_cfg.moe_z_loss_coef)
                                                  if moe and (aux or model_cfg.moe_z_loss_coef)
                                                  else ())
        self.bias_update_speed = model_cfg.moe_bias_update_speed
        # expert parallelism: the group whose tokens the load-balancing loss's f_e covers
        self.expert_group = None
        if moe:
            from posttrain.models.moe import expert_group
            self.expert_group = expert_group(self.model)
        if self.bias_update_speed and not _moe_balance().score_bias_blocks(self.model):
            raise ConfigError("model.moe_bias_update_speed: this model's routers have no "
                              "score-correction bias (DeepSeek-V3's e_score_correction_bias); "
                              "set it to 0")
        self._expert_loads: torch.Tensor | None = None   # this step's, summed over micro-batches
        if self.cp_size > 1 and (self.router_coefs or self.bias_update_speed):
            raise ConfigError("parallel.cp > 1 with MoE router losses or bias balancing: the "
                              "router statistics would be taken over each rank's share of "
                              "the tokens; set model.moe_aux_loss_coef and moe_z_loss_coef to "
                              "0 (and moe_bias_update_speed), or parallel.cp=1")

    # ------------------------------------------------------------------ build
    def _init_missing(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """Deterministic init of parameters the checkpoint lacks (LoRA adapters, custom head)."""
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + _stable_hash(name))
        # a custom head replacing the LM head (a reward model's), or heads beside it (the
        # sequence recipe's per-position heads, `posttrain.models.heads`)
        if name.startswith(("head.", "heads.")):
            if name.endswith(".bias"):
                return torch.zeros(param.shape)
            return torch.randn(tuple(param.shape), generator=gen) / math.sqrt(param.shape[-1])
        return _lora_module().adapter_init_tensor(name, tuple(param.shape), gen)

    # ------------------------------------------------------------------ train
    def train_step(self, micro_batches: list[dict], global_loss_tokens: int) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches; returns global metrics.

        `micro_batches` are this rank's share (`self.dp.share`) of the step's; the ranks of a
        tensor-parallel group get the same. `global_loss_tokens` is N_global, the step's loss
        units over all data-parallel ranks (module doc).
        """
        t0 = time.perf_counter()
        local_loss, local_stats, router = self.accumulate_gradients(micro_batches,
                                                                    global_loss_tokens)
        grad_norm = self._clip()
        self.optimizer.step()
        self._phase_done()
        if self.heap is not None and not self.heap.settled:
            self._settle_heap()
        balance = self._update_score_bias() if self.bias_update_speed else {}
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        loss_total = self.dp.sum(local_loss)
        stats = {k: self.dp.sum(v) / max(global_loss_tokens, 1)
                 for k, v in sorted(local_stats.items())}
        # the MoE router losses: means over the step's micro-batches (unweighted)
        stats.update({k: self.dp.sum(v) / (len(micro_batches) * self.dp.size)
                      for k, v in sorted(router.items())})
        return {"step": self.step, "loss": loss_total / max(global_loss_tokens, 1), **stats,
                **balance, "grad_norm": grad_norm, "lr": lr,
                "step_time_s": time.perf_counter() - t0}

    def _phase_done(self) -> None:
        """A phase of the step (forward, backward, optimizer step) freed its transients."""
        if self.heap is not None:
            self.heap.phase_done()

    def _settle_heap(self) -> None:
        """The first optimizer step has shown how much a step grows between release points."""
        heap = self.heap
        heap.settle()
        if self.rank == 0 and heap.budget is not None:
            log.info("host heap: freed pages stay for reuse while resident memory + %.2f GiB "
                     "(the most it grew between two release points) fits the planned peak "
                     "of %.2f GiB; released at %d points of the first step",
                     heap.growth / 2**30, heap.budget / 2**30, heap.released)

    def _update_score_bias(self) -> dict[str, float]:
        """Auxiliary-loss-free balancing after the optimizer step: the step's expert loads,
        summed over the data-parallel ranks (the ranks of a tensor-parallel group saw the same
        tokens), move every router's score-correction bias; returns the loads' max violation
        before the update."""
        balance = _moe_balance()
        loads, self._expert_loads = self._expert_loads, None
        if loads is None:          # only dummy micro-batches here: no tokens, same collective
            blocks = balance.score_bias_blocks(self.model)
            loads = torch.zeros(len(blocks), blocks[0].e_score_correction_bias.shape[0],
                                dtype=torch.float64, device=self.device)
        if self.dp.group is not None:
            dist.all_reduce(loads, group=self.dp.group)
        balance.update_score_bias(self.model, loads, self.bias_update_speed)
        return {"moe/max_violation": balance.max_load_violation(loads)}

    def accumulate_gradients(self, micro_batches: list[dict], global_loss_tokens: int
                             ) -> tuple[float, dict[str, float], dict[str, float]]:
        """Forward and backward over this rank's micro-batches: the gradient of the step's
        loss (module doc), plus for MoE models coef x the router losses of each micro-batch
        averaged over the step's micro-batches. Returns the local loss sum, the loss root's
        stats sums and the router losses' sums (unscaled, over this rank's micro-batches)."""
        self.root.train()
        # summed on the device in float64 and read once per step (`_host_sums`), not synced
        # to the host after every micro-batch; the same float64 sums as on the host
        local_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        local_stats: dict[str, torch.Tensor] = {}
        router: dict[str, torch.Tensor] = {}
        # FSDP averages gradients over its shard ranks: the data-parallel ones x the cp ones
        scale = self.dp.size * self.cp_size / max(global_loss_tokens, 1)
        self._phase_done()
        for batch in micro_batches:
            loss_sum, stats = self._forward(batch)
            self._phase_done()
            if self.bias_update_speed and batch.get("live", True):
                loads = _moe_balance().expert_loads(self.model, _real_token_mask(batch))
                self._expert_loads = (loads if self._expert_loads is None
                                      else self._expert_loads + loads)
            objective = loss_sum * scale
            if self.router_coefs:
                # FSDP averages gradients over the D ranks; each holds 1/D of the G
                # micro-batches, so 1 / (its count) gives the mean over all G
                terms = self._router_losses(batch)
                for k, (coef, value) in terms.items():
                    objective = objective + value * (coef / len(micro_batches))
                    router[k] = router.get(k, 0.0) + _as_float64(value, self.device)
            objective.backward()
            self._phase_done()
            local_loss += _as_float64(loss_sum, self.device)
            for k, v in stats.items():
                local_stats[k] = local_stats.get(k, 0.0) + _as_float64(v, self.device)
        if not micro_batches:
            self._zero_contribution()
        loss, stats_sums, router_sums = _host_sums(local_loss, local_stats, router)
        if self.cp_group is not None:      # each cp rank summed its share of the rows' tokens
            loss = self._cp_sum({"loss": loss})["loss"]
            stats_sums = self._cp_sum(stats_sums)
        return loss, stats_sums, router_sums

    def _cp_sum(self, values: dict[str, float]) -> dict[str, float]:
        """Sums over this rank's tokens added up over its "cp" group (each micro-batch's rows
        counted once, as without context parallelism)."""
        if self.cp_group is None or not values:
            return dict(values)
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
        dist.all_reduce(t, group=self.cp_group)
        return dict(zip(keys, t.tolist()))

    def cp_shard(self, seq_len: int) -> Any:
        """This rank's `CPShard` of rows of `seq_len` tokens (None without context parallelism)."""
        if self.cp_group is None:
            return None
        from posttrain.ops.context_parallel import CPShard
        return CPShard(self.cp_rank, self.cp_size, seq_len, self.cp_group)

    def _router_losses(self, batch: dict) -> dict[str, tuple[float, torch.Tensor]]:
        """{metric: (coefficient, value)} of the router losses of the last forward, padding
        left out."""
        from posttrain.models.moe import MoEBlock, router_logits
        from posttrain.models.moe_balance import (load_balancing_loss, router_z_loss,
                                                  sequence_balance_loss)
        logits = router_logits(self.model)
        mask = _real_token_mask(batch)
        aux_coef, z_coef = self.router_coefs
        out = {}
        if aux_coef and self.args.moe_routing == "sigmoid_group_topk":
            # DeepSeek-V3: the paper's sequence-wise balance loss over each row's documents
            experts = [m.expert_NK for m in self.model.modules() if isinstance(m, MoEBlock)]
            rows, seq_len = batch["input_ids"].shape
            lengths = batch.get("document_lengths") or [[seq_len]] * rows
            out["moe/aux_loss"] = (aux_coef, sequence_balance_loss(logits, experts, lengths,
                                                                   mask))
        elif aux_coef:
            # with expert parallelism f_e is the expert group's (`load_balancing_loss`)
            out["moe/aux_loss"] = (aux_coef, load_balancing_loss(
                logits, self.args.num_experts_per_tok, mask, self.expert_group))
        if z_coef:
            out["moe/z_loss"] = (z_coef, router_z_loss(logits, mask))
        return out

    def root_args(self, batch: dict, root: nn.Module | None = None) -> tuple:
        """The arguments of a loss root (`input_keys`) for one micro-batch, on this device.
        With context parallelism the root's per-token row fields (`row_keys`) are cut to this
        rank's tokens; `document_lengths` stay the whole rows'."""
        root = self.root if root is None else root
        keys = getattr(root, "input_keys", CausalLMLoss.input_keys)
        rows = set(getattr(root, "row_keys", CausalLMLoss.row_keys))
        shard = self.cp_shard(batch["input_ids"].shape[1]) if self.cp_group is not None else None

        def arg(key: str) -> Any:
            value = batch.get(key)
            if not isinstance(value, torch.Tensor):
                return value
            value = value.to(self.device)
            return shard.local(value) if shard is not None and key in rows else value

        return tuple(arg(k) for k in keys)

    def _forward(self, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss root over one micro-batch (`root_args`)."""
        out = self.root(*self.root_args(batch))
        return out if isinstance(out, tuple) else (out, {})

    @torch.no_grad()
    def score(self, batch: dict, root: nn.Module | None = None) -> torch.Tensor:
        """A loss root's `score_only` output for one micro-batch (GRPO's log-probs [S, T]),
        without gradients; with context parallelism each rank scores the tokens it holds
        (0 elsewhere) and the parts are summed over the group."""
        root = self.root if root is None else root
        root.eval()
        out = root(*self.root_args(batch, root), score_only=True)
        if self.cp_group is not None:
            out = out.contiguous()
            dist.all_reduce(out, group=self.cp_group)
        return out

    def _zero_contribution(self) -> None:
        raise ConfigError("a rank got no micro-batch in a step: tokens_per_step must give "
                          "every rank at least one micro-batch")

    def _clip(self) -> float:
        params = [p for p in self.root.parameters() if p.grad is not None]
        max_norm = self.cfg.grad_clip_norm or math.inf
        # clip_grad_norm_ in steps: under TP + FSDP the tensor-parallel weights live on the 2-D
        # mesh and the rest (embedding, norms, head) on its data-parallel dims, and DTensor cannot
        # stack norms of different meshes, so each mesh's norm is reduced on its own first
        by_mesh: dict[Any, list[torch.Tensor]] = {}
        for p in params:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
        parts = []
        for group in by_mesh.values():
            n = torch.nn.utils.get_total_norm([p.grad for p in group], 2.0, foreach=True)
            parts.append(n.full_tensor() if hasattr(n, "full_tensor") else n)
        total = parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack(parts))
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
        return float(total)

    @torch.no_grad()
    def eval_loss_sum(self, batch: dict) -> float:
        return self.eval_sums(batch)["loss"]

    @torch.no_grad()
    def eval_sums(self, batch: dict) -> dict[str, float]:
        """The loss sum and the loss module's stats sums of one batch, without gradients."""
        self.root.eval()
        loss_sum, stats = self._forward(batch)
        return self._cp_sum({"loss": float(loss_sum), **{k: float(v) for k, v in stats.items()}})

    # ------------------------------------------------------------------ state
    def save_checkpoint(self, extra: dict, rank_extra: dict | None = None) -> str:
        return self.checkpoints.save(self.step, self.root, self.optimizer,
                                     scheduler=self.scheduler, extra={**extra, "step": self.step},
                                     rank_extra=rank_extra)

    def load_checkpoint(self) -> dict | None:
        """Restore the newest valid checkpoint; returns its `extra` (None = fresh start)."""
        ckpt = self.checkpoints.load(self.root, self.optimizer, scheduler=self.scheduler)
        if ckpt is None:
            return None
        self.step = int(ckpt.meta["extra"]["step"])
        log.info("resumed from %s at step %d", ckpt.path, self.step)
        return {**ckpt.meta["extra"], "rank_extra": ckpt.meta.get("rank_extra")}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Native-named full weights on rank 0 ({} elsewhere); a collective. A transformers
        model's names are its own, prefixed ``hf.``."""
        from posttrain.distributed.parallelize import gather_full_state_dict
        sd = gather_full_state_dict(self.root)
        return {k[len("model."):]: v for k, v in sd.items() if k.startswith("model.")}


def _as_float64(value: Any, device: torch.device) -> torch.Tensor:
    """A loss or stat (tensor or number) as a detached float64 scalar on `device`: adding
    these equals adding their Python floats (float32 -> float64 is exact)."""
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(()).to(device=device, dtype=torch.float64)
    return torch.tensor(float(value), dtype=torch.float64, device=device)


def _host_sums(loss: torch.Tensor, stats: dict[str, torch.Tensor],
               router: dict[str, torch.Tensor]
               ) -> tuple[float, dict[str, float], dict[str, float]]:
    """A step's device-side sums read back in one transfer, as floats."""
    values = torch.stack([loss, *stats.values(), *router.values()]).cpu().tolist()
    n = 1 + len(stats)
    return values[0], dict(zip(stats, values[1:n])), dict(zip(router, values[n:]))


def _real_token_mask(batch: dict) -> torch.Tensor | None:
    """[B, T] with 1 on real tokens, 0 on the trailing padding of each row (None: no padding
    recorded, every position is real)."""
    pads = batch.get("row_num_pad")
    if not pads or not any(pads):
        return None
    B, T = batch["input_ids"].shape
    mask = torch.ones(B, T)
    for b, pad in enumerate(pads):
        if pad:
            mask[b, T - int(pad):] = 0
    return mask


def _stable_hash(text: str) -> int:
    h = 0
    for ch in text.encode():
        h = (h * 131 + ch) % 1_000_000_007
    return h
