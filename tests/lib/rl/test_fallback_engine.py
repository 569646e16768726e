"""NativeEngine over a transformers model without a native definition (`HFCausalLM`): decoding
through transformers' KV cache with left-padded prompts, against transformers' own forward and
`generate`, against the GRPO trainer's chunked log-probs, weight updates by ``hf.`` names, and
the factory's choice of engine."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from posttrain.errors import ConfigError
from posttrain.models.fallback import HFCausalLM, load_fallback
from posttrain.rl.engine import SamplingConfig
from posttrain.rl.native import NativeEngine

VOCAB = 250
PROMPTS = [[5, 17, 3, 42, 8, 11, 60], [7], [1, 2, 3, 4]]
ATOL = 1e-5


def _config(arch: str):
    from transformers import Glm4Config, Olmo3Config
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.2)
    if arch == "olmo3":      # a window shorter than every sequence here, beside a full layer
        return Olmo3Config(**common, sliding_window=4,
                           layer_types=["sliding_attention", "full_attention"])
    return Glm4Config(**common, head_dim=16)


@pytest.fixture(params=["olmo3", "glm4"])
def hf_dir(request, tmp_path: Path) -> Path:
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(request.param), dtype=torch.float32)
    model.save_pretrained(tmp_path / request.param)
    return tmp_path / request.param


def _load(hf_dir: Path) -> HFCausalLM:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_fallback(hf_dir, dtype=torch.float32).eval()


def _reference(hf_dir: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def _trainer_logprobs(model: HFCausalLM, rollouts) -> list[list[float]]:
    """The GRPO trainer's log-probs of the rollouts: one packed row, the chunked log-probs over
    `head.weight` (`GRPOLoss` with ``score_only``)."""
    from posttrain.rl.batch import Sample, pack_micro_batches
    from posttrain.train.grpo import AlgorithmConfig, GRPOLoss
    samples = [Sample(r.prompt_ids, r.completion_ids, r.logprobs, 0.0) for r in rollouts]
    (batch,) = pack_micro_batches(samples, max_tokens=4096)
    assert len(batch["document_lengths"][0]) == len(rollouts)
    loss = GRPOLoss(model, AlgorithmConfig(), temperature=1.0, constant_norm=None)
    with torch.no_grad():
        logp = loss(*(batch.get(k) for k in GRPOLoss.input_keys), score_only=True)
    return [logp[s, :len(r.completion_ids)].tolist() for s, r in enumerate(rollouts)]


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def test_rollout_logprobs_equal_transformers_and_the_trainer(hf_dir) -> None:
    model = _load(hf_dir)
    engine = NativeEngine(model)
    groups = engine.generate(PROMPTS, SamplingConfig(temperature=1.0, max_new_tokens=12,
                                                     seed=3), n=2)
    rollouts = [r for g in groups for r in g]
    assert all(len(r.completion_ids) == 12 for r in rollouts)     # no stop token: full length
    sampled = [r.logprobs for r in rollouts]
    sequences = [r.prompt_ids + r.completion_ids for r in rollouts]
    starts = [len(r.prompt_ids) for r in rollouts]
    ref = _reference(hf_dir)
    with torch.no_grad():
        expected = []
        for seq, p in zip(sequences, starts):
            logp = ref(input_ids=torch.tensor([seq])).logits[0].log_softmax(-1)
            expected.append([float(logp[t - 1, seq[t]]) for t in range(p, len(seq))])
    assert _max_diff(sampled, expected) <= ATOL
    assert _max_diff(engine.logprobs(sequences, starts), expected) <= ATOL
    assert _max_diff(_trainer_logprobs(model, rollouts), sampled) <= ATOL


def test_greedy_equals_transformers_generate(hf_dir) -> None:
    engine = NativeEngine(_load(hf_dir))
    groups = engine.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=10), n=1)
    ref = _reference(hf_dir)
    with torch.no_grad():
        for prompt, (rollout,) in zip(PROMPTS, groups):
            out = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10,
                               min_new_tokens=10)
            assert out[0, len(prompt):].tolist() == rollout.completion_ids


def test_update_weights_by_transformers_names(hf_dir) -> None:
    trainer = _load(hf_dir)
    engine = NativeEngine(trainer, copy_model=True)
    assert all(name.startswith("hf.") for name in engine.parameter_shapes)
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(1.5)
    sequences, starts = [PROMPTS[0] + PROMPTS[2]], [len(PROMPTS[0])]
    stale = engine.logprobs(sequences, starts)
    engine.update_weights(trainer.named_parameters())
    fresh = engine.logprobs(sequences, starts)
    with torch.no_grad():
        ids = torch.tensor(sequences)
        logp = trainer.logits(trainer(ids))[0].log_softmax(-1)
        want = [[float(logp[t - 1, ids[0, t]]) for t in range(starts[0], ids.shape[1])]]
    assert _max_diff(fresh, want) <= ATOL < _max_diff(stale, want)
    with pytest.raises(ValueError, match="'model.norm.weight'"):
        engine.update_weights([("model.norm.weight", torch.zeros(64))])


def test_factory_builds_the_transformers_engine_and_refuses_vllm(hf_dir) -> None:
    from posttrain.rl.factory import RolloutEngineConfig, build_rollout_engine
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # the trainer warned already: not again
        engine = build_rollout_engine(RolloutEngineConfig(), None, str(hf_dir), "cpu")
    assert isinstance(engine.model, HFCausalLM) and not engine.model.training
    assert engine.parameter_shapes == NativeEngine(_load(hf_dir)).parameter_shapes
    with pytest.raises(ConfigError, match="rollout.kind: vllm.*no native definition"):
        build_rollout_engine(RolloutEngineConfig(kind="vllm"), None, str(hf_dir), "cpu")
