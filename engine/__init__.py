"""The serving engine: paged KV cache, continuous batching with chunked prefill, full-decode CUDA
graphs, piecewise prefill graphs (through the infer_graphs backend), GPU sampling, the LLM API."""
from engine.config import ConfigError, EngineConfig
from engine.core.llm import LLM, QueueFullError
from engine.outputs import RequestOutput
from engine.params import InvalidRequestError, SamplingParams
from engine.request import FinishReason, TokenLogprobs

__all__ = ["ConfigError", "EngineConfig", "LLM", "FinishReason", "InvalidRequestError", "RequestOutput", "TokenLogprobs",
           "QueueFullError", "SamplingParams"]
