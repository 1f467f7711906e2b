"""Quality and memory of every quantization mode, one JSON object (and a markdown table).

For each mode an engine is built from the same checkpoint (SmolLM2 by default) and measured:
  * weight bytes (and the ratio to float32), KV-cache bytes per token;
  * perplexity on fixed English texts that ship with every CPython (`pydoc_data.topics`: the
    first `--ppl-tokens` tokens of each of `--topics`), from the engine's own prompt logprobs,
    so the KV cache's quantization is in it, prefilled `--chunk` tokens a step so every chunk
    reads the earlier ones back from the cache;
  * whether greedy chat answers "What is the capital of France?" with Paris;
  * single-stream decode tokens/s (`--output-len` greedy tokens) and batch output tokens/s
    (`--batch` requests at once), each the median of `--repeats` runs;
  * how long building the engine took (calibration included).

    python -m jinfer.bench.quantization [--modes f32,int8,...] [--out F] [--markdown]
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np
from pydoc_data.topics import topics

from jinfer.bench.machine import machine_info
from jinfer.bench.report import emit
from jinfer.llm import LLM
from jinfer.loader import DEFAULT_MODEL
from jinfer.sampling.params import SamplingParams

MODES = {  # name -> engine options
    "f32": {},
    "int8": dict(quantization="int8"),
    "w8a8-plain": dict(quantization="w8a8", quantization_config={"smoothquant": False}),
    "w8a8": dict(quantization="w8a8"),  # SmoothQuant + GPTQ onto the int8 grid
    "int4-rtn-g128": dict(quantization="int4", quantization_config={"method": "rtn"}),
    "int4-awq-g128": dict(quantization="int4", quantization_config={"method": "awq"}),
    "int4-gptq-g128": dict(quantization="int4", quantization_config={"method": "gptq"}),
    **{f"{fmt}-{method}": dict(quantization=fmt, quantization_config={"method": method})
       for fmt in ("mxfp4", "nvfp4") for method in ("rtn", "awq")},
    "fp8": dict(quantization="fp8"),  # FP8-dynamic: e4m3 weights and per-token activations
    "fp8-w8a16": dict(quantization="fp8", quantization_config={"activations": "float"}),
    "gguf": dict(quantization="gguf"),
    "kv-int8": dict(kv_cache_dtype="int8"),
    "kv-fp8": dict(kv_cache_dtype="fp8"),
}
TOPICS = ("assignment", "class", "exceptions")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def perplexity(llm: LLM, ids: list[int]) -> float:
  out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
  return math.exp(-float(np.mean([lp[t] for t, lp in zip(ids[1:], out.prompt_logprobs[1:])])))


def _single(llm: LLM, prompt: list[int], n: int) -> float:
  out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                     use_tqdm=False)[0]
  t = out.metrics.token_times
  return (len(t) - 1) / (t[-1] - t[0])


def _batch(llm: LLM, prompts: list[list[int]], n: int) -> float:
  t0 = time.perf_counter()
  llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
               use_tqdm=False)
  return len(prompts) * n / (time.perf_counter() - t0)


def measure(model: str, options: dict, args, texts: dict[str, list[int]] | None) -> dict:
  t0 = time.perf_counter()
  llm = LLM(model, max_model_len=args.ppl_tokens + 64, max_num_seqs=args.batch,
            max_num_batched_tokens=args.chunk, enable_prompt_logprobs=True, warmup=False,
            **options)
  build_s = time.perf_counter() - t0
  stats = llm.engine.stats()
  tok = llm.tokenizer
  texts = texts or {t: tok.encode(topics[t])[:args.ppl_tokens] for t in args.topics.split(",")}
  answer = llm.chat([QUESTION], SamplingParams(temperature=0.0, max_tokens=16),
                    use_tqdm=False)[0].outputs[0].text
  rng = np.random.default_rng(0)
  prompt = rng.integers(0, 1000, args.prompt_len).tolist()
  batch = [rng.integers(0, 1000, int(rng.integers(16, 64))).tolist() for _ in range(args.batch)]
  _single(llm, prompt, 4), _batch(llm, batch, 4)  # compile what the timed runs use
  single = [_single(llm, prompt, args.output_len) for _ in range(args.repeats)]
  batched = [_batch(llm, batch, args.batch_output_len) for _ in range(args.repeats)]
  return {"options": options, "build_s": round(build_s, 1), "weight_bytes": stats.weight_bytes,
          "kv_bytes_per_token": stats.kv_bytes_per_token,
          "perplexity": {t: perplexity(llm, ids) for t, ids in texts.items()},
          "answer": answer, "paris": "Paris" in answer,
          "single_stream_tok_s": statistics.median(single),
          f"batch{args.batch}_tok_s": statistics.median(batched)}, texts


def markdown(report: dict) -> str:
  rows = report["modes"]
  base = rows["f32"] if "f32" in rows else next(iter(rows.values()))
  topics_ = list(base["perplexity"])
  batch_key = next(k for k in base if k.startswith("batch"))
  head = (["mode", "weights", "x f32", "KV B/token"] + [f"ppl {t}" for t in topics_]
          + ["Paris", "tok/s 1", f"tok/s {batch_key[5:-6]}"])
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for name, r in rows.items():
    ppl = [f"{r['perplexity'][t]:.3f} ({100 * (r['perplexity'][t] / base['perplexity'][t] - 1):+.2f}%)"
           for t in topics_]
    lines.append("| " + " | ".join(
        [name, f"{r['weight_bytes'] / 2**20:.0f} MiB",
         f"{r['weight_bytes'] / base['weight_bytes']:.3f}", str(r["kv_bytes_per_token"])] + ppl
        + ["yes" if r["paris"] else "no", f"{r['single_stream_tok_s']:.1f}",
           f"{r[batch_key]:.1f}"]) + " |")
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}",
                               description=__doc__.split("\n")[0])
  ap.add_argument("--model", default=DEFAULT_MODEL)
  ap.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
  ap.add_argument("--topics", default=",".join(TOPICS))
  ap.add_argument("--ppl-tokens", type=int, default=1024)
  ap.add_argument("--chunk", type=int, default=256, help="prefill tokens per step")
  ap.add_argument("--prompt-len", type=int, default=32)
  ap.add_argument("--output-len", type=int, default=64)
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--batch-output-len", type=int, default=32)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--markdown", action="store_true", help="also print the table for the docs")
  ap.add_argument("--out", default=None, help="also write the JSON to this file")
  args = ap.parse_args()
  report, texts = {"machine": machine_info(), "model": args.model, "modes": {}}, None
  for name in args.modes.split(","):
    print(f"{name} ...", flush=True)
    report["modes"][name], texts = measure(args.model, MODES[name], args, texts)
  emit(report, args.out)
  if args.markdown:
    print(markdown(report))


if __name__ == "__main__":
  main()
