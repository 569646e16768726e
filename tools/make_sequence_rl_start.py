"""Make the committed starting checkpoint of the sequence RL tests: the tiny sequence model.

`tests/steps/test_train_sequence_rl.py` trains with RL from a model pretrained on the bundled
event data by `configs/sequence/tiny.yaml` (40 steps). Training it there would add about 20 s
to every `make test`, and a pretraining trajectory ends at a slightly different model on every
CPU kind, so the RL test (its golden losses above all) would start from another point on each.
The tests start from this fixed checkpoint instead; the sequence recipe itself is tested by
`tests/steps/test_train_sequence.py`.

    python tools/make_sequence_rl_start.py                  # trains configs/sequence/tiny.yaml
    python tools/make_sequence_rl_start.py --sequence-dir runs/sequence_tiny/hf   # packages one

It writes `tests/fixtures/events_sequence/`: the causal LM of the export (weights, config,
``event_vocab.json``; not the per-position heads, which RL does not use) and
`provenance.json` (the recipe, the code version, the run's last loss and held-out next-item
accuracy).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "lib"), str(ROOT)]
RECIPE = "configs/sequence/tiny.yaml"
OUT = ROOT / "tests" / "fixtures" / "events_sequence"
FILES = ("config.json", "model.safetensors", "event_vocab.json")


def train(run_dir: Path) -> Path:
    from posttrain.config.recipes import load_recipe
    from posttrain.train.sequence import SequenceConfig
    from steps import train_sequence
    cfg = load_recipe(ROOT / RECIPE, SequenceConfig, {"run.dir": str(run_dir)})
    return Path(train_sequence.run(cfg, show_progress=True)["hf_dir"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequence-dir", help="an existing export of the recipe to package "
                        "(default: train it now)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(args.sequence_dir) if args.sequence_dir else train(Path(tmp) / "sequence")
        result_path = hf.parent / "result.json"
        result = json.loads(result_path.read_text()) if result_path.is_file() else {}
        rows = ([json.loads(x) for x in (hf.parent / "metrics.jsonl").read_text().splitlines()]
                if (hf.parent / "metrics.jsonl").is_file() else [])
        OUT.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            shutil.copyfile(hf / name, OUT / name)
    losses = [r for r in rows if "loss" in r]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    ev = result.get("eval") or {}
    provenance = {
        "recipe": RECIPE, "code_commit": commit,
        "steps": losses[-1]["step"] if losses else None,
        "final_loss": losses[-1]["loss"] if losses else None,
        "heldout_next_item_accuracy": ev.get("eval_next_item_accuracy"),
        "heldout_next_item_loss": ev.get("eval_next_item_loss"),
        "made_by": "python tools/make_sequence_rl_start.py",
    }
    (OUT / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    print(json.dumps(provenance))
    return 0


if __name__ == "__main__":
    sys.exit(main())
