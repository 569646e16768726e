"""`posttrain validate`: read a config as its recipe would, and check that its inputs exist.

    posttrain validate --config configs/grpo/tools_tiny.yaml
    posttrain validate --config my.yaml --recipe dpo --set train.max_steps=10

The config is read with its kind's schema (`posttrain.config.registry`: unknown keys and wrong
types fail naming the file and key). Then every input it names is looked for: checkpoints
(``hf_dir``), data and tokenizer paths (``path``), a reward model's ``dir``, a retraining
run's recipe and snapshots. An input that is missing but names the config that makes it
(``produced_by``) is fine, and the command that makes it is printed; any other missing input
is a problem. Remote inputs (``s3://``) are not looked up. Exit status: 0 valid, 2 a problem.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.config.registry import command, export_dir, kind_of, schema
from posttrain.errors import ConfigError

_GLOB = "*?["


@dataclass(frozen=True)
class Input:
    """One input a config names: its dotted key, the path, and what makes it (a config)."""

    key: str
    path: str
    produced_by: str | None = None

    def exists(self) -> bool:
        if "://" in self.path:
            return True
        if any(c in self.path for c in _GLOB):
            return any(Path().glob(self.path)) if not Path(self.path).is_absolute() else \
                any(Path("/").glob(self.path.lstrip("/")))
        return Path(self.path).exists()


def load(path: str, kind: str, overrides: dict | None = None) -> Any:
    from posttrain.config.recipes import load_recipe
    return load_recipe(path, schema(kind), overrides)


def inputs(resolved: Any, key: str = "") -> list[Input]:
    """The inputs named in a resolved config (a plain dict, `posttrain.config.loader.to_dict`)."""
    found: list[Input] = []
    if isinstance(resolved, dict):
        made_by = resolved.get("produced_by")
        for name, value in resolved.items():
            where = f"{key}.{name}" if key else str(name)
            if name in ("hf_dir", "path", "root", "recipe") or (name == "dir" and made_by):
                paths = value if isinstance(value, list) else [value]
                found += [Input(where, p, made_by) for p in paths if isinstance(p, str)]
            elif name != "produced_by":
                found += inputs(value, where)
    elif isinstance(resolved, list):
        for i, value in enumerate(resolved):
            found += inputs(value, f"{key}[{i}]")
    return found


def check(path: str, kind: str, overrides: dict | None = None) -> tuple[list[str], list[str]]:
    """(notes, problems) for the config at `path` read as `kind` (module docstring)."""
    from posttrain.config.loader import to_dict
    cfg = load(path, kind, overrides)
    notes, problems = [], []
    for item in inputs(to_dict(cfg)):
        if item.exists():
            continue
        if not item.produced_by:
            problems.append(f"{item.key}: {item.path} not found (point it at an existing "
                            f"path, e.g. --set {item.key}=...)")
            continue
        maker = Path(item.produced_by)
        if not maker.is_file():
            problems.append(f"{item.key}: {item.path} not found, and its produced_by "
                            f"{maker} does not exist")
            continue
        made = export_dir(load(str(maker), kind_of(maker)))
        if made is not None and Path(made) != Path(item.path):
            problems.append(f"{item.key}: {item.path} is not what {maker} makes (its export "
                            f"is {made})")
            continue
        notes.append(f"{item.key}: {item.path} is made by `{command(maker)}` (a flow run "
                     f"finds or trains it)")
    return notes, problems


def main(args: argparse.Namespace) -> int:
    from steps.arguments import overrides_from
    kind = kind_of(args.config, args.recipe)
    overrides = overrides_from(argparse.Namespace(
        run_dir=None, launcher=None, num_workers=None, max_steps=None, set=args.set))
    notes, problems = check(args.config, kind, overrides)
    for line in notes:
        print(line)
    if problems:
        raise ConfigError(f"{args.config} ({kind}): " + "; ".join(problems))
    print(f"{args.config}: a valid {kind} config; run it with `{command(args.config, kind)}`")
    return 0
