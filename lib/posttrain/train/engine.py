"""The per-rank training engine shared by every recipe (SFT, DPO, reward, distillation, GRPO).

One `Engine` lives in each trainer process (a Ray actor, a spawned process, or inline). It
builds the model the sharded way, owns the optimizer, scheduler and checkpoints, and runs one
optimizer step over the micro-batches it is given:

    build:  meta model (HF config) -> LoRA -> parallelize (TP, AC, compile, FSDP2) over the
            loss module -> to_empty -> stream the HF tensors, each rank keeping its shard
    step:   for each micro-batch: loss_sum(batch) * dp_size / N_global -> backward
            clip grad norm -> optimizer.step -> scheduler.step -> zero_grad

`N_global` is the number of loss units in the whole step across data-parallel ranks (loss
tokens for SFT, pairs for DPO and reward models), so the gradient is the one of a single big
batch however the step is split (FSDP averages gradients over the data-parallel ranks, hence the
`* dp_size`).

Data goes by *data-parallel* rank (`Engine.dp`): the ranks of one tensor-parallel group hold
different slices of the same weights, so they must see the same micro-batches; a step's
micro-batches are dealt out over the "dp" dim of the mesh (`dp.share`), and sums over
the data (losses, stats, eval) are taken over that dim only (`dp.sum`). With `tp=1` the
data-parallel rank is the global rank.

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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from posttrain.config.model import LoraSettings, ModelConfig, ModelInitConfig
from posttrain.config.train import EngineConfig
from posttrain.distributed.env import build_mesh, dp_mesh, get_device
from posttrain.distributed.materialize import materialize
from posttrain.distributed.parallelize import (ParallelConfig, count_params, param_device,
                                               parallelize, parallelize_frozen)
from posttrain.errors import ConfigError
from posttrain.models.args import DTYPES, ModelArgs
from posttrain.models.families.base import VOCAB_PARAMS
from posttrain.models.hf_io import grow_vocab_rows, iter_hf_tensors, load_hf
from posttrain.models.transformer import LMHead, Transformer, build_model
from posttrain.train.checkpoint import CheckpointConfig, CheckpointManager
from posttrain.train.optim import build_optimizer, build_scheduler

__all__ = ["all_reduce_max", "all_reduce_sum", "build_sharded", "CausalLMLoss", "DataParallel",
           "Engine", "EngineConfig", "LoraSettings", "ModelConfig", "ModelInitConfig",
           "write_random_hf_model"]

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class DataParallel:
    """This rank's place on the data-parallel ("dp") dim of the device mesh: which share
    of a step's data it takes, and the group over which sums of that data are taken. The ranks
    of one tensor-parallel group have the same `rank` and see the same data."""

    rank: int
    size: int
    group: Any = None             # the process group of the "dp" dim (None: no group)

    @classmethod
    def of_mesh(cls, mesh: Any) -> "DataParallel":
        dim = dp_mesh(mesh)          # dp_replicate x dp_shard
        return cls(dim.get_local_rank(), dim.size(), dim.get_group() if dim.size() > 1 else None)

    def share(self, items: Sequence[T]) -> list[T]:
        """This rank's items: r, r + size, r + 2 size, ..."""
        return list(items[self.rank::self.size])

    def rounds(self, n: int) -> int:
        """Forwards every rank runs over n items dealt out by `share` (the most any rank gets):
        under FSDP the all-gathers are collective, so a rank with fewer repeats one."""
        return -(-n // self.size)

    def sum(self, value: float) -> float:
        """`value` summed over the data-parallel ranks (each data item counted once)."""
        return value if self.group is None else _all_reduce(value, dist.ReduceOp.SUM, self.group)

    def sum_all(self, values: dict[str, float]) -> dict[str, float]:
        """Each of `values` summed over the data-parallel ranks, in one collective."""
        if self.group is None:
            return dict(values)
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return dict(zip(keys, t.tolist()))

    def all(self, flag: bool) -> bool:
        """Whether `flag` holds on every data-parallel rank (a collective)."""
        if self.group is None:
            return flag
        return bool(_all_reduce(float(flag), dist.ReduceOp.MIN, self.group))

    def gather(self, obj: Any) -> list[Any]:
        """The `obj` of every data-parallel rank, in rank order (a collective)."""
        if self.group is None:
            return [obj]
        out: list = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out


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
                 vocab_size: int | None = None, added_tokens: Sequence[int] = ()):
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
        balance = self._update_score_bias() if self.bias_update_speed else {}
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        loss_total = self.dp.sum(local_loss.item())
        stats = {k: self.dp.sum(v) / max(global_loss_tokens, 1)
                 for k, v in sorted(local_stats.items())}
        # the MoE router losses: means over the step's micro-batches (unweighted)
        stats.update({k: self.dp.sum(v) / (len(micro_batches) * self.dp.size)
                      for k, v in sorted(router.items())})
        return {"step": self.step, "loss": loss_total / max(global_loss_tokens, 1), **stats,
                **balance, "grad_norm": grad_norm, "lr": lr,
                "step_time_s": time.perf_counter() - t0}

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
                             ) -> tuple[torch.Tensor, dict[str, float], dict[str, float]]:
        """Forward and backward over this rank's micro-batches: the gradient of the step's
        loss (module doc), plus for MoE models coef x the router losses of each micro-batch
        averaged over the step's micro-batches. Returns the local loss sum, the loss root's
        stats sums and the router losses' sums (unscaled, over this rank's micro-batches)."""
        self.root.train()
        local_loss = torch.zeros((), dtype=torch.float64)
        local_stats: dict[str, float] = {}
        router: dict[str, float] = {}
        # FSDP averages gradients over its shard ranks: the data-parallel ones x the cp ones
        scale = self.dp.size * self.cp_size / max(global_loss_tokens, 1)
        for batch in micro_batches:
            loss_sum, stats = self._forward(batch)
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
                    router[k] = router.get(k, 0.0) + float(value.detach())
            objective.backward()
            local_loss += loss_sum.detach().double().cpu()
            for k, v in stats.items():
                local_stats[k] = local_stats.get(k, 0.0) + float(v)
        if not micro_batches:
            self._zero_contribution()
        if self.cp_group is not None:      # each cp rank summed its share of the rows' tokens
            local_loss = torch.tensor(self._cp_sum({"loss": float(local_loss)})["loss"],
                                      dtype=torch.float64)
            local_stats = self._cp_sum(local_stats)
        return local_loss, local_stats, router

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


def build_sharded(model_cfg: ModelConfig, parallel: ParallelConfig, hf_dir: str,
                  device: torch.device, loss_factory: Callable[[Transformer], nn.Module], *,
                  vocab_size: int | None = None, frozen: bool = False,
                  init_missing: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                  mesh: Any = None, added_tokens: Sequence[int] = ()
                  ) -> tuple[Transformer, nn.Module]:
    """The model of `hf_dir` inside `loss_factory(model)`, laid out on the device mesh and
    filled from the checkpoint, each rank reading only its shards (see the module docstring).

    `vocab_size` above the checkpoint's grows the embedding and head rows (tokens the data layer
    added); `model_cfg.lora` wraps the targets first. `frozen` builds a model that is only run
    forward without gradients (a KL reference): sharded the same way, no activation
    checkpointing, everything resharded after each forward. `init_missing(name, param)` fills
    parameters the checkpoint lacks (LoRA adapters, a custom head); without it they are an error.
    `mesh` is the device mesh to lay it out on (default: a new one from `parallel`).
    With LoRA, the vocabulary rows of `model_cfg.lora.trainable_tokens` (resolved ids) and
    `modules_to_save` train too (`posttrain.models.trainable_tokens`); `added_tokens` (the ids
    the tokenizer added) must be among them, or the build is refused.

    An architecture without a native definition trains through transformers
    (`posttrain.train.fallback_build`), with LoRA on its own Linear names.
    """
    from posttrain.models.auto import has_native_definition
    from posttrain.models.hf_io import read_hf_config
    if not has_native_definition(read_hf_config(hf_dir)):
        lora_cfg = model_cfg.lora
        if lora_cfg is not None and (added_tokens or lora_cfg.modules_to_save
                                     or lora_cfg.token_ids(())):
            raise ConfigError(f"model.lora: {hf_dir} has no native definition and trains "
                              "through transformers, where LoRA cannot train vocabulary rows "
                              "(model.lora.trainable_tokens / modules_to_save; the tokenizer "
                              f"added {len(added_tokens)} tokens); train without model.lora")
        from posttrain.train.fallback_build import build_fallback
        return build_fallback(model_cfg, parallel, hf_dir, loss_factory, vocab_size=vocab_size,
                               frozen=frozen, mesh=mesh, init_missing=init_missing)
    model = load_hf(hf_dir, on_meta=True, param_filter=lambda name: False,
                    vocab_multiple=model_cfg.vocab_multiple)
    ckpt_args = model.args
    if vocab_size is not None and vocab_size > ckpt_args.vocab_size:
        log.info("growing the vocabulary from %d to %d (tokens added by the tokenizer)",
                 ckpt_args.vocab_size, vocab_size)
        model = build_model(ckpt_args.replace(vocab_size=vocab_size), device="meta")
    if model_cfg.lora is not None:
        lora = _lora_module()
        lcfg = lora.LoraConfig(rank=model_cfg.lora.rank, alpha=model_cfg.lora.alpha,
                               dropout=model_cfg.lora.dropout, targets=model_cfg.lora.targets)
        lora.apply_lora(model, lcfg)
        from posttrain.models.trainable_tokens import apply_trainable_tokens
        apply_trainable_tokens(model, model_cfg.lora.token_ids(added_tokens),
                               model_cfg.lora.modules_to_save, required=added_tokens)
    fp32 = model.fp32_names()    # DeepSeek-V3's router: not rounded to a bf16 model.dtype
    root = loss_factory(model)
    mesh = mesh if mesh is not None else build_mesh(parallel.dp_shard, parallel.tp,
                                                    parallel.dp_replicate, parallel.cp)
    root = (parallelize_frozen if frozen else parallelize)(model, mesh, parallel, root=root)
    dtype = DTYPES[model_cfg.dtype]
    # a custom head (a reward model's scalar projection) replaces the LM head: it is
    # initialized by `init_missing`, not read from the checkpoint
    custom_head = not isinstance(model.head, LMHead)
    tensors = ((name, _fit_vocab(name, t, ckpt_args, model.args).to(
                    torch.float32 if name in fp32 else dtype))
               for name, t in iter_hf_tensors(hf_dir, ckpt_args)
               if not (custom_head and name.startswith("head.")))
    # under parallel.offload the shards live in host memory (FSDP2 copies them in to gather)
    materialize(root, param_device(parallel, device), tensors, prefix="model.",
                init_missing=init_missing)
    model.tie_weights()
    return model, root


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


def _fit_vocab(name: str, t: torch.Tensor, ckpt: ModelArgs, model: ModelArgs) -> torch.Tensor:
    if name not in VOCAB_PARAMS or ckpt.vocab_size == model.vocab_size:
        return t
    return grow_vocab_rows(t, ckpt.vocab_size, model.vocab_size, model.padded_vocab_size)


def all_reduce_sum(value: float) -> float:
    return _all_reduce(value, dist.ReduceOp.SUM)


def all_reduce_max(value: float) -> float:
    return _all_reduce(value, dist.ReduceOp.MAX)


def _all_reduce(value: float, op, group: Any = None) -> float:
    """`value` reduced over `group` (default: every rank)."""
    if group is None and (not dist.is_initialized() or dist.get_world_size() == 1):
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op, group=group)
    return float(t.item())


def _stable_hash(text: str) -> int:
    h = 0
    for ch in text.encode():
        h = (h * 131 + ch) % 1_000_000_007
    return h


def write_random_hf_model(init: ModelInitConfig, vocab_size: int, out_dir: str | Path,
                          tokenizer_dir: str | None = None) -> str:
    """Create a random HF checkpoint from a tiny config (deterministic for `init.seed`)."""
    from transformers import AutoModelForCausalLM

    from posttrain.models.verify import tiny_hf_config
    out = Path(out_dir)
    if (out / "config.json").is_file():
        return str(out)
    config = tiny_hf_config(init.family, **{"initializer_range": 0.02, "vocab_size": vocab_size,
                                            **init.overrides})
    torch.manual_seed(init.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    if tokenizer_dir:
        import shutil
        for f in Path(tokenizer_dir).iterdir():
            if f.is_file():
                shutil.copy2(f, tmp / f.name)
    tmp.rename(out)
    return str(out)
