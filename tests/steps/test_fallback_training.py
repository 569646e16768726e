"""Architectures without a native definition train through the one driver (transformers).

Tiny random GPT-2 (tied head, absolute positions, Conv1D layers) and Phi-3 (untied, RoPE)
checkpoints are made here with transformers; SFT and DPO runs on them, through the same CLI as
the native recipes (`steps.train_sft`, `steps.train_dpo`, one inline worker, FSDP2 over a
group of one), must

- train (the loss moves) and checkpoint after every step, on 1 worker and sharded over 2
  (the same losses and weights within 1e-5);
- resume bit for bit after a SIGKILL (the exported weights are byte-identical);
- export a checkpoint that transformers loads with the logits of the trained model (the
  engine's model restored from the last checkpoint), within 1e-5;
- warn once, naming what does not apply to them (document masks by transformers' detection,
  LoRA on the architecture's own names, no TP, the 6 N FLOPs estimate).

GRPO, distillation and the reward model on the fallback: tests/steps/test_fallback_rl.py.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from .conftest import run_and_kill, run_to_end, safetensors

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
STEPS, KILL_STEP = 4, 2
CASES = [("gpt2", "sft"), ("phi3", "sft"), ("phi3", "dpo")]
RESUMED = [("phi3", "sft"), ("phi3", "dpo")]       # SIGKILL + restart (a subprocess each)


def _checkpoint(arch: str, vocab: int, out: Path) -> Path:
    from transformers import AutoModelForCausalLM, GPT2Config, Phi3Config
    if arch == "gpt2":
        config = GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                            bos_token_id=0, eos_token_id=0, initializer_range=0.05)
    else:
        config = Phi3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=512, original_max_position_embeddings=512,
                            pad_token_id=0, bos_token_id=1, eos_token_id=2,
                            initializer_range=0.05)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


def _config(recipe: str, hf_dir: Path) -> dict:
    data = ROOT / "assets" / "data"
    common = {"run": {"num_workers": 1, "launcher": "inline"},
              "tokenizer": {"path": str(ROOT / "assets" / "tokenizer")},
              "model": {"hf_dir": str(hf_dir), "dtype": "float32"},
              "eval": {"max_batches": 4}}
    # Adam's eps 1e-6, not 1e-8: Adam divides each gradient by its own RMS, so an entry whose
    # gradient is near 0 moves by a fraction of lr that rounding decides. With 1e-8 one embedding
    # entry differed by 5e-6, then 2e-5 (another float reassociation in the loss), between 1 and
    # 2 workers while every other weight was within 1e-6; with 1e-6 it differs by 2e-6.
    train = {"max_steps": STEPS, "tokens_per_step": 512,
             "optimizer": {"lr": 3e-3, "weight_decay": 0.0, "eps": 1e-6},
             "scheduler": {"kind": "constant"},
             "parallel": {"activation_checkpointing": "none"}, "seed": 0,
             "checkpoint_every_steps": 1, "keep_checkpoints": 10}
    if recipe == "sft":
        return {**common,
                "data": {"format": "chat", "max_tokens_per_sample": 128,
                         "train": [{"name": "chat", "path": str(data / "chat/train.jsonl")}],
                         "eval": [{"name": "chat", "path": str(data / "chat/eval.jsonl")}]},
                "train": {**train, "loader": {"packing": {"max_tokens_per_pack": 256}}}}
    return {**common, "loss": {"beta": 0.1},
            "data": {"format": "preference", "max_tokens_per_sample": 96, "on_bad_row": "skip",
                     "train": [{"name": "pref", "path": str(data / "preference/train.jsonl")}],
                     "eval": [{"name": "pref", "path": str(data / "preference/eval.jsonl")}]},
            "train": {**train, "loader": {"format": "preference",
                                          "packing": {"max_tokens_per_pack": 256}}}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[str, str], tuple[Path, Path]]:
    """(arch, recipe) -> (config path, run dir) of an uninterrupted run."""
    from transformers import AutoTokenizer
    tmp = tmp_path_factory.mktemp("fallback")
    vocab = len(AutoTokenizer.from_pretrained(str(ROOT / "assets" / "tokenizer")))
    out = {}
    for arch, recipe in CASES:
        hf_dir = tmp / f"base_{arch}"
        if not hf_dir.exists():
            _checkpoint(arch, vocab, hf_dir)
        config = tmp / f"{arch}_{recipe}.yaml"
        config.write_text(yaml.safe_dump(_config(recipe, hf_dir)))
        run_dir = tmp / f"{arch}_{recipe}"
        run_to_end(f"steps.train_{recipe}", config, run_dir)
        out[arch, recipe] = config, run_dir
    return out


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.parametrize("arch, recipe", CASES)
def test_trains(runs, arch, recipe):
    losses = _losses(runs[arch, recipe][1])
    assert len(losses) == STEPS and losses[-1] < losses[0], losses
    result = json.loads((runs[arch, recipe][1] / "result.json").read_text())
    assert result["mean_mfu"] > 0                      # the 6 N estimate, not 0


@pytest.mark.parametrize("arch, recipe", RESUMED)
def test_resumes_bit_for_bit(runs, arch, recipe):
    config, ref_dir = runs[arch, recipe]
    losses = _losses(ref_dir)
    run_dir = ref_dir.with_name(ref_dir.name + "_killed")
    run_and_kill(f"steps.train_{recipe}", config, run_dir, KILL_STEP)
    run_to_end(f"steps.train_{recipe}", config, run_dir)
    assert safetensors(run_dir / "hf") == safetensors(ref_dir / "hf")
    assert _losses(run_dir)[KILL_STEP:] == losses[KILL_STEP:]


def test_two_fsdp2_workers_match_one(runs, tmp_path, local_ray):
    """The transformers model sharded over 2 Ray workers (FSDP2 over gloo) trains the same
    steps: per-step losses within 1e-5 of the 1-worker run, weights within 1e-5."""
    from steps import train_sft

    from .conftest import assert_weights_close
    config, ref_dir = runs["phi3", "sft"]
    result = train_sft.run(config, overrides={
        "run.dir": str(tmp_path / "ray2"), "run.launcher": "ray", "run.num_workers": 2},
        prepared_dir=str(ref_dir / "prepared"), show_progress=False)
    assert result["model"]["world_size"] == 2
    got, want = _losses(Path(result["run_dir"])), _losses(ref_dir)
    assert len(got) == len(want) == STEPS
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)
    assert_weights_close(Path(result["hf_dir"]), ref_dir / "hf", 1e-5)


@pytest.mark.parametrize("arch", ["gpt2", "phi3"])
def test_export_loads_in_transformers_with_the_trained_logits(runs, arch):
    from transformers import AutoModelForCausalLM

    from posttrain.config.loader import build
    from posttrain.distributed.env import init_process_group
    from posttrain.models.fallback import FallbackWarning
    from posttrain.train.engine import Engine
    from posttrain.train.sft import SFTConfig
    config, run_dir = runs[arch, "sft"]
    cfg = build(SFTConfig, yaml.safe_load(config.read_text()))
    init_process_group()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        engine = Engine(cfg.model, cfg.train.engine, cfg.model.hf_dir, str(run_dir))
    assert engine.args is None and engine.load_checkpoint() is not None
    assert engine.step == STEPS
    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    hf = AutoModelForCausalLM.from_pretrained(str(run_dir / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        engine.root.eval()
        engine.root.unshard()          # the root's own parameters (embedding, head); the
        trained = engine.model.logits(engine.model(ids))    # blocks gather in their hooks
        engine.root.reshard()
        exported = hf(input_ids=ids).logits
    base = AutoModelForCausalLM.from_pretrained(cfg.model.hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (base(input_ids=ids).logits - exported).abs().max() > 1e-3   # it did train
    assert (trained - exported).abs().max() <= 1e-5


def test_the_run_warns_once_naming_what_does_not_apply(runs, tmp_path):
    from posttrain.models.fallback import FallbackWarning
    from steps import train_sft
    config, _ = runs["gpt2", "sft"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_sft.run(config, overrides={"run.dir": str(tmp_path / "run"), "train.max_steps": 1},
                      show_progress=False)
    fallback = [w for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(fallback) == 1, [str(w.message) for w in fallback]
    text = str(fallback[0].message)
    for phrase in ("no native definition", "document", "LoRA", "tensor parallelism", "6*N"):
        assert phrase in text, (phrase, text)


def test_lora_on_the_fallback_fails_naming_the_key(runs, tmp_path):
    """LoRA on a transformers model targets its own Linear names; GPT-2's blocks are Conv1D,
    so the native default targets are refused before training starts, naming the key and
    what the model has (tensor parallelism is refused likewise, `posttrain.train.fallback_build`)."""
    from posttrain.config.loader import build, to_dict
    from posttrain.errors import ConfigError
    from posttrain.train.recipe import RecipeWorker
    from posttrain.train.sft import SFT
    config, ref_dir = runs["gpt2", "sft"]
    cfg = yaml.safe_load(config.read_text())
    cfg["model"]["lora"] = {"rank": 4}
    cfg["export"] = {"format": "peft"}
    cfg = to_dict(build(SFT.config_cls, cfg))
    with warnings.catch_warnings(), pytest.raises(ConfigError,
                                                  match="model.lora.targets.*lm_head"):
        warnings.simplefilter("ignore")
        RecipeWorker(SFT, cfg, cfg["model"]["hf_dir"], str(ref_dir / "prepared"),
                     str(tmp_path / "run"))
