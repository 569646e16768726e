"""The transformers fallback (GPT-2, Phi-3: no native bridge) behind the native interface."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from posttrain.errors import ConfigError, PosttrainError
from posttrain.models import Transformer
from posttrain.models.auto import load_model
from posttrain.models.fallback import FallbackWarning, HFCausalLM, estimated_flops_per_token
from posttrain.ops.cross_entropy import chunked_cross_entropy

VOCAB = 250


def _tiny_config(arch: str):
    from transformers import GPT2Config, Olmo3Config, Phi3Config

    if arch == "olmo3":
        return Olmo3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2, initializer_range=0.1)
    if arch == "gpt2":      # tied head, absolute positions, Conv1D layers
        return GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                          bos_token_id=0, eos_token_id=0, initializer_range=0.1)
    return Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,  # untied, RoPE
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, original_max_position_embeddings=128,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.1)


@pytest.fixture
def hf_dir(tmp_path: Path, request) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny_config(request.param), dtype=torch.float32)
    out = tmp_path / request.param
    model.save_pretrained(out)
    return out


def _load(hf_dir: Path) -> tuple[HFCausalLM, nn.Module]:
    from transformers import AutoModelForCausalLM

    with pytest.warns(FallbackWarning, match="no native definition") as record:
        model = load_model(hf_dir, dtype=torch.float32)
    assert "MFU is estimated with 6*N" in str(record[0].message)
    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    return model.eval(), ref


def _ids(seq_len: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq_len), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("hf_dir", ["gpt2", "phi3"], indirect=True)
def test_forward_logits_and_chunked_loss_match_transformers(hf_dir) -> None:
    model, ref = _load(hf_dir)
    assert isinstance(model, HFCausalLM) and model.supports_packed_documents
    assert isinstance(model.layers, nn.ModuleList) and len(model.layers) == 2
    assert model.head.weight is model.hf.get_output_embeddings().weight
    assert model.embed is model.hf.get_input_embeddings()
    assert model.head.real_vocab_size == VOCAB

    ids = _ids()
    labels = ids.clone()
    labels[0, :5] = -100                                    # a prompt without loss
    with torch.no_grad():
        hidden = model(ids)
        out = ref(input_ids=ids, labels=labels)
        assert hidden.shape == (2, 16, 64)
        assert (model.logits(hidden) - out.logits).abs().max() <= 1e-5
        # transformers shifts inside its loss; chunked CE takes labels already aligned
        loss = chunked_cross_entropy(hidden[:, :-1], model.head.weight, labels[:, 1:],
                                     real_vocab_size=model.head.real_vocab_size,
                                     bias=model.head.bias, softcap=model.head.softcap,
                                     chunk_tokens=7)
    assert abs(float(loss) - float(out.loss)) <= 1e-5


@pytest.mark.parametrize("hf_dir", ["phi3"], indirect=True)
def test_packed_rows(hf_dir) -> None:
    model, _ = _load(hf_dir)
    ids = _ids()
    docs = [[5, 11], [16]]
    with torch.no_grad():
        packed = model(ids, document_lengths=docs)
        alone = model(ids[:1, 5:])
        assert (packed[0, 5:] - alone[0]).abs().max() <= 1e-5
        assert (packed[1] - model(ids[1:])[0]).abs().max() <= 1e-5
        with pytest.raises(PosttrainError, match="restart"):
            model(ids, position_ids=torch.arange(16).expand(2, 16), document_lengths=docs)
        # an architecture whose attention ignores restarting positions: the probe sees it
        inner = model.hf.base_model
        inner.forward = lambda forward=inner.forward, **kw: forward(**{**kw, "position_ids": None})
        assert model.probe_packed_documents() is False
        del inner.forward
        assert model.probe_packed_documents() is True
        model.supports_packed_documents = False
        with pytest.raises(PosttrainError, match="allow_cross_document_attention"):
            model(ids, document_lengths=docs)
        model(ids, document_lengths=[[16], [16]])           # one document per row is fine
        model.allow_cross_document_attention = True
        model(ids, document_lengths=docs)


@pytest.mark.parametrize("hf_dir", ["phi3"], indirect=True)
def test_lora_on_fallback_exports_to_peft(hf_dir, tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from posttrain.models.lora import LoraConfig, apply_lora, lora_modules
    from posttrain.models.lora_export import save_peft_adapter

    model, _ = _load(hf_dir)
    with pytest.raises(ConfigError, match="o_proj"):        # native names do not exist here
        apply_lora(model, LoraConfig(targets=("q",)))
    with pytest.raises(ConfigError, match="LM head"):
        apply_lora(model, LoraConfig(targets=("lm_head",)))
    apply_lora(model, LoraConfig(rank=4, targets=("qkv_proj", "down_proj"), init_seed=0))
    with torch.no_grad():
        for _, m in lora_modules(model):
            m.lora_B.normal_(std=0.05)
    ids = _ids()
    with torch.no_grad():
        ours = model.logits(model(ids))
    out = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(hf_dir))
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        assert (peft_model(input_ids=ids).logits - ours).abs().max() <= 1e-4


@pytest.mark.parametrize("hf_dir", ["gpt2"], indirect=True)
def test_checks_flops_and_kwargs(hf_dir) -> None:
    model, ref = _load(hf_dir)
    n_params = sum(p.numel() for p in ref.parameters())     # tied: the embedding is the head
    assert estimated_flops_per_token(model) == 6.0 * n_params
    model.softcap = 0.5                                      # logits the model does not make
    with pytest.raises(ConfigError, match="post-processes logits"):
        model.check_logits()
    with pytest.raises(ConfigError, match="on_meta"):
        load_model(hf_dir, on_meta=True)


def test_native_checkpoints_load_natively(make_hf_dir) -> None:
    hf_dir, _ = make_hf_dir("qwen3")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        model = load_model(hf_dir, dtype=torch.float32, vocab_multiple=128)
    assert isinstance(model, Transformer) and model.args.padded_vocab_size == 256
    with pytest.warns(UserWarning, match="attn_implementation"):
        load_model(hf_dir, attn_implementation="sdpa")


@pytest.mark.parametrize("hf_dir", ["olmo3"], indirect=True)
def test_verify_model_names_the_fallback_in_one_line(hf_dir, capsys) -> None:
    """`posttrain verify-model` on an architecture without a native definition: one line on
    stderr naming the fallback and what it covers, a non-zero exit, no traceback."""
    from steps.cli import main
    assert main(["verify-model", "--hf-dir", str(hf_dir)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.strip().splitlines()) == 1, out.err
    for phrase in ("'olmo3' has no native definition", "transformers fallback", "GRPO",
                   "distillation", "reward models", "LoRA"):
        assert phrase in out.err, (phrase, out.err)


@pytest.mark.parametrize("hf_dir", ["olmo3"], indirect=True)
@pytest.mark.parametrize("fmt", ["merged", "peft"])
def test_lora_export_of_a_trained_fallback_state(hf_dir, tmp_path, fmt) -> None:
    """A recipe's export of a LoRA run on the fallback (the gathered state, ``hf.`` names):
    merged weights or a PEFT adapter that transformers / PEFT load with the model's logits."""
    from transformers import AutoModelForCausalLM

    from posttrain.models.lora import LoraConfig, apply_lora, lora_modules
    from posttrain.train.engine import LoraSettings
    from posttrain.train.export import export_fallback
    model, _ = _load(hf_dir)
    settings = LoraSettings(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
    apply_lora(model, LoraConfig(rank=4, alpha=8.0, targets=settings.targets, init_seed=0))
    with torch.no_grad():
        for _, m in lora_modules(model):
            m.lora_B.normal_(std=0.05, generator=torch.Generator().manual_seed(1))
        ours = model.logits(model(_ids()))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    out = export_fallback(state, str(hf_dir), str(tmp_path / fmt), fmt=fmt, lora=settings)
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    if fmt == "merged":
        exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    else:
        from peft import PeftModel
        exported = PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        assert (exported(input_ids=_ids()).logits - ours).abs().max() <= 1e-5
