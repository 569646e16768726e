"""Make the committed starting checkpoint of the GRPO tests: the arithmetic SFT model.

`tests/steps/test_train_grpo.py` trains GRPO from an SFT model that knows the digit-by-digit
procedure. Training it there cost 3 to 10 minutes of every `make test` (500 steps), and, worse,
a long SFT trajectory ends at another model on every CPU kind (held-out greedy accuracy 0.41 on
one machine, 0.52 on another), so the GRPO test started from a different point on each. The
tests now start from this fixed checkpoint instead; SFT itself is tested by
`tests/steps/test_train_sft.py` and the flow tests.

    python tools/make_grpo_start.py                 # trains configs/sft/arithmetic_tiny.yaml
    python tools/make_grpo_start.py --sft-dir runs/sft_arithmetic/hf   # packages an export

It writes `tests/fixtures/arithmetic_sft/`: the Hugging Face export (weights, config, tokenizer)
and `provenance.json` (the recipe, the code version, the SFT run's last losses and the held-out
greedy accuracy of the checkpoint).
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
sys.path.insert(0, str(ROOT))
RECIPE = "configs/sft/arithmetic_tiny.yaml"
OUT = ROOT / "tests" / "fixtures" / "arithmetic_sft"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "chat_template.jinja")


def train(run_dir: Path) -> Path:
    from posttrain.config.recipes import load_recipe
    from posttrain.train.sft import SFTConfig
    from steps import train_sft
    cfg = load_recipe(ROOT / RECIPE, SFTConfig, {"run.dir": str(run_dir)})
    return Path(train_sft.run(cfg, show_progress=True)["hf_dir"])


def greedy_accuracy(hf_dir: Path, work: Path) -> float:
    """Held-out greedy accuracy on the 200 problems the GRPO tests evaluate."""
    from posttrain.config.recipes import load_recipe
    from posttrain.train.grpo import GRPOConfig
    from steps import evaluate
    cfg = load_recipe(ROOT / "configs/grpo/tiny.yaml", GRPOConfig,
                      {"model.hf_dir": str(hf_dir), "run.dir": str(work)})
    result = evaluate.run(evaluate.recipe_suite("grpo", cfg), str(hf_dir))
    return result.tasks[0].model["accuracy"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sft-dir", help="an existing export of the recipe to package "
                        "(default: train it now)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        hf = Path(args.sft_dir) if args.sft_dir else train(work / "sft")
        metrics_path = hf.parent / "metrics.jsonl"
        rows = ([json.loads(x) for x in metrics_path.read_text().splitlines()]
                if metrics_path.is_file() else [])
        losses = [r for r in rows if "loss" in r]
        evals = [r for r in rows if "eval_loss" in r]
        accuracy = greedy_accuracy(hf, work / "eval")
    OUT.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copyfile(hf / name, OUT / name)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    provenance = {
        "recipe": RECIPE, "code_commit": commit,
        "steps": losses[-1]["step"] if losses else None,
        "final_loss": losses[-1]["loss"] if losses else None,
        "eval_loss": evals[-1]["eval_loss"] if evals else None,
        "heldout_greedy_accuracy": accuracy, "heldout_prompts": 200,
        "made_by": "python tools/make_grpo_start.py",
    }
    (OUT / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    print(json.dumps(provenance))
    return 0


if __name__ == "__main__":
    sys.exit(main())
