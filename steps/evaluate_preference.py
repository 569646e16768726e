"""Evaluate a DPO-trained checkpoint on held-out pairs, against the model it started from.

Loads both exported Hugging Face checkpoints (policy and starting model), runs the prepared
eval split's pairs through each, and reports preference accuracy, reward margin, rewards,
DPO loss and log-probs (`posttrain.eval.preference`). Writes `<out>/eval.json` if asked.

    python -m steps.evaluate_preference --policy-dir runs/dpo_tiny/hf \\
        --reference-dir runs/dpo_tiny/base_model --prepared-dir runs/dpo_tiny/prepared
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from posttrain.data.loader import LoaderConfig, sources_from_manifest
from posttrain.eval.preference import preference_eval
from posttrain.models.hf_io import load_hf


def run(policy_dir: str, reference_dir: str, prepared_dir: str, *,
        loader: LoaderConfig | None = None, beta: float = 0.1, max_batches: int = 50,
        logp_reduction: str = "sum", out_dir: str | None = None) -> dict[str, Any]:
    loader = loader or LoaderConfig(format="preference")
    result: dict[str, Any] = {"policy_dir": policy_dir, "reference_dir": reference_dir,
                              "beta": beta}
    result["heldout"] = preference_eval(
        load_hf(policy_dir), load_hf(reference_dir), sources_from_manifest(prepared_dir, "eval"),
        loader, beta=beta, max_batches=max_batches, reduction=logp_reduction)
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "eval.json").write_text(json.dumps(result, indent=2))
    return result


def table(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows (metric, value) for a card or a printout."""
    h = result.get("heldout", {})
    names = {"accuracy": "held-out preference accuracy", "margin": "held-out reward margin",
             "loss": "held-out DPO loss", "rewards_chosen": "reward (chosen)",
             "rewards_rejected": "reward (rejected)", "pairs": "held-out pairs"}
    return [{"metric": label, "value": round(h[k], 6) if isinstance(h[k], float) else h[k]}
            for k, label in names.items() if k in h]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m steps.evaluate_preference", description=__doc__)
    p.add_argument("--policy-dir", required=True)
    p.add_argument("--reference-dir", required=True)
    p.add_argument("--prepared-dir", required=True)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--out-dir")
    a = p.parse_args(argv)
    print(json.dumps(run(a.policy_dir, a.reference_dir, a.prepared_dir, beta=a.beta,
                         out_dir=a.out_dir), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
