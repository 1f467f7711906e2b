"""Long context: a document far longer than one step, a fact hidden in it, a question at the end.

    python examples/long_context.py [--model smollm2-135m-instruct] [--context-tokens 1800]
        [--chunk 256] [--context-parallel-size 1] [--kv-cache-dtype auto]

The prompt is prefilled in chunks of `--chunk` tokens (chunked prefill: other requests would
run between them), its KV cache paged; `--kv-cache-dtype int8` stores that cache in a quarter of
float32's bytes, and `--context-parallel-size N` spreads its pages and the prefill over N devices
(ring attention; on a CPU, `XLA_FLAGS=--xla_force_host_platform_device_count=N` makes N).
A second question over the same document reuses its cached pages (prefix caching): its first
token comes much sooner.
"""
import argparse
import time

from jinfer import LLM, SamplingParams

FILLER = ("The archive holds letters, ledgers and maps from many centuries. Most of them "
          "describe ordinary days: harvests, weather, prices at the market and travel. ")
FACT = "The key to the archive's east door is kept under the blue clock. "


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default="smollm2-135m-instruct")
  ap.add_argument("--context-tokens", type=int, default=1800, help="document length, about")
  ap.add_argument("--chunk", type=int, default=256, help="prefill tokens per step")
  ap.add_argument("--context-parallel-size", type=int, default=1)
  ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"])
  ap.add_argument("--max-tokens", type=int, default=24)
  args = ap.parse_args(argv)

  llm = LLM(args.model, max_model_len=args.context_tokens + 256, max_num_seqs=2,
            max_num_batched_tokens=args.chunk, warmup=False,
            context_parallel_size=args.context_parallel_size, kv_cache_dtype=args.kv_cache_dtype)
  tok = llm.tokenizer
  per = len(tok.encode(FILLER))
  n = max(2, args.context_tokens // per)
  document = FILLER * (n // 2) + FACT + FILLER * (n - n // 2)
  sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
  for question in ("Where is the key to the east door kept?", "What does the archive hold?"):
    t0 = time.perf_counter()
    out = llm.generate([f"{document}\nQuestion: {question}\nAnswer:"], sp, use_tqdm=False)[0]
    m = out.metrics
    print(f"{len(out.prompt_token_ids)} prompt tokens, first token after "
          f"{m.ttft:.2f} s, {time.perf_counter() - t0:.2f} s in all: {out.outputs[0].text!r}")
  stats = llm.engine.stats()
  print(f"prefix cache hit rate {stats.prefix_hit_rate:.2f}; KV cache "
        f"{stats.kv_bytes_per_token} bytes per token")


if __name__ == "__main__":
  main()
