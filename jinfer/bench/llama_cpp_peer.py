"""llama.cpp (through `llama-cpp-python`) on the same GGUF and workload, when it is installed.

Build it with `CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install llama-cpp-python`: a native build
targets the build machine's instruction set, and on CPUs whose virtualized flags differ from
what the compiler detects it dies with an illegal instruction.
"""
from __future__ import annotations

import importlib.util
import os
import time


def available() -> bool:
  return importlib.util.find_spec("llama_cpp") is not None


def _model(gguf_path: str, n_ctx: int, threads: int):
  import llama_cpp
  return llama_cpp.Llama(model_path=gguf_path, n_ctx=n_ctx, n_threads=threads,
                         n_threads_batch=threads, n_batch=512, verbose=False)


def _greedy(llm, prompt: list[int], n: int) -> tuple[float, float]:
  """Greedy tokens after `prompt`, EOS ignored: (seconds to the first token, decode seconds
  from the first token to the n-th)."""
  t0 = time.perf_counter()
  first = None
  for i, _ in enumerate(llm.generate(prompt, temp=0.0, top_k=1, reset=True)):
    if i == 0:
      first = time.perf_counter()
    if i + 1 == n:
      break
  return first - t0, time.perf_counter() - first


def single_stream(gguf_path: str, prompt: list[int], output_len: int, *, repeats: int = 3,
                  threads: int | None = None) -> dict:
  """Decode tokens/s of one request, the median of `repeats` runs."""
  import llama_cpp
  threads = threads or len(os.sched_getaffinity(0))
  llm = _model(gguf_path, len(prompt) + output_len + 8, threads)
  _greedy(llm, prompt, 4)  # warm up
  runs = sorted((output_len - 1) / _greedy(llm, prompt, output_len)[1] for _ in range(repeats))
  return {"version": llama_cpp.__version__, "threads": threads,
          "decode_tokens_per_s": runs[len(runs) // 2], "runs": runs}


def offline(gguf_path: str, prompts: list[list[int]], output_lens: list[int], *,
            threads: int | None = None) -> dict:
  """The workload one request at a time (llama-cpp-python serves one sequence per model)."""
  import llama_cpp
  threads = threads or len(os.sched_getaffinity(0))
  llm = _model(gguf_path, max(len(p) + n for p, n in zip(prompts, output_lens)) + 8, threads)
  t0 = time.perf_counter()
  for p, n in zip(prompts, output_lens):
    _greedy(llm, p, n)
  wall = time.perf_counter() - t0
  return {"version": llama_cpp.__version__, "threads": threads, "wall_s": wall,
          "output_tokens": sum(output_lens), "output_tokens_per_s": sum(output_lens) / wall}
