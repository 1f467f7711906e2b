"""Decode speed by weight format: single stream and a batch, interleaved runs, one JSON object.

For each `--modes` entry (f32, int8 = W8A16, w8a8) an engine is built over the same loaded
params and runs both workloads once untimed (compiling the steps they use); then, `--repeats`
times in turn over the modes (so a change in the machine's load hits every mode alike):
  * single stream: one request, `--prompt-len` tokens of prompt, `--output-len` greedy tokens
    (EOS ignored), decode tokens/s from its first token to its last;
  * batch: `--batch` requests, prompts of `--batch-input-len-min`..`--batch-input-len-max` tokens
    (numpy seed 0, as `jinfer bench`), `--batch-output-len` tokens each, output tokens/s.
Medians are reported with every run and the load average beside each. When `llama_cpp` is
importable, llama.cpp decodes the same GGUF single stream in the same run (see
`jinfer/bench/llama_cpp_peer.py` for how to build it).

    python -m jinfer.bench.single_stream [--modes f32,int8,w8a8] [--repeats 3] [--out F]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import jax.numpy as jnp
import numpy as np

import jinfer
from jinfer.bench import llama_cpp_peer
from jinfer.bench.machine import machine_info
from jinfer.bench.report import emit
from jinfer.bench.offline import RandomWorkload
from jinfer.engine.engine import LLMEngine
from jinfer.engine.engine_config import EngineConfig
from jinfer.sampling.params import SamplingParams
from jinfer.weights.builtin import builtin_gguf_path, is_builtin
from jinfer.loader import DEFAULT_MODEL, load_model


def _load() -> float | None:
  return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def _single(engine: LLMEngine, prompt: list[int], output_len: int) -> float:
  rid = engine.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=output_len,
                                                        ignore_eos=True))
  t = engine.run_to_completion([rid])[rid].metrics.token_times
  return (len(t) - 1) / (t[-1] - t[0])


def _batch(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> float:
  sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
  t0 = time.perf_counter()
  rids = [engine.add_request(None, p, sp) for p in prompts]
  engine.run_to_completion(rids)
  return len(prompts) * output_len / (time.perf_counter() - t0)


def main():
  ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}",
                              description=__doc__.split("\n")[0])
  ap.add_argument("--model", default=DEFAULT_MODEL)
  ap.add_argument("--modes", default="f32,int8,w8a8")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--prompt-len", type=int, default=128)
  ap.add_argument("--output-len", type=int, default=64)
  ap.add_argument("--batch", type=int, default=32, help="0: no batch runs")
  ap.add_argument("--batch-input-len-min", type=int, default=32)
  ap.add_argument("--batch-input-len-max", type=int, default=256)
  ap.add_argument("--batch-output-len", type=int, default=64)
  ap.add_argument("--scan-layers", default=None, choices=("true", "false"),
                  help="default: the engine's own choice")
  ap.add_argument("--skip-llama-cpp", action="store_true")
  ap.add_argument("--out", default=None, help="also write the JSON to this file")
  args = ap.parse_args()

  model_config, params, _ = load_model(args.model, jnp.float32, load_tokenizer=False)
  vocab = model_config.vocab_size
  prompt = ((np.arange(args.prompt_len) * 7919) % vocab).tolist()
  workload = RandomWorkload(num_prompts=max(args.batch, 1), input_len_min=args.batch_input_len_min,
                            input_len_max=args.batch_input_len_max,
                            output_len=args.batch_output_len)
  prompts = workload.prompts(vocab)
  max_len = max(args.prompt_len + args.output_len, workload.max_len)
  scan = None if args.scan_layers is None else args.scan_layers == "true"
  engines, report = {}, {"machine": machine_info(), "jinfer": os.path.dirname(jinfer.__file__),
                         "model": args.model, "modes": {}}
  for mode in args.modes.split(","):
    config = EngineConfig.of(max_model_len=max_len, max_num_seqs=max(args.batch, 1),
                          quantization=None if mode == "f32" else mode, scan_layers=scan)
    t0 = time.monotonic()
    engines[mode] = LLMEngine.from_parts(model_config, params, None, config=config, warmup=False)
    _single(engines[mode], prompt, 4)
    if args.batch:
      _batch(engines[mode], prompts[:args.batch], args.batch_output_len)
    report["modes"][mode] = {"weight_bytes": engines[mode].stats().weight_bytes,
                             "build_and_first_runs_s": time.monotonic() - t0,
                             "single_stream_tok_s": [], "batch_tok_s": [], "load_avg_1m": []}
  for _ in range(args.repeats):
    for mode, engine in engines.items():
      r = report["modes"][mode]
      r["single_stream_tok_s"].append(_single(engine, prompt, args.output_len))
      if args.batch:
        r["batch_tok_s"].append(_batch(engine, prompts[:args.batch], args.batch_output_len))
      r["load_avg_1m"].append(_load())
  for r in report["modes"].values():
    r["single_stream_median"] = statistics.median(r["single_stream_tok_s"])
    if r["batch_tok_s"]:
      r["batch_median"] = statistics.median(r["batch_tok_s"])
  path = builtin_gguf_path(args.model) if is_builtin(args.model) else args.model
  if llama_cpp_peer.available() and not args.skip_llama_cpp and path.endswith(".gguf"):
    report["llama_cpp"] = llama_cpp_peer.single_stream(path, prompt, args.output_len,
                                                       repeats=args.repeats)
    report["llama_cpp"]["load_avg_1m"] = _load()
  else:
    report["llama_cpp"] = None  # not installed (or not a GGUF model)
  emit(report, args.out)


if __name__ == "__main__":
  main()
