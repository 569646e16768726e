"""Trainable vocabulary rows beside LoRA (posttrain.models.trainable_tokens): the forward
equals the base with the rows written in, training moves the added tokens' rows and nothing
else of the vocabulary, and the merged export and the PEFT adapter (loaded by the real peft
on the resized base) give the trained model's logits; whole modules (modules_to_save) the
same; the refusals name the option."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from posttrain.errors import ConfigError
from posttrain.models import load_hf
from posttrain.models.hf_io import resize_vocab
from posttrain.models.lora import LoraConfig, apply_lora, disable_adapters
from posttrain.models.lora_export import save_merged_hf, save_peft_adapter
from posttrain.models.trainable_tokens import apply_trainable_tokens, token_rows

BASE_VOCAB, VOCAB = 250, 254
ADDED = tuple(range(BASE_VOCAB, VOCAB))       # 4 tokens the tokenizer added


def _ids(seed: int) -> torch.Tensor:
    """Rows that use the added tokens often (as data written with them does)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, BASE_VOCAB, (2, 12), generator=gen)
    ids[:, 1::3] = torch.tensor(ADDED)[torch.randperm(len(ADDED), generator=gen)]
    return ids


def _logits(model, ids):
    with torch.no_grad():
        return model.logits(model(ids))[..., :VOCAB]


def _grown(hf_dir):
    model = load_hf(hf_dir, dtype=torch.float32).eval()
    return resize_vocab(model, VOCAB)


def _adapted(hf_dir, token_ids=ADDED, modules_to_save=()):
    model = _grown(hf_dir)
    apply_lora(model, LoraConfig(rank=4, alpha=8.0, targets=("q", "v"), init_seed=0))
    return apply_trainable_tokens(model, token_ids, modules_to_save, required=ADDED)


def _train(model, steps: int = 3) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(steps):
        ids = _ids(10 + step)
        logits = model.logits(model(ids[:, :-1]))[..., :VOCAB]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


def _hf_logits(hf_dir, ids, adapter=None):
    """transformers' logits of `hf_dir` (resized to the grown vocabulary for an adapter, as a
    user loads one), with the PEFT `adapter` on it."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    if adapter is not None:
        from peft import PeftModel
        model.resize_token_embeddings(VOCAB)
        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits[..., :VOCAB]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_forward_reads_the_base_with_the_rows_written_in(make_hf_dir, tied) -> None:
    """With random deltas, logits equal the plain model whose embedding and head rows are set
    to W[t] + D by hand; the gradient reaches each delta row (and only the deltas and the
    adapters train)."""
    hf_dir, _ = make_hf_dir("qwen3", tie_word_embeddings=tied)
    model = _adapted(hf_dir)
    gen = torch.Generator().manual_seed(1)
    deltas = {name: torch.randn(rows.delta.shape, generator=gen) * 0.3
              for name, rows in token_rows(model)}
    assert sorted(deltas) == (["embed.weight"] if tied else ["embed.weight", "head.weight"])
    with torch.no_grad():
        for name, rows in token_rows(model):
            rows.delta.copy_(deltas[name])
    reference = _grown(hf_dir)                 # LoRA's B = 0: the adapted model is the base
    with torch.no_grad():
        for name, delta in deltas.items():
            weight = reference.get_parameter(name)
            for i, t in enumerate(ADDED):
                weight[t] += delta[i]
    ids = _ids(0)
    assert (_logits(model, ids) - _logits(reference, ids)).abs().max() <= 1e-6
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {n for n in trainable if "lora_" not in n} == {
        n.replace("weight", "token_adapter.delta") for n in deltas}
    model.logits(model(ids)).logsumexp(-1).sum().backward()
    for _, rows in token_rows(model):
        assert (rows.delta.grad.abs().sum(-1) > 0).all()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_added_rows_train_and_both_exports_carry_them(make_hf_dir, tmp_path, tied) -> None:
    hf_dir, _ = make_hf_dir("qwen3", tie_word_embeddings=tied)
    model = _adapted(hf_dir)
    before = {"embed": model.embed.weight.detach().clone(),
              "head": model.head.weight.detach().clone()}       # W' = W at start
    _train(model)
    after = {"embed": model.embed.token_adapter.apply(model.embed.weight).detach(),
             "head": model.head.weight.detach()}
    added = torch.tensor(ADDED)
    others = torch.ones(before["embed"].shape[0], dtype=torch.bool)
    others[added] = False
    for module in ("embed", "head"):
        moved = (after[module][added] - before[module][added]).norm(dim=-1)
        assert (moved > 0).all(), module                          # every added row trained
        assert torch.equal(after[module][others], before[module][others]), module
    assert torch.equal(model.embed.weight, before["embed"])      # the base stays frozen

    ids = _ids(0)
    trained = _logits(model, ids)
    merged = save_merged_hf(model, tmp_path / "merged")
    merged_logits = _hf_logits(merged, ids)
    assert (merged_logits - trained).abs().max() <= 1e-5
    assert torch.equal(model.embed.weight, before["embed"])      # rows unmerged bit for bit
    assert (_logits(model, ids) - trained).abs().max() <= 1e-5  # LoRA unmerge rounds

    out = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(hf_dir))
    config = json.loads((out / "adapter_config.json").read_text())
    want = (list(ADDED) if tied else {"embed_tokens": list(ADDED), "lm_head": list(ADDED)})
    assert config["trainable_token_indices"] == want
    with safe_open(out / "adapter_model.safetensors", framework="pt") as f:
        rows = f.get_tensor("base_model.model.model.embed_tokens.token_adapter."
                            "trainable_tokens_delta")
    assert torch.equal(rows, after["embed"][added])             # PEFT stores the rows
    assert (_hf_logits(hf_dir, ids, adapter=out) - merged_logits).abs().max() <= 1e-5


def test_disable_and_merge_restore_the_base_rows(make_hf_dir) -> None:
    """disable_adapters reads the base rows (merged or not); merge writes W' and unmerge puts
    the base rows back bit for bit."""
    hf_dir, _ = make_hf_dir("qwen3", tie_word_embeddings=True)
    ids = _ids(0)
    base_logits = _logits(_grown(hf_dir), ids)
    model = _adapted(hf_dir)
    _train(model, steps=2)
    trained = _logits(model, ids)
    assert (trained - base_logits).abs().max() > 1e-2
    with disable_adapters(model):
        assert torch.equal(_logits(model, ids), base_logits)
    embed = model.embed.weight.detach().clone()
    rows = model.embed.token_adapter
    rows.merge(model.embed.weight)
    assert not torch.equal(model.embed.weight, embed)
    assert (_logits(model, ids) - trained).abs().max() <= 1e-5
    with disable_adapters(model):
        assert (_logits(model, ids) - base_logits).abs().max() <= 1e-5
    rows.unmerge(model.embed.weight)
    assert torch.equal(model.embed.weight, embed)
    assert torch.equal(_logits(model, ids), trained)


def test_a_whole_head_beside_embedding_rows_exports_to_peft(make_hf_dir, tmp_path) -> None:
    """An untied model's head trained whole (modules_to_save) beside the embedding's rows:
    PEFT's modules_to_save + trainable_token_indices give the trained logits; the base is no
    longer inside the model, so disable_adapters refuses."""
    hf_dir, _ = make_hf_dir("qwen3", tie_word_embeddings=False)
    model = _adapted(hf_dir, modules_to_save=("head",))
    assert [n for n, _ in token_rows(model)] == ["embed.weight"]
    assert model.head.weight.requires_grad
    _train(model)
    ids = _ids(0)
    trained = _logits(model, ids)
    out = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(hf_dir))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["lm_head"]
    assert config["trainable_token_indices"] == {"embed_tokens": list(ADDED)}
    assert (_hf_logits(hf_dir, ids, adapter=out) - trained).abs().max() <= 1e-5
    with pytest.raises(ConfigError, match=r"modules_to_save trains \['head'\]"):
        with disable_adapters(model):
            pass


def test_frozen_added_rows_are_refused_naming_the_option(make_hf_dir) -> None:
    hf_dir, _ = make_hf_dir("qwen3", tie_word_embeddings=False)
    with pytest.raises(ConfigError, match=r"embed and head rows .* model\.lora\."
                                          r"trainable_tokens: added"):
        _adapted(hf_dir, token_ids=())
    with pytest.raises(ConfigError, match=r"head rows .*2 of them are not in"):
        _adapted(hf_dir, token_ids=ADDED[:2], modules_to_save=("embed",))
    with pytest.raises(ConfigError, match=r"\['lm_head'\] are not vocabulary modules.*"
                                          r"\['head'\] for PEFT's"):
        _adapted(hf_dir, modules_to_save=("lm_head",))
    with pytest.raises(ConfigError, match=r"in \[0, 254\)"):
        _adapted(hf_dir, token_ids=(3, 254))
    _adapted(hf_dir, token_ids=(), modules_to_save=("embed", "head"))   # covered whole
