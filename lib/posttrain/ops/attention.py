"""Causal attention over packed rows, with document boundaries, sliding windows and soft-capping.

One entry point, `attention(q, k, v, ...)`, used by every native model. A packed row holds several
documents back to back; a query attends only to keys of its own document, never to a later
position, and (with a sliding window) only to the last `window` positions:

    allowed(i, j) = doc(i) == doc(j)  and  j <= i  and  i - window < j
    s_ij = scale * <q_i, k_j>                    (scale defaults to head_dim ** -0.5)
    s_ij = softcap * tanh(s_ij / softcap)        (only with softcap, as Gemma 2/3 does)
    out_i = sum_j softmax_j(s_ij over allowed j) * v_j
    out_i = sum_j exp(s_ij) v_j / (exp(sink_h) + sum_j exp(s_ij))   (with sinks, as GPT-OSS)

A sink is a learned logit per query head that joins every softmax denominator with a zero value
row, so a query can attend to "nothing". The explicit paths append it as one more column of the
scores; FlexAttention rescales its output by Z / (Z + exp(sink)) = sigmoid(lse - sink).

The window convention is Hugging Face's (`masking_utils.sliding_window_overlay`:
`kv_idx > q_idx - sliding_window`), so a window of w sees the current token and the w - 1 before it.
Grouped-query attention (H query heads over Hkv key/value heads, H % Hkv == 0) is handled here:
query head h reads key/value head h // (H // Hkv), as `repeat_kv` in transformers does. Values
may have another head dim than queries and keys (multi-head latent attention); SDPA on the CPU
then runs its math kernel (the flash kernel needs equal dims).

Backends (`backend="auto"` picks; the others can be forced, e.g. by benches and tests):

- ``"causal"``: one document per row, no window shorter than the row, no softcap: a single
  `scaled_dot_product_attention(is_causal=True)` over the batch, on every device.
- ``"split"`` (CPU): each row is cut into its documents with `Tensor.split` and each piece runs
  causal SDPA on its own; the pieces are joined with `torch.cat`. Cost grows with sum(L_i^2), not
  (sum L_i)^2. Measured on CPU with torch 2.13 (STACK-NOTES): 0.14-0.22x the time of causal SDPA
  over the whole 8k row, where SDPA with a block-diagonal mask is 2.2x. `split` and not slicing:
  the backward of each slice `q[:, :, s:e]` allocates a zero tensor the size of the whole row,
  while `split`'s backward is one `cat`. A document that needs a window shorter than itself gets
  SDPA with an explicit band mask; with softcap (which SDPA cannot express) the document runs an
  explicit masked softmax (so does every document with sinks). Both are still per document,
  so masks stay L_i x L_i. It runs behind `torch.compiler.disable`: compiled blocks on the CPU
  (`parallel.compile`) compile what comes before and after it, and keep it eager.
- ``"flex"`` (CUDA, when `torch.nn.attention.flex_attention` imports): FlexAttention with a block
  mask built from per-position document ids, compiled once per process (torch.compile re-specialises
  per shape and keeps each). Softcap becomes a `score_mod`. FlexAttention has no CPU backward in
  torch 2.13 (eager refuses, compiled fails), hence not the CPU choice.
- ``"masked_sdpa"``: SDPA with a dense [B, 1, T, T] boolean mask (explicit softmax with softcap).
  The fallback on a GPU without FlexAttention, and a reference point for benches.

All backends agree with a per-document full-softmax reference within 1e-5 in fp32, forward and
backward (tests/lib/ops/test_attention.py).
"""

from __future__ import annotations

import functools
import math
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, Literal

import torch
import torch.nn.functional as F

from posttrain.ops.compiler import outside_graphs

Backend = Literal["auto", "causal", "split", "flex", "masked_sdpa", "cp"]
_BACKENDS = typing.get_args(Backend)

__all__ = ["Backend", "DocumentMask", "attention", "build_mask", "document_ids", "flex_available",
           "reference_attention"]


@dataclass(frozen=True, eq=False)
class DocumentMask:
    """The attention mask of one batch for one kind of layer, built once (`build_mask`) and
    shared by every layer of that kind.

    It holds what its backend needs and nothing else: the lengths as Python lists for the
    per-document `split` path (read outside compiled graphs); a dense [B, 1, T, T] boolean
    tensor (`masked_sdpa`) or a FlexAttention `BlockMask` (`flex`) for compiled blocks on
    CUDA, which then see tensors only. Either way a new packing of the same shape reuses the
    compiled graph instead of recompiling.
    """

    backend: Backend
    seq_len: int
    window: int | None = None
    lengths: list[list[int]] | None = None          # split
    allowed: torch.Tensor | None = None             # masked_sdpa: [B, 1, T, T]; cp: [B, 1, T/cp, T]
    block_mask: object | None = None                # flex: BlockMask
    compile_flex: bool = True
    cp: object | None = None                        # cp: this rank's `context_parallel.CPShard`


def build_mask(document_lengths: Sequence[Sequence[int]] | None, batch: int, seq_len: int,
               device: torch.device | str, *, sliding_window: int | None = None,
               softcap: float | None = None, backend: Backend = "auto",
               tensors_only: bool = False, compile_flex: bool = True,
               sinks: bool = False, cp: object | None = None) -> DocumentMask:
    """The mask for `attention(..., mask=...)` of rows [B, T] with these documents
    (`sinks`: the layers have attention sinks, which plain causal SDPA cannot apply).

    `tensors_only` (compiled blocks) never picks the list-driven `causal` path, so that every
    batch of one shape takes the same path: on CUDA FlexAttention (dense masked SDPA without
    it) inside the compiled graph; elsewhere the per-document `split`, run outside the graph
    (`attention` reads its lengths behind `torch.compiler.disable`, so a new packing does not
    recompile), because a dense T x T mask costs more on a CPU than the split saves.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {_BACKENDS}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive number of tokens, "
                         f"got {sliding_window}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    if cp is not None and cp.size > 1:
        # context parallelism: `seq_len` is the whole row's, the queries this rank's
        # (`posttrain.ops.context_parallel`)
        from posttrain.ops.context_parallel import cp_attention_mask
        lengths = _check_document_lengths(document_lengths, batch, seq_len)
        doc_ids_BT = document_ids(lengths, batch, seq_len, device)
        return DocumentMask("cp", seq_len // cp.size, sliding_window, cp=cp,
                            allowed=cp_attention_mask(doc_ids_BT, cp, sliding_window))
    lengths = _check_document_lengths(document_lengths, batch, seq_len)
    device = torch.device(device)
    if backend == "auto":
        if tensors_only:
            backend = (("flex" if flex_available() else "masked_sdpa") if device.type == "cuda"
                       else "split")
        else:
            backend = _choose_backend(device, lengths, seq_len, sliding_window, softcap,
                                      sinks=sinks)
    if backend == "causal":
        if (lengths is not None or softcap is not None or sinks
                or (sliding_window is not None and sliding_window < seq_len)):
            raise ValueError("backend='causal' needs one document per row, no softcap, no sinks "
                             "and no sliding window shorter than the row")
        return DocumentMask("causal", seq_len, sliding_window)
    if backend == "split":
        return DocumentMask("split", seq_len, sliding_window, lengths=lengths)
    doc_ids_BT = document_ids(lengths, batch, seq_len, device)
    if backend == "flex":
        return DocumentMask("flex", seq_len, sliding_window, compile_flex=compile_flex,
                            block_mask=_flex_block_mask(doc_ids_BT, sliding_window,
                                                        compile_flex))
    return DocumentMask("masked_sdpa", seq_len, sliding_window,
                        allowed=_allowed_mask(doc_ids_BT, sliding_window)[:, None])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              mask: DocumentMask | None = None,
              document_lengths: Sequence[Sequence[int]] | None = None,
              sliding_window: int | None = None,
              scale: float | None = None,
              softcap: float | None = None,
              sinks: torch.Tensor | None = None,
              backend: Backend = "auto",
              compile_flex: bool = True) -> torch.Tensor:
    """Causal attention that never crosses a document boundary.

    Args:
        q: [B, H, T, D] queries.
        k, v: [B, Hkv, T, D] keys and [B, Hkv, T, Dv] values, H % Hkv == 0 (Dv may differ
            from D: multi-head latent attention).
        mask: the batch's mask from `build_mask` (a model builds it once per forward and
            hands it to every layer); when given, `document_lengths`, `sliding_window`,
            `backend` and `compile_flex` must be left at their defaults.
        document_lengths: per batch row, the lengths of its documents in order, summing to T.
            None means one document per row.
        sliding_window: a query at i sees keys j with i - window < j <= i (within its document).
        scale: score scale, default D ** -0.5.
        softcap: scores become softcap * tanh(scores / softcap) before the softmax.
        sinks: [H] one logit per query head that joins every softmax denominator (value 0).
        backend: "auto" picks by device (see the module docstring); others force one.
        compile_flex: run FlexAttention compiled (the only fast way); False for eager checks.

    Returns:
        [B, H, T, Dv], the dtype of q.
    """
    batch, heads, seq_len, head_dim = _check_shapes(q, k, v)
    if mask is None:
        mask = build_mask(document_lengths, batch, seq_len, q.device,
                          sliding_window=sliding_window, softcap=softcap, backend=backend,
                          compile_flex=compile_flex, sinks=sinks is not None)
    elif (document_lengths is not None or sliding_window is not None or backend != "auto"
          or not compile_flex):
        raise ValueError("attention(mask=...) takes the documents, window and backend from the "
                         "mask; do not pass them again")
    elif mask.seq_len != seq_len:
        raise ValueError(f"the mask was built for {mask.seq_len} tokens, q has {seq_len}")
    if sinks is not None and hasattr(sinks, "to_local"):
        sinks = sinks.to_local()     # a DTensor split with the heads under tensor parallelism
    if sinks is not None and tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must hold one logit per query head ({heads}), "
                         f"got shape {tuple(sinks.shape)}")
    scale = head_dim ** -0.5 if scale is None else scale
    gqa = heads != k.shape[1]
    window = mask.window
    if mask.backend == "causal" and sinks is None:
        if softcap is not None or (window is not None and window < seq_len):
            raise ValueError("a 'causal' mask takes no softcap and no window shorter than the row")
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    if mask.backend == "cp":      # gather every rank's keys and values of the row
        from posttrain.ops.context_parallel import gather_sequence
        k, v = gather_sequence(k, mask.cp, dim=2), gather_sequence(v, mask.cp, dim=2)
        return _masked_attention(q, k, v, mask.allowed, scale, softcap, sinks)
    if mask.backend in ("causal", "split"):      # a causal mask with sinks: one document per row
        return _split_attention_outside_graph(q, k, v, mask, scale, softcap, sinks)
    if mask.backend == "flex":
        return _flex_attention(q, k, v, mask.block_mask, scale, softcap, mask.compile_flex,
                               sinks)
    return _masked_attention(q, k, v, mask.allowed, scale, softcap, sinks)


def document_ids(lengths: list[list[int]] | None, batch: int, seq_len: int,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, T] int32 tensor: the index of the document each position belongs to (0 everywhere
    when `lengths` is None)."""
    if lengths is None:
        return torch.zeros(batch, seq_len, dtype=torch.int32, device=device)
    rows = [torch.repeat_interleave(torch.arange(len(row), dtype=torch.int32),
                                    torch.tensor(row, dtype=torch.int64)) for row in lengths]
    return torch.stack(rows).to(device)


@functools.cache
def flex_available() -> bool:
    """Whether this torch build ships FlexAttention."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        document_lengths: Sequence[Sequence[int]] | None = None,
                        sliding_window: int | None = None, scale: float | None = None,
                        softcap: float | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Plain per-document attention for tests and benches: for every row and document, the full
    score matrix, the causal/window mask and a softmax (over the scores and the head's sink
    logit, if any), computed in float64 then cast back."""
    batch, heads, seq_len, head_dim = _check_shapes(q, k, v)
    lengths = _check_document_lengths(document_lengths, batch, seq_len) or [[seq_len]] * batch
    scale = head_dim ** -0.5 if scale is None else scale
    group = heads // k.shape[1]
    rows = []
    for b, row in enumerate(lengths):
        docs, start = [], 0
        for length in row:
            qd = q[b, :, start:start + length].double()
            kd = k[b, :, start:start + length].double().repeat_interleave(group, dim=0)
            vd = v[b, :, start:start + length].double().repeat_interleave(group, dim=0)
            scores = qd @ kd.transpose(-1, -2) * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            scores = scores.masked_fill(~_causal_window_mask(length, sliding_window, q.device),
                                        -math.inf)
            if sinks is not None:
                denominator = torch.logsumexp(scores, dim=-1, keepdim=True)
                denominator = torch.logaddexp(denominator, sinks.double()[:, None, None])
                docs.append(torch.exp(scores - denominator) @ vd)
            else:
                docs.append(torch.softmax(scores, dim=-1) @ vd)
            start += length
        rows.append(torch.cat(docs, dim=1))
    return torch.stack(rows).to(q.dtype)


# --------------------------------------------------------------------------- checks and choice


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int]:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"attention expects q [B, H, T, D], k [B, Hkv, T, D] and v [B, Hkv, T, "
                         f"Dv]; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    batch, heads, seq_len, head_dim = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, seq_len, head_dim):
        raise ValueError(f"k/v {tuple(k.shape)} do not match q {tuple(q.shape)} in B, T or D")
    if heads % k.shape[1] != 0:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads "
                         f"({k.shape[1]})")
    return batch, heads, seq_len, head_dim


def _check_document_lengths(document_lengths: Sequence[Sequence[int]] | None, batch: int,
                            seq_len: int) -> list[list[int]] | None:
    """Validated lengths as lists of ints, or None when every row is a single document."""
    if document_lengths is None:
        return None
    if len(document_lengths) != batch:
        raise ValueError(f"document_lengths has {len(document_lengths)} rows, "
                         f"the batch has {batch}")
    lengths = [[int(n) for n in row] for row in document_lengths]
    for b, row in enumerate(lengths):
        if any(n < 1 for n in row) or sum(row) != seq_len:
            raise ValueError(f"document_lengths row {b} must be positive lengths summing to the "
                             f"sequence length {seq_len}; got {row}")
    if all(len(row) == 1 for row in lengths):
        return None
    return lengths


def _choose_backend(device: torch.device, lengths: list[list[int]] | None, seq_len: int,
                    sliding_window: int | None, softcap: float | None, *,
                    sinks: bool = False) -> Backend:
    full_window = sliding_window is None or sliding_window >= seq_len
    if lengths is None and softcap is None and not sinks and full_window:
        return "causal"
    if device.type == "cuda":
        return "flex" if flex_available() else "masked_sdpa"
    return "split"


# --------------------------------------------------------------------------- backends


def _split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     lengths: list[list[int]] | None, window: int | None, scale: float,
                     softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Per-document attention on `split` pieces (see the module docstring for why `split`)."""
    seq_len = q.shape[2]
    if lengths is None or all(row == lengths[0] for row in lengths):
        row = [seq_len] if lengths is None else lengths[0]
        return _split_row(q, k, v, row, window, scale, softcap, sinks)
    # Rows split differently: one row at a time (split along B too, for the same backward reason).
    outs = [_split_row(qb, kb, vb, row, window, scale, softcap, sinks)
            for qb, kb, vb, row in zip(q.split(1), k.split(1), v.split(1), lengths)]
    return torch.cat(outs, dim=0)


@outside_graphs
def _split_attention_outside_graph(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   mask: DocumentMask, scale: float, softcap: float | None,
                                   sinks: torch.Tensor | None) -> torch.Tensor:
    """`_split_attention` with the mask's lengths read here, outside any compiled graph: a
    compiled block that traced them would specialise on the packing and recompile for every
    new one (eager callers pay only the decorator's call)."""
    return _split_attention(q, k, v, mask.lengths, mask.window, scale, softcap, sinks)


def _split_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row: list[int],
               window: int | None, scale: float, softcap: float | None,
               sinks: torch.Tensor | None) -> torch.Tensor:
    """Rows of q/k/v that share one document split `row`."""
    if len(row) == 1:
        return _document_attention(q, k, v, window, scale, softcap, sinks)
    outs = [_document_attention(qd, kd, vd, window, scale, softcap, sinks)
            for qd, kd, vd in zip(q.split(row, dim=2), k.split(row, dim=2), v.split(row, dim=2))]
    return torch.cat(outs, dim=2)


def _document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
                        scale: float, softcap: float | None,
                        sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention within one document (all of q/k/v's T belongs to it)."""
    length = q.shape[2]
    gqa = q.shape[1] != k.shape[1]
    needs_window = window is not None and window < length
    explicit = softcap is not None or sinks is not None
    if not explicit and not needs_window:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    allowed_TT = _causal_window_mask(length, window, q.device)
    if not explicit:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_TT, scale=scale,
                                              enable_gqa=gqa)
    return _masked_attention(q, k, v, allowed_TT, scale, softcap, sinks)


def _causal_window_mask(seq_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[T, T] bool, True where query i may attend key j: j <= i and i - window < j."""
    pos = torch.arange(seq_len, device=device)
    allowed_TT = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed_TT &= pos[None, :] > pos[:, None] - window
    return allowed_TT


def _allowed_mask(doc_ids_BT: torch.Tensor, window: int | None) -> torch.Tensor:
    """[B, T, T] bool: causal, in the window, and within the same document."""
    allowed_TT = _causal_window_mask(doc_ids_BT.shape[1], window, doc_ids_BT.device)
    return allowed_TT[None] & (doc_ids_BT[:, :, None] == doc_ids_BT[:, None, :])


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      allowed: torch.Tensor, scale: float, softcap: float | None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Dense masked attention; `allowed` broadcasts to [B, H, T, T]. SDPA without softcap and
    sinks, else an explicit softmax (in fp32, as transformers' eager Gemma and GPT-OSS paths
    do), the sink appended as one more column that is dropped after the softmax."""
    group = q.shape[1] // k.shape[1]
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale,
                                              enable_gqa=group > 1)
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, -math.inf)
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


def _flex_block_mask(doc_ids_BT: torch.Tensor, window: int | None, compile_flex: bool):
    """The FlexAttention block mask for causal, windowed attention within documents."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, seq_len = doc_ids_BT.shape

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        allowed = (kv_idx <= q_idx) & (doc_ids_BT[b, q_idx] == doc_ids_BT[b, kv_idx])
        if window is not None:
            allowed = allowed & (kv_idx > q_idx - window)
        return allowed

    return create_block_mask(mask_mod, batch, None, seq_len, seq_len, device=doc_ids_BT.device,
                             _compile=compile_flex)


def _flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: object,
                    scale: float, softcap: float | None, compile_flex: bool,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """FlexAttention over a prebuilt block mask, with an optional softcap score_mod; sinks
    rescale its output by sigmoid(lse - sink) (the softmax without them has sum Z = e^lse)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    score_mod: Callable | None = None
    if softcap is not None:
        cap = float(softcap)

        def score_mod(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                      kv_idx: torch.Tensor) -> torch.Tensor:
            return cap * torch.tanh(score / cap)

    run = _compiled_flex() if compile_flex else flex_attention
    if sinks is None:
        return run(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                   enable_gqa=q.shape[1] != k.shape[1])
    out, aux = run(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                   enable_gqa=q.shape[1] != k.shape[1], return_aux=AuxRequest(lse=True))
    kept_BHT = torch.sigmoid(aux.lse.float() - sinks.float().view(1, -1, 1))
    return (out.float() * kept_BHT[..., None]).to(out.dtype)


@functools.cache
def _compiled_flex() -> Callable:
    """One compiled FlexAttention per process; torch.compile keeps a specialisation per shape."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                     *, scale: float, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Queries q [B, H, T, D] over keys [B, Hkv, S, D] and values [B, Hkv, S, Dv] (S may
    differ from T: a KV cache) under an explicit boolean mask `allowed` broadcasting to [B, H, T, S]; softcap and
    sinks as in `attention`."""
    if sinks is not None and hasattr(sinks, "to_local"):
        sinks = sinks.to_local()
    return _masked_attention(q, k, v, allowed, scale, softcap, sinks)
