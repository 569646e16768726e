"""GRPO, distillation and the reward model on architectures without a native definition.

Tiny random OLMo 3 (sliding and full layers) and GLM-4 (fused gate_up_proj) checkpoints, made
here with transformers (the bundled tokenizer's 3,185 ids, hidden 64, 2 layers), train through
the transformers fallback (`posttrain.models.fallback`) with the same CLIs as the native
models (one inline worker, FSDP2 over a group of one). What is shown:

- GRPO on a toy task (reward: the fraction of vowels in a completion; a random model starts
  near 0.09) raises the reward far beyond a control run whose rewards are shuffled over each
  batch (the same batch mean, no information about which completion earned it): OLMo 3
  fine-tuned in full, GLM-4 with LoRA on its own Linear names and a ``lora_base`` KL
  reference (the weight sync then sends the adapters only). At every step the rollout
  engine's log-probs equal the trainer's (the sync probe and the logged gap);
- SIGKILL + restart gives byte-identical exports and identical per-step metrics, for both;
- a run warns once, naming what does not apply to the architecture; `steps.evaluate` answers
  with the export;
- distillation with a transformers student and a transformers teacher, and each of them
  beside a native one: the held-out divergence the run reports equals KL(teacher || student)
  computed from transformers' own forwards of the exported student and the teacher;
- a reward model (scalar head on a transformers body): its loss falls, the export keeps the
  body's LM head for transformers, and `load_reward_model`'s scores equal the run's own.
"""

from __future__ import annotations

import json
import shutil
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch
import yaml

from .conftest import run_and_kill, run_to_end, safetensors

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
VOCAB = 3185                      # the bundled tokenizer's
GRPO_STEPS, KILL_STEP = {"olmo3": 16, "glm4": 20}, 6
REWARD = "tests.steps.fallback_rewards:"
LORA = {"rank": 8, "alpha": 16,
        "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"]}
MIN_GAIN = 0.05                   # reward, absolute: over the start and over the control
SYNC_ATOL = {"olmo3": 1e-5, "glm4": 1e-4}      # LoRA: the engine holds merged weights

_run_grpo = partial(run_to_end, "steps.train_grpo")
_kill_grpo = partial(run_and_kill, "steps.train_grpo")


def _checkpoint(arch: str, out: Path, init_std: float) -> Path:
    """A random transformers checkpoint with the bundled tokenizer beside it."""
    from transformers import AutoModelForCausalLM, Glm4Config, Olmo3Config
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  pad_token_id=0, bos_token_id=0, eos_token_id=0, initializer_range=init_std)
    config = (Olmo3Config(**common, sliding_window=16,
                          layer_types=["sliding_attention", "full_attention"])
              if arch == "olmo3" else Glm4Config(**common, head_dim=16))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    for f in (ROOT / "assets" / "tokenizer").iterdir():
        shutil.copy2(f, out / f.name)
    return out


def _rows(src: str, out: Path, n: int) -> Path:
    lines = (ROOT / "assets" / "data" / src).read_text().splitlines()[:n]
    out.write_text("\n".join(lines) + "\n")
    return out


def _metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


# --------------------------------------------------------------------------- GRPO


def _grpo_config(tmp: Path, arch: str, hf_dir: Path, reward: str) -> Path:
    cfg = {"run": {"num_workers": 1, "launcher": "inline"},
           "tokenizer": {"path": str(ROOT / "assets" / "tokenizer")},
           "data": {"format": "prompt", "max_tokens_per_sample": 64,
                    "train": [{"name": "toy", "path": str(tmp / "prompts.jsonl")}]},
           "model": {"hf_dir": str(hf_dir), "dtype": "float32"},
           "train": {"max_steps": GRPO_STEPS[arch], "prompts_per_step": 8,
                     "samples_per_prompt": 8, "max_tokens_per_micro_batch": 512,
                     "optimizer": {"lr": 1e-2, "weight_decay": 0.0},
                     "scheduler": {"kind": "constant"}, "seed": 0,
                     "checkpoint_every_steps": 1, "keep_checkpoints": 20},
           "sampling": {"temperature": 1.0, "max_new_tokens": 16,
                        "stop_tokens": ["<|im_end|>"]},
           "rewards": {"functions": [{"name": REWARD + reward, "weight": 1.0}]},
           "eval": {"max_prompts": 0}}
    if arch == "glm4":
        cfg["model"]["lora"] = LORA
        cfg["train"]["optimizer"]["lr"] = 3e-2
        cfg["algorithm"] = {"reference": "lora_base", "kl_coef": 0.01}
        cfg["export"] = {"format": "merged"}
    path = tmp / f"{arch}_{reward}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def grpo(tmp_path_factory) -> dict[str, dict]:
    """Per architecture: the reference run (a CLI subprocess, a checkpoint after every step),
    and the shuffled-reward control (in this process, its warnings recorded)."""
    from steps import train_grpo
    tmp = tmp_path_factory.mktemp("fallback_grpo")
    _rows("arithmetic/train.jsonl", tmp / "prompts.jsonl", 64)
    out = {}
    for arch in ("olmo3", "glm4"):
        # LoRA moves a random model's outputs only when its head is not near zero
        hf_dir = _checkpoint(arch, tmp / f"base_{arch}", 0.05 if arch == "olmo3" else 0.3)
        config = _grpo_config(tmp, arch, hf_dir, "vowels")
        _run_grpo(config, tmp / f"{arch}_ref")
        control = _grpo_config(tmp, arch, hf_dir, "shuffled_vowels")
        with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings(record=True) as caught:
            mp.syspath_prepend(str(ROOT))           # the reward module, as the CLI's cwd has it
            warnings.simplefilter("always")
            train_grpo.run(control, overrides={"run.dir": str(tmp / f"{arch}_control")},
                           show_progress=False)
        out[arch] = {"config": config, "ref": tmp / f"{arch}_ref",
                     "control": tmp / f"{arch}_control", "warnings": caught}
    return out


def _reward(metrics: dict[int, dict], steps: range) -> float:
    return sum(metrics[s]["reward/total/mean"] for s in steps) / len(steps)


@pytest.mark.parametrize("arch", ["olmo3", "glm4"])
def test_grpo_raises_the_reward_beyond_a_shuffled_control(grpo, arch):
    """Measured (AMD EPYC): OLMo 3 0.09 -> 0.29 (control 0.08), GLM-4 + LoRA 0.09 -> 0.20
    (control 0.09), means over the first 3 and the last 3 steps."""
    run, control = _metrics(grpo[arch]["ref"]), _metrics(grpo[arch]["control"])
    n = GRPO_STEPS[arch]
    assert sorted(run) == sorted(control) == list(range(1, n + 1))
    first, last = range(1, 4), range(n - 2, n + 1)
    start, end, shuffled = _reward(run, first), _reward(run, last), _reward(control, last)
    print(f"{arch}: reward {start:.3f} -> {end:.3f}; shuffled control "
          f"{_reward(control, first):.3f} -> {shuffled:.3f}")
    assert end >= start + MIN_GAIN and end >= shuffled + MIN_GAIN, (start, end, shuffled)


@pytest.mark.parametrize("arch", ["olmo3", "glm4"])
def test_rollout_logprobs_equal_the_trainers(grpo, arch):
    """The engine decodes the transformers model with its own KV cache; the trainer scores
    packed rows with the chunked log-probs over `head.weight`."""
    for m in _metrics(grpo[arch]["ref"]).values():
        assert m["sync/max_abs_logprob_diff"] <= SYNC_ATOL[arch], m
        assert m["logprob_gap"] <= SYNC_ATOL[arch], m
    model = json.loads((grpo[arch]["ref"] / "result.json").read_text())["model"]
    assert model["packs_documents"] is True         # transformers separates the documents
    if arch == "glm4":
        assert model["trainable_params"] < model["params"] / 10         # LoRA adapters only


@pytest.mark.parametrize("arch", ["olmo3", "glm4"])
def test_grpo_sigkill_and_restart_is_bit_identical(grpo, arch):
    config, ref = grpo[arch]["config"], grpo[arch]["ref"]
    run_dir = ref.with_name(f"{arch}_killed")
    _kill_grpo(config, run_dir, KILL_STEP)
    _run_grpo(config, run_dir)
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["started_at_step"], result["steps"]) == (KILL_STEP, GRPO_STEPS[arch])
    assert safetensors(run_dir / "hf") == safetensors(ref / "hf")
    keys = ("reward/total/mean", "loss", "grad_norm", "rollout_tokens", "entropy")
    got, want = _metrics(run_dir), _metrics(ref)
    for step in want:
        assert [got[step][k] for k in keys] == [want[step][k] for k in keys], step


def test_the_evaluate_step_answers_with_the_export(grpo, monkeypatch):
    """`steps.evaluate` runs the GRPO suite on a transformers export (and its base) with the
    same engine: the held-out reward of sampled answers rose like the training reward."""
    from steps import evaluate
    monkeypatch.syspath_prepend(str(ROOT))
    cfg = yaml.safe_load(grpo["olmo3"]["config"].read_text())
    cfg["data"]["eval"] = cfg["data"]["train"]
    cfg["eval"] = {"max_prompts": 16, "temperature": 1.0, "samples_per_prompt": 4}
    config = grpo["olmo3"]["ref"].with_name("olmo3_eval.yaml")
    config.write_text(yaml.safe_dump(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # the fallback's, once per checkpoint loaded
        result = evaluate.run(evaluate.recipe_suite("grpo", config),
                              str(grpo["olmo3"]["ref"] / "hf"), cfg["model"]["hf_dir"]).tasks[0]
    print(f"held-out reward {result.baseline['reward_mean']:.3f} -> "
          f"{result.model['reward_mean']:.3f}")
    assert result.model["reward_mean"] >= result.baseline["reward_mean"] + MIN_GAIN


def test_grpo_warns_once_naming_what_does_not_apply(grpo):
    from posttrain.models.fallback import FallbackWarning
    caught = [w for w in grpo["glm4"]["warnings"] if issubclass(w.category, FallbackWarning)]
    assert len(caught) == 1, [str(w.message) for w in caught]
    text = str(caught[0].message)
    for phrase in ("no native definition", "document", "gate_up_proj", "tensor parallelism",
                   "6*N", "vLLM"):
        assert phrase in text, (phrase, text)


# --------------------------------------------------------------------------- distillation


DISTILL_STEPS = 4
PAIRS = [("olmo3", "glm4"), ("qwen3", "olmo3"), ("olmo3", "qwen3")]   # (student, teacher)


def _native_checkpoint(out: Path) -> Path:
    """A random tiny Qwen3 (native definition) with the bundled tokenizer."""
    from posttrain.models.verify import random_hf_model, tiny_hf_config
    model = random_hf_model(tiny_hf_config("qwen3", vocab_size=VOCAB, tie_word_embeddings=True,
                                           initializer_range=0.05), seed=1)
    model.save_pretrained(out)
    for f in (ROOT / "assets" / "tokenizer").iterdir():
        shutil.copy2(f, out / f.name)
    return out


def _distill_config(tmp: Path, student: Path, teacher: Path, name: str) -> dict:
    return {"run": {"num_workers": 1, "launcher": "inline", "dir": str(tmp / name)},
            "tokenizer": {"path": str(ROOT / "assets" / "tokenizer")},
            "data": {"format": "chat", "max_tokens_per_sample": 128, "on_bad_row": "skip",
                     "train": [{"name": "chat", "path": str(tmp / "train.jsonl")}],
                     "eval": [{"name": "chat", "path": str(tmp / "eval.jsonl")}]},
            "model": {"hf_dir": str(student), "dtype": "float32"},
            "teacher": {"hf_dir": str(teacher)},
            "train": {"max_steps": DISTILL_STEPS, "tokens_per_step": 512,
                      "loader": {"packing": {"max_tokens_per_pack": 128}},
                      "optimizer": {"lr": 3e-3, "weight_decay": 0.0},
                      "scheduler": {"kind": "constant"}, "seed": 0,
                      "checkpoint_every_steps": 100},
            "eval": {"max_batches": 2}}


@pytest.fixture(scope="module")
def distilled(tmp_path_factory) -> dict[tuple[str, str], tuple[object, dict]]:
    """(student, teacher) -> (config, result) of a short online distillation run."""
    from posttrain.config.loader import build
    from posttrain.train.distill import DistillConfig
    from steps import train_distill
    tmp = tmp_path_factory.mktemp("fallback_distill")
    _rows("chat/train.jsonl", tmp / "train.jsonl", 64)
    _rows("chat/eval.jsonl", tmp / "eval.jsonl", 16)
    dirs = {"olmo3": _checkpoint("olmo3", tmp / "olmo3", 0.05),
            "glm4": _checkpoint("glm4", tmp / "glm4", 0.3),
            "qwen3": _native_checkpoint(tmp / "qwen3")}
    out = {}
    for student, teacher in PAIRS:
        cfg = build(DistillConfig, _distill_config(tmp, dirs[student], dirs[teacher],
                                                   f"{student}_from_{teacher}"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out[student, teacher] = cfg, train_distill.run(cfg, show_progress=False)
    return out


def _reference_divergence(cfg, result: dict) -> float:
    """Mean KL(teacher || student) over the held-out label positions the run evaluated, from
    transformers' forwards of the exported student and of the teacher, one document at a
    time."""
    from transformers import AutoModelForCausalLM

    from posttrain.data.loader import TrainLoader, sources_from_manifest
    from posttrain.train.recipe import one_pass
    student = AutoModelForCausalLM.from_pretrained(result["hf_dir"], dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(cfg.teacher.hf_dir, dtype=torch.float32)
    total, count = 0.0, 0
    sources = sources_from_manifest(result["prepared_dir"], "eval")
    with torch.no_grad(), TrainLoader(sources, one_pass(cfg.train.loader)) as loader:
        for batch, _ in zip(loader, range(cfg.eval.max_batches)):
            for b, lengths in enumerate(batch["document_lengths"]):
                for ids, labels in zip(batch["input_ids"][b].split(lengths),
                                       batch["labels"][b].split(lengths)):
                    kept = labels != -100
                    if not kept.any():
                        continue
                    s = student(input_ids=ids[None]).logits[0, kept, :VOCAB].log_softmax(-1)
                    t = teacher(input_ids=ids[None]).logits[0, kept, :VOCAB].log_softmax(-1)
                    total += float((t.exp() * (t - s)).sum())
                    count += int(kept.sum())
    assert count == result["eval"]["eval_tokens"]
    return total / count


@pytest.mark.parametrize("student, teacher", PAIRS)
def test_distillation_with_a_transformers_model(distilled, student, teacher):
    """The teacher's tensors survive the root's materialization (a transformers teacher in a
    native student's root) and a native teacher fills a transformers student's root: the
    run's held-out divergence is the one transformers computes."""
    cfg, result = distilled[student, teacher]
    losses = [m["loss"] for m in _metrics(Path(result["run_dir"])).values()]
    assert len(losses) == DISTILL_STEPS and losses[-1] < losses[0], losses
    got, want = result["eval"]["eval_divergence"], _reference_divergence(cfg, result)
    print(f"{student} <- {teacher}: loss {losses[0]:.4f} -> {losses[-1]:.4f}; held-out KL "
          f"{got:.6f} (transformers {want:.6f})")
    assert abs(got - want) <= 1e-5 * max(1.0, want), (got, want)


# --------------------------------------------------------------------------- reward model


@pytest.fixture(scope="module")
def reward_run(tmp_path_factory) -> tuple[Path, dict]:
    from posttrain.config.loader import build
    from posttrain.train.reward import RewardConfig
    from steps import train_reward
    tmp = tmp_path_factory.mktemp("fallback_reward")
    _rows("preference/train.jsonl", tmp / "train.jsonl", 96)
    _rows("preference/eval.jsonl", tmp / "eval.jsonl", 24)
    cfg = {"run": {"num_workers": 1, "launcher": "inline", "dir": str(tmp / "run")},
           "tokenizer": {"path": str(ROOT / "assets" / "tokenizer")},
           "data": {"format": "preference", "max_tokens_per_sample": 96, "on_bad_row": "skip",
                    "train": [{"name": "pairs", "path": str(tmp / "train.jsonl")}],
                    "eval": [{"name": "pairs", "path": str(tmp / "eval.jsonl")}]},
           "model": {"hf_dir": str(_checkpoint("olmo3", tmp / "olmo3", 0.05)),
                     "dtype": "float32"},
           "train": {"max_steps": 8, "tokens_per_step": 1024,
                     "loader": {"format": "preference",
                                "packing": {"max_tokens_per_pack": 256}},
                     "optimizer": {"lr": 3e-3, "weight_decay": 0.0},
                     "scheduler": {"kind": "constant"}, "seed": 0,
                     "checkpoint_every_steps": 100},
           "eval": {"max_batches": 100}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tmp, train_reward.run(build(RewardConfig, cfg), show_progress=False)


def test_reward_model_on_a_transformers_body(reward_run):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from posttrain.models.reward_model import load_reward_model
    tmp, result = reward_run
    losses = [m["loss"] for m in _metrics(Path(result["run_dir"])).values()]
    assert losses[-1] < losses[0], losses
    out = Path(result["hf_dir"])
    assert json.loads((out / "reward_head.json").read_text())["hidden_size"] == 64
    body = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(result["base_model_dir"], dtype=torch.float32)
    assert type(body).__name__ == "Olmo3ForCausalLM"
    assert torch.equal(body.lm_head.weight, base.lm_head.weight)        # kept, not trained
    assert not torch.equal(body.model.norm.weight, base.model.norm.weight)     # trained
    assert load_file(str(out / "reward_head.safetensors"))["weight"].shape == (1, 64)
    # the callable's scores are the run's: the mean chosen reward over the held-out pairs
    rows = [json.loads(x) for x in (tmp / "eval.jsonl").read_text().splitlines()]
    ev = result["eval"]
    assert ev["eval_pairs"] == len(rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        score = load_reward_model(str(out))
        singles = [score(r["prompt"], r["chosen"][0]["content"]) for r in rows]
        # GRPO's batched scorer (right-padded forwards through transformers) agrees
        from posttrain.rl.model_rewards import RewardModelScorer
        batched = RewardModelScorer(str(out), batch_size=8).score(
            [r["prompt"] for r in rows], [r["chosen"][0]["content"] for r in rows])
    worst = max(abs(a - b) for a, b in zip(batched, singles))
    assert worst <= 1e-5 * max(1.0, *map(abs, singles))
    mean = sum(singles) / len(rows)
    print(f"reward model: loss {losses[0]:.4f} -> {losses[-1]:.4f}; held-out accuracy "
          f"{ev['eval_accuracy']:.3f}; mean chosen reward {ev['eval_rewards_chosen']:.6f} "
          f"(callable {mean:.6f})")
    assert abs(mean - ev["eval_rewards_chosen"]) <= 1e-5 * max(1.0, abs(mean))
