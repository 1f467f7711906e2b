"""MoE against dense on one machine; prints one JSON object with the machine.

(1) A decode step of an MoE model against a dense model with the same active parameters, across
batch sizes. Both are Qwen3-style with random weights: hidden 512, 4 layers, 8 query and 2 KV
heads of 64, vocab 4096; the dense FFN is 2048 wide, the MoE layer routes each token to 2 of 8
experts 1024 wide, so a token meets the same FFN parameters in both (2 x 3 x 512 x 1024 =
3 x 512 x 2048), while the MoE model holds 4x as many. A step is B sequences adding one token
each at context --context, through the jitted forward (cache donated; the engine's step without
sampling), with the layer stack scanned and unrolled. The MoE step's expert load (tokens per
expert, busiest over mean) is reported beside it.

(2) The grouped matmul of the MoE layer's gate/up projection ([B*2, 512] x [8, 512, 2048],
rows routed by a softmax router over random activations) for each backend that runs natively
here, against the one-hot baseline that computes every row with every expert and keeps its
own, and against the dense matmul of the same active rows ([B, 512] x [512, 4096]).

Repetitions interleave the variants compared and report medians (the CPU may be shared; the load
average is recorded).

  python -m jinfer.bench.moe --out moe.json [--batch-sizes 1,16,64,128,256] [--reps 9]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.bench.machine import machine_info
from jinfer.config import ModelConfig
from jinfer.engine.expert_load import ExpertLoad
from jinfer.models import CausalLM, param_shapes, unstack_layers
from jinfer.models.kernel_options import KernelOptions
from jinfer.bench.report import emit
from pallas_kernels import AttentionMetadata, KVCacheSpec
from pallas_kernels.grouped_matmul import default_backend, grouped_matmul

DENSE = ModelConfig(architecture="qwen3", vocab_size=4096, hidden_size=512, intermediate_size=2048,
                    num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64, qk_norm=True)
MOE = dataclasses.replace(DENSE, architecture="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=1024, norm_topk_prob=True, moe_layers=())
PAGE = 16


def _params(config: ModelConfig, seed: int) -> dict:
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape, np.float32) * 0.05),
                      param_shapes(config))


def _decode_step(config: ModelConfig, params: dict, batch: int, context: int, scan: bool,
                 kernels: KernelOptions):
  """A callable running one decode step (blocking), and the step's expert load or None."""
  model = CausalLM(config, kernels, scan_layers=scan)
  pages = context // PAGE + 1
  spec = KVCacheSpec(num_layers=config.num_layers, num_pages=1 + batch * pages, page_size=PAGE,
                     num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)
  table = 1 + np.arange(batch * pages, dtype=np.int32).reshape(batch, pages)
  md = AttentionMetadata(
      slot_mapping=jnp.asarray(table[:, context // PAGE] * PAGE + context % PAGE),
      block_table=jnp.asarray(table), kv_lens=jnp.full(batch, context + 1, jnp.int32),
      cu_q_lens=jnp.arange(batch + 1, dtype=jnp.int32),
      num_seqs=jnp.asarray([batch], jnp.int32), max_q_len=1)
  ids = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, batch), jnp.int32)
  positions = jnp.full(batch, context, jnp.int32)
  p = params if scan else unstack_layers(params, config.num_layers)

  @functools.partial(jax.jit, donate_argnums=(1,))
  def step(p, cache):
    (logits, _, cache), state = model.apply({"params": p}, ids, positions, cache, md,
                                            jnp.arange(batch), mutable=["expert_load"])
    return logits, cache, state.get("expert_load")

  holder = {"cache": jnp.zeros(spec.shape, spec.dtype)}

  def run():
    logits, holder["cache"], load = step(p, holder["cache"])
    logits.block_until_ready()
    return load

  load = run()  # compile
  if load is None:
    return run, None
  return run, ExpertLoad.of(config.moe_layer_ids, np.asarray(load["tokens_per_expert"][0]))


def _median_ms(fns: dict, reps: int) -> dict:
  """Median wall ms of each callable, repetitions interleaved across them."""
  times = {k: [] for k in fns}
  for _ in range(reps):
    for k, fn in fns.items():
      t0 = time.perf_counter()
      fn()
      times[k].append(time.perf_counter() - t0)
  return {k: round(float(np.median(v)) * 1e3, 3) for k, v in times.items()}


def bench_steps(batch_sizes: list[int], context: int, reps: int) -> list[dict]:
  dense_params, moe_params = _params(DENSE, 0), _params(MOE, 0)
  rows = []
  for scan in (True, False):
    for b in batch_sizes:
      kernels = KernelOptions(grouped_matmul=default_backend())
      dense, _ = _decode_step(DENSE, dense_params, b, context, scan, kernels)
      moe, load = _decode_step(MOE, moe_params, b, context, scan, kernels)
      ms = _median_ms({"dense": dense, "moe": moe}, reps)
      rows.append({"layers": "scanned" if scan else "unrolled", "batch": b,
                   "dense_ms": ms["dense"], "moe_ms": ms["moe"],
                   "moe_over_dense": round(ms["moe"] / ms["dense"], 3),
                   "expert_load": load.as_dict(), "load_avg_1m": _load()})
      print(json.dumps(rows[-1]), flush=True)
  return rows


def _one_hot(x, w, group_sizes):
  """Every row through every expert, each row keeping its own group's output."""
  m = x.shape[0]
  groups = jnp.minimum(jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(m), side="right"),
                       w.shape[0] - 1)
  every = jnp.einsum("mk,gkn->gmn", x, w)  # [G, M, N]
  return jnp.where((jnp.arange(m) < jnp.sum(group_sizes))[:, None],
                   every[groups, jnp.arange(m)], 0)


def bench_grouped_matmul(batch_sizes: list[int], reps: int) -> list[dict]:
  rng = np.random.default_rng(0)
  e, n, k, f = MOE.hidden_size, MOE.num_experts, MOE.num_experts_per_tok, MOE.moe_intermediate_size
  w = jnp.asarray(rng.standard_normal((n, e, 2 * f), np.float32) * 0.05)
  dense_w = jnp.asarray(rng.standard_normal((e, 2 * k * f), np.float32) * 0.05)
  router = rng.standard_normal((e, n)) * 0.5
  backends = ["ragged_dot", default_backend()] if default_backend() != "ragged_dot" else [
      "ragged_dot"]
  rows = []
  for b in batch_sizes:
    x = rng.standard_normal((b, e)).astype(np.float32)
    chosen = np.argsort(-(x @ router), axis=1)[:, :k].reshape(-1)  # [B*k] top-k experts
    order = np.argsort(chosen, kind="stable")
    group_sizes = jnp.asarray(np.bincount(chosen, minlength=n), jnp.int32)
    rows_sorted = jnp.asarray(x[order // k])  # [B*k, E]
    fns = {name: functools.partial(
        lambda fn, *a: fn(*a).block_until_ready(),
        jax.jit(functools.partial(grouped_matmul, backend=name)), rows_sorted, w, group_sizes)
        for name in backends}
    fns["one_hot"] = functools.partial(lambda fn, *a: fn(*a).block_until_ready(),
                                       jax.jit(_one_hot), rows_sorted, w, group_sizes)
    fns["dense_same_active"] = functools.partial(lambda fn, *a: fn(*a).block_until_ready(),
                                                 jax.jit(jnp.matmul), jnp.asarray(x), dense_w)
    for fn in fns.values():  # compile
      fn()
    ms = _median_ms(fns, reps)
    rows.append({"batch": b, "rows": b * k, "group_sizes": np.asarray(group_sizes).tolist(),
                 "ms": ms, "load_avg_1m": _load()})
    print(json.dumps(rows[-1]), flush=True)
  return rows


def _load() -> float | None:
  return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def main():
  ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}",
                              description=__doc__.split("\n")[0])
  ap.add_argument("--batch-sizes", default="1,16,64,128,256")
  ap.add_argument("--context", type=int, default=128)
  ap.add_argument("--reps", type=int, default=9)
  ap.add_argument("--out", default=None, help="also write the JSON to this file")
  args = ap.parse_args()
  batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
  report = {"machine": machine_info(), "dense_model": dataclasses.asdict(DENSE),
            "moe_model": dataclasses.asdict(MOE), "context": args.context, "reps": args.reps,
            "grouped_matmul_backend": default_backend()}
  report["grouped_matmul"] = bench_grouped_matmul(batch_sizes, args.reps)
  report["decode_step"] = bench_steps(batch_sizes, args.context, args.reps)
  report["machine"]["load_avg_1m_at_end"] = _load()
  emit(report, args.out)


if __name__ == "__main__":
  main()
