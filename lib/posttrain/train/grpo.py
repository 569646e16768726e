"""The GRPO recipe's parts: the driver-side recipe, the trainer rank and the rollout actor.

The controller (`steps/train_grpo.py`) owns the loop and the prompt stream; this module owns
what runs on the ranks:

- `GRPOLoss`, the FSDP root (`posttrain.train.grpo_loss_root`): the model over a packed
  micro-batch, the completion tokens' log-probs, `posttrain.losses.grpo.grpo_loss`.
- `GRPOWorker`, one trainer rank: an `Engine` (FSDP2, optimizer, checkpoints) and, when the
  rollout placement is ``colocated``, a rollout engine on the same device that it keeps in step
  with the trainer's weights.
- `RolloutWorker`, a rollout engine of its own (placement ``separate``), a plain Ray actor.

Weight sync (`posttrain.rl.weight_sync`): every trainer rank gathers the sharded weights one
tensor at a time in a fixed plan; colocated, each rank copies them into its engine; separate,
rank 0 packs them into buckets in the engine's dtype and broadcasts each over a process group
of its own with the engine actors (`open_weight_sync` / `join_weight_sync` once, then
`send_weights` with the engines' `receive_weights`). With LoRA only the adapters travel after
the first sync; the engines merge them into the base they keep.

Reference model (for the KL penalty and the ``kl`` metric): ``none``; ``lora_base`` (the LoRA
policy with its adapters disabled, no extra memory); or ``copy`` (the starting weights, frozen,
read from the same checkpoint and sharded over the trainer ranks like the policy, so each rank
holds 1/W of one more model; `posttrain.distributed.parallelize.parallelize_frozen`).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Any

import torch

from posttrain.config.grpo import (AlgorithmConfig, GRPOConfig, GRPOEvalConfig, GRPOTrainConfig,
                                   SamplingSettings, SyncCheckConfig, check_advantage)
from posttrain.config.loader import build
from posttrain.data.prepared import local_view
from posttrain.distributed.env import init_process_group
from posttrain.distributed.sync_group import GroupAddress
from posttrain.errors import ConfigError
from posttrain.config.eval import TaskConfig
from posttrain.models.routing_replay import moe_blocks
from posttrain.rl.engine import Rollout, SamplingConfig
from posttrain.rl.factory import build_rollout_engine
from posttrain.rl.weight_sync import SyncPlan, WeightReceiver, WeightSender
from posttrain.train.critic import Critic
from posttrain.models.args import DTYPES
from posttrain.train.engine import Engine, all_reduce_max, build_sharded
from posttrain.train.grpo_loss_root import TOKEN_STATS, GRPOLoss
from posttrain.train.metrics import device_peak_flops, step_metrics
from posttrain.train.recipe import tokenizer_added_ids, tokenizer_vocab

__all__ = ["AlgorithmConfig", "check_advantage", "GRPO", "GRPOConfig", "GRPOEvalConfig",
           "GRPOLoss", "GRPOTrainConfig", "GRPOWorker", "RolloutWorker", "SamplingSettings",
           "SyncCheckConfig"]

log = logging.getLogger(__name__)

class GRPO:
    """The GRPO recipe for the one driver: its worker (`GRPOWorker`) and controller
    (`steps.train_grpo.GRPOController`) replace the kernel's; these are its driver-side parts."""

    name = "grpo"
    config_cls = GRPOConfig

    @staticmethod
    def eval_suite(cfg: GRPOConfig, models: dict[str, str]) -> Any:
        """Held-out prompts answered by the export and by the starting model (the run's
        evaluation sampling, its rollout engine) and scored by the run's reward functions."""
        from posttrain.config.eval import GenerationSettings, SuiteConfig
        if not cfg.data.eval:
            return None
        ev, s = cfg.eval, cfg.sampling
        names = [f.name for f in cfg.rewards.functions]
        generation = GenerationSettings(
            max_new_tokens=s.max_new_tokens, temperature=ev.temperature, top_p=s.top_p,
            top_k=s.top_k, samples_per_prompt=ev.samples_per_prompt,
            stop_tokens=tuple(s.stop_tokens), seed=ev.seed)
        tasks = tuple(TaskConfig(
            name=src.name or f"eval{i}", kind="reward", data=src, max_samples=ev.max_prompts,
            max_tokens_per_sample=cfg.data.max_tokens_per_sample, columns=cfg.data.columns,
            on_bad_row=cfg.data.on_bad_row, role_map=cfg.data.role_map, generation=generation,
            rewards=tuple(cfg.rewards.functions),
            accuracy_reward=ev.accuracy_reward if ev.accuracy_reward in names else None,
            environment=None if cfg.environment.single_turn else cfg.environment)
            for i, src in enumerate(cfg.data.eval))
        return SuiteConfig(tasks=tasks + cfg.eval.tasks, tokenizer=cfg.tokenizer,
                           dtype=cfg.model.dtype,
                           rollout=replace(cfg.rollout, placement="colocated"))

    @staticmethod
    def postfix(m: dict) -> dict[str, str]:
        return {"reward": f"{m['reward/total/mean']:.3f}", "kl": f"{m.get('kl', 0.0):.4f}",
                "len": f"{m['response_length/mean']:.1f}",
                "tok/s": f"{m['rollout_tokens_per_s']:.0f}",
                "sync": f"{m['sync/max_abs_logprob_diff']:.1e}"}

    @staticmethod
    def result(history: list[dict]) -> dict[str, Any]:
        if not history:
            return {}
        last = history[-min(len(history), 5):]
        return {"final_reward_mean": sum(m["reward/total/mean"] for m in last) / len(last),
                "mean_rollout_tokens_per_s": (sum(m["rollout_tokens_per_s"] for m in history)
                                              / len(history)),
                "max_sync_diff": max(m["sync/max_abs_logprob_diff"] for m in history)}

    @staticmethod
    def summary(result: dict) -> list[str]:
        lines = []
        if "final_reward_mean" in result:
            lines.append(f"train reward (last steps) {result['final_reward_mean']:.3f}; "
                         f"{result['mean_rollout_tokens_per_s']:.0f} rollout tokens/s; "
                         f"weight sync max |diff| {result['max_sync_diff']:.2e}")
        base, final = result.get("baseline_eval") or {}, result.get("eval") or {}
        for key in ("eval/accuracy", "eval/reward_mean"):
            if key in final:
                before = f"{base[key]:.3f} -> " if key in base else ""
                lines.append(f"held-out {key.split('/')[1]}: {before}{final[key]:.3f}")
        return lines


# --------------------------------------------------------------------------- trainer rank


class GRPOWorker:
    """One trainer rank (module docstring). Methods are called by the controller on every rank
    (they are collectives under FSDP) unless noted.

    A recipe on the same rank (sequence RL) sets `config_cls` and `token_ranges`: the ids
    its engine may sample, which the loss's log-probs are renormalised over (empty: all)."""

    config_cls: type = GRPOConfig

    def __init__(self, cfg: dict[str, Any], hf_dir: str, prepared_dir: str, run_dir: str,
                 models: dict[str, str] | None = None, host_budget: int | None = None):
        """`models`: the driver's other model directories (GRPO has none); `host_budget`:
        what this rank may keep resident on a CPU (`posttrain.train.host_heap.HostHeap`)."""
        self.cfg = build(self.config_cls, cfg, where=f"{self.config_cls.__name__} config")
        self.prepared_dir = local_view(prepared_dir)
        self.hf_dir = hf_dir
        self.token_ranges = self.allowed_token_ranges()
        train = self.cfg.train
        constant = self.cfg.algorithm.constant_norm or float(self.cfg.episode_tokens)
        init_process_group()
        torch.manual_seed(train.engine.seed)
        self.engine = Engine(
            self.cfg.model, train.optimizer_engine, hf_dir, run_dir,
            vocab_size=tokenizer_vocab(prepared_dir),
            added_tokens=tokenizer_added_ids(prepared_dir), host_budget=host_budget,
            loss_factory=lambda m: GRPOLoss(m, self.cfg.algorithm, self._temperature, constant,
                                            self.cfg.model.loss_chunk_tokens,
                                            self.token_ranges))
        self.rank, self.world = self.engine.rank, self.engine.world
        if self.cfg.algorithm.routing_replay and not moe_blocks(self.engine.model):
            raise ConfigError("algorithm.routing_replay replays the experts of a "
                              "mixture-of-experts model; this model has no native MoE "
                              "layers: set routing_replay: false")
        self.critic: Critic | None = None
        if getattr(self.cfg, "critic", None) is not None:    # PPO (posttrain.train.critic)
            self.critic = Critic(self.cfg.critic, self.cfg.model, train.optimizer_engine, hf_dir,
                                 run_dir, vocab_size=self.engine.vocab_size,
                                 aggregation=self.cfg.algorithm.aggregation,
                                 constant_norm=constant, host_budget=host_budget)
        self.reference: GRPOLoss | None = None
        if self.cfg.algorithm.reference == "copy":
            self.reference = self._frozen_copy().eval()
        self.weight_sync = WeightSender(self.engine.model, self.rank, self.engine.device)
        self.rollout = self._local_receiver = None
        if self.cfg.rollout.placement == "colocated":
            self.rollout = build_rollout_engine(self.cfg.rollout, self.engine.args, hf_dir,
                                                self.engine.device, self._param_dtype(),
                                                seed=train.engine.seed)
            plan = self._sync_plan(self.rollout.parameter_shapes, self.rollout.dtype)
            self._local_receiver = WeightReceiver(self.rollout, plan)
        self._first_local_sync = True
        self._rollout_released = False
        self.peak_flops, _ = device_peak_flops(self.engine.device)

    def allowed_token_ranges(self) -> tuple[tuple[int, int], ...]:
        """The ids the engine may sample (GRPO: all of them)."""
        return ()

    @property
    def _temperature(self) -> float:
        return self.cfg.sampling.temperature if self.cfg.sampling.temperature > 0 else 1.0

    def _param_dtype(self) -> torch.dtype:
        return DTYPES[self.cfg.model.dtype]

    def _frozen_copy(self) -> GRPOLoss:
        """The ``copy`` reference: the starting policy (the policy's checkpoint without LoRA,
        whose adapters start at zero) in a frozen root of its own, sharded like the trainer."""
        algorithm = replace(self.cfg.algorithm, reference="none", kl_coef=0.0)
        _, root = build_sharded(
            replace(self.cfg.model, lora=None), self.engine.cfg.parallel, self.hf_dir,
            self.engine.device,
            lambda m: GRPOLoss(m, algorithm, self._temperature, None,
                               self.cfg.model.loss_chunk_tokens, self.token_ranges),
            vocab_size=self.engine.vocab_size, frozen=True)
        return root

    # ------------------------------------------------------------------ info and state
    def describe(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world, "params": self.engine.num_params,
                "trainable_params": self.engine.num_trainable,
                "device": str(self.engine.device), "packs_documents": self.packs_documents}

    @property
    def packs_documents(self) -> bool:
        """Whether a micro-batch row may hold several sequences: always for a native model; for
        a transformers one (no native definition) where its attention separates them
        (`posttrain.models.fallback.HFCausalLM.supports_packed_documents`)."""
        model = self.engine.model
        return self.engine.args is not None or bool(
            model.supports_packed_documents or model.allow_cross_document_attention)

    def model_args(self):
        return self.engine.args

    def resume(self) -> dict | None:
        """Load the newest valid checkpoint; returns the controller's state saved with it."""
        extra = self.engine.load_checkpoint()
        if extra is not None and self.critic is not None:
            self.critic.load(self.engine.step)       # the same step (Critic's docstring)
        return None if extra is None else extra["controller"]

    def save_checkpoint(self, controller_state: dict) -> str:
        if self.critic is not None:                   # first: a kill in between is safe
            self.critic.save(self.engine.step)
        return self.engine.save_checkpoint({"controller": controller_state})

    # ------------------------------------------------------------------ weights
    def _sync_plan(self, engine_shapes: dict[str, tuple[int, ...]], engine_dtype: torch.dtype
                   ) -> SyncPlan:
        lora = self.cfg.model.lora
        scaling = None if lora is None else lora.alpha / lora.rank
        return self.weight_sync.make_plan(
            engine_shapes, engine_dtype, lora_scaling=scaling,
            bucket_bytes=int(self.cfg.rollout.sync_bucket_mb * 2**20))

    def sync_rollout(self) -> int:
        """Colocated: copy the trainer's weights (with LoRA after the first sync only the
        adapters) into this rank's engine, a tensor at a time; returns the bytes written."""
        if self._local_receiver is None:
            raise RuntimeError("sync_rollout needs rollout.placement: colocated")
        full = self._first_local_sync or self._rollout_released
        if self._rollout_released:
            self.rollout.resume_memory()
        written = self.weight_sync.copy_to(self._local_receiver, full=full)
        self._first_local_sync = self._rollout_released = False
        return written

    def release_rollout(self) -> None:
        """Colocated with `rollout.release_memory`: the engine gives back its memory before
        the update (`RolloutEngine.release_memory`); `sync_rollout` takes it back."""
        if self.rollout is not None and self.cfg.rollout.release_memory:
            self._rollout_released = self.rollout.release_memory() or self._rollout_released

    def open_weight_sync(self, engine_shapes: dict[str, tuple[int, ...]],
                         engine_dtype: torch.dtype, num_engines: int
                         ) -> tuple[SyncPlan, GroupAddress | None]:
        """Separate engines: fix the sync plan for engines with these parameters and, on rank
        0, serve the sync group's store on this node (MASTER_ADDR, which the engines reach);
        returns the plan and the group's address (None off rank 0)."""
        plan = self._sync_plan(engine_shapes, engine_dtype)
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        return plan, self.weight_sync.serve(num_engines, host)

    def join_weight_sync(self) -> None:
        """Rank 0 joins the sync group (with every engine at once); a no-op elsewhere."""
        self.weight_sync.join()

    def send_weights(self, full: bool) -> int:
        """Gather and broadcast one sync to the separate engines; returns the bytes each
        receives (a collective)."""
        return self.weight_sync.send(full)

    # ------------------------------------------------------------------ rollouts
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, n: int
                 ) -> list[list[Rollout]]:
        """Colocated: this rank's share (prompts r, r + W, ...) of the prompts."""
        if self.rollout is None:
            raise RuntimeError("generate on a trainer rank needs rollout.placement: colocated")
        mine = prompts[self.rank::self.world]
        seeded = replace(sampling, seed=sampling.seed * 1009 + self.rank)
        return self.rollout.generate(mine, seeded, n) if mine else []

    def probe(self, sequence: list[int], prompt_len: int) -> dict[str, list[float]]:
        """The weight-sync check: the trainer's and (colocated) the engine's log-probs of a
        fixed sequence."""
        batch = _probe_batch(sequence, prompt_len, 2 * self.engine.cp_size)
        trainer = self.engine.score(batch)
        out = {"trainer": trainer[0].float().cpu().tolist()}
        if self.rollout is not None:
            ranges = {"allowed_token_ranges": self.token_ranges} if self.token_ranges else {}
            out["engine"] = self.rollout.logprobs([sequence], [prompt_len],
                                                  temperature=self._temperature, **ranges)[0]
        return out

    # ------------------------------------------------------------------ update
    def train_rollouts(self, mini_batches: list[list[dict]]) -> dict[str, float]:
        """The policy update of one GRPO step: for each mini-batch (a list of micro-batches,
        this data-parallel rank taking r, r + D, ...) one optimizer step; with a critic (PPO)
        its values and the per-token advantages first, its update after
        (`posttrain.train.critic`). Old-policy log-probs
        are computed first for the mini-batches after the first (the first is scored by the
        policy that has not moved yet, so its own log-probs, detached, are the old ones),
        reference log-probs when configured. A colocated engine's memory is released first
        (`release_rollout`)."""
        self.release_rollout()
        mine = [self.engine.dp.share(mb) for mb in mini_batches]
        t0 = time.perf_counter()
        # PPO: the critic's values, per-token advantages and returns, before any update
        critic = self.critic.prepare(mine) if self.critic is not None else {}
        for i, batches in enumerate(mine):
            for b in batches:
                if i > 0:
                    b["old_logp"] = self.engine.score(b)
                if self.reference is not None:
                    b["ref_logp"] = self.engine.score(b, self.reference)
        logprobs_s = time.perf_counter() - t0
        totals: dict[str, float] = {}
        routing = [0.0, 0.0]                  # replayed, mismatched token selections
        losses, grad_norms = [], []
        for batches in mine:
            m = self.engine.train_step(batches, 1)
            losses.append(m["loss"])
            grad_norms.append(m["grad_norm"])
            for k in TOKEN_STATS:
                if k in m:
                    totals[k] = totals.get(k, 0.0) + m[k]
            if "routing_replayed" in m:       # sums over the data-parallel ranks
                routing[0] += m["routing_replayed"]
                routing[1] += m["routing_mismatched"]
            lr = m["lr"]
        if self.critic is not None:
            critic.update(self.critic.update(mine))
        tokens = sum(mbs[0]["global_tokens"] for mbs in mini_batches)
        out = {k: v / max(tokens, 1) for k, v in totals.items()}
        if routing[0]:
            # the share of (token, MoE layer) selections where the trainer's own top-k differs
            # from the engine's recorded one, over the update's forwards
            out["routing/mismatch_rate"] = routing[1] / routing[0]
        seconds = time.perf_counter() - t0
        out.update(critic)
        out.update({"loss": sum(losses) / len(losses), "grad_norm": max(grad_norms), "lr": lr,
                    "optimizer_step": self.engine.step,
                    "time/logprobs_s": all_reduce_max(logprobs_s),
                    "time/update_s": all_reduce_max(seconds - logprobs_s)})
        # the update phase's throughput and MFU, through the metrics every recipe uses
        live = [b for mbs in mini_batches for b in mbs if b["live"]]
        counts = {"real_tokens": float(sum(b["num_tokens"] for b in live)), "pad_tokens": 0.0,
                  "loss_tokens": float(sum(int(b["mask"].sum()) for b in live))}
        out.update(step_metrics(counts, seconds=all_reduce_max(seconds), data_wait_s=0.0,
                                flops=self.update_flops(mini_batches),
                                peak_flops=self.peak_flops * self.world,
                                device=self.engine.device))
        out.pop("data_wait_s")
        return out

    def update_flops(self, mini_batches: list[list[dict]]) -> float:
        """Model FLOPs of one GRPO update over all ranks: per live micro-batch the policy's
        forward and backward (the LM head over the completion tokens), and a forward for the
        old-policy log-probs (mini-batches after the first) and for the reference (when
        configured); with a critic its scoring forward and its forward and backward. Dummy
        micro-batches are not model work."""
        from posttrain.train.recipe import policy_flops
        model, lora = self.engine.model, self.cfg.model.lora
        reference = self.cfg.algorithm.reference != "none"     # the base model, no adapters
        total = 0.0
        for old, b in ((i > 0, b) for i, mbs in enumerate(mini_batches)
                       for b in mbs if b["live"]):
            view = {"document_lengths": b["document_lengths"], "row_num_pad": [0],
                    "num_real_tokens": b["num_tokens"], "num_loss_tokens": int(b["mask"].sum())}
            total += policy_flops(model, view, lora=lora)
            if old:
                total += policy_flops(model, view, lora=lora, training=False)
            if reference:
                total += policy_flops(model, view, training=False)
            if self.critic is not None:
                total += self.critic.flops(view)
        return total

    def export(self, out_dir: str) -> str | None:
        """Write the HF checkpoint (rank 0); a collective."""
        from posttrain.train.export import export_worker
        return export_worker(self.engine, self.cfg, self.prepared_dir, out_dir)

    def close(self) -> None:
        self.weight_sync.close()


def _probe_batch(sequence: list[int], prompt_len: int, row_multiple: int = 1) -> dict:
    from posttrain.rl.batch import Sample, pack_micro_batches
    completion = sequence[prompt_len:]
    sample = Sample(sequence[:prompt_len], completion, [0.0] * len(completion), 0.0)
    return pack_micro_batches([sample], max_tokens=len(sequence),
                              row_multiple=row_multiple)[0]


# --------------------------------------------------------------------------- separate engines


class RolloutWorker:
    """A rollout engine in its own Ray actor (placement ``separate``)."""

    def __init__(self, cfg: dict[str, Any], args: Any, hf_dir: str, index: int):
        self.cfg = build(GRPOConfig, cfg, where="grpo config")
        self.index = index
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":        # the CPUs Ray gave this actor (rollout.resources_per_engine)
            torch.set_num_threads(max(1, int(self.cfg.rollout.resources_per_engine.get(
                "num_cpus", 1))))
        dtype = DTYPES[self.cfg.model.dtype]
        self.engine = build_rollout_engine(self.cfg.rollout, args, hf_dir, device, dtype,
                                           seed=self.cfg.train.engine.seed)
        self.receiver: WeightReceiver | None = None

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, n: int
                 ) -> list[list[Rollout]]:
        seeded = replace(sampling, seed=sampling.seed * 1009 + self.index)
        return self.engine.generate(prompts, seeded, n) if prompts else []

    def weight_manifest(self) -> tuple[dict[str, tuple[int, ...]], torch.dtype]:
        """The engine's parameter shapes and dtype, for the trainers' sync plan."""
        return self.engine.parameter_shapes, self.engine.dtype

    def join_weight_sync(self, plan: SyncPlan, address: GroupAddress) -> None:
        """Join the trainers' sync group as member 1 + index (with the trainers at once)."""
        self.receiver = WeightReceiver(self.engine, plan)
        self.receiver.join(address, 1 + self.index)

    def receive_weights(self, full: bool) -> int:
        return self.receiver.receive(full)

    def logprobs(self, sequences: list[list[int]], prompt_lens: list[int],
                 temperature: float) -> list[list[float]]:
        return self.engine.logprobs(sequences, prompt_lens, temperature=temperature)

