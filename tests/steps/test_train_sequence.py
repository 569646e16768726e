"""steps/train_sequence.py end to end: the bundled config (configs/sequence/tiny.yaml) on the
bundled synthetic event data, exactly as `posttrain train-sequence` runs it (inline launcher).

What is proved, against one uninterrupted reference run (a subprocess, 40 steps):
- pretrained from scratch, the model predicts held-out next items far above chance (and above
  always guessing the most frequent item), the event-type head beats the majority class and
  the dwell head beats predicting the mean;
- the export is a Hugging Face causal LM that transformers loads with the trained model's
  next-item logits, and `load_heads` gives the trained heads' outputs on its hidden states;
- SIGKILL after the step-20 checkpoint (mid-epoch: shuffle and packing buffers full of labelled
  samples) + restart gives bit-identical losses, held-out metrics and exported files;
- the first losses match the stored golden values.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from functools import partial
from pathlib import Path

import pytest
import torch

from posttrain.config.recipes import load_recipe
from posttrain.train.sequence import SequenceConfig

from .conftest import run_and_kill, run_to_end, safetensors
from .golden import check_golden

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "sequence" / "tiny.yaml"
EVAL_ROWS = ROOT / "assets" / "data" / "events" / "eval.jsonl"
pytestmark = pytest.mark.slow          # a module fixture trains the reference run
MAX_STEPS, KILL_STEP = 40, 20          # the config's max_steps and a checkpoint of it
NUM_ITEMS = 100
# measured 0.544 (the best possible is about 0.57: the top successor's 0.6 of the 95% of steps
# that do not jump) on ATEN_CPU_CAPABILITY=default/avx2 x 1/2 threads; chance is 0.01
NEXT_ITEM_FLOOR = 0.4
LOGIT_ATOL = 1e-5

_run_to_end = partial(run_to_end, "steps.train_sequence")
_run_and_kill = partial(run_and_kill, "steps.train_sequence")


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("sequence") / "reference"
    _run_to_end(CONFIG, run_dir)
    return run_dir


def test_first_losses_match_the_golden_values(reference):
    check_golden("sequence", [m["loss"] for m in _metrics(reference) if "loss" in m])


def test_held_out_predictions_are_far_above_chance(reference):
    ev = json.loads((reference / "result.json").read_text())["eval"]
    rows = [json.loads(x) for x in EVAL_ROWS.read_text().splitlines()]
    # every event is a target once (<bos> predicts the first): the baselines over all of them
    items = Counter(t for r in rows for t in r["tokens"])
    types = Counter(t for r in rows for t in r["labels"]["event_type"])
    dwell = torch.tensor([d for r in rows for d in r["labels"]["dwell"] if d is not None])
    n = sum(items.values())
    assert ev["eval_tokens"] == ev["eval_event_type_labels"] == n
    assert ev["eval_dwell_labels"] == len(dwell)
    chance, most_frequent = 1 / NUM_ITEMS, max(items.values()) / n
    majority_type, mean_dwell_mse = max(types.values()) / n, float(dwell.var(unbiased=False))
    print(f"held out: next item {ev['eval_next_item_accuracy']:.3f} (chance {chance:.3f}, most "
          f"frequent {most_frequent:.3f}); event type {ev['eval_event_type_accuracy']:.3f} "
          f"(majority {majority_type:.3f}); dwell MSE {ev['eval_dwell_loss']:.3f} (predicting "
          f"the mean {mean_dwell_mse:.3f})")
    assert ev["eval_next_item_accuracy"] >= max(5 * chance, 5 * most_frequent, NEXT_ITEM_FLOOR)
    assert ev["eval_event_type_accuracy"] >= majority_type + 0.15
    assert ev["eval_dwell_loss"] <= 0.85 * mean_dwell_mse


def _trained_model(cfg: SequenceConfig, run_dir: Path):
    """The run's last checkpoint as the engine trained it: the native body and its heads."""
    from posttrain.distributed.env import init_process_group
    from posttrain.models.heads import PositionHeads
    from posttrain.train.engine import Engine
    from posttrain.train.export import model_from_state
    from posttrain.train.recipe import tokenizer_vocab
    from posttrain.train.sequence import SequenceLoss
    init_process_group()
    engine = Engine(cfg.model, cfg.train.engine, str(run_dir / "base_model"), str(run_dir),
                    loss_factory=lambda m: SequenceLoss(m, cfg.heads),
                    vocab_size=tokenizer_vocab(str(run_dir / "prepared")))
    assert engine.load_checkpoint() is not None and engine.step == MAX_STEPS
    state = engine.full_state_dict()
    heads = PositionHeads(cfg.heads.per_position, engine.args.hidden_size)
    heads.load_state_dict({k[len("heads."):]: state.pop(k) for k in list(state)
                           if k.startswith("heads.")})
    return model_from_state(state, engine.args).eval(), heads.eval()


def test_export_loads_in_transformers_with_the_trained_outputs(reference):
    from transformers import AutoModelForCausalLM

    from posttrain.data.events import load_event_vocab
    from posttrain.models.heads import load_heads
    cfg = load_recipe(CONFIG, SequenceConfig, {"run.dir": str(reference)})
    native, native_heads = _trained_model(cfg, reference)
    out = reference / "hf"
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    heads = load_heads(out)
    vocab = load_event_vocab(out)
    assert vocab.vocab_size == hf.config.vocab_size == 103
    assert (hf.config.pad_token_id, hf.config.bos_token_id) == (0, 1)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}   # not heads.safetensors
    rows = [json.loads(x) for x in EVAL_ROWS.read_text().splitlines()[:4]]
    worst = {"logits": 0.0, "event_type": 0.0, "dwell": 0.0}
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([[vocab.special_id("bos")] + [vocab.item_id(t)
                                                            for t in r["tokens"]]])
            hidden = native(ids)
            want = native.logits(hidden)[..., :vocab.vocab_size]
            got = hf(ids, output_hidden_states=True)
            worst["logits"] = max(worst["logits"], float((got.logits - want).abs().max()))
            mine, theirs = native_heads(hidden), heads(hf.model(ids).last_hidden_state)
            for name in ("event_type", "dwell"):
                worst[name] = max(worst[name], float((theirs[name] - mine[name]).abs().max()))
    print(f"max |transformers + load_heads - trained|: {worst}")
    assert max(worst.values()) <= LOGIT_ATOL, worst


def test_sigkill_and_restart_gives_bit_identical_results(reference, tmp_path):
    run_dir = tmp_path / "killed"
    # what its first start writes; copied, they spare that start a transformers model build
    for part in ("prepared", "base_model"):
        shutil.copytree(reference / part, run_dir / part)
    _run_and_kill(CONFIG, run_dir, KILL_STEP)
    _run_to_end(CONFIG, run_dir)
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["started_at_step"], result["steps"]) == (KILL_STEP, MAX_STEPS)
    assert safetensors(run_dir / "hf") == safetensors(reference / "hf")   # LM and heads
    for name in ("heads.json", "event_vocab.json", "config.json"):
        assert (run_dir / "hf" / name).read_text() == (reference / "hf" / name).read_text()
    mine, ref = _metrics(run_dir), _metrics(reference)
    keys = ("step", "loss", "next_item_loss", "event_type_loss", "dwell_loss", "grad_norm")
    assert [tuple(m[k] for k in keys) for m in mine if "loss" in m] == \
        [tuple(m[k] for k in keys) for m in ref if "loss" in m]
    evals = [{k: v for k, v in m.items() if k.startswith("eval_")} for m in (mine[-1], ref[-1])]
    assert evals[0] == evals[1] and evals[0]


def test_cli_has_the_verb():
    from steps.cli import build_parser
    args = build_parser().parse_args(["train-sequence", "--config", str(CONFIG)])
    assert args.command == "train-sequence"
