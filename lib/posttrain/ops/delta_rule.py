"""The gated delta rule (Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks", arXiv:2412.06464)
over packed rows: a chunked form for training and a recurrent form for decoding that agree.

Per head, with a state S [Dk, Dv] that starts at zero at every document start:

    S_t = exp(g_t) S_{t-1}                                  (gated decay, g_t <= 0)
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T              (delta rule: correct the read)
    o_t = S_t^T q_t

with q and k L2-normalised (eps 1e-6) and q scaled by Dk ** -0.5, everything in fp32, as the
FLA kernels and transformers' reference (`torch_chunk_gated_delta_rule`) compute it. Key heads
are shared by `Hv // Hk` consecutive value heads.

Chunked form (training). The sequence is cut into chunks of C tokens. Within a chunk, the
writes of all C tokens are folded into one lower-triangular solve (the WY / UT transform of
DeltaNet), and the chunk reads the state carried in from the previous chunk with two matmuls:

    A_ij   = [i > j] exp(G_i - G_j) beta_i <k_i, k_j>       G = cumsum of g within the chunk
    U      = (I + A)^-1 (beta v)            W = (I + A)^-1 (beta exp(G) k)
    V'     = U - W S                        (what the chunk writes, given the state it reads)
    o      = exp(G) q S + ([i >= j] exp(G_i - G_j) <q_i, k_j>) V'
    S_next = exp(G_C) S + (exp(G_C - G) k)^T V'

From chunk to chunk. S_next is an affine map of S, S_next = M S + b with
M = exp(G_C) I - (exp(G_C - G) k)^T W  [Dk, Dk] and  b = (exp(G_C - G) k)^T U  [Dk, Dv]; where
the next chunk starts a document, M and b are zeroed (the state entering chunk 0 is the initial
state, zeroed too if chunk 0 starts a document). Composing affine maps is associative, so every
chunk's incoming state comes from a scan (`_scan`): adjacent chunks' maps are composed in pairs,
the pairs' scan gives the states at even chunks, each odd chunk's state follows from the even
one before it; log2 N levels of a few batched ops, after which all chunks read their states and
write their outputs at once, and the final state is the last chunk's S_next.

Why not a loop over the chunks (`_pass_serially`, which computes the same with fewer FLOPs): it
runs ~10 small ops per chunk forward and as many autograd nodes backward, and each chunk's slice
of the [B, H, N, C, D] tensors it reads costs a full-size gradient in backward (O(N^2) memory
traffic). For 16 heads of 128 and 8k tokens (128 chunks) it dispatches 12,200 ATen ops forward +
backward where the scan dispatches 830, and takes 3.6x the scan's time even on a CPU
(`bench/delta_rule.py`). The scan's cost: it forms the [Dk, Dk] maps and multiplies them, about
2 Dk^2 (C + Dk + 2 Dv) FLOPs per chunk forward on top of the loop's (1.3x the rule's own at
C = 64, Dk = Dv = 128: hardware work that model FLOPs do not count, see `models/flops.py`), and
autograd keeps the maps and offsets of every level and the states between them: 0.9 GiB more
than the loop at 8k tokens and 16 heads of 128 (2.2 GiB in all), growing with N, i.e. about 3.7
times one level's [N, Dk, Dk + Dv] fp32 maps. At one or two chunks there is nothing to compose:
the loop runs.

Packed rows. Every document is laid out from a chunk boundary (a row is re-spaced so that each
document starts a chunk, padded with zero tokens whose write strength is 0 and decay 1), and the
carried state is zeroed at the chunks that start a document. A chunk therefore never mixes two
documents, and a document's outputs equal those of running it alone. The convolution in front
of the rule (`causal_conv`) restarts at document starts through the positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv", "chunk_gated_delta_rule", "gated_delta_rule",
           "recurrent_gated_delta_rule", "l2_normalize"]


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's and transformers' convention)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[B, T, H*, D] inputs -> fp32 [B, Hv, T, D] (key heads repeated for their value heads),
    q and k normalised, q scaled; g and beta [B, Hv, T]."""
    hv, hk = v.shape[2], k.shape[2]
    if hv != hk:
        q = q.repeat_interleave(hv // hk, dim=2)
        k = k.repeat_interleave(hv // hk, dim=2)
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))
    q = l2_normalize(q) * q.shape[-1] ** -0.5
    return q, l2_normalize(k), v, g, beta


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, *, chunk_size: int = 64,
                           initial_state: torch.Tensor | None = None,
                           reset_BN: torch.Tensor | None = None,
                           output_final_state: bool = True,
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked form over whole rows.

    Args:
        q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g (log decay, <= 0), beta: [B, T, Hv].
        initial_state: [B, Hv, Dk, Dv] fp32, or None for zeros.
        reset_BN: [B, T / chunk_size] bool, True where a chunk starts a new document (the
            carried state is dropped there); T must then be a multiple of chunk_size.
        output_final_state: False skips the last chunk's state update (training needs none).

    The state passes from chunk to chunk by the scan, or in a loop over one or two chunks
    (`_SERIAL_MAX_CHUNKS`; see the module docstring).

    Returns:
        the output [B, T, Hv, Dv] in q's dtype and the final state [B, Hv, Dk, Dv] (fp32), or
        None without `output_final_state`.
    """
    dtype = q.dtype
    B, T = q.shape[:2]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    C = chunk_size
    pad = (C - T % C) % C
    if pad:
        assert reset_BN is None, "a reset mask needs rows laid out in whole chunks"
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    H, N = v.shape[1], (T + pad) // C
    q, k, v = (x.reshape(B, H, N, C, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(B, H, N, C), beta.reshape(B, H, N, C)

    G = g.cumsum(dim=-1)                                        # [B, H, N, C]
    later = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    decay_CC = (G[..., :, None] - G[..., None, :]).masked_fill(later, float("-inf")).exp()
    k_beta = k * beta[..., None]
    # I + A: the solve reads the strictly lower triangle and takes the diagonal as ones
    ut = (k_beta @ k.transpose(-1, -2)) * decay_CC
    u = torch.linalg.solve_triangular(ut, v * beta[..., None], upper=False,
                                      unitriangular=True)        # [B, H, N, C, Dv]
    w = torch.linalg.solve_triangular(ut, k_beta * G.exp()[..., None], upper=False,
                                      unitriangular=True)        # [B, H, N, C, Dk]
    intra = (q @ k.transpose(-1, -2)) * decay_CC                # [B, H, N, C, C]
    q_read = q * G.exp()[..., None]
    k_write = k * (G[..., -1:] - G).exp()[..., None]
    chunk_decay = G[..., -1].exp()[..., None, None]             # [B, H, N, 1, 1]

    keep = None if reset_BN is None else (~reset_BN).to(q.dtype)[:, None, :, None, None]
    state = None if initial_state is None else initial_state.float()
    if N <= _SERIAL_MAX_CHUNKS:
        out, state = _pass_serially(u, w, q_read, intra, k_write, chunk_decay, keep, state,
                                    output_final_state)
    else:
        out, state = _pass_by_scan(u, w, q_read, intra, k_write, chunk_decay, keep, state,
                                   output_final_state)
    out = out.reshape(B, H, N * C, -1)[:, :, :T]
    return out.transpose(1, 2).to(dtype), state


# Up to this many chunks a row's state is passed chunk by chunk; beyond, by the scan.
_SERIAL_MAX_CHUNKS = 2


def _pass_serially(u: torch.Tensor, w: torch.Tensor, q_read: torch.Tensor, intra: torch.Tensor,
                   k_write: torch.Tensor, chunk_decay: torch.Tensor, keep: torch.Tensor | None,
                   state: torch.Tensor | None, output_final_state: bool,
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The state from chunk to chunk in order: [B, H, N, C, Dv] outputs and the final state."""
    outs, N = [], u.shape[2]
    for n in range(N):
        if state is None:       # a zero state: the chunk reads nothing from it
            v_new = u[:, :, n]
            outs.append(intra[:, :, n] @ v_new)
        else:
            if keep is not None:
                state = state * keep[:, :, n]
            v_new = u[:, :, n] - w[:, :, n] @ state
            outs.append(q_read[:, :, n] @ state + intra[:, :, n] @ v_new)
        if n == N - 1 and not output_final_state:
            return torch.stack(outs, dim=2), None
        written = k_write[:, :, n].transpose(-1, -2) @ v_new
        state = written if state is None else state * chunk_decay[:, :, n] + written
    return torch.stack(outs, dim=2), state


def _pass_by_scan(u: torch.Tensor, w: torch.Tensor, q_read: torch.Tensor, intra: torch.Tensor,
                  k_write: torch.Tensor, chunk_decay: torch.Tensor, keep: torch.Tensor | None,
                  state: torch.Tensor | None, output_final_state: bool,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`_pass_serially` by a scan over the chunks' affine state maps: every chunk's incoming
    state in log2 N batched levels, then all chunks' outputs at once."""
    B, H, N, C, Dv = u.shape
    Dk = w.shape[-1]
    k_write_T = k_write[:, :, :-1].transpose(-1, -2)                 # [B, H, N-1, Dk, C]
    eye = torch.eye(Dk, dtype=u.dtype, device=u.device)
    # S_out = M S_in + b: M = exp(G_C) I - k_write^T W, b = k_write^T U; the next chunk
    # reads keep * S_out (keep = 0 where it starts a document)
    maps = chunk_decay[:, :, :-1] * eye - k_write_T @ w[:, :, :-1]   # [B, H, N-1, Dk, Dk]
    offsets = k_write_T @ u[:, :, :-1]                               # [B, H, N-1, Dk, Dv]
    if keep is not None:
        maps, offsets = maps * keep[:, :, 1:], offsets * keep[:, :, 1:]
    if state is None:
        state = u.new_zeros(B, H, Dk, Dv)
    elif keep is not None:
        state = state * keep[:, :, 0]
    states = _scan(state, maps, offsets)                             # [B, H, N, Dk, Dv]
    v_new = u - w @ states
    out = q_read @ states + intra @ v_new
    if not output_final_state:
        return out, None
    last = states[:, :, -1] * chunk_decay[:, :, -1] + (
        k_write[:, :, -1].transpose(-1, -2) @ v_new[:, :, -1])
    return out, last


def _scan(state: torch.Tensor, maps: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """S_0 = state, S_{n+1} = maps_n S_n + offsets_n for the m maps [..., m, Dk, Dk] and
    offsets [..., m, Dk, Dv]: the m + 1 states [..., m + 1, Dk, Dv]. Adjacent maps are composed
    in pairs (m / 2 maps), the states at even positions come from the scan of those, and the
    states at odd positions each from the even one before it: log2 m levels of a few batched
    ops each, about 2 m map products in all."""
    m = maps.shape[-3]
    if m == 0:
        return state[..., None, :, :]
    if m == 1:
        return torch.stack([state, maps[..., 0, :, :] @ state + offsets[..., 0, :, :]], dim=-3)
    p = m // 2
    first_M, first_b = maps[..., 0:2 * p:2, :, :], offsets[..., 0:2 * p:2, :, :]
    second_M, second_b = maps[..., 1::2, :, :], offsets[..., 1::2, :, :]
    even = _scan(state, second_M @ first_M, second_M @ first_b + second_b)   # S_0, S_2, ..
    odd = maps[..., 0::2, :, :] @ even[..., :m - p, :, :] + offsets[..., 0::2, :, :]
    if m % 2:               # m + 1 even: S_0, S_1, ..., S_m pair up
        return torch.stack([even, odd], dim=-3).flatten(-4, -3)
    both = torch.stack([even[..., :p, :, :], odd], dim=-3).flatten(-4, -3)
    return torch.cat([both, even[..., p:, :, :]], dim=-3)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               g: torch.Tensor, beta: torch.Tensor, *,
                               initial_state: torch.Tensor | None = None,
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrent form, one token at a time (decoding); the arguments and results of
    `chunk_gated_delta_rule` without chunking or resets."""
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    B, H, T = v.shape[:3]
    state = (q.new_zeros(B, H, k.shape[-1], v.shape[-1]) if initial_state is None
             else initial_state.float())
    outs = []
    for t in range(T):
        state = state * g[:, :, t].exp()[..., None, None]
        read = (state * k[:, :, t, :, None]).sum(dim=-2)        # S^T k   [B, H, Dv]
        delta = (v[:, :, t] - read) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append((state * q[:, :, t, :, None]).sum(dim=-2))
    out = torch.stack(outs, dim=2)
    return out.transpose(1, 2).to(dtype), state


def _chunk_layout(lengths: list[list[int]], seq_len: int, chunk: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each token of each row goes when every document starts a chunk: flat indices
    [B * T] into a [B, T'] layout, the reset mask [B, T' / chunk], and T'."""
    starts, padded_rows = [], []
    for row in lengths:
        offsets, at = [], 0
        for n in row:
            offsets.append(at)
            at += -(-n // chunk) * chunk
        starts.append(offsets)
        padded_rows.append(at)
    width = max(padded_rows)
    index, reset = [], torch.zeros(len(lengths), width // chunk, dtype=torch.bool)
    for b, (row, offsets) in enumerate(zip(lengths, starts)):
        for n, at in zip(row, offsets):
            index.append(torch.arange(at, at + n) + b * width)
            reset[b, at // chunk] = True
    return torch.cat(index).to(device), reset.to(device), width


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, *, document_lengths: list[list[int]] | None = None,
                     chunk_size: int = 64, output_final_state: bool = False,
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`chunk_gated_delta_rule` over packed rows ([B, T] with `document_lengths[b]` summing to
    T; None: one document per row): each document from a zero state. Returns the output
    [B, T, Hv, Dv] and, with `output_final_state`, each row's state after its last token (the
    last document's)."""
    if document_lengths is None or all(len(row) == 1 for row in document_lengths):
        return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size,
                                      output_final_state=output_final_state)
    B, T = q.shape[:2]
    index, reset, width = _chunk_layout(document_lengths, T, chunk_size, q.device)

    def spread(x: torch.Tensor) -> torch.Tensor:     # [B, T, ...] -> [B, T', ...], zeros between
        flat = x.new_zeros(B * width, *x.shape[2:])
        return flat.index_copy(0, index, x.reshape(B * T, *x.shape[2:])).view(B, width,
                                                                              *x.shape[2:])

    out, state = chunk_gated_delta_rule(spread(q), spread(k), spread(v), spread(g), spread(beta),
                                        chunk_size=chunk_size, reset_BN=reset,
                                        output_final_state=output_final_state)
    out = out.reshape(B * width, *out.shape[2:]).index_select(0, index)
    return out.view(B, T, *out.shape[1:]), state


def causal_conv(x_BTC: torch.Tensor, weight_CK: torch.Tensor, position_ids_BT: torch.Tensor,
                history_BCk: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution with restarts: out[t] = sum_j w[K-1-j] x[t-j] over the
    j <= position(t) of the token's own document (earlier inputs count as zero), which is
    `F.conv1d(x, w, padding=K-1, groups=C)[:T]` run on every document alone.

    `history_BCk` [B, C, K-1]: the K-1 inputs before x (decoding; then every token continues
    the row's document and positions are not consulted). Returns [B, T, C] before activation.
    """
    K = weight_CK.shape[-1]
    T = x_BTC.shape[1]
    if history_BCk is not None:
        x_full = torch.cat([history_BCk.transpose(1, 2).to(x_BTC.dtype), x_BTC], dim=1)
        return sum(x_full[:, K - 1 - j:K - 1 - j + T] * weight_CK[:, K - 1 - j]
                   for j in range(K))
    out = x_BTC * weight_CK[:, K - 1]
    for j in range(1, K):
        shifted = F.pad(x_BTC, (0, 0, j, 0))[:, :T]
        visible = (position_ids_BT >= j)[..., None].to(x_BTC.dtype)
        out = out + shifted * visible * weight_CK[:, K - 1 - j]
    return out
