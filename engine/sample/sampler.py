"""Sampler: next tokens from logits, on the logits' device, without waiting for the device.

Requests that ask for them first get a float32 copy of the logits adjusted, in this order:
logit_bias added; penalties (presence, frequency, repetition) from per-request token counts that
live on the device and that each sampling step updates there, so the overlapped loop's next step
sees a token the host has not read; EOS and stop tokens masked until min_tokens are out. Greedy
rows take the argmax. Sampled rows divide by temperature, keep the top_k logits, the smallest
top_p nucleus and the tokens with at least min_p times the top probability, and draw by the
exponential race (argmax of probs / E, E ~ Exp(1)), which is a draw from probs. A request with a
seed owns a torch.Generator on the device and draws its own noise row every step, so its tokens
depend only on its seed and its logits, never on the batch around it; requests without a seed share
the engine's generator.

`sample` returns the tokens as a device tensor and never blocks the host: the per-row parameters
travel through engine.sample.staging's pinned ring with non_blocking copies (a pageable copy to CUDA
synchronizes the stream, so the host would wait for the step's forward), and no Python scalar is
assigned into a device tensor by indexing (index_put_ copies it to the device the pageable way).
`__call__` is `sample` read back to a list (the synchronous loop's one host sync per step).
"""
from __future__ import annotations

from pathlib import Path

import torch

from engine.request import Request, TokenLogprobs
from engine.sample.argmax import RowArgmax
from engine.sample.staging import host_to_device


def argmax_of_keys(keys: torch.Tensor, scatter: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """custom_ops.triton_argmax.argmax_of_keys, imported at the first call: keys exist on CUDA only, and
    an engine on the CPU (or a process that only parses arguments) never pays Triton's import."""
    from custom_ops.triton_argmax import argmax_of_keys as reduce_keys
    return reduce_keys(keys, scatter)


def verify_greedy_from_keys(keys: torch.Tensor, index: torch.Tensor, proposals: torch.Tensor) -> torch.Tensor:
    """custom_ops.triton_argmax.verify_greedy_from_keys, imported at the first call (as argmax_of_keys)."""
    from custom_ops.triton_argmax import verify_greedy_from_keys as verify
    return verify(keys, index, proposals)


class Sampler:
    def __init__(self, device: torch.device, seed: int, eos_token_ids: tuple[int, ...] = (),
                 argmax_choices: Path | None = None) -> None:
        """`argmax_choices`: the file the argmax method choices persist in (engine.sample.argmax)."""
        self.device = device
        self.eos_token_ids = tuple(eos_token_ids)  # what min_tokens holds back (with stop_token_ids)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._one = torch.ones(1, dtype=torch.int32, device=device)  # the count a sampled token adds
        self._no_prompt: torch.Tensor | None = None  # the prompt mask of every request without a repetition penalty
        self.argmax = RowArgmax(argmax_choices)  # engine.worker.startup's warm-up picks its method per vocabulary (choose)

    def attach(self, request: Request) -> None:
        """Give a seeded sampling request its own generator (once; it survives preemption)."""
        params = request.params
        if params.seed is not None and params.temperature > 0 and request.generator is None:
            request.generator = torch.Generator(device=self.device)
            request.generator.manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """logits [N, V] (row i belongs to requests[i]) -> N token ids (waits for the device)."""
        return self.sample(logits, requests).tolist()

    def sample(self, logits: torch.Tensor, requests: list[Request], argmax_keys: torch.Tensor | None = None,
               scatter: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """logits [N, V] (row i belongs to requests[i]) -> [N] int64 token ids on the logits' device.
        `argmax_keys`: the LM head's per-tile argmax keys of these logits (engine.worker.model_runner.StepResult),
        which give the greedy tokens of unadjusted logits from a few KB a row. `scatter` (dest, index):
        the tokens are also written to dest[index] (by the keys' own launch where it serves)."""
        if logits.shape[0] != len(requests):
            raise ValueError(f"sampler got logits for {logits.shape[0]} rows and {len(requests)} requests")
        adjusting = [i for i, r in enumerate(requests) if r.params.adjusts_logits]
        if not adjusting and argmax_keys is not None and all(r.params.temperature == 0 for r in requests):
            return argmax_of_keys(argmax_keys, scatter)
        tokens = self._sample(logits, requests, adjusting, argmax_keys)
        if scatter is not None:
            scatter[0].index_copy_(0, scatter[1], tokens)
        return tokens

    def compile_kernels(self, logits: torch.Tensor, key_tiles: int | None) -> None:
        """Launch, on `logits` [N, V], each kernel a step sampling N rows can run outside a graph: the
        argmax in the logits' dtype (greedy rows) and in float32 (sampled and mixed batches), and with
        `key_tiles` (the argmax keys a row the LM head stores at N rows) the keys' reduction, alone and
        with its scatter. Their Triton variants depend on N (engine.worker.startup's warm-up calls this for
        every N a step can sample), and one first met in a serving step compiles there."""
        self.argmax(logits)
        self.argmax(logits.float())
        if key_tiles:
            rows = logits.shape[0]
            keys = torch.zeros(rows, key_tiles, dtype=torch.int64, device=logits.device)
            argmax_of_keys(keys)
            index = torch.arange(rows, device=logits.device)
            argmax_of_keys(keys, (torch.empty_like(index), index))

    def _sample(self, logits: torch.Tensor, requests: list[Request], adjusting: list[int],
                argmax_keys: torch.Tensor | None) -> torch.Tensor:
        if not adjusting:
            return self._draw(logits, requests, argmax_keys)
        biased = [(i, token, bias) for i in adjusting for token, bias in requests[i].params.logit_bias]
        penalized = [i for i in adjusting if requests[i].params.has_penalties]
        held_back = [(i, token) for i in adjusting if requests[i].params.min_tokens
                     # the tokens out so far, those still in flight included
                     and requests[i].num_planned_tokens - requests[i].num_prompt_tokens < requests[i].params.min_tokens
                     for token in self._stop_ids(requests[i])]
        # a float32 copy: the logits a decode graph owns, which logprobs read, stay as they are
        adjusted = logits.float() if logits.dtype != torch.float32 else logits.clone()
        if biased:
            rows, tokens, biases = zip(*biased)
            adjusted.index_put_((host_to_device(list(rows), torch.int64, logits.device),
                                 host_to_device(list(tokens), torch.int64, logits.device)),
                                host_to_device(list(biases), torch.float32, logits.device), accumulate=True)
        if penalized:
            adjusted = self._penalized(adjusted, requests, penalized)
        if held_back:
            # index_fill_ takes the value as a kernel argument; `adjusted[rows, tokens] = value` would
            # make it a CPU tensor that index_put_ copies to the device, a pageable copy that waits
            # for the step
            vocab = adjusted.shape[-1]
            flat = host_to_device([row * vocab + token for row, token in held_back], torch.int64, logits.device)
            adjusted.view(-1).index_fill_(0, flat, float("-inf"))
        tokens = self._draw(adjusted, requests)
        for i in penalized:  # the next step's penalties see this token, without the host reading it
            requests[i].output_counts.index_add_(0, tokens[i:i + 1], self._one)
        return tokens

    def _stop_ids(self, request: Request) -> tuple[int, ...]:
        params = request.params
        return tuple(params.stop_token_ids) + (() if params.ignore_eos else self.eos_token_ids)

    def _penalized(self, logits: torch.Tensor, requests: list[Request], rows: list[int]) -> torch.Tensor:
        """The penalties of `rows` applied to `logits` in place: a float32 copy the sampler made (the
        logits a decode graph owns, which logprobs read, stay as they are)."""
        device, vocab = logits.device, logits.shape[-1]
        chosen = [requests[i] for i in rows]
        for request in chosen:
            if request.output_counts is None:  # first sampling step (survives preemption)
                request.output_counts = torch.zeros(vocab, dtype=torch.int32, device=device)
                request.prompt_mask = self._prompt_mask(request, vocab, device)
        index = host_to_device(rows, torch.int64, device)
        counts = torch.stack([r.output_counts for r in chosen]).float()
        seen = (counts > 0) | torch.stack([r.prompt_mask for r in chosen])
        penalties = host_to_device([[r.params.repetition_penalty, r.params.frequency_penalty, r.params.presence_penalty]
                                    for r in chosen], torch.float32, device)
        repetition, frequency, presence = penalties[:, 0:1], penalties[:, 1:2], penalties[:, 2:3]
        sub = logits.index_select(0, index)
        sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
        sub = sub - frequency * counts - presence * (counts > 0).float()
        return logits.index_copy_(0, index, sub)

    def _prompt_mask(self, request: Request, vocab: int, device: torch.device) -> torch.Tensor:
        """Which tokens the prompt holds; only the repetition penalty reads it, so requests without one
        share one all-false mask."""
        if request.params.repetition_penalty != 1:
            ids = host_to_device(request.prompt_token_ids, torch.int64, device)
            return torch.zeros(vocab, dtype=torch.bool, device=device).index_fill_(0, ids, True)  # see held_back
        if self._no_prompt is None or self._no_prompt.shape[0] != vocab:
            self._no_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        return self._no_prompt

    def _draw(self, logits: torch.Tensor, requests: list[Request],
              argmax_keys: torch.Tensor | None = None) -> torch.Tensor:
        """`argmax_keys`: of these very logits (never of adjusted ones), for the greedy rows of a mixed
        batch (an all-greedy one with keys never gets here: `sample` reduces the keys alone)."""
        if all(r.params.temperature == 0 for r in requests):
            return self.argmax(logits)
        logits = logits.float()
        greedy = self.argmax(logits) if argmax_keys is None else argmax_of_keys(argmax_keys)
        temperature = host_to_device([r.params.temperature or 1.0 for r in requests], torch.float32, logits.device)
        probs = self._filtered_probs(logits / temperature[:, None], requests)
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        for i, request in enumerate(requests):
            if request.generator is not None:
                noise[i].exponential_(generator=request.generator)
        # Exp(1) can return 0: a floor keeps 0/0 (NaN, which argmax would pick) out of zero-prob tokens.
        noise.clamp_(min=1e-30)
        sampled = self.argmax(probs / noise)
        is_greedy = host_to_device([r.params.temperature == 0 for r in requests], torch.bool, logits.device)
        return torch.where(is_greedy, greedy, sampled)

    @staticmethod
    def logprobs(logits: torch.Tensor, tokens: torch.Tensor, requests: list[Request]
                 ) -> tuple[list[int], torch.Tensor] | None:
        """For the rows whose request asked (SamplingParams.logprobs): (those rows, a float32 [R, 1 + 2k]
        device tensor of the sampled token's log-probability, then the k largest log-probabilities and
        their token ids, k the largest ask). None when no row asked: nothing is launched. Never waits
        for the device; `unpack` turns the tensor read back into TokenLogprobs."""
        rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        if not rows:
            return None
        k = max(requests[i].params.logprobs for i in rows)
        if len(rows) < len(requests):
            index = host_to_device(rows, torch.int64, logits.device)
            logits, tokens = logits.index_select(0, index), tokens.index_select(0, index)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        packed = [logprobs.gather(1, tokens[:, None])]
        if k:
            values, ids = logprobs.topk(k, dim=-1)
            packed += [values, ids.float()]  # token ids < 2**24 are exact in float32
        return rows, torch.cat(packed, dim=1)

    @staticmethod
    def unpack(rows: list[int], packed: list[list[float]], tokens: list[int], requests: list[Request]
               ) -> list[tuple[int, TokenLogprobs]]:
        """(row, TokenLogprobs) for each row of `logprobs`' tensor read back to a list."""
        out = []
        for row, values in zip(rows, packed):
            k = requests[row].params.logprobs
            width = (len(values) - 1) // 2
            top = tuple((int(values[1 + width + j]), values[1 + j]) for j in range(k))
            out.append((row, TokenLogprobs(tokens[row], values[0], top)))
        return out

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        top_ks = [r.params.top_k for r in requests]
        top_ps = [r.params.top_p for r in requests]
        min_ps = [r.params.min_p for r in requests]
        if all(k == 0 for k in top_ks) and all(p >= 1.0 for p in top_ps):
            return Sampler._min_p(torch.softmax(logits, dim=-1), min_ps)
        vocab = logits.shape[-1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device)[None, :]
        k = host_to_device([k if 0 < k < vocab else vocab for k in top_ks], torch.int64, logits.device)
        sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        p = host_to_device(top_ps, sorted_probs.dtype, logits.device)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # A token stays while the mass ranked above it is < top_p: the top token always stays.
        sorted_probs = sorted_probs.masked_fill(mass_before >= p[:, None], 0.0)
        probs = torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)
        return Sampler._min_p(probs / probs.sum(dim=-1, keepdim=True), min_ps)

    @staticmethod
    def _min_p(probs: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
        """Keep the tokens with at least min_p times the row's top probability (after top-k / top-p,
        as transformers orders them; the ratio to the top token is the same before and after)."""
        if all(m == 0 for m in min_ps):
            return probs
        threshold = host_to_device(min_ps, probs.dtype, probs.device)[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
        return probs / probs.sum(dim=-1, keepdim=True)
