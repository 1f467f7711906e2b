"""Benchmarks that print JSON and the machine they ran on; each runs as
`python -m jinfer.bench.<name>` (`jinfer bench` and `jinfer bench-serve` use `offline` and
`load_generator`). Nothing imports them.

  offline         offline throughput: continuous vs static batching vs HF transformers / llama.cpp
  single_stream   decode speed by weight format, single stream and a batch
  profile_decode  where a decode step's time goes (matmuls, attention, LM head, sampling, host)
  speculative     speculation off vs n-gram, the distilled draft and Medusa heads
  moe             an MoE model against a dense one with the same active parameters
  parallel        parallel layouts: bytes per device, collectives, step times, agreement
  long_context    needle retrieval and perplexity with ring attention against one device
  cold_start      a fresh process's load, warmup and first requests, cold and warm cache
  kernels         the Pallas kernels against jnp baselines on a GPU or TPU
  load_generator  load on an OpenAI-compatible server (`jinfer bench-serve`)
"""
