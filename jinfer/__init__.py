"""jinfer: a JAX/Pallas LLM inference library for TPU and GPU."""
from jinfer.engine.async_engine import AsyncLLMEngine
from jinfer.engine.engine import LLMEngine
from jinfer.engine.engine_config import EngineConfig
from jinfer.engine.request import CompletionOutput, RequestOutput
from jinfer.llm import LLM
from jinfer.sampling.params import SamplingParams

__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "EngineConfig", "SamplingParams", "RequestOutput",
           "CompletionOutput"]
