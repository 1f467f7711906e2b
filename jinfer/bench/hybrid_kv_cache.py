"""KV memory of the hybrid KV cache: what one long sequence holds, by KV group, against every
layer keeping the whole context.

One prompt of `--tokens` tokens (CPython's documentation, no download) is prefilled on one
device and its first token sampled greedily; the engine's stats, read while the sequence still
runs, give the KV bytes it holds in each group (jinfer/models/kv_groups.py). With `--baseline`
(the default) the same runs with `disable_hybrid_kv_cache_manager=True`, every layer keeping the
whole context, and the two first tokens and their logprobs are compared. The pool is sized for
the one sequence (`max_num_seqs=1`), so `kv_cache_bytes` is the memory each engine reserves.

  python -m jinfer.bench.hybrid_kv_cache [--model gemma-3-270m] [--tokens 32766] [--no-baseline]
"""
from __future__ import annotations

import argparse
import time

from jinfer.bench.machine import machine_info
from jinfer.bench.report import emit


def text_tokens(tokenizer, n: int) -> list[int]:
  """The first n tokens of CPython's documentation topics, end to end."""
  from pydoc_data.topics import topics
  ids = tokenizer.encode(" ".join(" ".join(topics[k].split()) for k in sorted(topics)))
  assert len(ids) >= n, f"the documentation has {len(ids)} tokens, fewer than {n}"
  return ids[:n]


def run(model: str, tokens: int, hybrid: bool, chunk: int) -> dict:
  from jinfer.engine.engine import LLMEngine
  from jinfer.engine.engine_config import EngineConfig
  from jinfer.sampling.params import SamplingParams
  config = EngineConfig.of(max_model_len=tokens + 2, max_num_seqs=1,
                           max_num_batched_tokens=chunk,
                           disable_hybrid_kv_cache_manager=not hybrid)
  engine = LLMEngine(model, config=config, warmup=False)
  prompt = text_tokens(engine.tokenizer, tokens)
  t0 = time.monotonic()
  # Two tokens: the sequence still runs (and holds its pages) when the first comes out.
  rid = engine.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=2,
                                                        logprobs=1))
  while True:
    outs = engine.step()
    if outs and outs[0].outputs[0].token_ids:  # the prompt is in: its whole KV is held
      out, stats = outs[0], engine.stats()
      break
  seconds = time.monotonic() - t0
  engine.abort(rid)
  token = out.outputs[0].token_ids[0]
  return {"hybrid": hybrid, "prefill_seconds": round(seconds, 1),
          "kv_group_windows": list(stats.kv_group_windows),
          "kv_bytes_per_seq_by_group": list(stats.kv_bytes_per_seq),
          "kv_bytes_per_seq": sum(stats.kv_bytes_per_seq),
          "kv_cache_bytes": stats.kv_cache_bytes,
          "first_token": token, "first_logprob": out.outputs[0].logprobs[0][token]}


def main(argv=None):
  ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default="gemma-3-270m")
  ap.add_argument("--tokens", type=int, default=32766,
                  help="the prompt's length (default: Gemma-3-270M's context, less two tokens "
                       "of answer)")
  ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
  ap.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                  help="also run with every layer keeping the whole context")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  runs = [run(args.model, args.tokens, True, args.chunk)]
  if args.baseline:
    runs.append(run(args.model, args.tokens, False, args.chunk))
  result = {"machine": machine_info(), "model": args.model, "tokens": args.tokens,
            "chunk": args.chunk, "runs": runs}
  if args.baseline:
    hybrid, full = runs
    result["kv_bytes_per_seq_ratio"] = hybrid["kv_bytes_per_seq"] / full["kv_bytes_per_seq"]
    result["kv_cache_bytes_ratio"] = hybrid["kv_cache_bytes"] / full["kv_cache_bytes"]
    result["same_first_token"] = hybrid["first_token"] == full["first_token"]
    result["first_logprob_diff"] = abs(hybrid["first_logprob"] - full["first_logprob"])
  emit(result, args.out)


if __name__ == "__main__":
  main()
