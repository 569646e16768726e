"""Train GRPO: a single controller over trainer ranks and rollout engines.

One step, as `GRPOController.step` reads:

    prompts   -> the next `prompts_per_step` rows of the seeded prompt stream
    rollouts  -> `samples_per_prompt` episodes each (`posttrain.rl.episodes`): one completion,
                 or with a multi-turn `environment:` the model's turns and the environment's
                 replies (tool results, feedback), token in and token out; the engine's
                 log-probs and a loss mask on the sampled tokens
    rewards   -> the configured reward functions on each final answer, weighted (failures
                 score 0, counted), plus the environment's rewards and DAPO's overlong
                 shaping (`overlong:`); with `dynamic_sampling:` the groups
                 without reward variance are dropped and more prompts drawn and sampled, up
                 to `max_rounds` rounds (`posttrain.rl.dynamic`)
    advantages-> per response from the group's rewards (`algorithm.advantage`): GRPO's
                 group-normalized (Dr. GRPO: centered only), RLOO's leave-one-out, or
                 REINFORCE++'s group-centered and batch-normalized; or PPO's (gae): per
                 token, by the trainer ranks' critic from each sample's reward
                 (`posttrain.train.critic`), which is updated in the same step
    update    -> packed micro-batches, `mini_batches` optimizer steps on the FSDP2 trainers
                 (with `algorithm.routing_replay`, an MoE policy's forwards route every token
                 through the experts the engine recorded for it)
    sync      -> the trainers' new weights into the engines (gathered per bucket and broadcast
                 in the engine's dtype; LoRA: adapters only), then the sync check: the
                 engine's and the trainer's log-probs of a fixed sequence must agree
    metrics   -> rewards per function, KL, clip fractions, entropy, lengths, log-prob gap,
                 time per phase, rollout tokens/s; code run by rewards and tools, counted by
                 sandbox mechanism (`sandbox/runs/bwrap`, `sandbox/runs/weak`)
    checkpoint-> every K steps: sharded weights and optimizer, the prompt stream position

The controller holds no weights. Trainer ranks are `posttrain.train.grpo.GRPOWorker` (Ray
actors, or one inline worker); rollout engines live on the trainer ranks (placement
``colocated``) or in their own actors (``separate``).

Asynchronous rollouts (`rollout.max_staleness: k`, placement ``separate``): the first three
lines of a step (`produce`) run in `posttrain.rl.pipeline.RolloutPipeline`, which starts the
batches of steps s+1..s+k while the trainers update on step s; the sync waits for them, so a
batch is made with one policy version, stamped on it (`rollout/policy_version`,
`rollout/staleness`), and corrected by the engine's log-probs in the loss.

Determinism and resume: the prompt order is a function of (seed, epoch), the sampler of step s is
seeded from (seed, s, round, turn, engine index), so a run killed and started again with the same
run directory continues from its last checkpoint and ends with the same weights as a run that never
stopped (with the same number of ranks and engines: a sample depends on its batch neighbours).
With k > 0 the checkpoint also holds the batches made ahead (`rollouts_ahead`): they were sampled
by weights that exist nowhere else, and their prompts are already drawn from the stream.

    posttrain train-grpo --config configs/grpo/tiny.yaml
    posttrain train-grpo --config configs/ppo/tiny.yaml          # PPO: a critic, GAE
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from posttrain.config.loader import to_dict
from posttrain.data.prepared import local_view
from posttrain.data.tokenizer import ChatTokenizer
from posttrain.eval.rl import reward_eval
from posttrain.losses.grpo import estimate_advantages
from posttrain.rl.batch import Sample, pack_micro_batches, split_mini_batches
from posttrain.rl.dynamic import GroupBatch, overlong_penalty, round_seed, sample_groups
from posttrain.rl.engine import Rollout, SamplingConfig, stop_token_ids
from posttrain.rl.episodes import Episode, EpisodeRunner, episode_metrics, score_episodes
from posttrain.rl.pipeline import RolloutPipeline
from posttrain.rl.prompts import PromptRow, PromptStream, read_prompt_rows
from posttrain.rl.rewards import RewardFailures, RewardOutput, combine
from posttrain.rl.sandbox import run_counts
from posttrain.train.grpo import GRPO, GRPOConfig, GRPOWorker, RolloutWorker
from posttrain.train.metrics import MetricsWriter
from steps.common import Controller, main_for, run_recipe

log = logging.getLogger("posttrain.train_grpo")


# --------------------------------------------------------------------------- rollout placement


class ColocatedRollouts:
    """Engines on the trainer ranks: rank r generates prompts r, r + W, ..."""

    def __init__(self, group: Any):
        self.group = group

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, n: int
                 ) -> list[list[Rollout]]:
        return _interleave(self.group.call("generate", prompts, sampling, n), len(prompts))

    def sync(self) -> int:
        """Every rank copies the trainer's weights into its engine; the bytes each wrote."""
        return self.group.call("sync_rollout")[0]

    def probe(self, sequence: list[int], prompt_len: int, temperature: float
              ) -> tuple[list[float], list[list[float]]]:
        out = self.group.call("probe", sequence, prompt_len)
        return out[0]["trainer"], [o["engine"] for o in out]

    def close(self) -> None:
        pass


class SeparateRollouts:
    """`rollout.num_engines` Ray actors. The trainer ranks gather the weights bucket by bucket
    and rank 0 broadcasts each bucket to the engines over a group of their own
    (`posttrain.rl.weight_sync`); with LoRA only the adapters after the first sync."""

    def __init__(self, cfg: GRPOConfig, group: Any, hf_dir: str):
        import ray
        self.group, self.ray = group, ray
        args = group.call("model_args")[0]
        rc = cfg.rollout
        res = dict(rc.resources_per_engine)
        options = {"num_cpus": res.pop("num_cpus", 1), "num_gpus": res.pop("num_gpus", 0),
                   "resources": res or None}
        actor = ray.remote(RolloutWorker).options(**options)
        self.engines = [actor.remote(to_dict(cfg), args, hf_dir, i)
                        for i in range(rc.num_engines)]
        self._open_sync()

    def _open_sync(self) -> None:
        """Form the sync group: the trainers fix the plan for the engines' parameters, rank 0
        serves the group's store, then rank 0 and every engine join it together."""
        manifests = self.ray.get([a.weight_manifest.remote() for a in self.engines])
        assert all(m == manifests[0] for m in manifests), "engines with different parameters"
        shapes, dtype = manifests[0]
        plan, address = self.group.call("open_weight_sync", shapes, dtype,
                                        len(self.engines))[0]
        self._get(self.group.call_async("join_weight_sync")
                  + [a.join_weight_sync.remote(plan, address) for a in self.engines])
        self._full = True          # the first sync also sends the LoRA bases

    def _get(self, refs: list[Any]) -> list[Any]:
        """ray.get, but raise as soon as one call fails (its peers may wait for it forever)."""
        pending = list(refs)
        while pending:
            ready, pending = self.ray.wait(pending, num_returns=1)
            self.ray.get(ready)
        return self.ray.get(refs)

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, n: int
                 ) -> list[list[Rollout]]:
        e = len(self.engines)
        refs = [a.generate.remote(prompts[i::e], sampling, n) for i, a in enumerate(self.engines)]
        return _interleave(self.ray.get(refs), len(prompts))

    def sync(self) -> int:
        """One sync to every engine; the bytes each received."""
        refs = self.group.call_async("send_weights", self._full)
        received = self._get(refs + [a.receive_weights.remote(self._full)
                                     for a in self.engines])
        self._full = False
        return received[0]

    def probe(self, sequence: list[int], prompt_len: int, temperature: float
              ) -> tuple[list[float], list[list[float]]]:
        trainer = self.group.call("probe", sequence, prompt_len)[0]["trainer"]
        refs = [a.logprobs.remote([sequence], [prompt_len], temperature) for a in self.engines]
        return trainer, [r[0] for r in self.ray.get(refs)]

    def close(self) -> None:
        for a in self.engines:
            self.ray.kill(a)


def _interleave(shares: list[list[Any]], n: int) -> list[Any]:
    """Undo the round-robin split: item i came from share i % W at position i // W."""
    w = len(shares)
    return [shares[i % w][i // w] for i in range(n)]


# --------------------------------------------------------------------------- the controller


class GRPOController(Controller):
    """GRPO's step loop parts for the one driver (`steps.common.run_recipe`)."""

    def __init__(self, cfg: GRPOConfig, group: Any, rollouts: Any, tokenizer: Any,
                 train_rows: list[PromptRow], eval_rows: list[PromptRow], num_ranks: int,
                 packs_documents: bool = True):
        super().__init__(cfg, group, {})
        self.rollouts = rollouts
        self.tokenizer, self.num_ranks = tokenizer, num_ranks
        # False: the model cannot keep the sequences of a row apart (`GRPOWorker.describe`)
        self.packs_documents = packs_documents
        self.writer: MetricsWriter | None = None
        self.records: dict[str, list[dict]] = {}
        self.stream = PromptStream(train_rows, seed=cfg.train.engine.seed)
        self.eval_rows = eval_rows
        self.reward, self.stop_ids, self.episodes = self.generation(tokenizer)
        first = train_rows[0].prompt_ids
        # any fixed token sequence will do; a prompt followed by itself stays in-distribution
        self.probe_sequence, self.probe_prompt_len = first + first, len(first)
        self.temperature = cfg.sampling.temperature if cfg.sampling.temperature > 0 else 1.0
        # rollouts: produced on the step (max_staleness 0) or up to k steps ahead while the
        # trainers update; `policy_version` counts the updates the engines' weights hold
        self.policy_version = 0
        self._sandbox_runs = run_counts()        # this process's sandboxes (rewards, tools)
        self.pipeline = RolloutPipeline(self.produce, lambda: self.policy_version,
                                        cfg.rollout.max_staleness,
                                        end=cfg.train.engine.max_steps)

    def generation(self, tokenizer: Any) -> tuple[Any, tuple[int, ...], Any]:
        """The run's reward (`CombinedReward`), stop ids and episode runner (`EpisodeRunner`'s
        `run`): here chat episodes in the tokenizer's ids (sequence RL: item completions)."""
        cfg = self.cfg
        stop_ids = stop_token_ids(tokenizer, cfg.sampling.stop_tokens)
        chat = ChatTokenizer(replace(cfg.tokenizer, added_tokens=(), semantic_ids=None),
                             tokenizer=tokenizer)       # the prepared one has them already
        return (combine(cfg.rewards.functions), stop_ids,
                EpisodeRunner(cfg.environment, chat, stop_ids))

    @classmethod
    def for_run(cls, cfg: GRPOConfig, group: Any, context: dict[str, Any]) -> "GRPOController":
        """The controller of a driver's run: tokenizer, prompt rows and rollout engines."""
        from transformers import AutoTokenizer
        prepared_dir = context["prepared_dir"]
        tokenizer = AutoTokenizer.from_pretrained(f"{local_view(prepared_dir)}/tokenizer")
        rollouts = (ColocatedRollouts(group) if cfg.rollout.placement == "colocated"
                    else SeparateRollouts(cfg, group, context["hf_dir"]))
        info = context["info"]
        ctl = cls(cfg, group, rollouts, tokenizer, read_prompt_rows(prepared_dir, "train"),
                  _eval_rows(prepared_dir)[:cfg.eval.max_prompts], info["world_size"],
                  packs_documents=info["packs_documents"])
        ctl.writer = context["writer"]
        return ctl

    def before_training(self) -> dict[str, Any]:
        self.reward.open()                       # model-based rewards load (or fail) now
        return {}

    def resume(self) -> int:
        state = self.group.call("resume")[0]
        if state is None:
            return 0
        self.stream.load_state_dict(state["prompts"])
        self.pipeline.restore(state.get("rollouts_ahead", []))
        return int(state["step"])

    def after_resume(self, start: int) -> dict[str, Any]:
        """The engines get the weights to continue from; a fresh run's baseline evaluation."""
        self.rollouts.sync()
        self.policy_version = start
        log.info("GRPO: %s rollouts (%s)", self.cfg.rollout.kind, self.cfg.rollout.placement)
        baseline, self.records["baseline_records"] = ({}, []) if start else self._evaluate()
        if baseline and self.writer is not None:
            self.writer.write({"step": 0, **baseline})
        return {"baseline_eval": baseline}

    def evaluate(self) -> dict[str, Any]:
        final, self.records["eval_records"] = self._evaluate()
        return final

    def save(self, step: int) -> None:
        self.save_checkpoint(step)

    def result(self) -> dict[str, Any]:
        return dict(self.records)

    def close(self) -> None:
        self.pipeline.close()
        self.rollouts.close()
        self.reward.close()                      # model-based rewards: their models, actors

    def produce(self, step: int) -> GroupBatch:
        """The rollout batch of `step`: prompts -> rollouts -> rewards; with dynamic sampling,
        more rounds until enough groups have reward variance. A function of the step, the
        prompt stream and the engines' weights (run in step order, on or ahead of the step)."""
        cfg = self.cfg
        n = cfg.train.samples_per_prompt
        step_seed = cfg.train.engine.seed * 1_000_003 + step
        times = {"generate": 0.0, "score": 0.0}

        def generate(prompts: list[PromptRow], round_index: int) -> list[list[Episode]]:
            t0 = time.perf_counter()
            sampling = replace(cfg.sampling.sampling(self.stop_ids, seed=round_seed(
                step_seed, round_index)), record_routing=cfg.algorithm.routing_replay)
            out = self.episodes.run(prompts, n, self.rollouts.generate, sampling)
            times["generate"] += time.perf_counter() - t0
            return out

        def score(prompts: list[PromptRow], groups: list[list[Episode]]) -> RewardOutput:
            t0 = time.perf_counter()
            out = self.score(prompts, groups)
            times["score"] += time.perf_counter() - t0
            return out

        batch = sample_groups(cfg.train.prompts_per_step, n, self.stream.next_batch, generate,
                              score, cfg.dynamic_sampling)
        batch.metrics.update({"time/generate_s": times["generate"],
                              "time/score_s": times["score"]})
        return batch

    def step(self, step: int) -> dict[str, Any]:
        cfg, t_start = self.cfg, time.perf_counter()
        n = cfg.train.samples_per_prompt
        batch = self.pipeline.take(step)         # with max_staleness, next ones start now
        t_rollouts = time.perf_counter()
        prompts, scored = batch.prompts, batch.scored
        rollouts = [r for g in batch.groups for r in g]
        # advantages
        rewards_G_N = torch.tensor(scored.total, dtype=torch.float64).view(len(prompts), n)
        if cfg.algorithm.advantage == "gae":     # PPO: per token by the critic, on the ranks
            advantages = torch.zeros_like(rewards_G_N)
        else:
            advantages = estimate_advantages(rewards_G_N, cfg.algorithm.advantage,
                                             normalize_std=cfg.algorithm.normalize_std)
        # update (importance-corrected by the engine's log-probs, however stale)
        samples = [Sample(r.prompt_ids, r.completion_ids, r.logprobs, float(a), r.loss_mask,
                          r.routing, reward=reward)
                   for r, a, reward in zip(rollouts, advantages.flatten().tolist(),
                                           rewards_G_N.flatten().tolist())]
        mini_batches = [pack_micro_batches(mb, max_tokens=cfg.train.max_tokens_per_micro_batch,
                                           num_ranks=self.num_ranks, pack=self.packs_documents,
                                           row_multiple=2 * cfg.train.engine.parallel.cp)
                        for mb in split_mini_batches(samples, cfg.train.mini_batches)]
        update = self.group.call("train_rollouts", mini_batches)[0]
        t_updated = time.perf_counter()
        # the batches in flight finish on the weights they started with, then the weight sync
        # and the check that engine and trainer agree
        ahead_wait = self.pipeline.wait()
        sync_bytes = self.rollouts.sync()
        self.policy_version = step + 1
        sync_diff = self.check_sync()
        t_synced = time.perf_counter()
        # metrics
        lengths = [len(r.completion_ids) for r in rollouts]
        generated = sum(lengths)
        metrics = {
            "step": step + 1, **scored.metrics(), **batch.metrics, **update,
            "response_length/mean": generated / len(rollouts),
            "response_length/max": max(lengths),
            "response_length/truncated_fraction":
                sum(r.finish_reason == "length" for r in rollouts) / len(rollouts),
            "groups_with_signal": (float((rewards_G_N.std(dim=1) > 0).float().mean())
                                   if n > 1 else 0.0),
            "sync/max_abs_logprob_diff": sync_diff,
            "sync/bytes": sync_bytes,
            "rollout_tokens": generated,
            "rollout_tokens_per_s": generated / max(batch.metrics["time/generate_s"], 1e-9),
            "time/rollout_wait_s": t_rollouts - t_start,
            "time/ahead_wait_s": ahead_wait,
            "time/sync_s": t_synced - t_updated - ahead_wait,
            "time/step_s": t_synced - t_start,
        }
        metrics.update(self.rollout_metrics(rollouts))
        metrics.update(self._sandbox_metrics())
        if cfg.eval.every_steps and (step + 1) % cfg.eval.every_steps == 0:
            metrics.update(self._evaluate()[0])
        return metrics

    def rollout_metrics(self, rollouts: list[Any]) -> dict[str, float]:
        """What the step's episodes did besides their length (multi-turn: turns, environment
        tokens; `episode_metrics`)."""
        return {} if self.cfg.environment.single_turn else episode_metrics(rollouts)

    def _sandbox_metrics(self) -> dict[str, float]:
        """Sandboxed code runs since the last step, by isolation mechanism (none: no keys)."""
        now, before = run_counts(), self._sandbox_runs
        self._sandbox_runs = now
        return {f"sandbox/runs/{k}": float(v - before.get(k, 0)) for k, v in now.items()
                if v != before.get(k, 0)}

    def score(self, prompts: list[PromptRow], groups: list[list[Episode]]) -> RewardOutput:
        """The configured rewards of each episode's final answer, plus the environment's
        reward (component "environment", multi-turn) and DAPO's overlong shaping (component
        "overlong") when configured."""
        rollouts = [r for g in groups for r in g]
        scored = score_episodes(self.reward, prompts, groups,
                                environment=not self.cfg.environment.single_turn)
        if self.cfg.overlong is None:
            return scored
        budget = self.cfg.episode_tokens
        shaping = [overlong_penalty(len(r.completion_ids), budget, self.cfg.overlong)
                   for r in rollouts]
        return RewardOutput(total=[t + s for t, s in zip(scored.total, shaping)],
                            components={**scored.components, "overlong": shaping},
                            failures={**scored.failures, "overlong": RewardFailures()})

    def check_sync(self) -> float:
        """Max |engine - trainer| log-prob over the probe sequence and every engine."""
        trainer, engines = self.rollouts.probe(self.probe_sequence, self.probe_prompt_len,
                                               self.temperature)
        diff = max(abs(a - b) for e in engines for a, b in zip(e, trainer))
        if diff > self.cfg.sync_check.tolerance:
            message = (f"weight sync check: the rollout engine's log-probs differ from the "
                       f"trainer's by {diff:.3g} (> sync_check.tolerance "
                       f"{self.cfg.sync_check.tolerance:g})")
            if self.cfg.sync_check.fail:
                raise RuntimeError(message)
            log.warning(message)
        return diff

    def _evaluate(self) -> tuple[dict[str, float], list[dict]]:
        """Held-out reward metrics and sample records (none without eval prompts)."""
        if not self.eval_rows:
            return {}, []
        ev = self.cfg.eval
        sampling = self.cfg.sampling.sampling(self.stop_ids, seed=ev.seed,
                                              temperature=ev.temperature)

        def generate(prompts: list[PromptRow]) -> list[list[Episode]]:
            return self.episodes.run(prompts, ev.samples_per_prompt, self.rollouts.generate,
                                     sampling)

        return reward_eval(generate, self.eval_rows, self.reward,
                           accuracy_reward=self.cfg.eval.accuracy_reward,
                           num_records=self.cfg.eval.num_records, **self.eval_scoring())

    def eval_scoring(self) -> dict[str, Any]:
        """How `reward_eval` scores the held-out episodes: with the environment's reward when
        it is multi-turn (sequence RL: its own `score`)."""
        return {"environment": not self.cfg.environment.single_turn}

    def save_checkpoint(self, step: int) -> None:
        """The prompt stream's position and the rollout batches made ahead of `step` (their
        prompts were drawn, and the weights that sampled them exist nowhere else)."""
        ahead = self.pipeline.state()            # waits for any still in flight, first
        self.group.call("save_checkpoint", {"prompts": self.stream.state_dict(), "step": step,
                                            "rollouts_ahead": ahead})


# --------------------------------------------------------------------------- the run


def run(config: GRPOConfig | str | Path, **kwargs: Any) -> dict[str, Any]:
    """Train, evaluate (held-out reward at the start and the end) and export; arguments as
    `steps.common.run_recipe`."""
    return run_recipe(GRPO, config, worker=GRPOWorker, controller=GRPOController.for_run,
                      **kwargs)


def _eval_rows(prepared_dir: str) -> list[PromptRow]:
    from posttrain.errors import DataError
    try:
        return read_prompt_rows(prepared_dir, "eval")
    except DataError as e:
        log.warning("no held-out prompts, so no evaluation: %s", e)
        return []


RECIPE = GRPO
main = main_for(RECIPE, run)


if __name__ == "__main__":
    from steps.cli import main as cli_main
    sys.exit(cli_main(["train-grpo", *sys.argv[1:]]))
