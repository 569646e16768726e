"""Evaluate an exported checkpoint: held-out loss and perplexity, and a few generated samples.

Loads the Hugging Face checkpoint the training step exported (so the numbers describe the
artifact users will deploy), runs the prepared eval split, and greedily answers a few held-out
prompts. Writes `<out>/eval.json` and returns the table.

    python -m steps.evaluate --hf-dir runs/sft_tiny/hf --prepared-dir runs/sft_tiny/prepared
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from posttrain.data.formats import FormatConfig, parse_row
from posttrain.data.loader import LoaderConfig, sources_from_manifest
from posttrain.data.sources import RowStream, expand_paths
from posttrain.data.tokenizer import ChatTokenizer, TokenizerConfig
from posttrain.eval.heldout import heldout_loss, sample_table
from posttrain.models.hf_io import load_hf


def run(hf_dir: str, prepared_dir: str, *, loader: LoaderConfig | None = None,
        max_batches: int = 50, num_samples: int = 4, max_new_tokens: int = 48,
        sample_source: str | None = None, out_dir: str | None = None) -> dict[str, Any]:
    model = load_hf(hf_dir)
    result: dict[str, Any] = {"hf_dir": hf_dir}
    manifest = json.loads((Path(prepared_dir) / "manifest.json").read_text())
    if any(s["split"] == "eval" for s in manifest["sources"]):
        result["heldout"] = heldout_loss(model, sources_from_manifest(prepared_dir, "eval"),
                                         loader or LoaderConfig(), max_batches)
    if num_samples and sample_source:
        tok = ChatTokenizer(TokenizerConfig(path=f"{prepared_dir}/tokenizer"))
        conversations = _conversations(sample_source, num_samples)
        result["samples"] = sample_table(model, tok, conversations,
                                         max_new_tokens=max_new_tokens)
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "eval.json").write_text(json.dumps(result, indent=2))
    return result


def _conversations(path: str, n: int) -> list[list[dict]]:
    out = []
    with RowStream(expand_paths(path)) as rows:
        for raw in rows:
            if raw.error is None:
                out.append(parse_row(raw.data, FormatConfig("chat")).messages)
            if len(out) >= n:
                break
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m steps.evaluate", description=__doc__)
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--prepared-dir", required=True)
    p.add_argument("--samples-from", help="JSONL of chats to prompt with (last turn held out)")
    p.add_argument("--out-dir")
    a = p.parse_args(argv)
    print(json.dumps(run(a.hf_dir, a.prepared_dir, sample_source=a.samples_from,
                         out_dir=a.out_dir), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
