"""Quality and memory of every quantization mode, one JSON object (and a markdown table).

For each mode an engine is built from the same checkpoint (SmolLM2 by default) and measured:
  * weight bytes (and the ratio to float32), KV-cache bytes per token;
  * perplexity on fixed texts that ship with every CPython (the first `--ppl-tokens` tokens of
    each of `--topics`: a `pydoc_data.topics` name is documentation prose, `py:MODULE` a
    standard-library module's source code, `doc:MODULE` its rendered docstrings, `licence`
    CPython's licence text), from the engine's own prompt logprobs, so the KV cache's
    quantization is in it, prefilled `--chunk` tokens a step so every chunk reads the earlier
    ones back from the cache;
  * whether greedy chat answers "What is the capital of France?" with Paris, single-stream
    decode tokens/s (`--output-len` greedy tokens) and batch output tokens/s (`--batch`
    requests at once), each the median of `--repeats` runs (not with `--quality-only`);
  * how long building the engine took (calibration included).
A mode is a name of `MODES` or `QUANTIZATION[:JSON options]`, e.g. `mixed:{"bits": 6}`.
`--plot F` draws weight bytes against perplexity (the Pareto plot of docs/quantization.md).

    python -m jinfer.bench.quantization [--modes f32,int8,...] [--out F] [--markdown] [--plot F]
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import pydoc
import statistics
import sysconfig
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
    **{f"mixed-{b}": dict(quantization="mixed", quantization_config={"bits": b})
       for b in (5, 5.5, 6, 7)},  # granularity "linear", the default
    **{f"mixed-layer-{b}": dict(quantization="mixed",
                                quantization_config={"bits": b, "granularity": "layer"})
       for b in (5, 5.5, 6, 7)},
}
TOPICS = ("assignment", "class", "exceptions")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def text(name: str) -> str:
  """The text a `--topics` name stands for (see the module docstring)."""
  kind, _, module = name.partition(":")
  if kind == "py":
    return inspect.getsource(importlib.import_module(module))
  if kind == "doc":
    return pydoc.render_doc(importlib.import_module(module), renderer=pydoc.plaintext)
  if name == "licence":
    with open(os.path.join(sysconfig.get_path("stdlib"), "LICENSE.txt"), encoding="utf-8") as fh:
      return fh.read()
  return topics[name]


def mode_options(name: str) -> dict:
  """Engine options of a `--modes` entry."""
  if name in MODES:
    return MODES[name]
  quantization, _, options = name.partition(":")
  return dict(quantization=quantization,
              **({"quantization_config": json.loads(options)} if options else {}))


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
  texts = texts or {t: tok.encode(text(t))[:args.ppl_tokens] for t in args.topics.split(",")}
  out = {"options": options, "build_s": round(build_s, 1), "weight_bytes": stats.weight_bytes,
         "kv_bytes_per_token": stats.kv_bytes_per_token,
         "perplexity": {t: perplexity(llm, ids) for t, ids in texts.items()}}
  if args.quality_only:
    return out, texts
  answer = llm.chat([QUESTION], SamplingParams(temperature=0.0, max_tokens=16),
                    use_tqdm=False)[0].outputs[0].text
  rng = np.random.default_rng(0)
  prompt = rng.integers(0, 1000, args.prompt_len).tolist()
  batch = [rng.integers(0, 1000, int(rng.integers(16, 64))).tolist() for _ in range(args.batch)]
  _single(llm, prompt, 4), _batch(llm, batch, 4)  # compile what the timed runs use
  single = [_single(llm, prompt, args.output_len) for _ in range(args.repeats)]
  batched = [_batch(llm, batch, args.batch_output_len) for _ in range(args.repeats)]
  return {**out, "answer": answer, "paris": "Paris" in answer,
          "single_stream_tok_s": statistics.median(single),
          f"batch{args.batch}_tok_s": statistics.median(batched)}, texts


def _base(report: dict) -> dict:
  rows = report["modes"]
  return rows["f32"] if "f32" in rows else next(iter(rows.values()))


def _increase(r: dict, base: dict) -> float:
  """The mean perplexity increase over the texts, in percent."""
  return 100 * float(np.mean([r["perplexity"][t] / base["perplexity"][t] - 1
                              for t in base["perplexity"]]))


def markdown(report: dict) -> str:
  rows, base = report["modes"], _base(report)
  topics_ = list(base["perplexity"])
  speed = "paris" in base
  batch_key = next((k for k in base if k.startswith("batch")), None)
  head = (["mode", "weights", "x f32", "KV B/token"] + [f"ppl {t}" for t in topics_]
          + ["mean"] + (["Paris", "tok/s 1", f"tok/s {batch_key[5:-6]}"] if speed else []))
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for name, r in rows.items():
    ppl = [f"{r['perplexity'][t]:.3f} ({100 * (r['perplexity'][t] / base['perplexity'][t] - 1):+.2f}%)"
           for t in topics_]
    lines.append("| " + " | ".join(
        [name, f"{r['weight_bytes'] / 2**20:.0f} MiB",
         f"{r['weight_bytes'] / base['weight_bytes']:.3f}", str(r["kv_bytes_per_token"])] + ppl
        + [f"{_increase(r, base):+.2f}%"]
        + (["yes" if r["paris"] else "no", f"{r['single_stream_tok_s']:.1f}",
            f"{r[batch_key]:.1f}"] if speed else [])) + " |")
  return "\n".join(lines)


def plot(report: dict, path: str) -> None:
  """Weight bytes against the mean perplexity increase, one point per mode."""
  import matplotlib
  matplotlib.use("Agg")  # no display; writes files only
  import matplotlib.pyplot as plt
  import matplotlib.ticker
  rows, base = report["modes"], _base(report)
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name, r in rows.items():
    x, y = r["weight_bytes"] / 2**20, _increase(r, base)
    ax.scatter(x, y, color="tab:red" if name.startswith("mixed") else "tab:blue")
    ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
  ax.set_xscale("log")
  ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
  ax.xaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
  ax.set_xlabel("weight bytes (MiB, log scale)")
  ax.set_ylabel("perplexity increase over float32 (%, mean of the texts)")
  ax.set_title(f"{report['model']}: {', '.join(base['perplexity'])}", fontsize=9)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main():
  ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}",
                               description=__doc__.split("\n")[0])
  ap.add_argument("--model", default=DEFAULT_MODEL)
  ap.add_argument("--modes", default=",".join(MODES),
                  help=f"of {', '.join(MODES)} or QUANTIZATION:JSON (separated by ';' then)")
  ap.add_argument("--topics", default=",".join(TOPICS))
  ap.add_argument("--ppl-tokens", type=int, default=1024)
  ap.add_argument("--chunk", type=int, default=256, help="prefill tokens per step")
  ap.add_argument("--prompt-len", type=int, default=32)
  ap.add_argument("--output-len", type=int, default=64)
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--batch-output-len", type=int, default=32)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--quality-only", action="store_true",
                  help="bytes and perplexity only: no answer, no speed")
  ap.add_argument("--markdown", action="store_true", help="also print the table for the docs")
  ap.add_argument("--out", default=None, help="also write the JSON to this file")
  ap.add_argument("--plot", default=None, help="also draw bytes against perplexity (PNG)")
  args = ap.parse_args()
  report, texts = {"machine": machine_info(), "model": args.model, "modes": {}}, None
  for name in args.modes.split(";" if ";" in args.modes else ","):
    print(f"{name} ...", flush=True)
    report["modes"][name], texts = measure(args.model, mode_options(name), args, texts)
    if args.out:  # each mode as it is measured: a long run keeps what it has
      with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2)
  emit(report, args.out)
  if args.markdown:
    print(markdown(report))
  if args.plot:
    plot(report, args.plot)


if __name__ == "__main__":
  main()
