"""`rollout.kind: package.module:Class`: an engine of one's own is checked when the config is
built, constructed with the documented keywords, and serves an export in evaluation exactly
as the native engine does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.errors import ConfigError
from posttrain.rl.engine import SamplingConfig
from posttrain.rl.factory import RolloutEngineConfig, build_rollout_engine, load_engine
from posttrain.rl.native import NativeEngine

ROOT = Path(__file__).resolve().parents[3]
START = ROOT / "tests" / "fixtures" / "events_sequence"      # a tiny native Qwen3 export
OWN = "tests.lib.rl.test_factory:WrappedEngine"


class WrappedEngine(NativeEngine):
    """An engine of one's own: the native engine over a model it builds itself, which keeps
    the keywords it was built with."""

    def __init__(self, *, args, hf_dir, device, dtype, seed, note="none"):
        from posttrain.models.transformer import build_model
        self.built_with = dict(hf_dir=hf_dir, device=device, dtype=dtype, seed=seed, note=note)
        super().__init__(build_model(args, device=device, dtype=dtype).eval())


@pytest.mark.parametrize("kind, match", [
    ("weird", "not native, vllm or an engine class"),
    ("os.path:join", "is not a class"),
    ("posttrain.rl.engine:SamplingConfig", "lacks"),
    ("no_such_module_xyz:Engine", "cannot import"),
])
def test_a_kind_that_is_not_an_engine_class_is_refused(kind, match):
    with pytest.raises(ConfigError, match=f"rollout.kind.*{match}"):
        RolloutEngineConfig(kind=kind)


def test_options_belong_to_ones_own_engine(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    with pytest.raises(ValueError, match="rollout.options"):
        RolloutEngineConfig(options={"note": "x"})
    with pytest.raises(ValueError, match="rollout.vllm"):
        RolloutEngineConfig(kind=OWN, vllm={"enforce_eager": True})


def test_ones_own_engine_is_built_with_the_keywords_and_serves_an_export(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from posttrain.models.auto import load_model
    cfg = RolloutEngineConfig(kind=OWN, options={"note": "hello"})
    model = load_model(str(START), device="cpu", dtype=torch.float32).eval()
    engine = build_rollout_engine(cfg, model.args, str(START), "cpu", torch.float32, seed=5)
    assert engine.built_with == dict(hf_dir=str(START), device="cpu", dtype=torch.float32,
                                     seed=5, note="hello")
    own = load_engine(cfg, str(START))
    native = load_engine(RolloutEngineConfig(), str(START))
    sampling = SamplingConfig(max_new_tokens=6, seed=3, allowed_token_ranges=((3, 103),))
    prompts = [[1, 10, 20], [1, 55]]
    got, want = own.generate(prompts, sampling, 3), native.generate(prompts, sampling, 3)
    assert type(own).__name__ == "WrappedEngine"
    assert [[r.completion_ids for r in g] for g in got] == \
        [[r.completion_ids for r in g] for g in want]
    assert [[r.logprobs for r in g] for g in got] == [[r.logprobs for r in g] for g in want]
