"""`NativeEngine`: batched sampling from a native `Transformer` with a KV cache (CPU, one GPU),
or from a transformers model without a native definition (`posttrain.models.fallback.HFCausalLM`).

How a `generate` call runs (see `posttrain.models.kv_cache` for the cache layout):

1. Prompts are taken `max_batch_sequences // n` at a time, left-padded to the longest one and
   prefilled once; the cache rows are then repeated `n` times (row i * n + j is sample j of
   prompt i), so the n samples of a prompt share one prefill.
2. Each step computes fp32 logits over the real vocabulary for the last token of every live row,
   draws the next token with `posttrain.ops.vocab.sample_next_token` (greedy, temperature, top-k,
   top-p) from one `torch.Generator` seeded by `SamplingConfig.seed`, and records its log-prob
   (convention in `posttrain.rl.engine`). With `allowed_token_ranges` the logits are those of
   the allowed ids only (the head's rows for them, `posttrain.ops.vocab.restrict_head`), so
   nothing else is drawn and the log-prob is renormalised over them, as a trainer computes it.
3. A row that samples a stop token or reaches `max_new_tokens` is finished and dropped from the
   batch and the cache, so later steps only pay for live rows.
4. With `SamplingConfig.record_routing` (an MoE model), after the prefill and every decode step
   the experts each MoE block chose for the tokens it ran are kept (`_RoutingRecorder`), and
   each rollout gets its record [prompt + completion, L_moe, k] (`Rollout.routing`;
   `posttrain.models.routing_replay`). Off, nothing is read.

The cache is the model's kind: the native static cache (`posttrain.models.kv_cache`) for a
`Transformer`, transformers' own cache behind the same interface (`fallback.HFKVCache`) for an
`HFCausalLM`, whose parameters are then named ``hf.<transformers name>`` for `update_weights`.
Loop, sampler, log-prob convention and teacher-forced scoring are the same for both.

Memory: the cache lives for one chunk of a `generate` call. Between generations the engine holds
its own copy of the weights; `release_memory` frees those storages (and the device allocator's
cached blocks) and `resume_memory` allocates them again for the next full weight sync, so a
colocated trainer's update runs without the engine's memory (`rollout.release_memory`).

Determinism: for the same prompts, config, weights, `n` and `max_batch_sequences` the rollouts are
identical. One generator serves the whole batch, so a sample depends on its batch neighbours.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from posttrain.models.fallback import HFCausalLM, HFKVCache, forward_with_hf_cache
from posttrain.models.kv_cache import KVCache, forward_with_cache
from posttrain.models.routing_replay import moe_blocks, recorded_routing
from posttrain.models.transformer import LMHead, Transformer
from posttrain.ops.cross_entropy import IGNORE_INDEX, chunked_logprobs
from posttrain.ops.vocab import (check_token_ranges, mask_padded_logits, renumber_tokens,
                                 restrict_head, sample_next_token, token_range_ids)
from posttrain.rl.engine import Rollout, SamplingConfig

__all__ = ["NativeEngine"]


class NativeEngine:
    """A `RolloutEngine` over a native `Transformer` or a transformers fallback `HFCausalLM`.

    Args:
        model: the model to sample from. Used as is (weights shared with the caller) unless
            `copy_model`, which deep-copies it so that training never touches the engine's weights
            between `update_weights` calls.
        max_batch_sequences: sequences (prompts x n) decoded together, at most; bounds the cache
            memory, 2 x layers x rows x kv_heads x (prompt + max_new_tokens) x head_dim values.
    """

    def __init__(self, model: Transformer, *, copy_model: bool = False,
                 max_batch_sequences: int = 256):
        if max_batch_sequences < 1:
            raise ValueError(f"max_batch_sequences must be >= 1, got {max_batch_sequences}")
        self.model = copy.deepcopy(model) if copy_model else model
        self.max_batch_sequences = max_batch_sequences
        fallback = isinstance(self.model, HFCausalLM)
        self._cache, self._forward = ((HFKVCache, forward_with_hf_cache) if fallback
                                      else (KVCache, forward_with_cache))
        args = getattr(self.model, "args", None)
        self.vocab_size = args.vocab_size if args is not None else self.model.real_vocab_size
        self._max_positions = (args.max_position_embeddings if args is not None
                               else self.model.max_position_embeddings)
        # a causal-LM head whose weight the chunked log-probs read (not a custom head)
        self._lm_head = fallback or isinstance(self.model.head, LMHead)
        self._released: dict[int, torch.Size] | None = None   # id(tensor) -> shape
        # name -> parameter or buffer, for `update_weights`: made once, since a weight sync
        # writes one tensor per call and walking the modules each time made a sync quadratic
        # in the tensors; they stay the same objects (`release_memory` swaps storage only)
        self._targets = {**dict(self.model.named_buffers()), **dict(self.model.named_parameters())}

    partial_updates = True        # `update_weights` takes any subset of the parameters

    @property
    def device(self) -> torch.device:
        return self.model.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed.weight.dtype

    @property
    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter (and persistent buffer: DeepSeek-V3's router bias) name -> shape (a tied
        head has no entry: send `embed.weight`; on an `HFCausalLM` the names are
        ``hf.<transformers name>``)."""
        from posttrain.distributed.materialize import persistent_buffers
        return {name: tuple(t.shape) for name, t in [*self.model.named_parameters(),
                                                      *persistent_buffers(self.model).items()]}

    # ------------------------------------------------------------------ memory

    def _synced_tensors(self) -> list[torch.Tensor]:
        """The tensors a weight sync writes (parameters and persistent buffers), once each."""
        from posttrain.distributed.materialize import persistent_buffers
        unique = {id(t): t for t in [*self.model.parameters(),
                                     *persistent_buffers(self.model).values()]}
        return list(unique.values())

    def release_memory(self) -> bool:
        """Free the weights' storage (the next sync refills it) and the device's cached
        blocks; the KV cache is already gone once `generate` returns."""
        if self._released is not None:
            return True
        self._released = {}
        device = self.device
        for t in self._synced_tensors():
            self._released[id(t)] = t.shape
            t.data = torch.empty(0, dtype=t.dtype, device=device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return True

    def resume_memory(self) -> None:
        """Allocate the released weights again (undefined until the next full sync)."""
        if self._released is None:
            return
        for t in self._synced_tensors():
            t.data = torch.empty(self._released[id(t)], dtype=t.dtype, device=t.device)
        self._released = None

    def _check_resident(self) -> None:
        if self._released is not None:
            raise RuntimeError("the engine's memory is released: call resume_memory() and "
                               "sync the weights before generating or scoring")

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 n: int = 1) -> list[list[Rollout]]:
        """`n` rollouts per prompt; result[i][j] is sample j of prompts[i]."""
        if n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
        self._check_resident()
        self._check_prompts(prompts, sampling.max_new_tokens)
        check_token_ranges(sampling.allowed_token_ranges, self.vocab_size,
                           key="sampling.allowed_token_ranges")
        self._check_recording(sampling)
        generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        per_chunk = max(1, self.max_batch_sequences // n)
        results: list[list[Rollout]] = []
        for start in range(0, len(prompts), per_chunk):
            results += self._generate_chunk(prompts[start:start + per_chunk], sampling, n,
                                            generator)
        return results

    @torch.inference_mode()
    def _generate_chunk(self, prompts: list[list[int]], sampling: SamplingConfig, n: int,
                        generator: torch.Generator) -> list[list[Rollout]]:
        device, max_new = self.device, sampling.max_new_tokens
        prompt_len = max(len(p) for p in prompts)
        ids_BP = torch.zeros(len(prompts), prompt_len, dtype=torch.long, device=device)
        for b, prompt in enumerate(prompts):
            ids_BP[b, prompt_len - len(prompt):] = torch.tensor(prompt, device=device)
        pad_B = torch.tensor([prompt_len - len(p) for p in prompts], device=device)
        cache = self._cache.allocate(self.model, pad_B, prompt_len + max_new)
        hidden_BH = self._forward(self.model, ids_BP, cache)[:, -1]
        recorder = (_RoutingRecorder(self.model, pad_B, n, max_new) if sampling.record_routing
                    else None)

        rows_B = torch.arange(len(prompts), device=device).repeat_interleave(n)
        cache, hidden_BH = cache.select(rows_B), hidden_BH.index_select(0, rows_B)
        live = list(range(len(prompts) * n))          # output index of each cache row
        tokens: list[list[int]] = [[] for _ in live]
        logps: list[list[float]] = [[] for _ in live]
        finish: list[str] = ["length"] * len(live)
        stops = set(sampling.stop_token_ids)
        lp_temperature = sampling.logprob_temperature
        # the allowed ids (None: all): column j of the logits is id allowed_A[j]
        allowed_A = (token_range_ids(sampling.allowed_token_ranges, device)
                     if sampling.allowed_token_ranges else None)
        for step in range(max_new):
            logits_BV = self._next_token_logits(hidden_BH, allowed_A)
            next_B = sample_next_token(logits_BV, sampling.temperature, sampling.top_p,
                                       sampling.top_k, generator,
                                       real_vocab_size=None if allowed_A is not None
                                       else self.vocab_size)
            logp_B = torch.log_softmax(logits_BV / lp_temperature, dim=-1).gather(
                -1, next_B[:, None]).squeeze(-1)
            if allowed_A is not None:
                next_B = allowed_A[next_B]
            keep = []
            for r, (out, token, logp) in enumerate(zip(live, next_B.tolist(), logp_B.tolist())):
                tokens[out].append(token)
                logps[out].append(logp)
                if token in stops:
                    finish[out] = "stop"
                elif len(tokens[out]) < max_new:
                    keep.append(r)
            if not keep:
                break
            if len(keep) < len(live):
                keep_B = torch.tensor(keep, device=device)
                cache, next_B = cache.select(keep_B), next_B.index_select(0, keep_B)
                live = [live[r] for r in keep]
            hidden_BH = self._forward(self.model, next_B[:, None], cache)[:, -1]
            if recorder is not None:
                recorder.decoded(live, step)
        routing = (recorder.rollouts([len(t) for t in tokens]) if recorder is not None
                   else [None] * len(tokens))
        return [[Rollout(list(prompts[i]), tokens[i * n + j], logps[i * n + j],
                         finish[i * n + j], routing[i * n + j])  # type: ignore[arg-type]
                 for j in range(n)] for i in range(len(prompts))]

    def _check_recording(self, sampling: SamplingConfig) -> None:
        if sampling.record_routing and (isinstance(self.model, HFCausalLM)
                                        or not moe_blocks(self.model)):
            raise ValueError("record_routing (algorithm.routing_replay) needs a native "
                             "mixture-of-experts model; this engine's model has no MoE layers")

    def _next_token_logits(self, hidden_BH: torch.Tensor,
                            allowed_A: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits [B, V] (padded columns -inf or cut), or [B, A] of the ids `allowed_A`,
        computed as `chunked_logprobs` computes them (projection in the model dtype, soft-cap in
        fp32), so the sampler's log-probs and a trainer's agree."""
        head, real = self.model.head, self.vocab_size
        if self._lm_head:
            bias = getattr(head, "bias", None)
            weight = head.weight[:real] if allowed_A is None else head.weight[allowed_A]
            if bias is not None:
                bias = bias[:real] if allowed_A is None else bias[allowed_A]
            logits_BV = F.linear(hidden_BH, weight, bias).float()
            if head.softcap is not None:
                logits_BV = torch.tanh(logits_BV / head.softcap) * head.softcap
            return logits_BV
        logits_BV = mask_padded_logits(self.model.logits(hidden_BH).float(), real)
        return logits_BV if allowed_A is None else logits_BV[:, allowed_A]

    def _check_prompts(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        vocab = self.vocab_size
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary "
                                 f"[0, {vocab})")
        longest = max((len(p) for p in prompts), default=0)
        limit = self._max_positions
        if limit is not None and longest + max_new_tokens > limit:
            raise ValueError(f"the longest prompt ({longest} tokens) + max_new_tokens "
                             f"({max_new_tokens}) exceeds the model's max_position_embeddings "
                             f"({limit}); shorten the prompts or lower max_new_tokens")

    # ------------------------------------------------------------------ weights and scoring

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full tensors with native parameter/buffer names into the model (any subset).

        A tied head has no `head.weight` of its own: send `embed.weight`.
        """
        targets = self._targets
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in targets:
                    hint = (" (the head is tied to the embedding; send embed.weight)"
                            if name == "head.weight" else
                            f"; known names look like {sorted(targets)[:4]}")
                    raise ValueError(f"update_weights got '{name}', which is not a parameter "
                                     f"or buffer of the engine's model{hint}")
                target = targets[name]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(f"update_weights: '{name}' has shape {tuple(tensor.shape)}, "
                                     f"the model expects {tuple(target.shape)} (full, unsharded "
                                     "tensors are required)")
                target.copy_(tensor)

    @torch.inference_mode()
    def logprobs(self, sequences: list[list[int]], prompt_lens: list[int], *,
                 temperature: float = 1.0, allowed_token_ranges: tuple = ()
                 ) -> list[list[float]]:
        """Teacher-forced log p(sequences[i][t]) for t >= prompt_lens[i], at `temperature`,
        renormalised over `allowed_token_ranges` when given (the convention of
        `posttrain.rl.engine`); one full forward per batch of sequences."""
        ranges = check_token_ranges(allowed_token_ranges, self.vocab_size,
                                    key="allowed_token_ranges")
        if len(sequences) != len(prompt_lens):
            raise ValueError(f"{len(sequences)} sequences but {len(prompt_lens)} prompt_lens")
        self._check_resident()
        for i, (seq, plen) in enumerate(zip(sequences, prompt_lens)):
            if not 1 <= plen <= len(seq):
                raise ValueError(f"prompt_lens[{i}] = {plen} must be in [1, {len(seq)}] "
                                 "(the first token has no log-prob)")
        out: list[list[float]] = []
        for start in range(0, len(sequences), self.max_batch_sequences):
            stop = start + self.max_batch_sequences
            out += self._score_batch(sequences[start:stop], prompt_lens[start:stop],
                                     temperature, ranges)
        return out

    def _score_batch(self, sequences: list[list[int]], prompt_lens: list[int],
                     temperature: float, ranges: tuple = ()) -> list[list[float]]:
        device, longest = self.device, max(len(s) for s in sequences)
        # right padding: causal attention keeps it out of every real position
        ids_BT = torch.zeros(len(sequences), longest, dtype=torch.long, device=device)
        targets_BT = torch.full_like(ids_BT, IGNORE_INDEX)
        for b, (seq, plen) in enumerate(zip(sequences, prompt_lens)):
            ids_BT[b, :len(seq)] = torch.tensor(seq, device=device)
            targets_BT[b, plen - 1:len(seq) - 1] = ids_BT[b, plen:len(seq)]
        hidden_BTH = self.model(ids_BT)
        head = self.model.head
        if self._lm_head:
            weight, bias, real = head.weight, getattr(head, "bias", None), self.vocab_size
            if ranges:
                weight, bias, targets_BT = restrict_head(weight, bias, targets_BT, ranges)
                real = weight.shape[0]
            logp_BT = chunked_logprobs(hidden_BTH, weight, targets_BT, real_vocab_size=real,
                                       softcap=head.softcap, bias=bias,
                                       temperature=temperature)
        else:
            logits = mask_padded_logits(self.model.logits(hidden_BTH).float(),
                                        self.vocab_size) / temperature
            if ranges:
                logits = logits[..., token_range_ids(ranges, device)]
                targets_BT = renumber_tokens(targets_BT, ranges, self.vocab_size)
            logp_BT = torch.log_softmax(logits, dim=-1).gather(
                -1, targets_BT.clamp_min(0)[..., None]).squeeze(-1)
        return [logp_BT[b, plen - 1:len(seq) - 1].tolist()
                for b, (seq, plen) in enumerate(zip(sequences, prompt_lens))]


class _RoutingRecorder:
    """The experts chosen in one chunk's prefill and decode steps, kept on the device until the
    rollouts are made (step 4 of the module docstring)."""

    def __init__(self, model: Transformer, pad_B: torch.Tensor, n: int, max_new: int):
        self.blocks = moe_blocks(model)
        B = pad_B.shape[0]
        prefill = recorded_routing(self.blocks)                       # [B * P, L, k]
        self.prefill_BPLK = prefill.view(B, -1, *prefill.shape[1:])
        self.pad, self.n = pad_B.tolist(), n
        # [rows, step, L, k]: the experts of completion token `step` of each row, when fed
        self.decode = prefill.new_full((B * n, max(max_new - 1, 0), *prefill.shape[1:]), -1)

    def decoded(self, live: list[int], step: int) -> None:
        """The decode forward of `step` ran the live rows `live` (output indices) over their
        completion token `step`."""
        rows = torch.tensor(live, device=self.decode.device)
        self.decode[rows, step] = recorded_routing(self.blocks)

    def rollouts(self, completion_lens: list[int]) -> list[torch.Tensor]:
        """Per output row: [prompt + completion, L, k] int16 on the CPU, -1 on the last token
        (sampled, never run)."""
        prefill, decode = self.prefill_BPLK.cpu(), self.decode.cpu()
        out = []
        for row, c in enumerate(completion_lens):
            b = row // self.n
            last = prefill.new_full((1, *prefill.shape[2:]), -1)
            out.append(torch.cat([prefill[b, self.pad[b]:], decode[row, :c - 1], last]))
        return out
