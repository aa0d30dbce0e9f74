"""LLM: the user-facing engine. `generate` for a batch, `add_request` / `step` for streaming.

    llm = LLM("default", max_num_seqs=8, prefill_graphs=True)
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=32))

Each step: schedule (decodes + prefill chunks under the token budget) -> run the model (the
dispatcher picks FULL / PIECEWISE / NONE) -> sample on the device -> update the requests.
Requests are validated when added, before anything reaches the device; a bad request raises
InvalidRequestError naming it and leaves the requests in flight untouched.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Any, Sequence, Union

import torch

from engine.config import ConfigError, EngineConfig
from engine.request import (
    InvalidRequestError, Request, RequestOutput, SamplingParams, check_prompt,
)
from engine.runtime import build_runtime
from engine.scheduler import Scheduler

logger = logging.getLogger("engine")

Prompt = Union[str, Sequence[int]]


class LLM:
    def __init__(self, model: str | torch.nn.Module = "default", tokenizer: Any = None, **config_fields: Any) -> None:
        """`model`: an HF-format dir, a .gguf file, "default", or an already built models.CausalLM.

        `config_fields` are EngineConfig fields (max_num_seqs=..., prefill_graphs=..., ...).
        `tokenizer`: a transformers tokenizer, or the name / path of one to load (EngineConfig.tokenizer,
        which must then load); by default the model directory's own, if it has one.
        """
        import models

        if isinstance(tokenizer, str):
            config_fields["tokenizer"], tokenizer = tokenizer, None
        model_dir = model if isinstance(model, str) else None
        name = model if isinstance(model, str) else f"<{type(model).__name__} instance>"
        if not isinstance(model, str):
            # A built model fixes the dtype and device the KV cache and buffers must match.
            weight = next(model.parameters())
            config_fields.setdefault("dtype", str(weight.dtype).removeprefix("torch."))
            config_fields.setdefault("device", str(weight.device))
        config = EngineConfig.from_kwargs(name, **config_fields)
        self.tp = None  # engine.tp.Leader under tensor parallelism (this process is rank 0)
        if config.tensor_parallel_size > 1:
            from engine.tp import launch  # starts the other ranks (a torchrun rank > 0 never returns)
            self.tp, config = launch(config, model)
        if not isinstance(model, str):
            _check_built_model(weight, config)
        device, dtype = config.device_and_dtype()
        if isinstance(model, str):
            load_start = time.perf_counter()
            model = models.from_pretrained(model, dtype=dtype, device=device,
                                           **({"tp": self.tp.parallel} if self.tp else {}))
            logger.info("loaded %s in %.1f s", name, time.perf_counter() - load_start)
        if tokenizer is None and config.tokenizer is not None:
            tokenizer = _load_tokenizer(config.tokenizer, required=True)
        elif tokenizer is None and model_dir is not None:
            tokenizer = _load_tokenizer(model_dir, required=False)
        self.model = model
        self.tokenizer = tokenizer
        self.model_config = model.config
        self.config = config.resolve(model.config.max_position_embeddings)
        with torch.inference_mode():
            self.runtime = build_runtime(model, self.config, self.tp.min_over_ranks if self.tp else None)
        if self.tp:
            self.tp.attach(self.runtime)
        self.scheduler = Scheduler(self.runtime.block_pool, self.config.max_num_seqs,
                                   self.config.max_num_batched_tokens, self.config.max_model_len,
                                   tuple(model.config.eos_token_ids))
        self._requests: dict[str, Request] = {}
        self._unreported: dict[str, Request] = {}  # streamed requests that got tokens inside generate()
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_generated_tokens = 0

    # -- requests ------------------------------------------------------------------------------

    def _validated(self, prompt: Prompt, params: SamplingParams, request_id: str) -> Request:
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"request {request_id!r}: params must be SamplingParams, got "
                                      f"{type(params).__name__}")
        if request_id in self._requests:
            raise InvalidRequestError(f"request {request_id!r}: a request with this id is already in flight")
        vocab = self.model_config.vocab_size
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError(f"request {request_id!r}: prompt is empty")
            if self.tokenizer is None:
                raise InvalidRequestError(f"request {request_id!r}: prompt is a string but the engine has no "
                                          "tokenizer; pass token ids or LLM(..., tokenizer=...)")
            prompt = self.tokenizer(prompt)["input_ids"]
        ids = check_prompt(request_id, prompt, vocab, self.config.max_model_len)
        params.check(request_id, vocab)
        return Request(request_id, ids, params)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue one request; it runs from the next `step`. Returns its id."""
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        request = self._validated(prompt, params or SamplingParams(), request_id)
        self._admit(request)
        return request_id

    def _admit(self, request: Request) -> None:
        self.runtime.sampler.attach(request)
        self._requests[request.request_id] = request
        self.scheduler.add(request)

    def has_unfinished_requests(self) -> bool:
        """True while a request runs or waits, or a streamed request's token awaits its step() output."""
        return self.scheduler.has_unfinished() or bool(self._unreported)

    # -- stepping -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; an output for every request that got a token (finished ones included).

        Requests added with add_request that got tokens while generate() ran are reported here too
        (their latest state), so a stream interleaved with generate() still sees every request finish.
        """
        sampled = self._step()
        late = [r for r in self._unreported.values() if r not in sampled]
        self._unreported.clear()
        return [self._output(r) for r in late + sampled]

    @torch.inference_mode()
    def _step(self) -> list[Request]:
        """Run one step; the requests that got a token, in chunk order."""
        out = self.scheduler.schedule()
        if out.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress with requests pending (KV pool too small?)")
            return []
        result = self.runtime.runner.execute(out, self.runtime.block_pool)
        sampling = [c.request for c in out.chunks if c.samples]
        tokens = self.runtime.sampler(result.logits, sampling) if sampling else []
        self.scheduler.update(out, tokens, time.perf_counter())
        self.num_steps += 1
        self.num_generated_tokens += len(tokens)
        for request in sampling:
            if request.is_finished:
                del self._requests[request.request_id]
        return sampling

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """One output per prompt, in order. Every prompt is validated before any of them runs."""
        if isinstance(prompts, torch.Tensor):  # [T] is one prompt, [B, T] a batch
            prompts = [prompts] if prompts.dim() == 1 else list(prompts)
        elif isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                          and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"generate got {len(prompts)} prompts but {len(params)} SamplingParams")
        base = next(self._ids)
        requests = [self._validated(p, sp, f"{base}.{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
        for request in requests:
            self._admit(request)
        # Outputs are built once at the end, not per step; tokens that streamed requests (added
        # with add_request) get meanwhile are kept for their next step() instead of being dropped.
        own = set(requests)
        while any(not r.is_finished for r in requests):
            for request in self._step():
                if request not in own:
                    self._unreported[request.request_id] = request
        return [self._output(r) for r in requests]

    def _output(self, request: Request) -> RequestOutput:
        tokens = request.output_token_ids
        text = self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else ""
        times = request.token_times
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            token_ids=list(tokens),
            text=text,
            finished=request.is_finished,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            ttft_s=times[0] - request.arrival_time if times else None,
            inter_token_latencies_s=[b - a for a, b in zip(times, times[1:])],
            num_preemptions=request.num_preemptions,
        )

    def close(self) -> None:
        """Free the KV pool and the decode graphs now (the layer registry would otherwise keep the pool)."""
        if self.tp is not None:
            self.tp.close()
        runner = self.runtime.runner
        if runner.decode_graphs is not None:
            runner.decode_graphs.release()
            runner.decode_graphs = None
        self.runtime.kv_cache.release()
        if self.runtime.kv_cache.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- introspection --------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        runner = self.runtime.runner
        graphs = runner.decode_graphs
        stats: dict[str, Any] = {
            "steps": self.num_steps,
            "generated_tokens": self.num_generated_tokens,
            "modes": dict(runner.dispatcher.mode_counts),
            "fallbacks": runner.dispatcher.fallbacks,
            "fallback_reasons": dict(runner.dispatcher.fallback_counts),
            "preemptions": self.scheduler.num_preemptions,
            "kv_blocks": self.runtime.block_pool.num_blocks,
            "decode_graphs": len(graphs.sizes) if graphs else 0,
            "decode_graph_replays": graphs.replays if graphs else 0,
            "decode_graph_replays_by_size": dict(graphs.replays_by_size) if graphs else {},
            "decode_graph_capture_seconds": graphs.capture_seconds if graphs else 0.0,
            "decode_graph_bytes": graphs.graph_bytes if graphs else 0,
            "piecewise_capture_seconds": self.runtime.piecewise_capture_seconds,
            **self.runtime.memory,
        }
        if self.runtime.backend is not None:
            stats["backend"] = dataclasses.asdict(self.runtime.backend.stats)
        if self.tp is not None:
            stats["ranks"] = self.tp.rank_stats()  # graph counts and fallbacks of every rank
        return stats


def _check_built_model(weight: torch.Tensor, config: EngineConfig) -> None:
    """A built model runs in its own dtype and on its own device: a config that asks for others
    would give a KV cache and buffers the model cannot use."""
    dtype = str(weight.dtype).removeprefix("torch.")
    if config.dtype != dtype:
        raise ConfigError(f"EngineConfig.dtype={config.dtype!r} but the built model's weights are {dtype}: "
                          "leave dtype unset for a built model, or convert the model first")
    asked = torch.device(config.device)
    if asked.type != weight.device.type or asked.index not in (None, weight.device.index):
        raise ConfigError(f"EngineConfig.device={config.device!r} but the built model's weights are on "
                          f"{weight.device}: leave device unset for a built model, or move the model first")


def _load_tokenizer(name: str, required: bool) -> Any:
    """The tokenizer `name` names; when not required (the model directory's own), None if it has none."""
    import models
    try:
        return models.load_tokenizer(name)
    except Exception as exc:
        if required:
            raise ConfigError(f"EngineConfig.tokenizer={name!r} could not be loaded: {exc}") from exc
        # a weights-only dir (tests, converted checkpoints) has no tokenizer
        logger.info("no tokenizer for %s (%s): prompts must be token ids", name, exc)
        return None
