"""LoRA serving cost: one decode step of B sequences with 0, 1, 4 and 16 distinct adapters
against the base model's step, and an adapter's load time; prints one JSON object.

Two engines over the same weights, one with `enable_lora` (`max_loras` slots of
`max_lora_rank`), one without. The step is the runner's device step on a fixed decode batch (B
rows, each with `--context` tokens of KV), timed alternately on both, medians of `--repeats`.
With N adapters the rows take them round-robin; N = 0 is the LoRA engine with no row using an
adapter (what enabling LoRA costs by itself). The adapters are random, of rank `--rank` on every
projection (q/k/v/o, gate/up/down), saved as PEFT directories; their load time is the host's
read and check (`load_peft_adapter`) and the slot write.

    python -m jinfer.bench.lora [--batch 64] [--rank 8] [--adapters 0,1,4,16] [--max-loras 16]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import jax
import numpy as np

from jinfer.bench.machine import machine_info
from jinfer.engine.engine import LLMEngine
from jinfer.engine.engine_config import EngineConfig
from jinfer.engine.step_input import empty_step_input, to_step_input
from jinfer.loader import DEFAULT_MODEL, load_model
from jinfer.weights.peft_adapter import load_peft_adapter, save_peft_adapter


def random_adapter_weights(targets: dict, rank: int, seed: int) -> dict:
  """Random `(a, b)` per adaptable module (`save_peft_adapter`'s input), small enough to keep
  the model's outputs sane."""
  rng = np.random.default_rng(seed)
  return {path: (rng.normal(0, 0.02, (layers, k, rank)).astype(np.float32),
                 rng.normal(0, 0.02, (layers, rank, n)).astype(np.float32))
          for path, (layers, k, n) in targets.items()}


def decode_input(engine: LLMEngine, batch: int, context: int, slots: list[int]):
  """A decode step of `batch` rows, each with `context` tokens of KV on pages of its own, row i
  using adapter slot `slots[i]` (-1: none)."""
  b, page = engine.buckets, engine.config.cache.page_size
  a = empty_step_input(b, b.pick(batch))
  per_seq = -(-(context + 1) // page)
  for i in range(batch):
    pages = 1 + (i * per_seq + np.arange(per_seq)) % (engine.config.num_pages - 1)
    a["block_table"][0, i, :per_seq] = pages
    a["slot_mapping"][0, i] = pages[context // page] * page + context % page
    a["positions"][i] = context
    a["token_ids"][i] = 100 + i
    a["kv_lens"][i] = context + 1
    a["cu_q_lens"][i + 1] = i + 1
    a["logits_indices"][i] = i
    if a["lora_slot"] is not None:
      a["lora_slot"][i] = slots[i]
  a["num_seqs"][0] = batch
  a["cu_q_lens"][batch + 1:] = batch
  return to_step_input(a, b)


def _time(runner, inp) -> float:
  t0 = time.perf_counter()
  runner._run(inp, None)
  return time.perf_counter() - t0


def main():
  ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default=DEFAULT_MODEL)
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--context", type=int, default=256)
  ap.add_argument("--rank", type=int, default=8)
  ap.add_argument("--adapters", default="0,1,4,16", help="distinct adapters per step")
  ap.add_argument("--max-loras", type=int, default=16)
  ap.add_argument("--repeats", type=int, default=20)
  args = ap.parse_args()
  counts = [int(n) for n in args.adapters.split(",")]
  if max(counts) > args.max_loras:
    ap.error(f"--adapters {max(counts)} exceeds --max-loras {args.max_loras}")
  config, params, tok = load_model(args.model)
  options = dict(max_num_seqs=args.batch, max_num_batched_tokens=args.batch,
                 max_model_len=args.context + 64, compile_in_background=False)
  engines = {}
  for name, extra in (("base", {}), ("lora", dict(enable_lora=True, max_loras=args.max_loras,
                                                 max_lora_rank=args.rank))):
    engines[name] = LLMEngine.from_parts(config, params, tok, warmup=False,
                                         config=EngineConfig.of(**options, **extra))
  lora = engines["lora"]
  targets = lora.lora_targets

  load_ms = []
  with tempfile.TemporaryDirectory() as tmp:
    for i in range(max(counts)):
      path = f"{tmp}/adapter{i}"
      save_peft_adapter(path, config, random_adapter_weights(targets, args.rank, i),
                        rank=args.rank, alpha=2 * args.rank)
      t0 = time.perf_counter()
      adapter = load_peft_adapter(path, config, max_rank=args.rank)
      lora.runner.write_adapter(i, lora._lora_pad(adapter))
      jax.block_until_ready(lora.runner.lora)
      load_ms.append(1e3 * (time.perf_counter() - t0))
    size = adapter.num_bytes()

  rows = {}
  base_inp = decode_input(engines["base"], args.batch, args.context, [-1] * args.batch)
  for n in counts:
    slots = [i % n if n else -1 for i in range(args.batch)]
    inp = decode_input(lora, args.batch, args.context, slots)
    _time(lora.runner, inp), _time(engines["base"].runner, base_inp)  # compile / warm
    base, with_lora = [], []
    for _ in range(args.repeats):  # alternated: the machine's noise hits both alike
      base.append(_time(engines["base"].runner, base_inp))
      with_lora.append(_time(lora.runner, inp))
    b, w = statistics.median(base), statistics.median(with_lora)
    rows[str(n)] = {"base_ms": round(1e3 * b, 2), "lora_ms": round(1e3 * w, 2),
                    "ratio": round(w / b, 3)}
  print(json.dumps({"machine": machine_info(), "model": args.model, "batch": args.batch,
                    "context": args.context, "rank": args.rank, "max_loras": args.max_loras,
                    "adapter_bytes": size,
                    "adapter_load_ms_median": round(statistics.median(load_ms), 1),
                    "steps_by_distinct_adapters": rows}, indent=1))


if __name__ == "__main__":
  main()
