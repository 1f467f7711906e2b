"""Where a decode token's time goes, at batch 1, 8 and 64: prints one JSON object.

For each batch size B, B requests with `--context` tokens of prompt are prefilled, then decode
steps run through the engine and are timed two ways:
  * the whole engine step (host bookkeeping + device step + reading the result back), and the
    device step alone (`ModelRunner._run`); the difference is host work;
  * the step's parts, each jitted on its own with exactly the shapes and params the step uses:
    the layers' linear layers (q/k/v/o, gate/up/down, run the way the stack runs them: scanned
    or unrolled), attention (KV write + ragged paged attention for every layer), the final norm
    and LM head, and sampling. What the step costs beyond its parts ("other") is the fixed
    per-layer work between them: norms, rope, residuals, the embedding and per-layer dispatch.
Each part's bytes of weights read per step and the bandwidth that implies are reported beside
it, so matmul time can be set against the memory roofline.

    python -m jinfer.bench.profile_decode [--batches 1,8,64] [--context 256] [--quantization int8]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.bench.machine import machine_info
from jinfer.engine.engine import LLMEngine
from jinfer.engine.engine_config import EngineConfig
from jinfer.models.llama import Linear, lm_head
from jinfer.quant.qarray import param_bytes
from jinfer.sampling.sample import sample
from jinfer.sampling.params import SamplingParams
from jinfer.loader import DEFAULT_MODEL, load_model
from pallas_kernels import ragged_paged_attention, write_kv


def _load() -> float | None:
  return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def _median_ms(fn, repeats: int) -> float:
  jax.block_until_ready(fn())  # compile
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    ts.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(ts)


def _layer_params(params: dict, num_layers: int, scanned: bool) -> list | dict:
  return params["layers"] if scanned else [params[f"layers_{i}"] for i in range(num_layers)]


def _over_layers(fn, layer_params, carry, scanned: bool):
  """fn(carry, layer params, layer index) -> carry, over every layer the way the stack runs."""
  if scanned:
    n = jax.tree.leaves(layer_params)[0].shape[0]
    carry, _ = jax.lax.scan(lambda c, a: (fn(c, a[0], a[1]), None), carry,
                            (layer_params, jnp.arange(n, dtype=jnp.int32)))
    return carry
  index = jnp.arange(len(layer_params), dtype=jnp.int32)  # as the model indexes its layers
  for i, p in enumerate(layer_params):
    carry = fn(carry, p, index[i])
  return carry


def part_timings(engine: LLMEngine, inp, repeats: int) -> dict:
  """Each part of a step jitted alone over the step's own shapes and params."""
  runner, c = engine.runner, engine.model_config
  t = inp.token_ids.shape[0]
  v = runner.variant(t)
  model, params = v.model, v.params
  kn, dtype, scanned = model.kernels, model.dtype, model.scan_layers
  layers = _layer_params(params, c.num_layers, scanned)
  e, hq, hkv, d, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
  lin = lambda shape, axes, n_in=1: Linear(shape, axes, kn, n_in=n_in, dtype=dtype)
  specs = {  # the model's linear layers, by where their kernels sit
      ("attn", "q_proj"): lin((e, hq, d), ("embed", "q_heads", "head_dim")),
      ("attn", "k_proj"): lin((e, hkv, d), ("embed", "kv_heads", "head_dim")),
      ("attn", "v_proj"): lin((e, hkv, d), ("embed", "kv_heads", "head_dim")),
      ("attn", "o_proj"): lin((hq, d, e), ("q_heads", "head_dim", "embed"), 2),
      ("mlp", "gate_proj"): lin((e, f), ("embed", "mlp")),
      ("mlp", "up_proj"): lin((e, f), ("embed", "mlp")),
      ("mlp", "down_proj"): lin((f, e), ("mlp", "embed")),
  }
  x0 = jnp.ones((t, e), dtype) * 0.01

  def matmuls(x, p, _):
    ap = lambda key, v: specs[key].apply({"params": p[key[0]][key[1]]}, v)
    q, k, v = ap(("attn", "q_proj"), x), ap(("attn", "k_proj"), x), ap(("attn", "v_proj"), x)
    h = x + ap(("attn", "o_proj"), q) + 1e-3 * (k.sum() + v.sum())
    g, u = ap(("mlp", "gate_proj"), h), ap(("mlp", "up_proj"), h)
    return h + ap(("mlp", "down_proj"), jax.nn.silu(g) * u)

  mm = jax.jit(lambda ps, x: _over_layers(matmuls, ps, x, scanned))
  q0 = jnp.ones((t, hq, d), dtype) * 0.01
  kv0 = jnp.ones((t, hkv, d), dtype) * 0.01

  # Each layer's slot in the cache and KV group, whose block table and slots it reads.
  group, slot = (jnp.asarray(a) for a in engine.config.kv_groups.layer_slots())

  def attention(md, carry, _, i):
    o, cache = carry
    md = md.replace(slot_mapping=md.slot_mapping[group[i]], block_table=md.block_table[group[i]])
    cache = write_kv(cache, slot[i], kv0, kv0, md.slot_mapping)
    o = o + ragged_paged_attention(q0 + o, cache, md, layer=slot[i], sm_scale=d ** -0.5,
                                   backend=kn.attention, interpret=kn.interpret)
    return o, cache

  # Attention reads no weights, so it is timed under a layer scan whichever way the stack runs
  # (unrolled, this jitted part alone is not updated in place and would time cache copies).
  attn = jax.jit(lambda cache, md: _over_layers(lambda *a: attention(md, *a),
                                                jnp.zeros((c.num_layers,)), (q0 * 0, cache),
                                                True),
                 donate_argnums=(0,))
  s = inp.logits_indices.shape[0]

  def head(p, x, rows):
    x = x[rows]
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5) * p["norm"]["scale"]
    return lm_head(p, c, kn, x)  # as the model runs it

  lm = jax.jit(head)
  logits = lm(params, x0, inp.logits_indices)
  samp = jax.jit(sample)
  out = {"layers_matmul_ms": _median_ms(lambda: mm(layers, x0), repeats)}
  cache = [runner.kv_cache]

  def run_attn():
    o, cache[0] = attn(cache[0], inp.md)
    return o

  out["attention_ms"] = _median_ms(run_attn, repeats)
  runner.kv_cache = cache[0]
  out["lm_head_ms"] = _median_ms(lambda: lm(params, x0, inp.logits_indices), repeats)
  out["sampling_ms"] = _median_ms(lambda: samp(logits, inp.sampling), repeats)
  layer_bytes = param_bytes(layers)
  head_bytes = param_bytes(params) - layer_bytes
  out["layers_weight_bytes"] = layer_bytes
  out["layers_matmul_gb_s"] = layer_bytes / out["layers_matmul_ms"] / 1e6
  out["lm_head_and_embedding_bytes"] = head_bytes
  out["rows_per_step"] = {"T": t, "S": s}
  out["scan_layers"] = scanned
  return out


def _prefill_steps(batch: int, context: int, tokens_per_step: int = 512) -> int:
  return -(-batch * context // tokens_per_step) + batch


def profile_batch(engine: LLMEngine, batch: int, context: int, steps: int, repeats: int) -> dict:
  vocab = engine.model_config.vocab_size
  # Sequences prefilled first decode while the others prefill: room for those steps too, so
  # all B are still decoding when the timed steps run.
  sp = SamplingParams(temperature=0.0, max_tokens=steps + _prefill_steps(batch, context) + 4,
                      ignore_eos=True)
  rids = [engine.add_request(None, ((np.arange(context) * 7919 + 31 * i) % vocab).tolist(), sp)
          for i in range(batch)]
  seqs = [s for r in rids for s in engine.groups[r].seqs]
  while any(s.num_computed_tokens < context for s in seqs):
    engine.step()  # prefill
  runner = engine.runner
  run_times, last_inp = [], []
  inner = runner._run

  def timed_run(inp, drafts=None):
    t0 = time.perf_counter()
    out = inner(inp, drafts)
    run_times.append(time.perf_counter() - t0)
    last_inp[:] = [inp]
    return out

  runner._run = timed_run
  step_times = []
  engine.step()  # the first decode step compiles its bucket, if the engine had no warmup
  run_times.clear()
  try:
    for _ in range(steps):
      t0 = time.perf_counter()
      engine.step()
      step_times.append(time.perf_counter() - t0)
  finally:
    runner._run = inner
  step_ms = 1e3 * statistics.median(step_times)
  device_ms = 1e3 * statistics.median(run_times)
  parts = part_timings(engine, last_inp[0], repeats)
  assert parts["rows_per_step"]["S"] >= batch, "some sequences stopped before the timed steps"
  for r in rids:
    engine.abort(r)
  known = (parts["layers_matmul_ms"] + parts["attention_ms"] + parts["lm_head_ms"]
           + parts["sampling_ms"])
  return {
      "batch": batch, "context": context, "load_avg_1m": _load(),
      "engine_step_ms": step_ms, "device_step_ms": device_ms,
      "host_ms": step_ms - device_ms,
      **parts,
      "other_ms": device_ms - known,
      "other_per_layer_ms": (device_ms - known) / engine.model_config.num_layers,
      "output_tokens_per_s": batch * 1e3 / step_ms,
  }


def main():
  ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}",
                              description=__doc__.split("\n")[0])
  ap.add_argument("--model", default=DEFAULT_MODEL)
  ap.add_argument("--batches", default="1,8,64")
  ap.add_argument("--context", type=int, default=256)
  ap.add_argument("--steps", type=int, default=16, help="decode steps timed per batch")
  ap.add_argument("--repeats", type=int, default=10, help="timed runs of each part")
  ap.add_argument("--quantization", default=None, choices=("int8", "w8a8"))
  ap.add_argument("--scan-layers", default=None, choices=("true", "false"))
  args = ap.parse_args()
  batches = [int(b) for b in args.batches.split(",")]
  model_config, params, _ = load_model(args.model, jnp.float32, load_tokenizer=False)
  extra = max(_prefill_steps(b, args.context) for b in batches)
  config = EngineConfig.of(max_model_len=args.context + args.steps + extra + 8,
                        max_num_seqs=max(batches),
                        quantization=args.quantization,
                        scan_layers=None if args.scan_layers is None else args.scan_layers == "true")
  engine = LLMEngine.from_parts(model_config, params, None, config=config, warmup=False)
  del params
  report = {"machine": machine_info(), "model": args.model, "quantization": args.quantization,
            "unrolled_max_tokens": engine.runner.unrolled_max_tokens,
            "weight_bytes": engine.stats().weight_bytes,
            "batches": [profile_batch(engine, b, args.context, args.steps, args.repeats)
                        for b in batches]}
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  main()
