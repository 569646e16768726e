"""Model-based GRPO rewards: a reward model's score, and an LLM judge's parsed verdict.

Both are ordinary registered reward functions (`posttrain.rl.rewards`), listed and weighted
with rule rewards in the same ``rewards.functions``::

    rewards:
      functions:
        - {name: reward_model, weight: 1.0, params: {dir: runs/reward_tiny/hf}}
        - {name: format, weight: 0.1}

**reward_model** scores each (prompt, completion) with the reward recipe's export
(`posttrain.train.reward`): the body reads the prompt and the completion as one assistant turn
(its own chat template), the scalar head the hidden state at the completion's last token, so
``r = w . h_last + b`` as in training, where the Bradley-Terry loss
``-log sigmoid(r_chosen - r_rejected)`` made it (Ouyang et al., 2022). A batch is scored in
padded forward passes, longest first: at most `batch_size` sequences and `max_tokens` padded
tokens per pass. Right padding is exact under causal attention (no real token attends to a
pad), so a score equals the one-sequence-per-forward score (`load_reward_model`) up to float
reassociation.

**llm_judge** asks a model to grade each completion (LLM-as-a-judge, Zheng et al., 2023). The
`rubric` is a template with ``{prompt}`` (the last user message), ``{completion}`` and any
prompt-row column (``{answer}``); it is sent as the user turn (after `system`, if any) through
the judge's own chat template, the judge answers through the rollout-engine interface
(`posttrain.rl.factory.load_engine`: native, the transformers fallback, or vLLM; greedy by
default), and `score_pattern` finds the score in its answer (the last match; its first group if
it has one). With `score_range` [lo, hi] the reward is ``clip((s - lo) / (hi - lo), 0, 1)``. An
answer without a score is a failure of the function (0, counted), or gets the reward
`unparseable_score` (on the normalised scale) when that is set. The judge's weights are its own, never synced.

**Placement.** ``placement: local`` loads the model in the process that scores (the GRPO
controller), once. ``placement: actor`` loads it on a Ray actor of its own with `num_cpus` /
`num_gpus` (a GRPO run needs ``run.launcher: ray``), started when the run starts, reused every
step, killed when the run ends. Either way the model is opened by `CombinedReward.open` (or
its first use) and kept, keyed by its params, until `CombinedReward.close`; the model
directory is checked there, where the model loads, not when the config is read (a flow is
compiled where it is not).
"""

from __future__ import annotations

import json
import logging
import math
import re
import string
import threading
from pathlib import Path
from typing import Any, Sequence

from posttrain.rl.rewards import SampleFailure, register

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_SCORE_PATTERN", "JudgeScorer", "RewardModelScorer", "parse_score",
           "render_rubric"]

DEFAULT_SCORE_PATTERN = r"Score:\s*(-?\d+(?:\.\d+)?)"
_PLACEMENTS = ("local", "actor")
_FIXED_FIELDS = ("prompt", "completion")


# --------------------------------------------------------------------------- reward model


class RewardModelScorer:
    """Batched scores of the reward model exported at `model_dir` (module docstring)."""

    def __init__(self, model_dir: str, *, device: str = "cpu", batch_size: int = 64,
                 max_tokens: int = 16384, produced_by: str | None = None):
        from posttrain.models.reward_model import HEAD_JSON, load_reward_parts
        if not (Path(model_dir) / HEAD_JSON).is_file():
            how = (f"it is the export of {produced_by}: train it first with `posttrain "
                   f"train-reward --config {produced_by}`" if produced_by else
                   "point it at the reward recipe's export dir")
            raise FileNotFoundError(f"reward_model: params.dir {model_dir!r} is not an "
                                    f"exported reward model (no {HEAD_JSON}); {how}")
        self.model, self.tokenizer = load_reward_parts(model_dir, device=device)
        self.device, self.batch_size, self.max_tokens = device, batch_size, max_tokens
        self.pad_id = self.tokenizer.pad_token_id or 0

    def score(self, prompts: Sequence[list[dict]], completions: Sequence[str]
              ) -> list[float | SampleFailure]:
        from posttrain.models.reward_model import reward_input_ids
        out: list[float | SampleFailure] = [SampleFailure("not scored")] * len(completions)
        ids: dict[int, list[int]] = {}
        for i, (p, c) in enumerate(zip(prompts, completions)):
            try:
                ids[i] = reward_input_ids(self.tokenizer, p, c)
            except Exception as e:  # noqa: BLE001 - one bad sample scores 0, counted
                out[i] = SampleFailure(f"{type(e).__name__}: {e}")
        for batch in self.batches({i: len(s) for i, s in ids.items()}):
            for i, r in zip(batch, self._forward([ids[i] for i in batch])):
                out[i] = r
        return out

    def batches(self, lengths: dict[int, int]) -> list[list[int]]:
        """Sample indices per forward, longest first: at most `batch_size` sequences and
        `max_tokens` padded tokens (a longer sequence goes alone)."""
        order = sorted(lengths, key=lambda i: (-lengths[i], i))
        out: list[list[int]] = []
        for i in order:
            if out and len(out[-1]) < self.batch_size and \
                    (len(out[-1]) + 1) * lengths[out[-1][0]] <= self.max_tokens:
                out[-1].append(i)
            else:
                out.append([i])
        return out

    def _forward(self, seqs: list[list[int]]) -> list[float]:
        import torch
        lens = torch.tensor([len(s) for s in seqs], device=self.device)
        ids_BT = torch.full((len(seqs), int(lens.max())), self.pad_id, dtype=torch.long)
        for b, s in enumerate(seqs):
            ids_BT[b, :len(s)] = torch.tensor(s)
        with torch.no_grad():
            hidden_BTH = self.model(ids_BT.to(self.device))
            last_BH = hidden_BTH[torch.arange(len(seqs), device=self.device), lens - 1]
            return self.model.head(last_BH).squeeze(-1).float().tolist()


def _validate_reward_model(*, dir: str, device: str = "cpu", placement: str = "local",
                           batch_size: int = 64, max_tokens: int = 16384,
                           num_cpus: float = 1, num_gpus: float = 0,
                           produced_by: str | None = None) -> None:
    del dir, produced_by
    if batch_size < 1 or max_tokens < 1:
        raise ValueError(f"params.batch_size ({batch_size}) and params.max_tokens "
                         f"({max_tokens}) must be >= 1")
    _validate_placement(placement, num_cpus, num_gpus)
    if num_gpus > 0 and not str(device).startswith("cuda"):
        raise ValueError(f"params.num_gpus: {num_gpus} gives the actor a GPU, but params.device "
                         f"is {device!r}; set device: cuda")


@register("reward_model", validate=_validate_reward_model,
          open=lambda **params: reward_model([], [], {}, **params),
          close=lambda **params: _close("reward_model", params))
def reward_model(completions: list[str], prompts: list[list[dict]],
                 columns: dict[str, list[Any]], *, dir: str, device: str = "cpu",
                 placement: str = "local", batch_size: int = 64, max_tokens: int = 16384,
                 num_cpus: float = 1, num_gpus: float = 0, produced_by: str | None = None
                 ) -> list[float | SampleFailure]:
    """The scalar score of the reward model exported at `dir`, batched (module docstring).
    `produced_by`: the reward recipe config that makes `dir` (named when it is missing)."""
    del columns
    scorer = _open("reward_model", dict(dir=str(dir), device=device, placement=placement,
                                        batch_size=batch_size, max_tokens=max_tokens,
                                        num_cpus=num_cpus, num_gpus=num_gpus,
                                        produced_by=produced_by))
    return scorer.score(prompts, completions)


# --------------------------------------------------------------------------- LLM judge


def parse_score(text: str, pattern: str = DEFAULT_SCORE_PATTERN,
                score_range: Sequence[float] | None = (0, 10)) -> float | None:
    """The judge's score in `text`: the last match of `pattern` (its first group, if it has
    one) as a number, mapped by `score_range` [lo, hi] to ``clip((s - lo) / (hi - lo), 0, 1)``
    (None: as is); None when there is no match or it is not a number."""
    matches = list(re.finditer(pattern, text))
    if not matches:
        return None
    m = matches[-1]
    try:
        value = float(m.group(1) if m.re.groups else m.group(0))
    except (TypeError, ValueError):
        return None
    if not math.isfinite(value):
        return None
    if score_range is None:
        return value
    lo, hi = score_range
    return min(1.0, max(0.0, (value - lo) / (hi - lo)))


def rubric_fields(rubric: str) -> list[str]:
    """The placeholders of `rubric` (``{name}``), in order."""
    return [f for _, f, _, _ in string.Formatter().parse(rubric) if f is not None]


def render_rubric(rubric: str, prompt: list[dict], completion: str, row: dict[str, Any]) -> str:
    """`rubric` with ``{prompt}`` (the last user message), ``{completion}`` and the row's
    columns filled in."""
    users = [m.get("content", "") for m in prompt if m.get("role") == "user"]
    return rubric.format(**{**row, "prompt": users[-1] if users else "",
                            "completion": completion})


class JudgeScorer:
    """An LLM judge on a rollout engine of its own (module docstring)."""

    def __init__(self, model_dir: str, *, rubric: str, system: str | None = None,
                 max_new_tokens: int = 64, temperature: float = 0.0,
                 score_pattern: str = DEFAULT_SCORE_PATTERN,
                 score_range: Sequence[float] | None = (0, 10),
                 unparseable_score: float | None = None, engine: dict | None = None,
                 dtype: str = "float32", seed: int = 0):
        from posttrain.data.tokenizer import ChatTokenizer, TokenizerConfig
        from posttrain.rl.engine import SamplingConfig
        from posttrain.rl.factory import load_engine
        if not (Path(model_dir) / "config.json").is_file():
            raise FileNotFoundError(f"llm_judge: params.dir {model_dir!r} is not a Hugging Face "
                                    "checkpoint (no config.json)")
        self.tokenizer = ChatTokenizer(TokenizerConfig(path=model_dir))
        self.engine = load_engine(_engine_config(engine), model_dir, dtype=dtype, seed=seed)
        stops = [t for t in (self.tokenizer.eos_token_id, self.tokenizer.end_of_turn_token_id)
                 if t is not None]
        self.sampling = SamplingConfig(temperature=temperature, max_new_tokens=max_new_tokens,
                                       stop_token_ids=tuple(dict.fromkeys(stops)), seed=seed)
        self.rubric, self.system = rubric, system
        self.pattern, self.score_range = score_pattern, score_range
        self.unparseable_score = unparseable_score

    def prompt_ids(self, text: str) -> list[int]:
        """The judge's prompt for one rendered rubric, through its chat template."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return self.tokenizer.encode_prompt([*system, {"role": "user", "content": text}])

    def score(self, prompts: Sequence[list[dict]], completions: Sequence[str],
              columns: dict[str, list[Any]]) -> list[float | SampleFailure]:
        out: list[float | SampleFailure] = [SampleFailure("not judged")] * len(completions)
        asked: dict[int, list[int]] = {}
        for i, (p, c) in enumerate(zip(prompts, completions)):
            row = {k: col[i] for k, col in columns.items()}
            try:
                asked[i] = self.prompt_ids(render_rubric(self.rubric, p, c, row))
            except Exception as e:  # noqa: BLE001 - one bad sample scores 0, counted
                out[i] = SampleFailure(f"{type(e).__name__}: {e}")
        if not asked:
            return out
        rollouts = self.engine.generate(list(asked.values()), self.sampling, 1)
        for i, group in zip(asked, rollouts):
            answer = self.tokenizer.hf.decode(group[0].completion_ids, skip_special_tokens=True)
            value = parse_score(answer, self.pattern, self.score_range)
            if value is None:
                value = (self.unparseable_score if self.unparseable_score is not None else
                         SampleFailure(f"no score matching {self.pattern!r} in the judge's "
                                       f"answer {answer[:200]!r}"))
            out[i] = value
        return out


def _engine_config(engine: dict | None) -> Any:
    """The judge's `RolloutEngineConfig` from its ``engine`` param (kind, max_batch_sequences,
    vllm options), checked as the recipe's ``rollout:`` is."""
    from posttrain.config.loader import build
    from posttrain.rl.factory import RolloutEngineConfig
    try:
        return build(RolloutEngineConfig, dict(engine or {}), "params.engine")
    except (TypeError, ValueError) as e:            # ConfigError is a ValueError
        raise ValueError(str(e) if "params.engine" in str(e) else f"params.engine: {e}") from None


def _judge_columns(*, rubric: str, **params: Any) -> list[str]:
    del params
    return [f for f in dict.fromkeys(rubric_fields(rubric)) if f not in _FIXED_FIELDS]


def _validate_judge(*, dir: str, rubric: str, system: str | None = None,
                    max_new_tokens: int = 64, temperature: float = 0.0,
                    score_pattern: str = DEFAULT_SCORE_PATTERN,
                    score_range: Sequence[float] | None = (0, 10),
                    unparseable_score: float | None = None, engine: dict | None = None,
                    dtype: str = "float32", seed: int = 0, placement: str = "local",
                    num_cpus: float = 1, num_gpus: float = 0) -> None:
    del system, seed
    from posttrain.models.args import DTYPES
    del dir
    try:
        fields = rubric_fields(rubric)
    except ValueError as e:
        raise ValueError(f"params.rubric is not a valid template: {e}") from None
    bad = [f for f in fields if not f.isidentifier()]
    if bad:
        raise ValueError(f"params.rubric: placeholders {bad} are not plain names; use {{prompt}}, "
                         "{completion} or a column such as {answer} ({{ and }} for braces)")
    if "completion" not in fields:
        raise ValueError("params.rubric has no {completion}: the judge would not see what it "
                         "grades")
    try:
        re.compile(score_pattern)
    except re.error as e:
        raise ValueError(f"params.score_pattern {score_pattern!r} is not a valid regex: "
                         f"{e}") from None
    if score_range is not None and (len(score_range) != 2 or not all(
            math.isfinite(float(x)) for x in score_range) or not score_range[0] < score_range[1]):
        raise ValueError(f"params.score_range must be [lo, hi] with lo < hi, got {score_range!r}")
    if unparseable_score is not None and not math.isfinite(unparseable_score):
        raise ValueError(f"params.unparseable_score must be finite, got {unparseable_score}")
    if max_new_tokens < 1 or temperature < 0:
        raise ValueError(f"params.max_new_tokens must be >= 1 and params.temperature >= 0, got "
                         f"{max_new_tokens} and {temperature}")
    if dtype not in DTYPES:
        raise ValueError(f"params.dtype {dtype!r} is not one of {sorted(DTYPES)}")
    _engine_config(engine)
    _validate_placement(placement, num_cpus, num_gpus)


@register("llm_judge", validate=_validate_judge, columns=_judge_columns,
          open=lambda **params: llm_judge([], [], {}, **params),
          close=lambda **params: _close("llm_judge", params))
def llm_judge(completions: list[str], prompts: list[list[dict]], columns: dict[str, list[Any]],
              *, dir: str, rubric: str, system: str | None = None, max_new_tokens: int = 64,
              temperature: float = 0.0, score_pattern: str = DEFAULT_SCORE_PATTERN,
              score_range: Sequence[float] | None = (0, 10),
              unparseable_score: float | None = None, engine: dict | None = None,
              dtype: str = "float32", seed: int = 0, placement: str = "local",
              num_cpus: float = 1, num_gpus: float = 0) -> list[float | SampleFailure]:
    """The judge's parsed, normalised score of each completion (module docstring)."""
    scorer = _open("llm_judge", dict(
        dir=str(dir), rubric=rubric, system=system, max_new_tokens=max_new_tokens,
        temperature=temperature, score_pattern=score_pattern,
        score_range=None if score_range is None else list(score_range),
        unparseable_score=unparseable_score, engine=engine or {}, dtype=dtype, seed=seed,
        placement=placement, num_cpus=num_cpus, num_gpus=num_gpus))
    used = {c: columns[c] for c in _judge_columns(rubric=rubric) if c in columns}
    return scorer.score(prompts, completions, used)


# --------------------------------------------------------------------------- placement


def _validate_placement(placement: str, num_cpus: float, num_gpus: float) -> None:
    if placement not in _PLACEMENTS:
        raise ValueError(f"params.placement {placement!r} is not one of {list(_PLACEMENTS)}")
    if num_cpus < 0 or num_gpus < 0:
        raise ValueError("params.num_cpus and params.num_gpus must be >= 0")
    if placement == "local" and (num_cpus, num_gpus) != (1, 0):
        raise ValueError("params.num_cpus / params.num_gpus size the Ray actor of placement: "
                         "actor; with placement: local the model uses this process's devices")


def _build(kind: str, params: dict[str, Any]) -> Any:
    """The scorer of `kind` for the function's `params` (placement keys dropped)."""
    kwargs = {k: v for k, v in params.items() if k not in ("placement", "num_cpus", "num_gpus")}
    model_dir = kwargs.pop("dir")
    cls = RewardModelScorer if kind == "reward_model" else JudgeScorer
    return cls(model_dir, **kwargs)


class ScorerHost:
    """The Ray actor of a ``placement: actor`` scorer: builds it once, scores on request."""

    def __init__(self, kind: str, params: dict[str, Any]):
        import torch
        if not torch.cuda.is_available():   # the CPUs Ray gave this actor
            torch.set_num_threads(max(1, int(params["num_cpus"])))
        self.scorer = _build(kind, params)

    def score(self, *args: Any) -> list[float | SampleFailure]:
        return self.scorer.score(*args)


class _ActorScorer:
    """A scorer's handle on its Ray actor."""

    def __init__(self, kind: str, params: dict[str, Any]):
        import ray
        if not ray.is_initialized():
            raise RuntimeError(f"{kind}: params.placement: actor needs Ray (a run with "
                               "run.launcher: ray); use placement: local outside one")
        self.ray = ray
        self.actor = ray.remote(ScorerHost).options(
            num_cpus=params["num_cpus"], num_gpus=params["num_gpus"],
            runtime_env={"env_vars": {"OMP_NUM_THREADS": str(max(1, int(params["num_cpus"])))}},
        ).remote(kind, params)

    def score(self, *args: Any) -> list[float | SampleFailure]:
        return self.ray.get(self.actor.score.remote(*args))

    def close(self) -> None:
        self.ray.kill(self.actor)


_OPEN: dict[str, Any] = {}        # (kind, params) as JSON -> the scorer opened for them
_LOCK = threading.Lock()


def _key(kind: str, params: dict[str, Any]) -> str:
    return json.dumps([kind, params], sort_keys=True, default=str)


def _open(kind: str, params: dict[str, Any]) -> Any:
    """The scorer for `params`, opened on first use (in this process, or its actor)."""
    key = _key(kind, params)
    with _LOCK:
        if key not in _OPEN:
            _OPEN[key] = (_ActorScorer(kind, params) if params["placement"] == "actor"
                          else _build(kind, params))
        return _OPEN[key]


def _close(kind: str, params: dict[str, Any]) -> None:
    """Forget (and kill, if an actor) every scorer of `kind` on the model `params["dir"]`."""
    with _LOCK:
        keys = [k for k in _OPEN if json.loads(k)[0] == kind
                and json.loads(k)[1]["dir"] == str(params["dir"])]
        scorers = [_OPEN.pop(k) for k in keys]
    for scorer in scorers:
        if isinstance(scorer, _ActorScorer):
            scorer.close()
