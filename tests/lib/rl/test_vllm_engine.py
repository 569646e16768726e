"""VLLMEngine: import without vLLM, native -> HF names against `save_hf`, checks that run before
vLLM is touched, and (in a python with vLLM) generation, scoring and weight sync against the
native engine on the same weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from posttrain.models import load_hf, save_hf
from posttrain.models.hf_io import hf_named_tensors, weight_map
from posttrain.models.transformer import Transformer
from posttrain.models.verify import random_hf_model, tiny_hf_config
from posttrain.rl.engine import SamplingConfig
from posttrain.rl.vllm_engine import VLLMEngine, check_native_tensors, native_parameter_shapes

REPO = Path(__file__).resolve().parents[3]
FAMILIES = ("qwen3", "llama", "gemma3", "qwen3_moe")   # llama and gemma3 tie their heads


def native_model(family: str, tmp_path: Path) -> Transformer:
    hf_dir = tmp_path / f"{family}-hf"
    random_hf_model(tiny_hf_config(family), seed=0).save_pretrained(hf_dir)
    return load_hf(hf_dir, dtype=torch.float32)


def test_module_imports_without_vllm() -> None:
    code = ("import sys; sys.modules['vllm'] = None\n"   # `import vllm` now raises ImportError
            "import posttrain.rl.vllm_engine")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_named_tensors_match_save_hf(family: str, tmp_path: Path) -> None:
    model = native_model(family, tmp_path)
    out = save_hf(model, tmp_path / "export")
    saved = {}
    for name, file in weight_map(out).items():
        with safe_open(file, framework="pt") as f:
            saved[name] = f.get_tensor(name)
    # state_dict has a tied model's head.weight, named_parameters does not: both convert alike
    for named in (model.state_dict().items(), model.named_parameters()):
        converted = dict(hf_named_tensors(model.args, named))
        assert converted.keys() == saved.keys()
        for name, t in saved.items():
            assert torch.equal(converted[name], t), name


def test_native_parameter_shapes_match_the_model(tmp_path: Path) -> None:
    model = native_model("llama", tmp_path)
    shapes = native_parameter_shapes(model.args)
    assert shapes == {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert "head.weight" not in shapes and shapes["embed.weight"][0] == 256   # 250 padded to 64


@pytest.fixture
def qwen3_shapes(tmp_path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, torch.Tensor]]:
    model = native_model("qwen3", tmp_path)
    return (native_parameter_shapes(model.args),
            {name: p.detach() for name, p in model.named_parameters()})


@pytest.mark.parametrize("change, message", [
    (lambda t: {**t, "layers.0.attn.qq.weight": t["norm.weight"]}, "not a parameter"),
    (lambda t: {**t, "embed.weight": t["embed.weight"][:250]}, "has shape (250, 64)"),
    (lambda t: {k: v for k, v in t.items() if k != "layers.1.mlp.up.weight"}, "1 missing"),
])
def test_check_native_tensors_errors(qwen3_shapes, change, message) -> None:
    shapes, tensors = qwen3_shapes
    assert [n for n, _ in check_native_tensors(tensors.items(), shapes)] == list(tensors)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_native_tensors(change(tensors).items(), shapes)
    with pytest.raises(ValueError, match="twice"):
        check_native_tensors([*tensors.items(), ("norm.weight", tensors["norm.weight"])], shapes)


class _Untouchable:
    """Stands in for `vllm.LLM`: any use fails the test (checks must come first)."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the engine was touched ({name}) before the inputs were checked")


def engine_without_vllm(model: Transformer) -> VLLMEngine:
    """A VLLMEngine whose checks can run; its vLLM side is `_Untouchable`."""
    engine = object.__new__(VLLMEngine)
    engine.args = model.args
    engine.parameter_shapes = native_parameter_shapes(model.args)
    engine.llm = _Untouchable()  # type: ignore[assignment]
    engine.max_model_len = 64
    engine.dtype = torch.float32
    return engine


def test_update_weights_checks_before_touching_vllm(tmp_path: Path) -> None:
    model = native_model("llama", tmp_path)
    engine = engine_without_vllm(model)
    params = dict(model.named_parameters())
    with pytest.raises(ValueError, match="tied to the embedding; send embed.weight"):
        engine.update_weights([*params.items(), ("head.weight", params["embed.weight"])])
    with pytest.raises(ValueError, match="the model expects"):
        engine.update_weights([(n, p[:-1] if n == "layers.0.attn.q.weight" else p)
                               for n, p in params.items()])
    with pytest.raises(ValueError, match="needs every parameter"):
        engine.update_weights(list(params.items())[:-1])


def test_generate_and_logprobs_check_inputs_first(tmp_path: Path) -> None:
    engine = engine_without_vllm(native_model("qwen3", tmp_path))
    sampling = SamplingConfig(max_new_tokens=8)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 2], []], sampling)
    with pytest.raises(ValueError, match=r"token ids \[250\] outside the vocabulary"):
        engine.generate([[1, 250]], sampling)
    with pytest.raises(ValueError, match="exceeds the engine's max_model_len"):
        engine.generate([[1] * 60], sampling)
    with pytest.raises(ValueError, match="n .* must be >= 1"):
        engine.generate([[1]], sampling, n=0)
    with pytest.raises(ValueError, match=r"prompt_lens\[0\] = 0"):
        engine.logprobs([[1, 2]], [0])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        engine.logprobs([[1, 2]], [1], temperature=0.0)
    with pytest.raises(ValueError, match="exceeds the engine's max_model_len"):
        engine.logprobs([[1] * 64], [1])     # scoring samples one token after the sequence


# ---------------------------------------------------------------------------- real vLLM

def vllm_python() -> str | None:
    path = os.environ.get("POSTTRAIN_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    return path if Path(path).is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(vllm_python() is None,
                    reason="no python with vLLM: run `make vllm-env` (creates .venv-vllm) or set "
                           "POSTTRAIN_VLLM_PYTHON")
def test_vllm_engine_matches_native_engine(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "lib")}     # this checkout's posttrain
    proc = subprocess.run([vllm_python(), str(REPO / "tests/lib/rl/vllm_check.py"),
                           str(tmp_path)], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("gen_logprob_diff_temp", "gen_logprob_diff_greedy", "gen_logprob_diff_top_p",
                "score_diff_t1.0", "score_diff_t0.7", "update_diff_vs_native",
                "update_gen_diff_vs_native", "group_sync_diff_vs_native"):
        assert m[key] < 1e-4, (key, m)
    assert m["update_change"] > 0.1, m                 # the new weights did change the scores
    assert m["group_sync_change"] > 0.1, m             # and so did the ones from the group
    assert m["group_sync_bytes"] == m["group_sync_expected_bytes"], m
    assert m["same_seed_same_rollouts"] and m["samples_differ"], m
    for case in ("temp", "greedy", "top_p"):
        assert sum(m[f"finish_{case}"].values()) == 20, m          # 5 prompts x n=4
    assert m["finish_temp"]["stop"] > 0 and m["finish_temp"]["length"] > 0, m
    assert m["bench_tokens"] == 16 * 4 * 32, m
