"""jinfer: a JAX/Pallas LLM inference library for TPU and GPU."""
from jinfer import logs as _logs

_logs.configure()  # progress lines on stderr at INFO, unless the application configured them

from jinfer.engine.async_engine import AsyncLLMEngine  # noqa: E402
from jinfer.engine.engine import LLMEngine
from jinfer.engine.engine_config import EngineConfig
from jinfer.engine.lora_slots import LoRARequest
from jinfer.engine.request import CompletionOutput, RequestOutput
from jinfer.llm import LLM
from jinfer.sampling.params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "EngineConfig", "LoRARequest", "SamplingParams",
           "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput"]
