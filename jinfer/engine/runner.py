"""Owns the params and the KV cache on device, and runs the one jitted step."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from typing import Callable, Collection

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from jinfer.sampling.accept import VerifyOutput, accept
from jinfer.config import ModelConfig
from jinfer.engine import compilation_cache
from jinfer.engine.speculative.proposer import InStep
from jinfer.engine.step_input import Buckets, StepInput, empty_step_input, to_step_input
from jinfer.models import CausalLM, layer_runs, linear_kernels, logical_axes, unstack_layers
from jinfer.models.kernel_options import KernelOptions
from jinfer.models.kv_groups import KVGroups
from jinfer.models.lora import lora_targets
from jinfer.parallel import distributed, sharding
from jinfer.quant.qarray import param_bytes
from jinfer.sampling.sample import SampleOutput, sample
from jinfer.sampling.params import MAX_LOGPROBS
from jinfer.sampling.tree import Tree
from pallas_kernels import AttentionMetadata, KVCacheSpec
from pallas_kernels.kv_cache_layout import copy_slots

log = logging.getLogger(__name__)


@struct.dataclass
class PromptLogprobs:
  target: jax.Array  # [T] float32: logprob of the token each row predicts
  top_ids: jax.Array  # [T, MAX_LOGPROBS] int32
  top_logprobs: jax.Array  # [T, MAX_LOGPROBS] float32


@struct.dataclass
class StepOutput:
  # One token per sequence ([S]); a verify step's fields are [S, K+1]: the accepted drafts, then
  # the target's token.
  sample: SampleOutput
  num_accepted: jax.Array | None  # [S] int32, verify steps only
  # An in-step proposer's proposals for each sequence's next step (Medusa: candidates
  # [S, H, topk] for the token after this step's last one).
  proposals: jax.Array | None
  prompt_logprobs: PromptLogprobs | None  # when the step carries prompt_logprobs requests
  # [MoE layers, experts] int32: tokens this step routed to each expert (live rows only);
  # None for a dense model.
  expert_load: jax.Array | None = None


def _expert_load(state) -> jax.Array | None:
  load = state.get("expert_load")
  return None if load is None else load["tokens_per_expert"][0]


def keep_path(kv_cache: jax.Array, md: AttentionMetadata, out: VerifyOutput) -> jax.Array:
  """Move each sequence's accepted path to the slots of its depths: node n of sequence s wrote
  its K/V at the slot of row cu_q_lens[s] + n; the node at depth d belongs at row
  cu_q_lens[s] + d. In every KV group (slot_mapping [G, T]): their pages are disjoint."""
  d = jnp.arange(1, out.path.shape[1])[None, :]  # [1, D]
  first = md.cu_q_lens[:-1, None]  # [S, 1]
  src = md.slot_mapping[:, first + out.path[:, 1:]]  # [G, S, D]
  dst = md.slot_mapping[:, first + d]
  move = (d <= out.num_accepted[:, None]) & (out.path[:, 1:] != d)  # [S, D]
  return copy_slots(kv_cache, src.reshape(-1), jnp.where(move, dst, -1).reshape(-1))



def _step(model: CausalLM, in_step: InStep | None, logprobs_mode: str, params, kv_cache,
          inp: StepInput, drafts: jax.Array | None, weights: dict | None,
          lora: dict | None) -> tuple:
  """`in_step` (static) and its `weights`: the target proposes its next step's drafts too, and
  verifies them as a tree. `logprobs_mode` (static): what the sampled tokens' logprobs report
  (`jinfer.sampling.sample.LOGPROBS_MODES`). `lora`: the adapter slots
  (jinfer/models/lora.py), which the step's rows pick from by `inp.lora`."""
  token_ids = inp.token_ids
  if drafts is not None:  # a device proposer's tokens take their verify rows
    token_ids = token_ids.at[inp.verify.draft_rows].set(drafts, mode="drop")
  variables = {"params": params} | ({} if lora is None else {"lora": lora})
  apply = functools.partial(model.apply, variables, token_ids, inp.positions,
                            kv_cache, inp.md, return_hidden=in_step is not None,
                            lora=inp.lora, mutable=["expert_load"])
  propose = lambda h: None if in_step is None else in_step.propose(weights, params, h)
  if inp.verify is not None:
    vt = inp.verify.tensors
    if drafts is not None:
      vt = vt.replace(draft_tokens=drafts)
    (logits, hidden, kv_cache), state = apply(inp.verify.logits_rows)  # [R, V]
    if in_step is not None:
      out = accept(logits, inp.sampling, vt, in_step.tree, in_step.typical, logprobs_mode)
      kv_cache = keep_path(kv_cache, inp.md, out)
      proposals = propose(hidden[out.stop_row])
    else:
      out = accept(logits, inp.sampling, vt, Tree.chain(vt.draft_tokens.shape[1]),
                   logprobs_mode=logprobs_mode)
      proposals = None
    return StepOutput(out.sample, out.num_accepted, proposals, None,
                      _expert_load(state)), kv_cache
  if not inp.prompt_logprobs:
    (logits, hidden, kv_cache), state = apply(inp.logits_indices)  # [S, V]
    return StepOutput(sample(logits, inp.sampling, logprobs_mode), None, propose(hidden), None,
                      _expert_load(state)), kv_cache
  (rows, hidden, kv_cache), state = apply()  # [T, V]
  lp = jax.nn.log_softmax(rows, axis=-1)
  top_lp, top_ids = jax.lax.top_k(lp, MAX_LOGPROBS)
  target = jnp.take_along_axis(lp, inp.target_ids[:, None], axis=-1)[:, 0]
  return StepOutput(
      sample(rows[inp.logits_indices], inp.sampling, logprobs_mode), None,
      None if hidden is None else propose(hidden[inp.logits_indices]),
      PromptLogprobs(target=target, top_ids=top_ids.astype(jnp.int32), top_logprobs=top_lp),
      _expert_load(state),
  ), kv_cache


def jit_step(model: CausalLM, in_step: InStep | None = None, out_shardings=None,
             logprobs_mode: str = "raw_logprobs") -> Callable:
  """`model`'s step, jitted: `(params, kv_cache, step_input, drafts, in_step_weights,
  lora_slots) -> (StepOutput, kv_cache)`. The cache is donated: XLA updates it in place instead
  of copying it every step."""
  return jax.jit(functools.partial(_step, model, in_step, logprobs_mode), donate_argnums=(1,),
                 out_shardings=out_shardings)


def step_shardings(mesh: Mesh, quantized_kv: bool):
  """(the KV cache's sharding, the step's out_shardings) on `mesh`: outputs replicated, so every
  process can read them; the cache as it came in."""
  kv = sharding.kv_cache_sharding(mesh, quantized_kv)
  return kv, (NamedSharding(mesh, P()), kv)


@dataclasses.dataclass(frozen=True)
class Variant:
  """One way to run the layer stack: the model, the params in the layout it reads, and its
  jitted step."""
  model: CausalLM
  params: dict | None
  step: Callable


class ModelRunner:
  """`params` in the stacked layout. Steps of at most `unrolled_max_tokens` tokens run the
  unrolled stack over per-layer arrays (views of the stacked ones on the CPU, see
  `unstack_layers`), larger steps the scanned stack: `model` and `params` are the scanned
  variant's when any step runs scanned, `_small` the unrolled variant beside it.

  `mesh`: the devices this runner's params and KV cache live on, laid out by
  `jinfer.parallel.sharding` (`config` has its KV heads duplicated already where fewer than the
  tensor axis); the step's outputs come back replicated, so every process can read them. With a
  mesh every step runs scanned."""

  def __init__(self, config: ModelConfig, params: dict, spec: KVCacheSpec, buckets: Buckets, *,
               kv_groups: KVGroups, kernels: KernelOptions, dtype, unrolled_max_tokens: int,
               unroll_scan: bool = False,
               in_step: InStep | None = None, in_step_weights: dict | None = None,
               mesh: Mesh | None = None,
               expert_parallel: bool = False, lora_slots: dict | None = None,
               logprobs_mode: str = "raw_logprobs"):
    """`lora_slots`: the adapter slots, empty (`jinfer.models.lora.empty_slots`), when the
    engine serves adapters. `logprobs_mode`: what sampled tokens' logprobs report."""
    self.config, self.spec, self.buckets, self.mesh = config, spec, buckets, mesh
    out_shardings = None
    lora_sharding = None
    if mesh is not None:
      params = sharding.shard_params(params, logical_axes(config), mesh, expert_parallel,
                                     linear=linear_kernels(config))
      if lora_slots is not None:
        specs = sharding.lora_slot_specs(logical_axes(config), linear_kernels(config),
                                         lora_targets(lora_slots))
        lora_sharding = jax.tree.map(lambda p: NamedSharding(mesh, p), specs)
      kv_sharding, out_shardings = step_shardings(mesh, spec.quantized)
      # Sharded params run the scanned stack only: the CPU's per-layer views are single-device
      # arrays that would drop the sharding, and off the CPU the scan reads its weights in
      # place anyway, so an unrolled variant would only add compiles.
      unrolled_max_tokens = 0
    else:
      # Params and cache committed to their device whichever loader made the params (orbax
      # restores committed arrays, the others uncommitted ones): the placement is part of the
      # compilation cache's key, so a saved quantized model loads the steps its quantizing run
      # compiled, and the cache a step returns has the placement it was given.
      leaf = jax.tree.leaves(params)[0]
      kv_sharding = SingleDeviceSharding(next(iter(leaf.devices())) if isinstance(leaf, jax.Array)
                                         else jax.devices()[0])
      params = jax.device_put(params, kv_sharding)
      lora_sharding = kv_sharding
    # Where each weight lives: new weights (`set_params`) and weights back from host memory
    # (`restore_params`) are placed so, and the compiled steps take them as they are.
    self.param_shardings = jax.tree.map(lambda a: a.sharding, params)
    self._host_params = None  # the weights in host memory while `offload_params` holds them
    # Written one slot at a time by a donated update: an adapter's load compiles nothing.
    self.lora = None if lora_slots is None else jax.device_put(lora_slots, lora_sharding)
    self._write_slot = jax.jit(
        lambda slots, slot, new: jax.tree.map(lambda s, n: s.at[:, slot].set(n.astype(s.dtype)),
                                              slots, new),
        donate_argnums=(0,), out_shardings=lora_sharding)
    self.unrolled_max_tokens = unrolled_max_tokens
    self.in_step_weights = in_step_weights
    jit = lambda model: jit_step(model, in_step, out_shardings, logprobs_mode)

    def variant(scan: bool) -> Variant:
      model = CausalLM(config, kernels, dtype=dtype, scan_layers=scan, kv_groups=kv_groups,
                       unroll_scan=unroll_scan, layer_runs=layer_runs(params) if scan else ())
      return Variant(model, None, jit(model))  # params: `_use_params`

    scanned = buckets.token_buckets[-1] > unrolled_max_tokens
    self._main = variant(scanned)
    self.model = self._main.model
    self._small = (variant(False) if scanned and buckets.token_buckets[0] <= unrolled_max_tokens
                   else None)
    self._use_params(params)
    # An array, or values and scales (`QuantizedKVCache`) for an int8 / fp8 cache.
    self._allocate = jax.jit(spec.allocate, out_shardings=kv_sharding)
    self.kv_cache = self._allocate()
    self.cache_resets = 0  # times a failed step consumed the cache and it was rebuilt empty
    self._shapes_run: set[tuple[int, bool, bool]] = set()
    # Several processes (jinfer/parallel/distributed.py): process 0 announces each step by its
    # index in this list of every step shape, then sends its input.
    self._multiprocess = mesh is not None and len(
        {d.process_index for d in mesh.devices.flat}) > 1
    self._variants = buckets.shapes(True)

  def run(self, inp: StepInput, drafts: jax.Array | None = None) -> StepOutput:
    """`drafts`: a device proposer's tokens for a verify step's draft rows (n-gram drafts are
    in `inp` already)."""
    shape = (inp.token_ids.shape[0], inp.prompt_logprobs, inp.verify is not None)
    if self._multiprocess:  # the other processes run the same step on their devices
      if drafts is not None:
        raise ValueError("a draft model's proposals cannot be sent to other processes yet")
      self._announce(self._variants.index(shape), inp)
    if shape in self._shapes_run:
      return self._run(inp, drafts)
    # A shape's first run compiles it (or loads it from the persistent cache): say so, since it
    # takes seconds.
    with self._preparing(shape):
      return self._run(inp, drafts)

  @contextlib.contextmanager
  def _preparing(self, shape: tuple[int, bool, bool]):
    """Logs a step shape's compile (or load from the persistent cache), which takes seconds."""
    what = " with prompt logprobs" if shape[1] else " verify" if shape[2] else ""
    log.info("preparing the %d-token%s step ...", shape[0], what)
    t0, hits = time.monotonic(), compilation_cache.cache_hits()
    yield
    self._shapes_run.add(shape)
    log.info("%d-token%s step %s in %.1f s", shape[0], what, "compiled" if hits ==
             compilation_cache.cache_hits() else "loaded from the compilation cache",
             time.monotonic() - t0)

  def compile(self, shape: tuple[int, bool, bool], drafts: jax.Array | None = None) -> None:
    """Compile the step of `shape` (T, prompt_logprobs, verify) ahead of time, without running
    it: safe on another thread while steps run. `drafts`: as `run`'s, for a verify shape."""
    if shape in self._shapes_run:
      return
    t, prompt_lp, verify = shape
    b = self.buckets
    v = self.variant(t)
    with self._preparing(shape):
      v.step.lower(v.params, self.kv_cache,
                   to_step_input(empty_step_input(b, t, prompt_lp, verify), b), drafts,
                   self.in_step_weights, self.lora).compile()

  def variant(self, num_tokens: int) -> Variant:
    """What a step of `num_tokens` (a bucket) runs."""
    if self._small is not None and num_tokens <= self.unrolled_max_tokens:
      return self._small
    return self._main

  def _run(self, inp: StepInput, drafts: jax.Array | None) -> StepOutput:
    v = self.variant(inp.token_ids.shape[0])
    try:
      out, self.kv_cache = v.step(v.params, self.kv_cache, inp, drafts, self.in_step_weights,
                                  self.lora)
    except Exception:
      # The cache was donated to the failed call: if XLA consumed it, start from an empty one
      # (the caller must then treat every cached token as gone).
      if self.kv_cache.is_deleted():
        self.kv_cache = self._allocate()
        self.cache_resets += 1
      raise
    return jax.tree.map(np.asarray, out)

  def _use_params(self, params: dict | None) -> None:
    """Every variant runs `params` (placed already; None: no weights on the devices)."""
    self.stacked_params = params  # the layout every variant's params are views or slices of
    for name in ("_main", "_small"):
      v = getattr(self, name)
      if v is not None:
        setattr(self, name, dataclasses.replace(v, params=(
            params if params is None or v.model.scan_layers
            else unstack_layers(params, self.config.num_layers))))
    self.params = self._main.params

  def set_params(self, params: dict) -> None:
    """Run `params` (the stacked layout, shaped and typed as the current ones) from the next
    step on, placed as the current ones are: an array placed so already is used as it is, not
    copied. A host copy `offload_params` kept is dropped."""
    self._host_params = None
    self._use_params(jax.device_put(params, self.param_shardings))

  def offload_params(self, keep: bool) -> None:
    """Let go of the weights on the devices; `keep` copies them into host memory first (for
    `restore_params`). Arrays someone else still holds (a trainer's, used without a copy) stay
    where they are."""
    if keep and self.stacked_params is not None:
      host = jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), self.param_shardings)
      self._host_params = jax.block_until_ready(jax.device_put(self.stacked_params, host))
    elif not keep:
      self._host_params = None
    self._use_params(None)

  def restore_params(self) -> None:
    """The weights `offload_params(keep=True)` moved to host memory, back on the devices."""
    self._use_params(jax.device_put(self._host_params, self.param_shardings))
    self._host_params = None

  @property
  def has_params(self) -> bool:
    """Weights on the devices or in host memory."""
    return self.stacked_params is not None or self._host_params is not None

  def free_kv_cache(self) -> None:
    for a in jax.tree.leaves(self.kv_cache):
      a.delete()  # now, whoever else refers to it: nothing outside the runner reads the cache
    self.kv_cache = None

  def allocate_kv_cache(self) -> None:
    self.kv_cache = self._allocate()

  def write_adapter(self, slot: int, weights: dict) -> None:
    """Put one adapter's weights (`lora_slots.pad_adapter`'s tree) in device slot `slot`."""
    self.lora = self._write_slot(self.lora, np.int32(slot), weights)

  def _announce(self, variant: int, inp: StepInput | None = None):
    distributed.broadcast(np.asarray([variant], np.int32), is_source=True)
    if inp is not None:
      distributed.broadcast(inp, is_source=True)

  def follow(self):
    """On a process other than the leader: run the leader's steps until it closes."""
    while True:
      (variant,) = distributed.broadcast(np.zeros(1, np.int32), is_source=False)
      if variant < 0:
        return
      t, prompt_lp, verify = self._variants[variant]
      template = to_step_input(empty_step_input(self.buckets, t, prompt_lp, verify),
                               self.buckets)
      inp = distributed.broadcast(template, is_source=False)
      try:
        self._run(inp, None)
      except Exception:  # the leader's step failed too, and it decides what happens next
        log.exception("a step failed")

  def close(self):
    """On the leader of several processes: release the followers."""
    if self._multiprocess and jax.process_index() == 0:
      self._announce(-1)
      self._multiprocess = False

  def warmup(self, with_prompt_logprobs: bool = False,
             empty_drafts: Callable[[int], jax.Array | None] = lambda s: None,
             buckets: Collection[int] | None = None) -> float:
    """Compile every bucket (or those of `buckets` tokens), ahead of time; returns seconds.
    `empty_drafts(S)`: stand-in device drafts for verify steps, when a device proposer has
    them."""
    t0 = time.monotonic()
    b = self.buckets
    for shape in b.shapes(with_prompt_logprobs):
      t, _, verify = shape
      if buckets is None or t in buckets:
        self.compile(shape, empty_drafts(b.num_seqs(t)) if verify else None)
    return time.monotonic() - t0

  @property
  def weight_bytes(self) -> int:
    # On the CPU the unrolled layers are views of `params`: one copy of the weights.
    return param_bytes(self.params)

  @property
  def kv_cache_bytes(self) -> int:
    return 0 if self.kv_cache is None else self.kv_cache.nbytes

  def bytes_per_device(self) -> dict:
    """{device: (weight bytes, KV cache bytes)} for the devices this process holds."""
    w, kv = sharding.bytes_per_device(self.params), sharding.bytes_per_device(self.kv_cache)
    return {d: (w.get(d, 0), kv.get(d, 0)) for d in set(w) | set(kv)}
