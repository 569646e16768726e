"""Configs the plan tests share: the bundled ones with only paths and sizes changed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[3]


def qwen3_0p6b_config_dir(out: Path) -> Path:
    """A directory with only the config.json of Qwen3-0.6B's shape: what the plan reads."""
    from posttrain.models.args import ModelArgs
    from posttrain.models.families import bridge_for_args
    from posttrain.models.shapes import QWEN3_0P6B
    args = ModelArgs(**QWEN3_0P6B)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(bridge_for_args(args).hf_config(args)))
    return out


def bundled(name: str, **changes: Any) -> dict:
    """configs/<name> as a dict with dotted `changes` applied."""
    cfg = yaml.safe_load((ROOT / "configs" / name).read_text())
    for dotted, value in changes.items():
        node = cfg
        *parents, last = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return cfg


def local_data(cfg: dict, fmt: str = "chat") -> dict:
    """The bundled tokenizer and data in place of the placeholders."""
    cfg["tokenizer"]["path"] = str(ROOT / "assets" / "tokenizer")
    src = "chat" if fmt == "chat" else "arithmetic"
    cfg["data"]["train"] = [{"name": src, "path": str(ROOT / f"assets/data/{src}/train.jsonl")}]
    cfg["data"]["eval"] = [{"name": src, "path": str(ROOT / f"assets/data/{src}/eval.jsonl")}]
    return cfg
