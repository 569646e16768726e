"""Hugging Face checkpoints in and out of the native models.

`load_hf` reads `config.json` and the safetensors files (one file, or shards listed in
`model.safetensors.index.json`) one tensor at a time; the model is built on the meta device and
only the parameters a rank owns (`param_filter`) get storage. Embedding and head rows are padded
to `vocab_multiple` with zero rows. MXFP4 tensors (`X_blocks` + `X_scales`, GPT-OSS's experts)
are dequantized to bf16 as they are read (`models/mxfp4.py`). The family bridge maps names and
layouts (`families/base.py`: one to one, stacked slices, fused tensors).

`save_hf` writes the reverse: the original config.json (real vocab size), tensors under their
HF names, shapes (padding stripped) and dtype (the model's `fp32_names` in fp32), sharded with an index past `max_shard_bytes`,
and the tokenizer files, so that `transformers.AutoModelForCausalLM.from_pretrained(out_dir)`
loads it unchanged.
"""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from posttrain.errors import ConfigError, PosttrainError
from posttrain.models import mxfp4
from posttrain.models.args import ModelArgs, pad_to_multiple
from posttrain.models.families import FamilyBridge, bridge_for_args, bridge_for_config
from posttrain.models.families.base import VOCAB_PARAMS
from posttrain.models.transformer import (LMHead, MLPFactory, Transformer,
                                          default_mlp_factory)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_NOT_TOKENIZER = {"config.json", INDEX_FILE, "pytorch_model.bin.index.json"}


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise PosttrainError(f"{path} not found: is {hf_dir} a Hugging Face model directory?")
    return json.loads(path.read_text())


def config_dtype(config: dict[str, Any]) -> torch.dtype | None:
    """The dtype a config.json declares (`dtype`, or the v4 `torch_dtype`), if any."""
    name = config.get("dtype") or config.get("torch_dtype")
    if not isinstance(name, str):
        return None
    dtype = getattr(torch, name.removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) else None


def weight_map(hf_dir: str | Path) -> dict[str, Path]:
    """HF tensor name -> safetensors file holding it."""
    hf_dir = Path(hf_dir)
    index = hf_dir / INDEX_FILE
    if index.is_file():
        entries = json.loads(index.read_text())["weight_map"]
        return {name: hf_dir / file for name, file in entries.items()}
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise PosttrainError(f"no *.safetensors files in {hf_dir}; convert .bin checkpoints "
                             "with transformers' save_pretrained(safe_serialization=True)")
    mapping: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            mapping.update({name: file for name in f.keys()})
    return mapping


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype)
    out[: t.shape[0]] = t
    return out


def iter_hf_tensors(hf_dir: str | Path, args: ModelArgs, *,
                    names: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (native name, CPU tensor) one at a time, vocab rows padded, file by file.

    `names` restricts what is read. A tied checkpoint's `lm_head.weight`, if present, is
    skipped (the native head shares the embedding). Distributed loaders use this to fill
    their shards without ever holding the whole model. Parameters stored as one HF tensor per
    slice (MoE experts) are stacked and yielded once their last slice has been read; an HF
    tensor that holds several native ones (GPT-OSS's fused experts) yields each.
    """
    bridge = bridge_for_args(args)
    files = weight_map(hf_dir)
    quantized = mxfp4.quantized_names(files)
    for name in quantized:
        files[name] = files.pop(name + mxfp4.BLOCKS)
        del files[name + mxfp4.SCALES]

    def wanted(native: str) -> bool:
        return ((names is None or native in names)
                and not (args.tie_word_embeddings and native == "head.weight"))

    by_file: dict[Path, list[tuple[str, list[str]]]] = defaultdict(list)
    for hf_name, file in files.items():
        natives = bridge.native_names(hf_name)
        if any(wanted(native) for native in natives):
            by_file[file].append((hf_name, natives))
    slices: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    for file, entries in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for hf_name, natives in entries:
                t = (mxfp4.read(hf_name, *quantized[hf_name]) if hf_name in quantized
                     else f.get_tensor(hf_name))
                index = bridge.stack_index(hf_name)
                if index is not None:
                    (native,) = natives
                    slices[native][index] = t
                    if len(slices[native]) == len(bridge.hf_names(native, args)):
                        parts = slices.pop(native)
                        yield native, torch.stack([parts[i] for i in range(len(parts))])
                    continue
                for native, t in bridge.to_native_tensors(hf_name, t):
                    if not wanted(native):
                        continue
                    if native in VOCAB_PARAMS:
                        t = _pad_rows(t, args.padded_vocab_size)
                    yield native, t
    if slices:
        native, parts = next(iter(slices.items()))
        missing = [name for name in bridge.hf_names(native, args)
                   if bridge.stack_index(name) not in parts]
        raise PosttrainError(f"{hf_dir}: checkpoint lacks {missing[:4]} ({len(missing)} "
                             f"slices of '{native}')")


def _state_names(model: nn.Module) -> list[str]:
    """What a checkpoint fills: the parameters and the persistent buffers (DeepSeek-V3's
    score-correction bias)."""
    return list(model.state_dict(keep_vars=True))


def _set_state(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_path, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_path)
    old = getattr(module, leaf)
    if tuple(old.shape) != tuple(value.shape):
        raise PosttrainError(f"checkpoint tensor for '{name}' has shape {tuple(value.shape)}, "
                             f"the model expects {tuple(old.shape)}; config.json and weights "
                             "disagree")
    if isinstance(old, nn.Parameter):
        setattr(module, leaf, nn.Parameter(value, requires_grad=old.requires_grad))
    else:
        module.register_buffer(leaf, value)


def load_hf(hf_dir: str | Path, *, device: torch.device | str = "cpu",
            dtype: torch.dtype | None = None, vocab_multiple: int = 64, on_meta: bool = False,
            param_filter: Callable[[str], bool] | None = None,
            mlp_factory: MLPFactory = default_mlp_factory) -> Transformer:
    """Native model with the weights of an HF checkpoint directory.

    The model is built on the meta device and parameters (and persistent buffers) are filled
    tensor by tensor on `device` in `dtype` (default: the checkpoint's; the model's
    `fp32_names` in fp32). With `on_meta=True`, only tensors for which
    `param_filter(native_name)` is true are read; the others stay on the meta device for the
    caller to shard and fill (`iter_hf_tensors`). Tied head and embedding count as
    `embed.weight`.
    """
    if param_filter is not None and not on_meta:
        raise ConfigError("load_hf: param_filter leaves the other parameters without values; "
                          "pass on_meta=True with it")
    config = read_hf_config(hf_dir)
    args = bridge_for_config(config).args_from_hf(config, vocab_multiple=vocab_multiple)
    args = args.replace(hf_source_dir=str(hf_dir))
    dtype = dtype or config_dtype(config) or torch.float32
    with torch.device("meta"):
        model = Transformer(args, mlp_factory)
    wanted = {name for name in _state_names(model) if param_filter is None or param_filter(name)}
    fp32 = model.fp32_names()
    for name, tensor in iter_hf_tensors(hf_dir, args, names=wanted):
        _set_state(model, name, tensor.to(device=device,
                                          dtype=torch.float32 if name in fp32 else dtype))
        wanted.discard(name)
    if wanted:
        raise PosttrainError(f"{hf_dir}: checkpoint lacks tensors for {sorted(wanted)[:8]} "
                             f"({len(wanted)} in all)")
    model.tie_weights()
    return model


# ---------------------------------------------------------------------------------- saving

def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a DTensor (FSDP/TP) or a plain one."""
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    if full.is_meta:
        raise PosttrainError("save_hf: the model still has parameters on the meta device")
    return full.detach()


def _hf_tensors(model: Transformer, bridge: FamilyBridge,
                dtype: torch.dtype) -> Iterator[tuple[str, Callable[[], torch.Tensor], int]]:
    """(HF name, thunk producing the CPU tensor, byte size) in state-dict order."""
    args = model.args
    if not isinstance(model.head, LMHead):
        raise PosttrainError("save_hf writes causal-LM checkpoints; this model has a custom "
                             f"head ({type(model.head).__name__}); save it separately")
    state = model.state_dict(keep_vars=True)
    fp32 = model.fp32_names()
    for name, value in state.items():
        if args.tie_word_embeddings and name == "head.weight":
            continue   # HF ties lm_head to embed_tokens on load

        hf_names = bridge.hf_names(name, args)
        if len(hf_names) > 1:       # stacked (MoE experts): one HF tensor per slice
            yield from _slice_tensors(value, hf_names, dtype)
            continue
        hf_name = hf_names[0]
        natives = bridge.native_names(hf_name)    # several for a fused HF tensor
        if natives[0] != name:
            continue                # written with the first of them
        rows = args.vocab_size if name in VOCAB_PARAMS else None
        shape = (rows, *value.shape[1:]) if rows is not None else tuple(value.shape)
        out_dtype = torch.float32 if name in fp32 else dtype
        nbytes = out_dtype.itemsize * sum(int(torch.Size(shape).numel()) if n == name
                                          else state[n].numel() for n in natives)

        def thunk(hf_name: str = hf_name, natives: list[str] = natives,
                  rows: int | None = rows, out_dtype: torch.dtype = out_dtype) -> torch.Tensor:
            parts = {}
            for native in natives:
                t = _full_tensor(state[native])
                t = t[:rows] if rows is not None else t
                parts[native] = t.to(device="cpu", dtype=out_dtype)
            return bridge.to_hf_tensor(hf_name, parts).contiguous().clone()

        yield hf_name, thunk, nbytes
    yield from _passthrough_tensors(args, bridge)


def _passthrough_tensors(args: ModelArgs, bridge: FamilyBridge,
                         ) -> Iterator[tuple[str, Callable[[], torch.Tensor], int]]:
    """The source checkpoint's tensors outside the native model (a multimodal checkpoint's
    vision tower, multi-token prediction layers), unchanged, in their own dtype."""
    source = args.hf_source_dir
    files = weight_map(source) if source and Path(source).is_dir() else {}
    kept = sorted(name for name in files if bridge.is_passthrough(name))
    if not kept and args.hf_config and bridge.architecture.endswith("ForConditionalGeneration"):
        raise PosttrainError(f"save_hf: this {args.family} model comes from a multimodal "
                             f"checkpoint whose other tensors (vision tower) are read from the "
                             f"source checkpoint on export, but {source!r} is not readable here")
    for name in kept:
        with safe_open(files[name], framework="pt") as f:
            sl = f.get_slice(name)
            nbytes = (int(torch.Size(sl.get_shape()).numel())
                      * _SAFETENSORS_BYTES.get(sl.get_dtype(), 4))

        def thunk(name: str = name) -> torch.Tensor:
            with safe_open(files[name], framework="pt") as f:
                return f.get_tensor(name)

        yield name, thunk, nbytes


_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2,
                      "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _slice_tensors(value: torch.Tensor, hf_names: list[str], dtype: torch.dtype,
                   ) -> Iterator[tuple[str, Callable[[], torch.Tensor], int]]:
    """One (name, thunk, bytes) per dim-0 slice; the full tensor is gathered once, on the first
    slice's thunk, and dropped after the last."""
    assert value.shape[0] == len(hf_names), (tuple(value.shape), len(hf_names))
    nbytes = dtype.itemsize * int(torch.Size(value.shape[1:]).numel())
    cache: dict[str, torch.Tensor] = {}

    def thunk(i: int) -> torch.Tensor:
        if "full" not in cache:
            cache["full"] = _full_tensor(value).to(device="cpu", dtype=dtype)
        t = cache["full"][i].contiguous().clone()
        if i == len(hf_names) - 1:
            cache.clear()
        return t

    for i, hf_name in enumerate(hf_names):
        yield hf_name, (lambda i=i: thunk(i)), nbytes


def hf_named_tensors(args: ModelArgs, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                     dtype: torch.dtype | None = None,
                     fp32_names: frozenset[str] = frozenset(),
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs for full tensors named as in the native model, laid out as
    `save_hf` writes them: vocabulary padding rows cut, stacked parameters (MoE experts) split
    into one tensor per slice, a tied model's `head.weight` dropped (HF ties it on load).

    For handing weights to an engine that loads HF checkpoints (vLLM) without writing them to
    disk. Tensors stay on their device; `dtype` casts them when given (`fp32_names` to fp32).
    """
    bridge = bridge_for_args(args)
    fusing: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)   # fused HF tensors' parts
    for name, tensor in named_tensors:
        if args.tie_word_embeddings and name == "head.weight":
            continue
        t = _full_tensor(tensor)
        if name in VOCAB_PARAMS:
            t = t[:args.vocab_size]
        if dtype is not None:
            t = t.to(torch.float32 if name in fp32_names else dtype)
        hf_names = bridge.hf_names(name, args)
        if len(hf_names) > 1:
            assert t.shape[0] == len(hf_names), (name, tuple(t.shape), len(hf_names))
            yield from zip(hf_names, t.unbind(0))
            continue
        parts = fusing[hf_names[0]]
        parts[name] = t
        if len(parts) == len(bridge.native_names(hf_names[0])):
            yield hf_names[0], bridge.to_hf_tensor(hf_names[0], fusing.pop(hf_names[0]))
    if fusing:
        raise PosttrainError(f"hf_named_tensors: {sorted(fusing)[:4]} lack some of the native "
                             "tensors they are made of")


def _copy_tokenizer_files(tokenizer_dir: Path, out_dir: Path) -> None:
    for path in sorted(tokenizer_dir.iterdir()):
        if (path.is_file() and path.name not in _NOT_TOKENIZER
                and not path.name.endswith(_WEIGHT_FILES)):
            shutil.copy2(path, out_dir / path.name)


def save_hf(model: Transformer, out_dir: str | Path, *, tokenizer_dir: str | Path | None = None,
            dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write `model` as an HF checkpoint directory loadable by `from_pretrained`.

    dtype defaults to the one the original config.json declared (else the model's). Returns
    the output directory.
    """
    args = model.args
    bridge = bridge_for_args(args)
    config = bridge.hf_config(args)
    dtype = dtype or config_dtype(config) or model.embed.weight.dtype
    config["torch_dtype" if "torch_dtype" in config and "dtype" not in config
           else "dtype"] = str(dtype).removeprefix("torch.")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is not None:
        _copy_tokenizer_files(Path(tokenizer_dir), out_dir)

    shards: list[list[tuple[str, Callable[[], torch.Tensor]]]] = [[]]
    shard_bytes, total = 0, 0
    for hf_name, thunk, nbytes in _hf_tensors(model, bridge, dtype):
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((hf_name, thunk))
        shard_bytes += nbytes
        total += nbytes
    n = len(shards)
    files = ([SINGLE_FILE] if n == 1
             else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
    for file in out_dir.glob("model*.safetensors*"):
        file.unlink()   # stale shards of an earlier export would shadow this one
    index: dict[str, str] = {}
    for file, shard in zip(files, shards):
        save_file({name: thunk() for name, thunk in shard}, out_dir / file,
                  metadata={"format": "pt"})
        index.update({name: file for name, _ in shard})
    if n > 1:
        (out_dir / INDEX_FILE).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": index}, indent=2))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out_dir


# ------------------------------------------------------------------------------ vocabulary

def grow_vocab_rows(weight: torch.Tensor, old_real: int, new_real: int,
                    padded: int) -> torch.Tensor:
    """Rows for a grown vocabulary: old rows kept, new rows = mean of the old real rows,
    rows past `new_real` zero padding (the same rule for a materialized or a streamed tensor)."""
    out = torch.zeros((padded, *weight.shape[1:]), dtype=weight.dtype, device=weight.device)
    out[:old_real] = weight[:old_real]
    out[old_real:new_real] = weight[:old_real].float().mean(0).to(weight.dtype)
    return out


def _grow_rows(weight: torch.Tensor, old_real: int, new_real: int,
               padded: int) -> nn.Parameter:
    return nn.Parameter(grow_vocab_rows(weight, old_real, new_real, padded),
                        requires_grad=weight.requires_grad)


@torch.no_grad()
def resize_vocab(model: Transformer, new_vocab_size: int) -> Transformer:
    """Grow the real vocabulary to `new_vocab_size` (tokens added by the data layer).

    New embedding and head rows start at the mean of the existing real rows, so old tokens keep
    their logits exactly; rows past the real vocabulary stay zero padding. Build optimizers
    after resizing: the parameters are replaced.
    """
    args = model.args
    if new_vocab_size < args.vocab_size:
        raise ConfigError(f"resize_vocab: cannot shrink the vocabulary from {args.vocab_size} "
                          f"to {new_vocab_size}")
    if new_vocab_size == args.vocab_size:
        return model
    padded = pad_to_multiple(new_vocab_size, args.vocab_multiple)
    model.embed.weight = _grow_rows(model.embed.weight, args.vocab_size, new_vocab_size, padded)
    model.embed.num_embeddings = padded
    if isinstance(model.head, LMHead):
        if not args.tie_word_embeddings:
            model.head.weight = _grow_rows(model.head.weight, args.vocab_size, new_vocab_size,
                                           padded)
        model.head.real_vocab_size = new_vocab_size
    model.args = args.replace(vocab_size=new_vocab_size)
    model.tie_weights()
    return model
