"""Every bundled config runs as typed: it validates with its recipe's schema, and each input it
names either exists, or names the bundled config that makes it (``produced_by``), whose export
is exactly that input; the only other inputs allowed missing are the absolute placeholders of
the real-model configs (``/models/...``: a user's checkpoint)."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.config.loader import to_dict
from posttrain.config.registry import kind_of
from steps import validate

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "configs").rglob("*.yaml"))


def test_every_bundled_config_validates_and_names_what_makes_its_inputs(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert len(CONFIGS) >= 25
    made_by_others = 0
    for path in CONFIGS:
        kind = kind_of(path)
        notes, problems = validate.check(path, kind)
        placeholders = [p for p in problems if " not found (point it at" in p]
        assert len(placeholders) == len(problems), (path, problems)
        for problem in placeholders:
            key, _, rest = problem.partition(": ")
            assert rest.startswith("/"), (path, problem)      # a user's path, not a run's
        cfg = to_dict(validate.load(path, kind))
        for item in validate.inputs(cfg):
            if item.path.startswith("runs/"):
                assert item.produced_by, (path, item)          # made by another bundled run
        made_by_others += len(notes)
    assert made_by_others >= 7     # grpo x5 (+rm's reward model), ppo, sequence_rl


def test_a_missing_input_without_its_maker_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    text = (ROOT / "configs/grpo/tools_tiny.yaml").read_text()
    config = tmp_path / "grpo.yaml"
    config.write_text(text.replace("  produced_by: configs/sft/tools_tiny.yaml", "  # gone"))
    notes, problems = validate.check(str(config), "grpo")
    assert problems == ["model.hf_dir: runs/sft_tools/hf not found (point it at an existing "
                        "path, e.g. --set model.hf_dir=...)"]
    config.write_text(text.replace("produced_by: configs/sft/tools_tiny.yaml",
                                   "produced_by: configs/sft/tiny.yaml"))
    notes, problems = validate.check(str(config), "grpo")
    assert problems == ["model.hf_dir: runs/sft_tools/hf is not what configs/sft/tiny.yaml "
                        "makes (its export is runs/sft_tiny/hf)"]


@pytest.mark.parametrize("argv,code,text", [
    (["validate", "--config", "configs/grpo/tools_tiny.yaml"], 0,
     "made by `posttrain train-sft --config configs/sft/tools_tiny.yaml`"),
    (["validate", "--config", "configs/grpo/tiny.yaml", "--set", "train.max_stepz=3"], 2,
     "max_stepz"),
])
def test_the_command(argv, code, text, capsys, monkeypatch):
    from steps.cli import main
    monkeypatch.chdir(ROOT)
    assert main(argv) == code
    out = capsys.readouterr()
    assert text in out.out + out.err
