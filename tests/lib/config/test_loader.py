from dataclasses import dataclass, field
from typing import Literal

import pytest

from posttrain.config import build, load_yaml, to_dict
from posttrain.errors import ConfigError


@dataclass(frozen=True)
class Inner:
    path: str
    weight: float = 1.0


@dataclass(frozen=True)
class Outer:
    inner: list[Inner]
    mode: Literal["a", "b"] = "a"
    limit: int | None = None
    tags: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        if self.limit is not None and self.limit < 0:
            raise ValueError("limit must be >= 0")


def test_build_round_trip():
    cfg = build(Outer, {"inner": [{"path": "x", "weight": 2}], "mode": "b", "tags": {"k": 1}})
    assert cfg.inner[0].weight == 2.0 and isinstance(cfg.inner[0].weight, float)
    assert build(Outer, to_dict(cfg)) == cfg


@pytest.mark.parametrize("data, message", [
    ({"inner": [{"pathh": "x"}]}, "cfg.inner[0].pathh: unknown key (did you mean 'path'?)"),
    ({"inner": [{"path": "x"}], "mdoe": "a"}, "cfg.mdoe: unknown key (did you mean 'mode'?)"),
    ({"inner": [{"path": "x"}], "mode": "c"}, "cfg.mode: 'c' is not one of ['a', 'b']"),
    ({"inner": [{"path": 3}]}, "cfg.inner[0].path: expected a string, got 3"),
    ({"inner": {}}, "cfg.inner: expected a list"),
    ({}, "cfg.inner: required key is missing"),
    ({"inner": [], "limit": True}, "cfg.limit"),
    ({"inner": [], "limit": -1}, "cfg: limit must be >= 0"),
])
def test_build_errors_name_the_key(data, message):
    with pytest.raises(ConfigError) as e:
        build(Outer, data, where="cfg")
    assert message in str(e.value)


def test_load_yaml_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_yaml(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_yaml(bad)
    evil = tmp_path / "evil.yaml"
    evil.write_text("a: !!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(ConfigError):
        load_yaml(evil)
