"""The sequence RL flow's config check. The flow is a thin composition of the driver that
tests/steps/test_train_sequence_rl.py runs and of the helpers every recipe flow shares (run
once end to end by hand when it was written: 4 steps from the committed sequence model, 23 s);
here, that its bundled configs pass the schema it parses them with and a start model without
an event vocabulary is refused at launch."""

from __future__ import annotations

import sys

import pytest
import yaml

from .conftest import REPO

SCHEMA = "posttrain.train.sequence_rl.SequenceRLConfig"
CONFIGS = REPO / "configs" / "sequence_rl"


def _parse():
    sys.path.insert(0, str(REPO / "flows"))
    from _posttrain_flow import parse_config
    return parse_config(SCHEMA)


def test_config_files_pass_the_schema():
    for path in sorted(CONFIGS.glob("*.yaml")):
        resolved = _parse()(path.read_text())
        assert resolved["data"]["format"] == "sequence", path


def test_a_start_without_an_event_vocabulary_fails_in_the_parser():
    from metaflow.exception import MetaflowException
    data = yaml.safe_load((CONFIGS / "tiny.yaml").read_text())
    data["model"]["hf_dir"] = str(REPO / "tests" / "fixtures" / "arithmetic_sft")
    with pytest.raises(MetaflowException, match="event_vocab.json"):
        _parse()(yaml.safe_dump(data))
