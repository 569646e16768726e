"""The GRPO recipe's config (`GRPOConfig`: rewards, algorithm, sampling, rollout engine,
environment, PPO's critic) and the advantage checks it shares with sequence RL
(`check_advantage`); the recipe is `posttrain.train.grpo`, the losses `posttrain.losses.grpo`.

Recipe configs live in `posttrain.config` so that a config is read and checked without
importing torch; `posttrain.train.grpo` and `posttrain.train.critic` import them from here (the
old import paths keep working).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from posttrain.config.data import TokenizerConfig
from posttrain.config.eval import TaskConfig
from posttrain.config.loader import inline
from posttrain.config.model import ModelConfig
from posttrain.config.recipes import DataConfig
from posttrain.config.rl import EnvironmentConfig, RolloutEngineConfig, SamplingConfig
from posttrain.config.train import (EngineConfig, ExportConfig, OptimizerConfig, RunConfig,
                                    SchedulerConfig, check_eval_tasks, check_export)
from posttrain.rl.dynamic import DynamicSamplingConfig, OverlongConfig
from posttrain.rl.rewards import RewardConfig, actor_placed


@dataclass(frozen=True)
class CriticConfig:
    """PPO's ``critic:`` section: where the value model starts, its training, and the knobs of
    the advantage (GAE's gamma and lam, whitening) and of the value loss (its clip). Present
    exactly when ``algorithm.advantage: gae``."""

    hf_dir: str | None = None          # default: the policy's starting checkpoint
    gamma: float = 1.0                 # discount per token
    lam: float = 0.95                  # GAE's lambda: 1 Monte Carlo, 0 one-step TD
    whiten_advantages: bool = True     # over the whole step's batch
    value_clip: float | None = 0.2     # eps_v, in reward units; null: no value clipping
    head_init_scale: float = 0.0       # x the engine's seeded init; 0: a zero value head
    optimizer: OptimizerConfig = OptimizerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    grad_clip_norm: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"critic.gamma must be in [0, 1], got {self.gamma}")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"critic.lam must be in [0, 1], got {self.lam}")
        if self.value_clip is not None and self.value_clip <= 0:
            raise ValueError(f"critic.value_clip must be > 0 (or null: no clipping), got "
                             f"{self.value_clip}")
        if self.head_init_scale < 0:
            raise ValueError(f"critic.head_init_scale must be >= 0, got {self.head_init_scale}")
        if self.grad_clip_norm < 0:
            raise ValueError("critic.grad_clip_norm must be >= 0 (0 disables clipping)")


@dataclass(frozen=True, kw_only=True)
class GRPOTrainConfig:
    """GRPO's ``train:`` section: the engine's config inline, where `max_steps` counts GRPO
    steps (rollout batches); each makes `mini_batches` optimizer steps over
    `prompts_per_step * samples_per_prompt` sequences (`optimizer_engine` is what the Engine
    gets: its `max_steps` counts optimizer steps, for the schedule)."""

    engine: EngineConfig = inline()
    prompts_per_step: int = 16
    samples_per_prompt: int = 8
    mini_batches: int = 1
    max_tokens_per_micro_batch: int = 4096

    def __post_init__(self) -> None:
        if self.prompts_per_step < 1:
            raise ValueError("train.prompts_per_step must be at least 1")
        if self.samples_per_prompt < 1:
            raise ValueError("train.samples_per_prompt must be at least 1")
        if self.mini_batches < 1 or self.prompts_per_step % self.mini_batches:
            raise ValueError(f"train.mini_batches={self.mini_batches} must divide "
                             f"train.prompts_per_step={self.prompts_per_step}")

    @property
    def optimizer_steps(self) -> int:
        return self.engine.max_steps * self.mini_batches

    @property
    def optimizer_engine(self) -> EngineConfig:
        return replace(self.engine, max_steps=self.optimizer_steps)


@dataclass(frozen=True)
class AlgorithmConfig:
    """The policy loss and the advantages; formulas in `posttrain.losses.grpo`."""

    # group_norm: GRPO (Dr. GRPO with normalize_std false); rloo: leave-one-out baseline;
    # reinforce_pp: REINFORCE++ (group baseline, normalized over the step's batch);
    # gae: PPO, per token from a learned critic (the `critic:` section, posttrain.train.critic)
    advantage: Literal["group_norm", "rloo", "reinforce_pp", "gae"] = "group_norm"
    normalize_std: bool = True                 # group_norm only; False: Dr. GRPO advantages
    ratio: Literal["token", "sequence"] = "token"   # sequence: GSPO (one ratio per response)
    clip_low: float = 0.2
    clip_high: float = 0.28                    # > clip_low: DAPO clip-higher
    aggregation: Literal["seq_mean_token_mean", "token_mean", "constant"] = "token_mean"
    constant_norm: float | None = None         # aggregation constant: default the episode budget
    kl_coef: float = 0.0
    reference: Literal["none", "lora_base", "copy"] = "none"
    is_cap: float | None = 2.0                 # truncated IS engine -> trainer; None: off
    use_engine_logprobs: bool = True           # False: no importance correction at all
    log_entropy: bool = True
    # MoE: the engine records each token's experts and every trainer forward replays them
    # (R3; posttrain.models.routing_replay)
    routing_replay: bool = False

    def __post_init__(self) -> None:
        if self.kl_coef > 0 and self.reference == "none":
            raise ValueError(f"algorithm.kl_coef={self.kl_coef} needs a reference model: set "
                             "algorithm.reference to lora_base or copy")
        if self.is_cap is not None and not self.use_engine_logprobs:
            raise ValueError("algorithm.is_cap needs use_engine_logprobs: true")


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_tokens: tuple[str, ...] = ()          # besides the tokenizer's eos (e.g. "<|im_end|>")

    def sampling(self, stop_token_ids: tuple[int, ...], seed: int,
                 temperature: float | None = None) -> SamplingConfig:
        """The engine's settings; `temperature` overrides the configured one (0: greedy,
        which also turns top-p and top-k off)."""
        t = self.temperature if temperature is None else temperature
        return SamplingConfig(temperature=t, top_p=self.top_p if t > 0 else 1.0,
                              top_k=self.top_k if t > 0 else 0,
                              max_new_tokens=self.max_new_tokens,
                              stop_token_ids=stop_token_ids, seed=seed)


@dataclass(frozen=True)
class GRPOEvalConfig:
    """Held-out evaluation: `samples_per_prompt` completions per prompt at `temperature`
    (0: one greedy completion; > 0: the mean@k accuracy of sampled completions)."""

    max_prompts: int = 200
    temperature: float = 0.0
    samples_per_prompt: int = 1
    seed: int = 1234
    every_steps: int = 0                       # 0: at the start and the end only
    num_records: int = 16                      # sample completions kept for the card
    accuracy_reward: str | None = "exact_match_number"   # its mean is reported as accuracy
    tasks: tuple[TaskConfig, ...] = ()         # the evaluate step: more suite tasks (benchmarks)


@dataclass(frozen=True)
class SyncCheckConfig:
    tolerance: float = 1e-3                    # max |engine - trainer| log-prob of the probe
    fail: bool = False                         # raise instead of warning when exceeded


@dataclass(frozen=True)
class GRPOConfig:
    tokenizer: TokenizerConfig
    data: DataConfig
    model: ModelConfig
    train: GRPOTrainConfig
    rewards: RewardConfig
    algorithm: AlgorithmConfig = AlgorithmConfig()
    sampling: SamplingSettings = SamplingSettings()
    rollout: RolloutEngineConfig = RolloutEngineConfig()
    sync_check: SyncCheckConfig = SyncCheckConfig()
    dynamic_sampling: DynamicSamplingConfig | None = None    # DAPO: drop groups without signal
    overlong: OverlongConfig | None = None                    # DAPO: soft overlong punishment
    environment: EnvironmentConfig = EnvironmentConfig()      # single-turn, tools, your own
    run: RunConfig = RunConfig(dir="runs/grpo")
    eval: GRPOEvalConfig = GRPOEvalConfig()
    export: ExportConfig = ExportConfig()
    critic: CriticConfig | None = None         # PPO: with algorithm.advantage: gae

    def __post_init__(self) -> None:
        check_advantage(self)
        if self.data.format != "prompt":
            raise ValueError(f"GRPO trains on prompt data (data.format: prompt), not "
                             f"{self.data.format!r}")
        # The rows must carry what the rewards read: prepare refuses the others by name.
        needed = sorted({*self.data.required_columns, *self.rewards.required_columns})
        object.__setattr__(self, "data", replace(self.data, required_columns=needed))
        if self.algorithm.reference == "lora_base" and self.model.lora is None:
            raise ValueError("algorithm.reference: lora_base needs model.lora")
        check_export(self.export, self.model.lora)
        check_eval_tasks(self.data.eval, self.eval.tasks)
        if self.eval.temperature == 0 and self.eval.samples_per_prompt != 1:
            raise ValueError("eval.samples_per_prompt > 1 needs eval.temperature > 0 (greedy "
                             "completions of one prompt are all the same)")
        if self.overlong is not None and self.overlong.buffer_tokens > self.episode_tokens:
            raise ValueError(f"overlong.buffer_tokens={self.overlong.buffer_tokens} exceeds "
                             f"the {self.episode_tokens} tokens of an episode "
                             "(sampling.max_new_tokens, or environment.max_total_tokens)")
        if self.algorithm.ratio == "sequence" and self.train.engine.parallel.cp > 1:
            raise ValueError("algorithm.ratio: sequence (GSPO) averages each response's token "
                             "log-ratios, which context parallelism splits over ranks; use "
                             "train.parallel.cp: 1 or algorithm.ratio: token")
        if self.algorithm.routing_replay and self.rollout.kind != "native":
            raise ValueError("algorithm.routing_replay records the experts in the native "
                             f"rollout engine; rollout.kind: {self.rollout.kind} does not return "
                             "them here: set rollout.kind: native or routing_replay: false")
        if self.rollout.placement == "separate" and self.run.launcher != "ray":
            raise ValueError("rollout.placement: separate runs the engines as Ray actors; set "
                             "run.launcher: ray")
        for name in actor_placed(self.rewards.functions):
            if self.run.launcher != "ray":
                raise ValueError(f"rewards.functions[{name}].params.placement: actor runs the "
                                 "model on a Ray actor; set run.launcher: ray, or placement: "
                                 "local")

    @property
    def episode_tokens(self) -> int:
        """The generation budget of a rollout: everything after the prompt (all turns and the
        environment's replies with a multi-turn environment); DAPO's overlong shaping and the
        ``constant`` aggregation count against it."""
        return self.environment.token_budget(self.sampling.max_new_tokens)


def check_advantage(cfg: Any) -> None:
    """The advantage estimator of a GRPO-style config (`GRPOConfig`, sequence RL's) against
    its sampling and its critic: group estimators compare samples of a prompt, GAE needs a
    critic (`posttrain.train.critic`) and nothing else."""
    gae, critic = cfg.algorithm.advantage == "gae", getattr(cfg, "critic", None)
    if gae and critic is None:
        raise ValueError("algorithm.advantage: gae (PPO) learns a value function: add a "
                         "critic: section (posttrain.train.critic.CriticConfig; {} takes "
                         "its defaults)")
    if not gae and critic is not None:
        raise ValueError(f"critic: is PPO's value model, used with algorithm.advantage: "
                         f"gae only (got {cfg.algorithm.advantage!r}); remove critic: or "
                         "set algorithm.advantage: gae")
    if not gae and cfg.train.samples_per_prompt < 2:
        raise ValueError(f"train.samples_per_prompt must be at least 2 with "
                         f"algorithm.advantage: {cfg.algorithm.advantage} (group-relative "
                         "advantages compare samples of one prompt); gae allows 1")
    if gae and cfg.train.engine.parallel.cp > 1:
        raise ValueError("critic: (algorithm.advantage: gae) does not support context "
                         "parallelism yet; set train.parallel.cp: 1")
    if gae and cfg.dynamic_sampling is not None and cfg.train.samples_per_prompt < 2:
        raise ValueError("dynamic_sampling drops prompts whose samples all score the same, "
                         "which is every prompt with train.samples_per_prompt: 1; remove "
                         "dynamic_sampling or sample at least 2 per prompt")
