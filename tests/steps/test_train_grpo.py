"""steps/train_grpo.py end to end on the bundled arithmetic task, on CPU.

Every GRPO run here starts from one committed SFT checkpoint (`tests/fixtures/arithmetic_sft`,
made by `tools/make_grpo_start.py` from configs/sft/arithmetic_tiny.yaml): the same starting
point on every machine, and no 500-step SFT run inside the suite. What is proved:
- 80 GRPO steps raise held-out accuracy on 200 unseen problems beyond chance, measured per
  problem on the distribution GRPO optimizes (32 samples per problem at the training
  temperature, a paired statistic over problems), and do not break the greedy policy;
- the weight sync check holds at every step (engine and trainer log-probs of a fixed sequence
  agree), and it does detect an engine that was not synced;
- SIGKILL + restart gives bit-identical exported weights and identical per-step metrics;
- two Ray trainer ranks (FSDP2) with a separate rollout engine actor follow one inline rank;
- bad configs fail naming the key.
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
from functools import partial
from pathlib import Path

import pytest
import yaml

from posttrain.config.recipes import load_recipe
from posttrain.errors import ConfigError
from posttrain.train.grpo import GRPOConfig
from steps import evaluate, train_grpo

from .conftest import assert_weights_close, run_and_kill, run_to_end, safetensors
from .rl_learning import EVAL_OVERRIDES, EVAL_SAMPLES, SFT_MODEL, accuracy_gain

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow          # a module fixture trains the reference runs
_run_to_end = partial(run_to_end, "steps.train_grpo")
_run_and_kill = partial(run_and_kill, "steps.train_grpo")

ACCURACY_STEPS = 80
MIN_GAIN = 0.01              # accuracy@32, absolute
MIN_T = 2.0                  # paired t over the 200 problems: p < 0.025, one-sided
GREEDY_TOLERANCE = 0.03      # greedy accuracy may end this much below its start, no more
RESUME_STEPS = 6
SYNC_ATOL = 1e-5             # fp32 engine vs fp32 trainer, same weights


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("grpo")


@pytest.fixture(scope="module")
def sft_model() -> Path:
    """The arithmetic SFT export every GRPO run here starts from (tools/make_grpo_start.py)."""
    return SFT_MODEL


def grpo_config(workdir: Path, sft_model: Path, name: str, **changes) -> Path:
    """configs/grpo/tiny.yaml starting from the SFT model, with dotted `changes`."""
    cfg = yaml.safe_load((ROOT / "configs/grpo/tiny.yaml").read_text())
    cfg["model"]["hf_dir"] = str(sft_model)
    for dotted, value in changes.items():
        node = cfg
        *parents, last = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def accuracy_run(workdir, sft_model) -> dict:
    """80 GRPO steps. The run's own held-out evaluation (at the start and at the end) samples
    EVAL_SAMPLES completions per problem at the training temperature; the greedy comparison of
    the export with its starting checkpoint is the GRPO recipe's suite run by `steps.evaluate`,
    as the flow and a user run it."""
    config = grpo_config(workdir, sft_model, "accuracy", **EVAL_OVERRIDES)
    result = train_grpo.run(config, overrides={"run.dir": str(workdir / "accuracy"),
                                               "train.max_steps": ACCURACY_STEPS},
                            show_progress=False)
    greedy = load_recipe(config, GRPOConfig, {"eval.temperature": 0.0,
                                              "eval.samples_per_prompt": 1})
    result["greedy"] = evaluate.run(evaluate.recipe_suite("grpo", greedy), result["hf_dir"],
                                    str(sft_model)).tasks[0]
    return result


def test_starting_checkpoint_has_the_bundled_tokenizer(sft_model):
    """The committed checkpoint must be remade (tools/make_grpo_start.py) when the assets are."""
    assert (sft_model / "tokenizer.json").read_bytes() == \
        (ROOT / "assets" / "tokenizer" / "tokenizer.json").read_bytes()
    provenance = json.loads((sft_model / "provenance.json").read_text())
    assert provenance["recipe"] == "configs/sft/arithmetic_tiny.yaml"


# ---------------------------------------------------------------------------- 1. learning
# 80 GRPO steps take minutes: `make test-long` runs it; the per-step checks below read the
# resume reference's shorter run
@pytest.mark.long
def test_grpo_raises_heldout_accuracy_over_the_sft_checkpoint(accuracy_run):
    """Held-out accuracy on 200 unseen problems, before and after 80 GRPO steps.

    GRPO maximizes the expected reward of a sample at the training temperature, so that is
    what is measured: each problem's accuracy over 32 samples, before and after, and the
    paired t statistic of the 200 per-problem differences. One greedy answer per problem (the
    earlier measure) moves by a few problems only, and where it ends depends on the float
    kernels of the machine (+0.02 to +0.11 over CPU kinds and thread counts); 32 samples per
    problem take out most of the measurement noise. Measured (AMD EPYC, ATEN_CPU_CAPABILITY
    default and avx2, training seeds 0 and 1): accuracy@32 0.182 -> 0.207-0.219, gain
    +0.025 to +0.037, t 3.0 to 4.3; greedy 0.42 -> 0.43-0.45. MIN_GAIN and MIN_T sit well
    below the smallest of those; the greedy answers must not get worse beyond that spread.
    """
    before, after = accuracy_run["baseline_eval"], accuracy_run["eval"]
    _, _, gain, t = accuracy_gain(accuracy_run)
    greedy = accuracy_run["greedy"]
    assert greedy.num_samples == 200
    g_before, g_after = greedy.baseline["accuracy"], greedy.model["accuracy"]
    print(f"held-out accuracy@{EVAL_SAMPLES} {before['eval/accuracy']:.4f} -> "
          f"{after['eval/accuracy']:.4f} (paired t = {t:.2f}); greedy {g_before:.3f} -> "
          f"{g_after:.3f}")
    assert g_before > 0.3                     # the SFT model knows the procedure
    assert gain >= MIN_GAIN, (before, after)
    assert t >= MIN_T, t
    assert g_after >= g_before - GREEDY_TOLERANCE, (g_before, g_after)
    assert after["eval/reward_mean"] > before["eval/reward_mean"]


def test_every_step_logs_the_phases_and_the_algorithm_metrics(resume_reference):
    train = [m for m in metrics(resume_reference[1]) if "reward/total/mean" in m]
    assert len(train) == RESUME_STEPS
    for m in train:
        for key in ("time/generate_s", "time/score_s", "time/logprobs_s", "time/update_s",
                    "time/sync_s", "rollout_tokens_per_s", "entropy", "clip_fraction_high",
                    "clip_fraction_low", "logprob_gap", "is_weight_mean",
                    "response_length/mean", "reward/format/mean", "reward/format/std",
                    "reward/exact_match_number/failures", "groups_with_signal", "grad_norm"):
            assert key in m and math.isfinite(m[key]), (key, m)
        # two mini-batches per step (the recipe): the first is on-policy (ratio exactly 1),
        # the second a small step off it (seen: |ratio - 1| < 3e-4, nothing clipped)
        assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-2)
        assert m["clip_fraction_low"] <= 0.01 and m["clip_fraction_high"] <= 0.01
        # engine (KV-cache decoding) vs trainer (packed forward) numerics, same fp32 weights
        assert m["logprob_gap"] < 1e-4
        assert m["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)


# ---------------------------------------------------------------------------- 2. weight sync
def test_weight_sync_check_holds_at_every_step(resume_reference):
    train = [m for m in metrics(resume_reference[1]) if "reward/total/mean" in m]
    assert len(train) == RESUME_STEPS
    worst = max(m["sync/max_abs_logprob_diff"] for m in train)
    assert worst <= SYNC_ATOL, worst


def test_weight_sync_check_detects_an_unsynced_engine(workdir, sft_model, tmp_path):
    """Drive one trainer rank by hand: after an update the colocated engine is stale until
    `sync_rollout`, and the probe shows it."""
    from posttrain.config.loader import to_dict
    from posttrain.train.grpo import GRPOWorker
    from steps.common import ensure_prepared
    # the engine keeps its memory through the update: skipping the sync must leave it stale,
    # not released (a released engine refuses to score until a sync brings it back)
    cfg = load_recipe(grpo_config(workdir, sft_model, "by_hand"), GRPOConfig,
                      {"run.dir": str(tmp_path), "train.optimizer.lr": 1e-3,
                       "rollout.release_memory": False})
    prepared = ensure_prepared(cfg, str(tmp_path / "prepared"), show_progress=False)
    worker = GRPOWorker(to_dict(cfg), str(sft_model), prepared, str(tmp_path))
    worker.sync_rollout()
    group = _inline(worker)
    ctl = train_grpo.GRPOController(
        cfg, group, train_grpo.ColocatedRollouts(group), _tokenizer(prepared),
        train_grpo.read_prompt_rows(prepared, "train"), [], 1)
    assert ctl.check_sync() <= SYNC_ATOL
    ctl.rollouts.sync = lambda: 0.0          # an update whose weights never reach the engine
    ctl.step(0)
    stale = ctl.check_sync()
    assert stale > 1e-3, stale
    worker.sync_rollout()
    assert ctl.check_sync() <= SYNC_ATOL


def _inline(worker):
    from steps.common import _Inline
    return _Inline(worker)


def _tokenizer(prepared: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(f"{prepared}/tokenizer")


class _NullWriter:
    def write(self, record: dict) -> None:
        pass


# ---------------------------------------------------------------------------- 3. resume
@pytest.fixture(scope="module")
def resume_reference(workdir, sft_model) -> tuple[Path, Path]:
    config = grpo_config(workdir, sft_model, "resume", **{
        "train.max_steps": RESUME_STEPS, "train.prompts_per_step": 8,
        "train.samples_per_prompt": 8,
        "train.mini_batches": 2, "train.checkpoint_every_steps": 1,
        "train.keep_checkpoints": 10, "eval.max_prompts": 16})
    ref = workdir / "resume_reference"
    _run_to_end(config, ref)
    return config, ref


def test_sigkill_and_restart_gives_bit_identical_weights(resume_reference, workdir):
    config, ref = resume_reference
    run_dir = workdir / "resume_killed"
    # two optimizer steps per GRPO step (mini_batches: 2): checkpoint 6 is after GRPO step 3
    _run_and_kill(config, run_dir, 6)
    _run_to_end(config, run_dir)
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["started_at_step"], result["steps"]) == (3, RESUME_STEPS)
    assert safetensors(run_dir / "hf") == safetensors(ref / "hf")
    keys = ("reward/total/mean", "loss", "grad_norm", "rollout_tokens", "entropy")
    got = {m["step"]: m for m in metrics(run_dir) if "loss" in m}
    want = {m["step"]: m for m in metrics(ref) if "loss" in m}
    assert sorted(got) == sorted(want) == list(range(1, RESUME_STEPS + 1))
    for step in want:
        assert [got[step][k] for k in keys] == [want[step][k] for k in keys], step


def test_dynamic_sampling_and_overlong_shaping_resume_bit_identical(workdir, sft_model):
    """DAPO's dynamic sampling and overlong shaping: the trained groups have reward variance
    (or are counted as filler), the overlong term is part of the reward, and a run SIGKILLed
    after a checkpoint and restarted ends with the weights and per-step metrics of one that
    never stopped (the extra rounds' prompts and seeds come back exactly)."""
    prompts = 8
    config = grpo_config(workdir, sft_model, "dapo", **{
        "train.max_steps": 3, "train.prompts_per_step": prompts, "train.samples_per_prompt": 8,
        "train.mini_batches": 1, "train.checkpoint_every_steps": 1,
        "train.keep_checkpoints": 10, "eval.max_prompts": 8,
        "dynamic_sampling": {"max_rounds": 3}, "overlong": {"buffer_tokens": 16}})
    ref, killed = workdir / "dapo_reference", workdir / "dapo_killed"
    _run_to_end(config, ref)
    _run_and_kill(config, killed, 1)
    _run_to_end(config, killed)
    assert safetensors(killed / "hf") == safetensors(ref / "hf")
    want = [m for m in metrics(ref) if "loss" in m]
    got = {m["step"]: m for m in metrics(killed) if "loss" in m}
    keys = ("reward/total/mean", "loss", "rollout_tokens", "dynamic_sampling/rounds",
            "dynamic_sampling/filtered_groups")
    for m in want:
        assert [got[m["step"]][k] for k in keys] == [m[k] for k in keys], m["step"]
    print([(m["dynamic_sampling/rounds"], m["dynamic_sampling/filtered_groups"],
            m["dynamic_sampling/filler_groups"], m["reward/overlong/mean"]) for m in want])
    assert sum(m["dynamic_sampling/filtered_groups"] for m in want) > 0
    for m in want:
        filler = m["dynamic_sampling/filler_groups"]
        assert m["groups_with_signal"] == pytest.approx(1 - filler / prompts)
        assert m["dynamic_sampling/rounds"] <= 3
        assert -1.0 <= m["reward/overlong/mean"] <= 0.0


# ---------------------------------------------------------------------------- 4. Ray, separate
@pytest.fixture(scope="module")
def local_ray():
    import shutil

    import ray
    tmp = tempfile.mkdtemp(prefix="ptr", dir="/tmp")
    ray.init(num_cpus=3, include_dashboard=False, _temp_dir=tmp, log_to_driver=False,
             configure_logging=False)
    yield
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def one_update(resume_reference, workdir) -> Path:
    """One GRPO step (two optimizer steps) of the resume config on one inline rank, exported;
    the engine's log lines are kept in `ENGINE_LOG`."""
    config, ref = resume_reference
    engine_log = logging.getLogger("posttrain.train.engine")
    handler = _Keep()
    engine_log.addHandler(handler)
    level = engine_log.level
    engine_log.setLevel(logging.INFO)       # (setLevel: it also clears the logger's cache)
    try:
        result = train_grpo.run(config, overrides={"run.dir": str(workdir / "one_update"),
                                                   "train.max_steps": 1},
                                prepared_dir=str(ref / "prepared"), show_progress=False)
    finally:
        engine_log.removeHandler(handler)
        engine_log.setLevel(level)
    return Path(result["run_dir"])


ENGINE_LOG: list[str] = []


class _Keep(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        ENGINE_LOG.append(record.getMessage())


def test_the_driver_hands_its_rank_the_planned_host_budget(resume_reference, one_update):
    """`run_recipe` plans the run once and hands each worker its trainer peak as the host
    budget; the rank's heap reports it when its first optimizer step settles it. Catches a
    driver or worker that drops the budget (the rank would release at every point)."""
    from posttrain.plan import host_budget
    config, _ = resume_reference
    budget = host_budget(load_recipe(config, GRPOConfig, {"train.max_steps": 1}))
    settled = [m for m in ENGINE_LOG if m.startswith("host heap:")]
    assert budget and len(settled) == 1, ENGINE_LOG
    assert f"planned peak of {budget / 2**30:.2f} GiB" in settled[0]


@pytest.mark.parametrize("cp", [1, 2], ids=["dp2", "cp2"])
def test_two_ray_trainers_with_a_separate_engine_follow_one_inline_rank(
        resume_reference, one_update, workdir, local_ray, cp):
    """dp2: the micro-batches split over two data-parallel ranks. cp2: every packed row of
    rollouts cut over two context-parallel ranks (rows filled to a multiple of 4), the
    old-policy log-probs of the second mini-batch scored by both halves and summed. Either
    gives the inline rank's losses and exported weights."""
    config, ref = resume_reference
    result = train_grpo.run(config, overrides={
        "run.dir": str(workdir / f"ray_separate_cp{cp}"), "run.launcher": "ray",
        "run.num_workers": 2, "train.parallel.cp": cp,
        "rollout.placement": "separate", "rollout.num_engines": 1,
        "rollout.resources_per_engine": {"num_cpus": 1}, "train.max_steps": 1},
        prepared_dir=str(ref / "prepared"), show_progress=False)
    assert result["model"]["world_size"] == 2
    got = [m for m in metrics(Path(result["run_dir"])) if "loss" in m]
    want = [m for m in metrics(one_update) if "loss" in m]
    # one engine with the starting weights samples exactly the inline rank's rollouts; the
    # update is split over two ranks, so only the gradient's summation order differs
    assert got[0]["rollout_tokens"] == want[0]["rollout_tokens"]
    assert got[0]["reward/total/mean"] == want[0]["reward/total/mean"]
    assert abs(got[0]["loss"] - want[0]["loss"]) < 1e-5
    assert abs(got[0]["grad_norm"] - want[0]["grad_norm"]) < 1e-4
    assert_weights_close(Path(result["hf_dir"]), one_update / "hf", 1e-5)
    assert max(m["sync/max_abs_logprob_diff"] for m in got) <= SYNC_ATOL


# ------------------------------------------------------------------- memory release
def test_releasing_the_colocated_engine_changes_nothing(resume_reference, workdir):
    """rollout.release_memory (the default) frees the colocated engine's weights before each
    update and takes them back for a full sync. With LoRA the sync is otherwise adapters only,
    so this catches an engine resumed without a full sync (garbage weights) or not resumed
    (generation refuses): two steps with release on and off give identical metrics and
    exported weights."""
    config, ref = resume_reference
    runs = {}
    for release in (True, False):
        changes = {"run.dir": str(workdir / f"release_{release}"), "train.max_steps": 2,
                   "rollout.release_memory": release, "export.format": "merged",
                   "model.lora": {"rank": 4, "alpha": 8.0}, "train.optimizer.lr": 1e-3}
        result = train_grpo.run(config, overrides=changes, prepared_dir=str(ref / "prepared"),
                                show_progress=False)
        runs[release] = result["run_dir"], result["hf_dir"]
    keys = ("reward/total/mean", "loss", "grad_norm", "rollout_tokens", "entropy",
            "sync/max_abs_logprob_diff")
    on, off = ([[m[k] for k in keys] for m in metrics(Path(runs[r][0])) if "loss" in m]
               for r in (True, False))
    assert len(on) == 2 and on == off
    assert on[0][1] != on[1][1]                                   # it trained
    assert safetensors(Path(runs[True][1])) == safetensors(Path(runs[False][1]))


# ---------------------------------------------------------------------------- 5. KL, LoRA
@pytest.mark.parametrize("variant", ["lora_base", "copy"])
def test_kl_to_a_reference_with_lora_or_a_frozen_copy(resume_reference, workdir, variant):
    """Two GRPO steps of two mini-batches each with a k3 KL penalty: at the first optimizer
    step the policy is the reference (KL exactly 0), afterwards it is not; the engine gets the
    LoRA-merged weights and still agrees with the trainer."""
    config, ref = resume_reference
    changes = {"run.dir": str(workdir / f"kl_{variant}"), "train.max_steps": 2,
               "algorithm.kl_coef": 0.05, "algorithm.reference": variant}
    if variant == "lora_base":
        changes.update({"model.lora": {"rank": 4, "alpha": 8.0}, "export.format": "merged",
                        "train.optimizer.lr": 1e-3})
    result = train_grpo.run(config, overrides=changes, prepared_dir=str(ref / "prepared"),
                            show_progress=False)
    steps = [m for m in metrics(Path(result["run_dir"])) if "loss" in m]
    assert len(steps) == 2
    assert steps[0]["kl"] > 0 and steps[1]["kl"] > steps[0]["kl"] / 10
    assert max(m["sync/max_abs_logprob_diff"] for m in steps) <= 1e-4
    if variant == "lora_base":
        assert result["model"]["trainable_params"] < result["model"]["params"] / 5
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(result["hf_dir"])        # a plain HF checkpoint


def test_copy_reference_is_the_starting_policy_and_sharded(resume_reference, workdir, sft_model):
    """The `copy` reference is read from the policy's checkpoint into a frozen FSDP2 root of
    its own: its log-probs equal the starting policy's exactly."""
    import torch
    from torch.distributed.tensor import DTensor

    from posttrain.config.loader import to_dict
    from posttrain.train.grpo import GRPOWorker, _probe_batch
    config, ref = resume_reference
    cfg = load_recipe(config, GRPOConfig, {"algorithm.reference": "copy",
                                           "algorithm.kl_coef": 0.05})
    worker = GRPOWorker(to_dict(cfg), str(sft_model), str(ref / "prepared"),
                        str(workdir / "copy_reference"))
    assert all(isinstance(p, DTensor) and not p.requires_grad
               for p in worker.reference.parameters())
    batch = _probe_batch(list(range(40, 80)), 12)
    policy = worker.engine.score(batch)
    reference = worker.engine.score(batch, worker.reference)
    assert policy.shape == reference.shape and torch.equal(policy, reference)


# ---------------------------------------------------------------------------- 6. config
@pytest.mark.parametrize("changes, names", [
    ({"algorithm.kl_coef": 0.1}, "algorithm.reference"),
    ({"train.samples_per_prompt": 1}, "samples_per_prompt"),
    ({"train.mini_batches": 3}, "mini_batches"),
    ({"rollout.placement": "separate"}, "run.launcher: ray"),
    ({"rewards.functions": [{"name": "no_such_reward"}]}, "no_such_reward"),
    ({"algorithm.aggregation": "mean"}, "aggregation"),
    ({"algorithm.advantage": "leave_one_out"}, "advantage"),
    ({"algorithm.ratio": "sequence", "train.parallel.cp": 2}, "algorithm.ratio: sequence"),
])
def test_bad_config_fails_naming_the_key(workdir, sft_model, changes, names):
    config = grpo_config(workdir, sft_model, "bad", **changes)
    with pytest.raises(ConfigError, match=names):
        load_recipe(config, GRPOConfig)


def test_unknown_stop_token_is_refused(workdir, sft_model, tmp_path):
    config = grpo_config(workdir, sft_model, "bad_stop", **{"sampling.stop_tokens": ["<|nope|>"]})
    with pytest.raises(ConfigError, match="'<|nope|>' is not a token"):
        train_grpo.run(config, overrides={"run.dir": str(tmp_path)}, show_progress=False)
