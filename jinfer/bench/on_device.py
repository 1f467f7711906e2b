"""Decode step time measured on the chip this runs on, beside `jinfer plan`'s estimate for it.

For a lent or rented TPU or GPU: the engine serves a model of the named config's shapes with
random weights (nothing to download; speed depends on shapes only) for each `--quantization`,
and at each `--batches` size runs that many requests of `--context-len` random prompt tokens and
`--output-len` greedy tokens (EOS ignored). Per run: the decode step time (median over requests
of the time between their tokens after the first), tokens/s, the memory-bandwidth utilization
(weights and KV bytes a step reads over the step time and the target's published bandwidth),
and the plan's estimate of the same step (bytes over bandwidth, flops over peak), so the
estimate can be judged. Prints one JSON object with the machine.

    python -m jinfer.bench.on_device [--model llama-3.1-8b] [--quantization none,int8,int4]
        [--batches 1,8,64] [--context-len 1024] [--output-len 32] [--target h100] [--out F]

On the CPU it runs too (slowly): `--model` a small config, for a smoke test.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.bench.machine import machine_info
from jinfer.bench.report import emit
from jinfer.engine.compile_only import AbstractEngine
from jinfer.engine.engine import LLMEngine
from jinfer.engine.engine_config import EngineConfig, default_dtype
from jinfer.loader import load_model
from jinfer.models import param_shapes
from jinfer.plan import Plan
from jinfer.sampling.params import SamplingParams
from jinfer.targets import TARGETS

# device_kind -> the target whose published figures apply
KINDS = {"NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200", "TPU v5 lite": "v5e-1",
         "TPU v6 lite": "v6e-1"}


def random_params(config, dtype) -> dict:
  """Params of `config`'s shapes, N(0, 0.02), made on the default device."""
  shapes = jax.tree.leaves(param_shapes(config, dtype))
  keys = jax.random.split(jax.random.key(0), len(shapes))
  make = jax.jit(lambda k, s: jax.random.normal(k, s.shape, jnp.float32).astype(s.dtype) * 0.02,
                 static_argnums=1)
  leaves = [make(k, s) for k, s in zip(keys, shapes)]
  return jax.tree.unflatten(jax.tree.structure(param_shapes(config, dtype)), leaves)


def step_seconds(engine: LLMEngine, batch: int, context: int, output: int, vocab: int) -> float:
  """Median over `batch` requests of the seconds between consecutive tokens after the first."""
  rng = np.random.default_rng(0)
  sp = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
  rids = [engine.add_request(None, rng.integers(0, vocab, context).tolist(), sp)
          for _ in range(batch)]
  done = engine.run_to_completion(rids)
  per = [(t[-1] - t[1]) / (len(t) - 2) for t in
         (done[r].metrics.token_times for r in rids)]
  return statistics.median(per)


def main(argv: list[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}",
                               description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="llama-3.1-8b",
                  help="a shipped config's name, an HF directory or config.json")
  ap.add_argument("--quantization", default="none,int8,int4")
  ap.add_argument("--batches", default="1,8,64")
  ap.add_argument("--context-len", type=int, default=1024)
  ap.add_argument("--output-len", type=int, default=32)
  ap.add_argument("--max-num-batched-tokens", type=int, default=512,
                  help="the engine's token budget: its largest step bucket")
  ap.add_argument("--target", default=None, choices=list(TARGETS),
                  help="whose published figures the estimate and MBU use (default: by device)")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)

  platform = {"gpu": "gpu", "tpu": "tpu"}.get(jax.default_backend(), "cpu")
  dtype = default_dtype(platform)
  config, _, _ = load_model(args.model, config_only=True, load_tokenizer=False)
  batches = [int(b) for b in args.batches.split(",")]
  kind = jax.devices()[0].device_kind
  target = TARGETS[args.target or KINDS.get(kind, "h100")]
  params = random_params(config, dtype)
  report = {"machine": machine_info(), "model": args.model, "target_figures": target.name,
            "context_len": args.context_len, "output_len": args.output_len, "runs": []}
  for q in args.quantization.split(","):
    q = None if q == "none" else q
    max_len = args.context_len + args.output_len + 1
    # Room for the largest batch at full length: a preemption would time recomputation.
    ec = EngineConfig.of(max_model_len=max_len, max_num_seqs=max(batches), quantization=q,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         num_pages=1 + max(batches) * -(-max_len // 16), page_size=16,
                         compile_in_background=False)
    t0 = time.monotonic()
    engine = LLMEngine.from_parts(config, params, None, config=ec, dtype=dtype)
    build = time.monotonic() - t0
    plan = Plan(args.model, target, AbstractEngine(config, ec, jax.devices(), platform, dtype),
                [], 0.9, args.context_len)
    estimates = {e["batch"]: e["step_seconds"] for e in plan.decode_estimates(tuple(batches))}
    kv_token = plan.engine.page_bytes / ec.cache.page_size
    for b in batches:
      measured = step_seconds(engine, b, args.context_len, args.output_len, config.vocab_size)
      read = plan.engine.weight_bytes + b * args.context_len * kv_token
      est = estimates[b]
      report["runs"].append({
          "quantization": q, "batch": b, "step_seconds": measured,
          "tokens_per_second": b / measured,
          "mbu": read / measured / target.hbm_bandwidth,
          "estimate_step_seconds": est, "measured_over_estimate": measured / est,
          "weight_bytes": plan.engine.weight_bytes, "build_and_warmup_s": build})
    engine.close()
  emit(report, args.out)
  return report


if __name__ == "__main__":
  main()
