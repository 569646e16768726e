"""PPO's critic: a value model trained beside the policy in the GRPO recipe's step.

With ``algorithm.advantage: gae`` the GRPO recipe is PPO (Schulman et al. 2017; for language
models Ouyang et al. 2022): the advantages come per token from a learned value function by GAE
instead of per response from a group of samples, so one sample per prompt is enough. The
formulas (GAE, whitening, the clipped value loss, explained variance) are in
`posttrain.losses.ppo`.

The critic is a native model (default: the policy's starting checkpoint, ``critic.hf_dir``
otherwise) whose LM head is replaced by a scalar value head, ``head = Linear(H, 1)``, the
reward model's custom-head path (`posttrain.train.reward.RewardLoss`): the engine initializes
it (seeded) and ``critic.head_init_scale`` scales that init, 0 (the default) giving a zero head,
so every value starts at 0 and the first advantages are the discounted returns. The value of
completion token t is the head at the position that predicts it (the state in which the
policy chose it). It is a `posttrain.train.engine.Engine` of its own on every trainer rank:
FSDP2 over the same mesh shape as the policy, its own optimizer and scheduler
(``critic.optimizer``, ``critic.scheduler``, ``critic.grad_clip_norm``), the full body
trained (no LoRA), checkpoints under ``<run_dir>/critic/checkpoints``.

One step (`GRPOWorker.train_rollouts`, on every rank, each taking its share of the
micro-batches):

    prepare  the critic scores every micro-batch of the step before any update (V_old);
             GAE per sequence from the sequence's scalar reward on its last trained token
             (``critic.gamma``, ``critic.lam``); whitening over the whole step's batch, its
             moments summed over the data-parallel ranks (``critic.whiten_advantages``)
    policy   the clipped policy loss with those per-token advantages, one optimizer step per
             mini-batch, as GRPO
    critic   one optimizer step per mini-batch on the clipped value loss against the returns,
             clipped around V_old (``critic.value_clip``)

Asynchronous rollouts (``rollout.max_staleness > 0``): the values are taken by the current
critic when the batch is trained, not when it was sampled, so advantages are always the newest
critic's estimate for the (possibly older) policy's samples; the policy's side is corrected by
the engine's log-probs as in GRPO. The critic needs nothing from the rollout side, so the
pipeline and its checkpointed batches are unchanged.

Checkpoints: the critic saves right before the policy, at the same step, and keeps one more
checkpoint than the policy; a resume takes the policy's newest valid checkpoint and then the
critic's of the same step. So a kill between the two saves (the critic's step s+1 written, the
policy's not) resumes both from step s.

Not supported (refused at launch): context parallelism (``train.parallel.cp > 1``).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from posttrain.config.grpo import CriticConfig
from posttrain.losses.ppo import (explained_variance, gae, masked_moments, terminal_rewards,
                                  value_loss, whiten)
from posttrain.models.transformer import Transformer
from posttrain.train.engine import Engine, EngineConfig, ModelConfig

# the value loss root's stats: sums over trained tokens, divided by the token count
_VALUE_STATS = ("value_loss", "value_clip_fraction", "value_abs_error")


class ValueLoss(nn.Module):
    """FSDP root over a packed micro-batch (`posttrain.rl.batch`): body -> value head at every
    position -> the values of the completion tokens [S, T] -> `value_loss`. With
    ``score_only`` it returns the values (0 off the mask), detached."""

    input_keys = ("input_ids", "position_ids", "document_lengths", "token_index", "mask",
                  "returns", "old_values", "global_tokens", "global_sequences", "live")
    row_keys = ("input_ids", "position_ids")

    def __init__(self, model: Transformer, value_clip: float | None, aggregation: str,
                 constant_norm: float | None):
        super().__init__()
        from posttrain.train.reward import _hidden_size
        model.head = nn.Linear(_hidden_size(model), 1, device="meta")
        self.model = model
        self.value_clip, self.aggregation = value_clip, aggregation
        self.constant_norm = constant_norm

    def values(self, input_ids, position_ids, document_lengths, token_index, mask
               ) -> torch.Tensor:
        hidden_BLH = self.model(input_ids, position_ids, document_lengths)
        values_L = self.model.head(hidden_BLH).reshape(-1).float()
        return values_L[token_index].where(mask, 0.0)

    def forward(self, input_ids, position_ids, document_lengths, token_index, mask,
                returns=None, old_values=None, global_tokens=None, global_sequences=None,
                live=True, *, score_only: bool = False):
        values = self.values(input_ids, position_ids, document_lengths, token_index, mask)
        if score_only:
            return values.detach()
        aggregation = self.aggregation
        loss, m = value_loss(
            values, old_values, returns, mask, clip=self.value_clip, aggregation=aggregation,
            constant_norm=self.constant_norm if aggregation == "constant" else None,
            global_tokens=global_tokens if aggregation == "token_mean" else None,
            global_sequences=None if aggregation == "token_mean" else global_sequences)
        n = mask.sum()
        stats = {k: m[k] * n for k in _VALUE_STATS}
        if not live:                       # a dummy micro-batch: collectives, no contribution
            return loss * 0.0, {k: torch.zeros_like(v) for k, v in stats.items()}
        return loss, stats


class Critic:
    """The critic on one trainer rank (module docstring). Every method is a collective over
    the trainer ranks."""

    def __init__(self, cfg: CriticConfig, model: ModelConfig, engine: EngineConfig,
                 hf_dir: str, run_dir: str, *, vocab_size: int | None, aggregation: str,
                 constant_norm: float | None, host_budget: int | None = None):
        """`model` and `engine` are the policy's (dtype, parallelism, seed, optimizer steps);
        `hf_dir` the policy's starting checkpoint; `aggregation` and `constant_norm` the policy
        loss's, which the value loss shares; `host_budget` the rank's, as the policy's."""
        self.cfg = cfg
        engine_cfg = replace(engine, optimizer=cfg.optimizer, scheduler=cfg.scheduler,
                             grad_clip_norm=cfg.grad_clip_norm,
                             keep_checkpoints=engine.keep_checkpoints + 1)
        start = cfg.hf_dir or hf_dir
        self.engine = Engine(
            replace(model.starting_from(start), lora=None), engine_cfg, start,
            f"{run_dir.rstrip('/')}/critic", vocab_size=vocab_size, host_budget=host_budget,
            loss_factory=lambda m: ValueLoss(m, cfg.value_clip, aggregation, constant_norm))
        with torch.no_grad():
            for p in self.engine.model.head.parameters():
                p.mul_(cfg.head_init_scale)

    # ------------------------------------------------------------------ one step
    def prepare(self, mine: list[list[dict]]) -> dict[str, float]:
        """Score this rank's micro-batches (every mini-batch of the step) and write into each
        ``old_values``, ``returns`` and the per-token ``advantages`` [S, T] (whitened over
        the step's batch when configured); returns the step's critic metrics before the
        update."""
        cfg, dp = self.cfg, self.engine.dp
        sums = {k: torch.zeros(3, dtype=torch.float64) for k in ("adv", "ret", "val")}
        for b in (b for batches in mine for b in batches):
            values_ST = self.engine.score(b).cpu().double()
            mask = b["mask"]
            adv_ST, ret_ST = gae(values_ST, terminal_rewards(b["rewards"], mask), mask,
                                 gamma=cfg.gamma, lam=cfg.lam)
            b["old_values"], b["returns"], b["advantages"] = (
                values_ST.float(), ret_ST.float(), adv_ST)
            if b["live"]:
                for key, x in (("adv", adv_ST), ("ret", ret_ST), ("val", values_ST)):
                    sums[key] += masked_moments(x, mask)
        flat = dp.sum_all({f"{k}{i}": float(v[i]) for k, v in sums.items() for i in range(3)})
        total = {k: torch.tensor([flat[f"{k}{i}"] for i in range(3)], dtype=torch.float64)
                 for k in sums}
        for b in (b for batches in mine for b in batches):
            adv_ST = b["advantages"]
            if cfg.whiten_advantages:
                adv_ST = whiten(adv_ST, b["mask"], total["adv"])
            b["advantages"] = adv_ST.float()
        n = max(float(total["val"][0]), 1.0)
        # R - V_old is the advantage before whitening
        return {"critic/explained_variance": explained_variance(total["ret"], total["adv"]),
                "critic/value_mean": float(total["val"][1]) / n,
                "critic/return_mean": float(total["ret"][1]) / n,
                "critic/advantage_mean": float(total["adv"][1]) / n}

    def update(self, mine: list[list[dict]]) -> dict[str, float]:
        """One optimizer step per mini-batch on the value loss; the step's metrics."""
        totals: dict[str, float] = {}
        losses, grad_norms = [], []
        tokens = 0
        for batches in mine:
            m = self.engine.train_step(batches, 1)     # the loss is normalized already
            losses.append(m["loss"])
            grad_norms.append(m["grad_norm"])
            for k in _VALUE_STATS:
                totals[k] = totals.get(k, 0.0) + m[k]
            tokens += batches[0]["global_tokens"]
        out = {f"critic/{k.removeprefix('value_')}": v / max(tokens, 1)
               for k, v in totals.items() if k != "value_loss"}
        out.update({"critic/loss": sum(losses) / len(losses),
                    "critic/grad_norm": max(grad_norms), "critic/lr": m["lr"]})
        return out

    def flops(self, view: dict) -> float:
        """The critic's model FLOPs over one micro-batch (`policy_flops`' view of it): the
        scoring forward and the update's forward and backward over the body (the value head,
        H per position, is not counted)."""
        from posttrain.train.recipe import policy_flops
        model = self.engine.model
        return (policy_flops(model, view, training=False, head=False)
                + policy_flops(model, view, head=False))

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int) -> str:
        """Save at optimizer step `step` (the policy's, which saves next)."""
        assert self.engine.step == step, (self.engine.step, step)
        return self.engine.save_checkpoint({})

    def load(self, step: int) -> None:
        """Load the checkpoint of optimizer step `step` (the one the policy resumed from);
        the RNG state is the policy's."""
        from posttrain.train.checkpoint_storage import CheckpointError
        found = [c for c in self.engine.checkpoints.list() if c.step == step]
        if not found:
            raise CheckpointError(
                f"the policy resumes from optimizer step {step} but the critic has no "
                f"checkpoint of that step under {self.engine.checkpoints.cfg.dir} (it has "
                f"{[c.step for c in self.engine.checkpoints.list()]}); was the critic added "
                "to this run directory later, or its checkpoints removed?")
        ckpt = self.engine.checkpoints.load(self.engine.root, self.engine.optimizer,
                                            scheduler=self.engine.scheduler,
                                            path=found[-1].path, restore_rng=False)
        self.engine.step = int(ckpt.meta["extra"]["step"])
