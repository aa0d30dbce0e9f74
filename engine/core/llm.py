"""LLM: the user-facing engine. `generate` for a batch, `add_request` / `step` / `abort` for streaming.

    llm = LLM("default", max_num_seqs=8)
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=32))

Each step: schedule (decodes + prefill chunks under the token budget) -> run the model (the
dispatcher picks FULL / PIECEWISE / NONE) -> sample on the device -> update the requests.
Requests are validated when added, before anything reaches the device; a bad request raises
InvalidRequestError naming it and leaves the requests in flight untouched.

Lifecycle: `close()`, leaving `with LLM(...) as llm:`, or dropping the last reference releases
everything the engine made (KV pool, graphs and their pool, compiled code and its Dynamo entries,
worker processes; engine/worker/startup.py). close() is idempotent; a closed engine refuses to step, and
its model (if it was handed in) can be given to a new engine. `stats()["startup"]` is the start-up
timeline (engine/worker/timeline.py).
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import logging
from typing import Any, Callable, Sequence, Union

import torch

from engine.config import ConfigError, EngineConfig
from engine.core.detokenizer import BatchDecoder, OutputTracker
from engine.core.scheduler import Scheduler
from engine.core.stats import collect_stats
from engine.core.step_loop import StepLoop
from engine.core.text_process import spawn_front_end, start_front_end
from engine.core.tokenizer_load import PendingTokenizer
from engine.outputs import RequestOutput
from engine.params import InvalidRequestError, SamplingParams, batch_of_prompts, check_prompt
from engine.request import FinishReason, Request
from engine.spec.draft import build_draft_proposer
from engine.spec.proposer import Proposer
from engine.worker.startup import build_runtime, check_built_model
from engine.worker.timeline import StartupTimeline

logger = logging.getLogger("engine")

Prompt = Union[str, Sequence[int]]


class QueueFullError(RuntimeError):
    """add_request refused a request because EngineConfig.max_waiting_requests requests already wait
    (back-pressure: retry once some have been scheduled). The request itself is valid."""

    def __init__(self, request_id: str, num_waiting: int, limit: int) -> None:
        super().__init__(f"request {request_id!r}: {num_waiting} requests are already waiting "
                         f"(EngineConfig.max_waiting_requests={limit}); retry later")
        self.request_id, self.num_waiting, self.limit = request_id, num_waiting, limit

    def __reduce__(self):  # crosses from the server's engine process to its HTTP process
        return type(self), (self.request_id, self.num_waiting, self.limit)


class LLM:
    def __init__(self, model: str | torch.nn.Module = "default", tokenizer: Any = None, revision: str | None = None,
                 **config_fields: Any) -> None:
        """`model`: an HF-format dir, a hub id ("org/name", through the Hugging Face cache, at
        `revision`), a .gguf file, "default", or an already built models.CausalLM.

        `config_fields` are EngineConfig fields (max_num_seqs=..., prefill_graphs=..., ...), and vLLM's
        `enforce_eager=True` (cudagraph_mode NONE: no CUDA graphs; the model is still compiled).
        `tokenizer`: a transformers tokenizer, or the name / path of one to load (EngineConfig.tokenizer,
        which must then load); by default the model directory's own, if it has one.
        """
        import models

        self._closed = True  # until start-up succeeds: __del__ of a half-built engine does nothing
        timeline = StartupTimeline()
        if isinstance(tokenizer, str):
            config_fields["tokenizer"], tokenizer = tokenizer, None
        if config_fields.pop("enforce_eager", False):
            mode = config_fields.setdefault("cudagraph_mode", "NONE")
            if str(mode).upper() != "NONE":
                raise ConfigError(f"enforce_eager=True and cudagraph_mode={mode!r} disagree: enforce_eager means "
                                  "cudagraph_mode='NONE'")
        name = model if isinstance(model, str) else f"<{type(model).__name__} instance>"
        if isinstance(model, str) and (revision is not None or models.paths.is_hub_id(model)):
            # resolved once here: every later reader (the load, the tokenizer, the other ranks) gets
            # the snapshot directory, and `revision` is not lost on the way
            model = models.resolve_model_path(model, revision)
        if not isinstance(model, str):
            # A built model fixes the dtype and device the KV cache and buffers must match.
            weight = next(model.parameters())
            config_fields.setdefault("dtype", str(weight.dtype).removeprefix("torch."))
            config_fields.setdefault("device", str(weight.device))
        config = EngineConfig.from_kwargs(name, **config_fields)
        self.tp = None  # engine.distributed.tp.Leader under tensor parallelism (this process is rank 0)
        if config.tensor_parallel_size > 1:
            from engine.distributed.tp import launch  # starts the other ranks (a torchrun rank > 0 never returns)
            self.tp, config = launch(config, model)
        if config.wants_compile():  # Dynamo and Inductor import while the weights load (engine.worker.compile)
            from engine.worker.compile import prefetch_compile_imports
            prefetch_compile_imports(torch.device(config.device_and_dtype()[0]).type)
        # the front end's process imports its modules while the engine starts (engine/core/text_process.py)
        self._spawned_front = spawn_front_end(config.wants_frontend_process())
        try:
            self._start(model, tokenizer, config, timeline, name)
        except BaseException:
            if self.tp is not None:
                self.tp.close()  # the other ranks must not outlive a start-up that failed here
            if self._spawned_front is not None:
                self._spawned_front.close()
            raise

    def _start(self, model: str | torch.nn.Module, tokenizer: Any, config: EngineConfig,
               timeline: StartupTimeline, name: str) -> None:
        """Everything after the config (and the other ranks, under tensor parallelism): load, build
        the runtime, the scheduler; the engine is open once this returns."""
        import models

        if not isinstance(model, str):
            check_built_model(next(model.parameters()), config)
            if config.quantization == "fp8":
                # in place, before anything compiles or captures it (models.quantization)
                logger.info("quantization=fp8: %d linear layers of the built model to FP8",
                            models.quantize_fp8(model))
        device, dtype = config.device_and_dtype()
        timeline.device = torch.device(device)
        pending = None  # the tokenizer, loading beside the weights and the compile on a GPU engine
        background = torch.device(device).type == "cuda"
        if tokenizer is None and config.tokenizer is not None:
            pending = PendingTokenizer(config.tokenizer, required=True, background=background)
        if isinstance(model, str):
            with timeline.phase("load"):
                # "default" and .gguf files are converted once, here, before the tokenizer reads the result
                model = models.resolve_model_path(model)
                if tokenizer is None and pending is None:
                    pending = PendingTokenizer(model, required=False, background=background)
                model = models.from_pretrained(model, dtype=dtype, device=device, quantization=config.quantization,
                                               **({"tp": self.tp.parallel} if self.tp else {}))
            logger.info("loaded %s", name)
        if pending is not None and not pending.background:
            with timeline.phase("tokenizer"):
                tokenizer, pending = pending.result(), None
        self.model = model
        self.model_config = model.config
        self.config = config.resolve(model.config.max_position_embeddings)
        spec = self.config.speculative_config
        proposer = None
        if spec is not None:
            # a draft model first: the target's KV pool is sized from the memory the draft leaves
            proposer = (build_draft_proposer(spec, self.config, model.config, timeline) if spec.draft_model
                        else Proposer(spec))
        try:
            with torch.inference_mode():
                self.runtime = build_runtime(model, self.config, timeline,
                                             self.tp.min_over_ranks if self.tp else None)
        except BaseException:
            if proposer is not None:
                proposer.close()
            raise
        if self.tp:
            self.tp.attach(self.runtime)
        try:
            if pending is not None:
                with timeline.phase("tokenizer"):  # what start-up still waits for of its load: ~0
                    tokenizer = pending.result()
            self.tokenizer = tokenizer
            self.scheduler = Scheduler(self.runtime.block_pool, self.config.max_num_seqs,
                                       self.config.max_num_batched_tokens, self.config.max_model_len,
                                       tuple(model.config.eos_token_ids), self.config.enable_prefix_caching,
                                       proposer)
        except BaseException:
            self.runtime.close()  # a refused configuration leaves nothing behind
            self.runtime = None
            if proposer is not None:
                proposer.close()
            raise
        # async scheduling: the host runs one step ahead of the device (engine/core/step_loop.py)
        self._loop = StepLoop(self.scheduler, self.runtime, depth=1 if self.config.async_scheduling else 0)
        if self.tp is not None and self._loop.device.type == "cuda":
            self._loop.wait_for = self.tp.wait_for
        self._requests: dict[str, Request] = {}
        self._unreported: dict[str, Request] = {}  # streamed requests that got tokens inside generate()
        self._trackers: dict[str, OutputTracker] = {}  # text and output cursors, until the final output
        self._decode = BatchDecoder(tokenizer) if tokenizer is not None else None  # one batch a step
        # detokenization and stop strings: in a process of their own (engine/core/text_process.py)
        # where EngineConfig.frontend_process asks for it, else on the step thread
        self._front = start_front_end(tokenizer, self._spawned_front)
        self._spawned_front = None
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_tokens_past_stop = 0  # sampled after a stop string's token (found late), never reported
        timeline.finish()
        self.startup = timeline
        self._final_stats: dict[str, Any] | None = None
        self._closed = False

    # -- requests ------------------------------------------------------------------------------

    def _validated(self, prompt: Prompt, params: SamplingParams, request_id: str) -> Request:
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"request {request_id!r}: params must be SamplingParams, got "
                                      f"{type(params).__name__}")
        if request_id in self._requests or request_id in self._trackers:  # running, or its end unreported
            raise InvalidRequestError(f"request {request_id!r}: a request with this id is already in flight")
        vocab = self.model_config.vocab_size
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError(f"request {request_id!r}: prompt is empty", param="prompt")
            if self.tokenizer is None:
                raise InvalidRequestError(f"request {request_id!r}: prompt is a string but the engine has no "
                                          "tokenizer; pass token ids or LLM(..., tokenizer=...)")
            prompt = self.encode(prompt)
        ids = check_prompt(request_id, prompt, vocab, self.config.max_model_len)
        params.check(request_id, vocab)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError(f"request {request_id!r}: SamplingParams.stop needs a tokenizer (stop strings "
                                      "are matched on the text); use stop_token_ids", param="stop")
        return Request(request_id, ids, params)

    @property
    def decodes_on_step_thread(self) -> bool:
        """Whether the step thread uses `tokenizer` (detokenization and stop strings in this process);
        False with the front end in its own process, which decodes with its own copy."""
        return self.tokenizer is not None and not self._front.process

    def encode(self, text: str, tokenizer: Any = None) -> list[int]:
        """A text prompt's token ids, as `add_request` encodes it. Callers that tokenize on another
        thread than the engine's (the server) pass their own copy of the tokenizer: a fast tokenizer
        is not documented as thread-safe (its Rust state is borrowed per call, and an encode may
        reconfigure truncation/padding, which fails with "Already borrowed" under a concurrent call)."""
        return (tokenizer or self.tokenizer)(text)["input_ids"]

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    *, bounded: bool = True) -> str:
        """Queue one request; it runs from the next `step`. Returns its id.

        Raises QueueFullError when EngineConfig.max_waiting_requests requests already wait (checked
        after validation, so a bad request is an InvalidRequestError whatever the queue holds).
        `bounded=False` skips that bound: for a request that is part of work already admitted (the
        server's choices 1..n-1 of a request whose choice 0 was let in)."""
        self._check_open()
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        request = self._validated(prompt, params or SamplingParams(), request_id)
        limit = self.config.max_waiting_requests
        if bounded and limit is not None and len(self.scheduler.waiting) >= limit:
            raise QueueFullError(request_id, len(self.scheduler.waiting), limit)
        self._admit(request)
        return request_id

    def _admit(self, request: Request) -> None:
        self.runtime.sampler.attach(request)
        self._trackers[request.request_id] = OutputTracker(request, self.tokenizer, self._decode,
                                                           local=not self._front.process)
        self._requests[request.request_id] = request
        self.scheduler.add(request)

    def has_unfinished_requests(self) -> bool:
        """True while a request runs or waits, or a streamed request's token awaits its step() output."""
        return (self.scheduler.has_unfinished() or bool(self._unreported)
                or (self._loop is not None and self._loop.has_inflight()))

    # -- stepping -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; an output for every request that got a token (finished ones included).

        Requests added with add_request that got tokens while generate() ran are reported here too
        (their latest state), so a stream interleaved with generate() still sees every request finish.
        """
        self._check_open()
        sampled = self._step()
        self._apply_stops(self._front.flush())  # outputs are built from the texts: every record applied first
        got_token = set(sampled)
        late = [r for r in self._unreported.values() if r not in got_token]
        self._unreported.clear()
        return [self._output(r) for r in late + sampled]

    @torch.inference_mode()
    def _step(self) -> list[Request]:
        """Run one step; the requests that got a token, in chunk order.

        With async scheduling, the step launched now reports its tokens at the next call, and this
        call reports the previous step's (a call with nothing to launch only reads them; StepLoop).
        The engine's device is current meanwhile: Triton launches its kernels on the current device,
        and an engine on cuda:1 is stepped by callers whose current device is cuda:0.
        """
        self._apply_stops(self._front.poll())  # found by the front end's process since the last step
        device = self.runtime.runner.device
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            launched, sampling = self._loop.step()
        self.num_steps += launched
        for request in sampling:
            if request.is_finished:
                self._requests.pop(request.request_id, None)
        if self._decode is not None:  # without a tokenizer an output's tracker catches up when it is built
            trackers = self._trackers
            self._apply_stops(self._front.hand_over([(trackers[r.request_id], r) for r in sampling]))
        return sampling

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """One output per prompt, in order. Every prompt is validated before any of them runs.
        `sampling_params=` is vLLM's name for `params`."""
        self._check_open()
        prompts, params = batch_of_prompts(prompts, params, sampling_params)
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
        self._apply_stops(self._front.flush())
        for request in requests:  # reported here, not by a later step()
            self._unreported.pop(request.request_id, None)
        return [self._output(r) for r in requests]

    def _output(self, request: Request) -> RequestOutput:
        tracker = self._trackers[request.request_id]
        if request.is_finished and not tracker.done and tracker.key is not None:  # its end, to the process
            self._front.hand_over([(tracker, request)])
            self._apply_stops(self._front.flush())
        out = tracker.output(request)
        if request.is_finished:
            del self._trackers[request.request_id]
            self._unreported.pop(request.request_id, None)  # this was its final output
        return out

    def _apply_stops(self, requests: list[Request]) -> None:
        """Finish the requests whose text reached a stop string (their blocks go back now). Inline
        that is the step that sampled the completing token; with the front end's process a step or two
        later, and the request's next output reports it (the tokens sampled meanwhile are not: its
        tracker's stopped_at)."""
        for request in requests:
            tracker = self._trackers.get(request.request_id)
            if tracker is not None and tracker.stopped_at is not None:
                self.num_tokens_past_stop += request.num_tokens - request.num_prompt_tokens - tracker.stopped_at
            self.scheduler.stop_string_matched(request)
            self._loop.finished(request)
            self._requests.pop(request.request_id, None)
            if request.request_id in self._trackers:  # its final output is not built yet
                self._unreported[request.request_id] = request

    def abort(self, request_id: str) -> bool:
        """Stop a request now: it is not scheduled again, its KV blocks go back to the pool at once,
        and the next `step()` reports it finished with finish_reason "abort".

        Idempotent: an id that is unknown or already finished is a no-op and returns False."""
        request = self._requests.pop(str(request_id), None)
        if request is None:
            return False
        self._finish_between_steps(request, FinishReason.ABORT)
        self._unreported[request.request_id] = request
        return True

    def _finish_between_steps(self, request: Request, reason: FinishReason) -> None:
        """Finish a request outside the scheduler's own stop checks: its blocks go back now, and so
        does its device token slot under async scheduling (once no step in flight samples for it)."""
        self.scheduler.finish(request, reason)
        self._loop.finished(request)

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Release everything this engine made, now; idempotent. Requests still in flight are abandoned.

        The model object is kept only if it was handed in (it can then serve a new engine); one the
        engine loaded itself goes with the engine. `stats()` keeps answering with its last values."""
        if self._closed:
            return
        # Every release runs even if one before it fails (a dead tensor-parallel rank, a device
        # error in the drain); the first failure is raised at the end.
        errors: list[BaseException] = []

        def attempt(release: Callable[[], None]) -> None:
            try:
                release()
            except Exception as exc:
                errors.append(exc)

        attempt(self._loop.drain)  # no graph or pool is freed under a step still running
        try:  # this rank's figures only: gathering the other ranks' could wait on a failed group
            self._final_stats = collect_stats(self, gather_ranks=False)
        except Exception as exc:
            errors.append(exc)
            self._final_stats = {}
        self._closed = True
        if self.tp is not None:
            attempt(self.tp.send_stop)  # the other ranks first: they may be waiting for this rank's next step
        attempt(self._front.close)
        runtime, self.runtime = self.runtime, None
        self._requests.clear()
        self._unreported.clear()
        self._loop = None  # it holds the runtime's token slots
        self.model = None
        cuda = runtime.kv_cache.device.type == "cuda"
        attempt(runtime.close)
        if self.scheduler.proposer is not None:
            attempt(self.scheduler.proposer.close)  # a draft model's engine
        del runtime  # the runner's static buffers and the model (if the engine loaded it) go here
        # A collection now, not at some later one: whatever of the engine is left in a reference cycle
        # (the capture loops' gc.freeze moved their survivors to the oldest generation, collected
        # rarely) would keep its graphs and their pool memory, and under tensor parallelism NCCL's
        # communicator cannot be left while a graph that captured it lives.
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()  # hand the freed blocks (and the graph pool's) back to the device
        if self.tp is not None:  # after the graphs, which hold NCCL's communicator; with the workers
            attempt(self.tp.leave_group)
            attempt(self.tp.join_workers)
        if errors:
            raise errors[0]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM is closed (LLM.close() or the end of its `with` block); "
                               "build a new LLM to run more requests")

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Dropping the last reference releases what close() releases; the Dynamo entries in
        # particular would otherwise outlive the engine (engine/worker/compile.py says why).
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:  # at interpreter shutdown torch may already be half torn down
                pass

    # -- introspection --------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        if self._final_stats is not None:
            return dict(self._final_stats)
        return collect_stats(self, gather_ranks=True)
