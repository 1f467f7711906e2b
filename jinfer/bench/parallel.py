"""A sweep of parallel layouts for one engine: bytes per device, collectives per step (counted in
the compiled HLO), step times, and agreement with one device.

On the CPU (default) it makes `--devices` host devices; their times mean little, since they
share the cores, but the bytes, the collective counts and the agreement are the real thing. On a
multi-chip machine pass `--shape llama3-8b` (random weights, bfloat16) and the layouts to try:

  python -m jinfer.bench.parallel --devices 8 --out parallel.json
  python -m jinfer.bench.parallel --shape llama3-8b --layouts tp1 tp2 tp4 tp8 tp4cp2 --out gpu.json

A layout is `tp<N>`, `cp<N>`, `ep` (expert parallel, MoE shapes) joined, e.g. `tp2cp4`.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time


def parse_args(argv=None):
  ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}",
                              description=__doc__.split("\n\n")[0])
  ap.add_argument("--devices", type=int, default=8, help="host devices to make on the CPU")
  ap.add_argument("--shape", default="tiny", choices=("tiny", "smollm2", "llama3-8b"))
  ap.add_argument("--layouts", nargs="*",
                  default=["tp1", "tp2", "tp4", "tp8", "cp2", "cp4", "cp8", "tp2cp2", "tp4cp2"])
  ap.add_argument("--batch", type=int, default=8, help="sequences decoding together")
  ap.add_argument("--prompt-len", type=int, default=1024)
  ap.add_argument("--decode-steps", type=int, default=8)
  ap.add_argument("--out", default=None)
  return ap.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  import jax
  if jax.config.jax_platforms in (None, "", "cpu"):
    jax.config.update("jax_num_cpu_devices", args.devices)
  import numpy as np

  from jinfer.bench.machine import machine_info
  from jinfer.bench.random_model import random_llama
  from jinfer.bench.report import emit
  from jinfer.engine.engine import LLMEngine
  from jinfer.engine.engine_config import EngineConfig, default_dtype
  from jinfer.sampling.params import SamplingParams

  dtype = default_dtype()
  cfg, params = random_llama(args.shape, dtype)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, cfg.vocab_size, args.prompt_len).tolist()
             for _ in range(args.batch)]
  sp = SamplingParams(max_tokens=args.decode_steps + 1, temperature=0.0, ignore_eos=True,
                      logprobs=1)
  report = {"machine": machine_info(), "shape": args.shape, "dtype": np.dtype(dtype).name,
            "batch": args.batch, "prompt_len": args.prompt_len, "layouts": {}}
  baseline = None
  for layout in args.layouts:
    sizes = dict(re.findall(r"(tp|cp)(\d+)", layout))
    opts = dict(tensor_parallel_size=int(sizes.get("tp", 1)),
                context_parallel_size=int(sizes.get("cp", 1)),
                enable_expert_parallel="ep" in layout)
    if opts["tensor_parallel_size"] * opts["context_parallel_size"] > jax.device_count():
      report["layouts"][layout] = {"skipped": f"needs more than {jax.device_count()} devices"}
      continue
    config = EngineConfig.of(max_model_len=args.prompt_len + args.decode_steps + 8,
                          max_num_seqs=args.batch, max_num_batched_tokens=512,
                          compilation_cache=False, **opts)
    try:
      engine = LLMEngine.from_parts(cfg, params, None, config=config, dtype=dtype, warmup=False)
    except ValueError as e:
      report["layouts"][layout] = {"error": str(e)}
      continue
    runner = engine.runner
    t0 = time.monotonic()
    runner.warmup()
    compile_s = time.monotonic() - t0
    rids = [engine.add_request(None, p, sp) for p in prompts]
    step_s = {"prefill": [], "decode": []}
    final = {}
    while engine.has_unfinished_requests():
      decoding = all(s.num_computed_tokens >= len(s.prompt_token_ids)
                     for s in engine.scheduler.running) and not engine.scheduler.waiting
      t0 = time.monotonic()
      final.update((o.request_id, o) for o in engine.step() if o.finished)
      step_s["decode" if decoding else "prefill"].append(time.monotonic() - t0)
    outs = [final[r].outputs[0] for r in rids]
    lps = np.array([[lp[t] for lp, t in zip(o.logprobs, o.token_ids)] for o in outs])
    tokens = [o.token_ids for o in outs]
    if baseline is None:
      baseline = (tokens, lps)
    per = runner.bytes_per_device()
    entry = {
        "options": opts,
        "weight_bytes_per_device": sorted({w for w, _ in per.values()}),
        "kv_cache_bytes_per_device": sorted({kv for _, kv in per.values()}),
        "weight_bytes_total": runner.weight_bytes,
        "collectives_per_step": {str(t): _collectives(runner, t) for t in (8, 512)},
        "warmup_s": round(compile_s, 2),
        "prefill_step_ms_median": _median_ms(step_s["prefill"]),
        "decode_step_ms_median": _median_ms(step_s["decode"]),
        "same_tokens_as_first_layout": tokens == baseline[0],
        "max_logprob_diff_vs_first_layout": float(np.abs(lps - baseline[1]).max()),
    }
    report["layouts"][layout] = entry
    print(layout, json.dumps(entry), file=sys.stderr, flush=True)
    del engine, runner
  emit(report, args.out)


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def _collectives(runner, t: int) -> dict:
  """Collective ops in the compiled step of `t` tokens (a loop body's count once: the layer scan
  and the ring run theirs once per layer and per hop)."""
  from jinfer.engine.step_input import empty_step_input, to_step_input
  inp = to_step_input(empty_step_input(runner.buckets, t), runner.buckets)
  v = runner.variant(t)
  hlo = v.step.lower(v.params, runner.kv_cache, inp, None,
                     runner.in_step_weights, runner.lora).compile().as_text()
  return {op: len(re.findall(rf"\b{op}(?:-start)?\(", hlo)) for op in COLLECTIVES}


def _median_ms(xs: list[float]) -> float | None:
  import numpy as np
  return round(float(np.median(xs)) * 1e3, 2) if xs else None


if __name__ == "__main__":
  main()
