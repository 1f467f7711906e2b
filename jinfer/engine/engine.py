"""LLMEngine: requests in, incremental outputs out, one scheduled step at a time."""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from typing import Iterable

import jax
import numpy as np

from jinfer.config import ModelConfig
from jinfer.engine import compilation_cache
from jinfer.engine.block_manager import BlockManager
from jinfer.engine.compile_guard import CompileGuard, CompileOnServingPath
from jinfer.engine.engine_config import EngineConfig, default_dtype
from jinfer.engine.expert_load import ExpertLoad
from jinfer.engine.lora_slots import AdapterSlots, LoRARequest, pad_adapter
from jinfer.engine.request import (CompletionOutput, RequestMetrics, RequestOutput, Sequence,
                                   Status)
from jinfer.engine.runner import ModelRunner
from jinfer.engine.scheduler import ScheduledBatch, Scheduler
from jinfer.engine.step_compiler import StepCompiler
from jinfer.engine.step_input import MAX_BANNED, RowError, StepInput, build_step_input
from jinfer.engine import weight_quantization, weight_update
from jinfer.models import linear_kernels, param_shapes
from jinfer.models.lora import empty_slots, target_shapes
from jinfer.parallel.mesh import make_mesh
from jinfer.parallel.sharding import check_tensor_parallel, duplicate_kv_heads
from jinfer.sampling.grammar import GrammarCompiler
from jinfer.sampling.sample import SampleOutput
from jinfer.sampling.params import SamplingParams
from jinfer.errors import EngineStateError, ParameterError
from jinfer.engine.speculative.pause import after_verify, paused
from jinfer.engine.speculative.proposer import Proposer, Target
from jinfer.engine.speculative.registry import create_proposer
from jinfer.engine.speculative.stats import SpecStats
from jinfer.tokenizer import IncrementalDetokenizer, Tokenizer
from jinfer.loader import DEFAULT_MODEL

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Group:
  """A request: its n sequences and what it was asked."""
  request_id: str
  prompt: str | None
  prompt_token_ids: list[int]
  params: SamplingParams
  seqs: list[Sequence]

  @property
  def finished(self) -> bool:
    return all(s.finished for s in self.seqs)


@dataclasses.dataclass
class EngineStats:
  num_running: int
  num_waiting: int
  kv_utilization: float  # token slots used / slots in allocated pages
  kv_pages_used: float  # allocated pages / usable pages
  prefix_hit_rate: float  # prompt tokens served from cache / prompt tokens looked up
  num_preemptions: int
  prompt_tokens: int  # computed (not cached) prompt tokens so far
  generation_tokens: int
  num_steps: int
  weight_bytes: int
  kv_cache_bytes: int
  # K and V of one token over every layer, quantization scales included (kv_cache_dtype), and
  # how many pages of the cache fit in a GiB.
  kv_bytes_per_token: int
  kv_pages_per_gib: float
  # The KV groups (jinfer/models/kv_groups.py): each one's sliding window (None: full
  # attention), and the KV bytes a running sequence holds in each, on average.
  kv_group_windows: tuple[int | None, ...] = ()
  kv_bytes_per_seq: tuple[float, ...] = ()
  # Compiles (or loads from the compilation cache) on the serving path after startup: each one
  # stalled every request; the recompile guard logs them with the step's shape.
  compiles_after_startup: int = 0
  buckets_compiled: int = 0  # of buckets_total token buckets (the rest compile in the background)
  buckets_total: int = 0
  expert_load: ExpertLoad | None = None  # MoE models: tokens routed to each expert so far
  spec: SpecStats | None = None  # speculative decoding, when on


class LLMEngine:
  """`model`: a built-in name, an HF directory or a .gguf file. `skip_tokenizer_init` serves
  token-id prompts only (outputs carry token ids and no text), for a model directory without a
  tokenizer. `LLMEngine.from_parts` builds one from a config, params and tokenizer in hand.
  `warmup`: True compiles the steps ahead (see `warmup`; a string is its `rest`), False leaves
  each step to compile when first run."""

  def __init__(self, model: str = DEFAULT_MODEL, *, dtype=None,
               config: EngineConfig | None = None, warmup: bool | str = True,
               skip_tokenizer_init: bool = False):
    config = config or EngineConfig()
    dtype = dtype or default_dtype()
    if config.kernels.compilation_cache:  # before loading: the loaders' conversions compile too
      compilation_cache.enable()
    log.info("loading %s ...", model)
    t0 = time.monotonic()
    model_config, params, tokenizer, config = weight_quantization.load(
        config, model, dtype, load_tokenizer=not skip_tokenizer_init)
    self.model_name = model
    self.load_seconds = time.monotonic() - t0
    log.info("loaded %s in %.1f s", model, self.load_seconds)
    self._build(model_config, params, tokenizer, config, dtype, warmup)
    log.info("%s ready in %.1f s (loading %.1f s, compiling %.1f s)", model,
             time.monotonic() - t0, self.load_seconds, self.warmup_seconds)

  @classmethod
  def from_parts(cls, model_config: ModelConfig, params: dict, tokenizer: Tokenizer | None, *,
                 config: EngineConfig | None = None, dtype=None, warmup: bool | str = True,
                 devices: list | None = None) -> "LLMEngine":
    """An engine over params already loaded (stacked layout, see `jinfer.models`); `devices`:
    the ones its mesh uses (default: the first tensor x context parallel size of them)."""
    self = cls.__new__(cls)
    self.load_seconds, self.model_name = 0.0, None
    self._build(model_config, params, tokenizer, config or EngineConfig(),
                dtype or default_dtype(), warmup, devices)
    return self

  def _build(self, model_config: ModelConfig, params: dict, tokenizer: Tokenizer | None,
             config: EngineConfig, dtype, warmup: bool | str, devices: list | None = None):
    self.model_config, self.tokenizer = model_config, tokenizer
    self.config = config = config.resolve(model_config, dtype)
    if config.kernels.compilation_cache:
      compilation_cache.enable()
    self.max_model_len = config.model.max_model_len
    self.eos_ids = tuple(model_config.eos_token_ids) or (tokenizer.eos_token_ids if tokenizer
                                                         else ())
    par = config.parallel
    self.blocks = BlockManager(config.num_pages, config.cache.page_size,
                               config.cache.enable_prefix_caching,
                               num_ranks=par.context_parallel_size,
                               windows=config.kv_groups.windows)
    # The step carries a structured-output mask over the model's logits: [S, ceil(V / 32)].
    self.buckets = dataclasses.replace(config.buckets(), vocab_size=model_config.vocab_size)
    self.grammars = (GrammarCompiler(tokenizer, model_config.vocab_size, self.eos_ids)
                     if tokenizer is not None else None)
    spec = config.speculative
    self.proposer: Proposer | None = None
    self.spec_stats = None
    # A mesh over several processes' devices (unless it is given this process's own).
    spans_processes = jax.process_count() > 1 and (
        devices is None or len({d.process_index for d in devices}) > 1)
    if spec is not None and spans_processes:
      raise ValueError("speculative decoding does not run on several processes yet")
    lora = config.lora
    if lora.enable_lora and spans_processes:
      raise ParameterError("enable_lora", "LoRA adapters do not run on several processes yet")
    # Its slot writes go to the runner's device slots (made below).
    self.adapters = (AdapterSlots(lora, model_config, lambda slot, a: self.runner.write_adapter(
        slot, self._lora_pad(a))) if lora.enable_lora else None)
    self.scheduler = Scheduler(config.scheduler, self.blocks, config.max_pages_per_seq,
                               lookahead=self._lookahead if spec is not None else None,
                               adapters=self.adapters)
    if spans_processes and (par.data_parallel_size > 1 or
                            par.devices_per_engine != jax.device_count()):
      raise ValueError(f"with several processes the mesh spans every device: "
                       f"tensor_parallel_size x context_parallel_size must be "
                       f"{jax.device_count()}, and data_parallel_size 1")
    mesh = None
    if par.is_parallel or devices is not None:
      check_tensor_parallel(model_config, par.tensor_parallel_size,
                            par.enable_expert_parallel)
      mesh = make_mesh(par, devices)
    # One device gets no mesh in the kernels: attention skips the per-shard wrapper.
    kernels = config.kernel_options(mesh if par.is_parallel else None)
    self.dtype = dtype
    self._int8_transposed = kernels.int8_transposed
    self._kv_head_copies_for = par.tensor_parallel_size if mesh is not None else None
    run_config, run_params = self._run_layout(params, tokenizer)
    if spec is not None:
      self.proposer = create_proposer(spec, Target(
          config=model_config, params=params, run_config=run_config, run_params=run_params,
          kernels=kernels, tokenizer=tokenizer, engine_config=config, buckets=self.buckets,
          dtype=dtype))
      # Positions are depths: a tree's are fewer than its nodes.
      self.spec_stats = SpecStats(self.proposer.max_depth)
    del params  # the proposer took what it shares; the runner keeps the params it runs
    lora_slots = None
    # {module path: (layers, K, N)}: the linear layers an adapter may adapt
    self.lora_targets = targets = target_shapes(param_shapes(run_config),
                                                linear_kernels(run_config))
    if lora.enable_lora:
      self._lora_pad = functools.partial(
          pad_adapter, targets=targets, max_rank=lora.max_lora_rank,
          head_dim=model_config.head_dim,
          kv_repeat=run_config.num_kv_heads // model_config.num_kv_heads)
      lora_slots = empty_slots(targets, lora.max_loras, lora.max_lora_rank, dtype)
    self.runner = ModelRunner(run_config, run_params, config.kv_spec(run_config),
                              self.buckets, kv_groups=config.kv_groups, kernels=kernels,
                              dtype=dtype,
                              unrolled_max_tokens=config.unrolled_max_tokens(),
                              unroll_scan=config.unroll_scan, mesh=mesh,
                              expert_parallel=par.enable_expert_parallel,
                              in_step=self.proposer and self.proposer.in_step,
                              in_step_weights=self.proposer and self.proposer.in_step_weights,
                              lora_slots=lora_slots,
                              logprobs_mode=config.model.logprobs_mode)
    if lora.enable_lora:  # compiles the slot writer now, not when the first adapter comes
      self.runner.write_adapter(0, self._lora_pad(None))
    self.groups: dict[str, _Group] = {}
    self._paused = False  # pause_generation: no step runs
    self._sleep_level = 0  # sleep: 1 weights in host memory, 2 dropped; the KV cache freed
    # Disaggregated serving (jinfer/engine/disaggregated.py): a prefill engine parks each
    # sequence once its prompt is computed and its first token sampled, pages held, in
    # `handoffs` for the coordinator to move to a decode engine (see `adopt`).
    self.hand_off_prefilled = False
    self.handoffs: list[Sequence] = []
    self._seed_rng = np.random.default_rng(config.model.seed)
    self._ids = itertools.count()
    self.num_steps = self.prompt_tokens = self.generation_tokens = 0
    self.expert_tokens = (np.zeros((len(model_config.moe_layer_ids), model_config.num_experts),
                                   np.int64) if model_config.moe_layer_ids else None)
    self.compiler = StepCompiler(
        self.buckets.token_buckets, lambda t: self._compile_bucket(t, verify=False),
        None if spec is None else lambda t: self._compile_bucket(t, plain=False))
    self.guard = CompileGuard()
    # Compiled ahead (warmup): steps keep to the compiled buckets, and the guard counts any
    # compile on the serving path. Without warmup, steps compile lazily on first use (tests).
    self._ahead = warmup
    self.warmup_seconds = (self.warmup(None if warmup is True else warmup) if warmup else 0.0)

  def _run_layout(self, params: dict, tokenizer: Tokenizer | None = None
                  ) -> tuple[ModelConfig, dict]:
    """(the config the runner runs, `params` as it runs them): quantized as the engine's
    `quantization` says, KV heads duplicated for a mesh of more tensor shards than KV heads.
    Quantized before the heads are duplicated: calibration sees the model's own heads, and
    every shard count runs the weights one device runs."""
    m = self.config.model
    run_params = weight_quantization.quantize_weights(
        self.model_config, params, m.quantization,
        weight_quantization.check_config(m.quantization, m.quantization_config),
        int8_transposed=self._int8_transposed, tokenizer=tokenizer)
    if self._kv_head_copies_for is None:
      return self.model_config, run_params
    return duplicate_kv_heads(self.model_config, run_params, self._kv_head_copies_for)

  def save_quantized(self, path: str, source: str | None = None) -> None:
    """Save the quantized weights this engine runs under directory `path`; `LLM(path)` loads
    them back without quantizing (or calibrating) again. `source`: the model they came from,
    whose config and tokenizer the saved weights go with (default: the one this engine loaded).
    """
    if (source or self.model_name) is None:
      raise ParameterError("source", "an engine built from parts needs the model's source")
    if self.runner.config.num_kv_heads != self.model_config.num_kv_heads:
      raise ParameterError("tensor_parallel_size", f"this engine holds each KV head "
                           f"{self.runner.config.num_kv_heads // self.model_config.num_kv_heads}"
                           f" times (tensor_parallel_size > num_kv_heads), not the model's "
                           f"layout: save from an engine with at most "
                           f"{self.model_config.num_kv_heads} tensor-parallel devices")
    m = self.config.model
    weight_quantization.save(path, self.runner.stacked_params, source=source or self.model_name,
                             quantization=m.quantization, quantization_config=m.quantization_config)

  def _compile_bucket(self, t: int, plain: bool = True, verify: bool = True) -> float:
    """Compile token bucket `t`'s steps ahead of time, with the proposer's passes beside them:
    `plain` the plain and prompt-logprobs variants, `verify` the verify variant; returns
    seconds."""
    t0 = time.monotonic()
    for shape in self.buckets.shapes(self.config.model.enable_prompt_logprobs):
      if shape[0] == t and (verify if shape[2] else plain):
        self.runner.compile(shape, self.proposer.empty_drafts(self.buckets.num_seqs(t))
                            if shape[2] else None)
    if self.proposer is not None:
      for v in (False,) * plain + (True,) * verify:
        self.proposer.compile(t, v)
    return time.monotonic() - t0

  def warmup(self, rest: str | None = None) -> float:
    """Compile the startup buckets, and then the rest: "background" (serving meanwhile), "now",
    or "never" (a one-shot run: steps keep to the startup buckets); default by
    `compile_in_background`. Returns seconds. From then on steps run only compiled buckets and
    the recompile guard counts."""
    t0 = time.monotonic()
    c = self.compiler
    shapes = self.buckets.shapes(self.config.model.enable_prompt_logprobs)
    log.info("%d step buckets %s, %d compiled programs%s%s", len(c.buckets), c.buckets,
             len(shapes), f" (steps of at most {self.runner.unrolled_max_tokens} token(s) "
             f"unrolled)" if self.runner.unrolled_max_tokens else "",
             " and the draft model's passes" if hasattr(self.proposer, "_propose") else "")
    rest = rest or ("background" if self.config.kernels.compile_in_background else "now")
    if rest not in ("background", "now", "never"):
      raise ValueError(f"rest: 'background', 'now' or 'never', not {rest!r}")
    if rest == "now":
      c.wait()
      took = time.monotonic() - t0
      log.info("every bucket compiled in %.1f s", took)
    else:
      # Speculation's verify steps compile in the background (it speculates once they are in).
      hits = compilation_cache.cache_hits()
      c.compile(c.startup_buckets, finish=rest == "never")
      took = time.monotonic() - t0
      left, last = len(c.buckets) - len(c.ready), c.ready[-1]
      # The rest compile like the largest startup bucket (scanned): its time estimates theirs,
      # unless it was loaded from the cache (which may or may not hold the rest).
      pace = ("" if compilation_cache.cache_hits() > hits else
              f" (about {left * c.seconds[last]:.0f} s at the {last}-token step's pace)")
      log.info("serving with buckets %s after %.1f s%s", c.ready, took,
               f"; {left} more compile in the background{pace}"
               if rest == "background" and left else "")
      if rest == "background":
        c.start()
    self._ahead = True
    return took

  def wait_until_compiled(self) -> None:
    """Return once every step bucket is compiled (the background compiler's work done)."""
    self.compiler.wait()

  # -- requests -----------------------------------------------------------------------------
  def tokenize(self, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise ValueError("this engine has no tokenizer (skip_tokenizer_init): pass token ids")
      return self.tokenizer.encode(prompt)
    return [int(t) for t in prompt]

  def validate(self, prompt_token_ids: list[int], params: SamplingParams):
    """Raise ParameterError (a ValueError naming the parameter at fault) for anything that
    cannot run; called before anything is queued. Returns the request's structured-output
    constraint compiled (a fresh matcher at the start of the output), or None."""
    matcher = None
    n = len(prompt_token_ids)
    if n == 0:
      raise ParameterError("prompt", "the prompt is empty")
    vocab = self.model_config.vocab_size
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
    if bad:
      raise ParameterError("prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
    if n >= self.max_model_len:
      raise ParameterError("prompt", f"the prompt has {n} tokens; max_model_len is "
                                     f"{self.max_model_len} (prompt + at least one output "
                                     f"token must fit)")
    if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
      raise ParameterError("max_tokens", f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) "
                                         f"exceeds max_model_len ({self.max_model_len})")
    if params.min_tokens and len(self.eos_ids) + len(params.stop_token_ids) > MAX_BANNED:
      raise ParameterError("min_tokens", f"min_tokens supports at most {MAX_BANNED} stop token ids")
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
    if bad:
      raise ParameterError("stop_token_ids",
                           f"stop token id {bad[0]} is outside the vocabulary [0, {vocab})")
    if params.stop and self.tokenizer is None:
      raise ParameterError("stop", "stop strings need a tokenizer; this engine has none "
                                   "(skip_tokenizer_init)")
    if params.structured_outputs is not None:
      if self.grammars is None:
        raise ParameterError("structured_outputs", "structured outputs need a tokenizer; this "
                                                   "engine has none (skip_tokenizer_init)")
      if params.min_tokens:
        # Banning EOS could leave a finished constraint no token at all.
        raise ParameterError("min_tokens", "min_tokens cannot be combined with "
                                           "structured_outputs: the constraint decides where "
                                           "the output ends")
      # Compiled here (and cached): `LLM.generate` validates every request before it queues any.
      matcher = self.grammars.matcher(params.structured_outputs)
    if params.prompt_logprobs is not None and not self.config.model.enable_prompt_logprobs:
      raise ParameterError("prompt_logprobs",
                           "prompt_logprobs needs the engine option enable_prompt_logprobs=True")
    return matcher

  def add_lora(self, lora_request: LoRARequest) -> None:
    """Check and load an adapter into host memory ahead of its requests (vLLM's `add_lora`);
    a request's own `lora_request` does the same."""
    if self.adapters is None:
      raise ParameterError("lora_request", "this engine serves no LoRA adapters: start it with "
                           "enable_lora=True")
    self.adapters.register(lora_request)

  def remove_lora(self, lora_int_id: int) -> bool:
    """Forget an adapter (its slot is freed once no running request uses it); False if
    unknown. Requests already queued with it run to the end."""
    if self.adapters is None or lora_int_id not in self.adapters.known:
      return False
    self.adapters.unregister(lora_int_id)
    return True

  def _lora_salt(self, cache_salt, lora: LoRARequest) -> tuple:
    """The prefix-cache salt of a request with adapter `lora`: its K/V differs from the base
    model's, another adapter's, and the same adapter's before an update."""
    return (cache_salt, "lora", lora.lora_int_id, lora.lora_path,
            self.adapters.versions.get(lora.lora_int_id, 0))

  def update_lora(self, name_or_id: str | int, tensors: dict) -> None:
    """Replace a registered adapter's weights in place, by `lora_name` or `lora_int_id`:
    `tensors` in PEFT's names or jinfer's trainer layout (`peft_adapter.replace_tensors`),
    the same rank and modules as the adapter's files. Every tensor is checked before anything
    is written (an AdapterError names the first bad one; the old weights stay). No compile.
    Its unfinished requests go on under the new weights as if they had started under them:
    running ones are recomputed (their K/V so far came from the old weights), and none of them
    reuses a prefix cached before. Call it between steps."""
    if self.adapters is None:
      raise ParameterError("lora", "this engine serves no LoRA adapters: start it with "
                           "enable_lora=True")
    request = self.adapters.update(name_or_id, tensors)
    for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
      if seq.lora is not None and seq.lora.lora_int_id == request.lora_int_id:
        seq.cache_salt = self._lora_salt(seq.cache_salt[0], seq.lora)
        seq.page_hashes = []
        if seq.status is Status.RUNNING:
          self.scheduler.preempt(seq)

  def list_loras(self) -> list[LoRARequest]:
    return [] if self.adapters is None else list(self.adapters.known.values())

  def add_request(self, request_id: str | None, prompt: str | list[int],
                  params: SamplingParams | None = None, *, arrival_time: float | None = None,
                  cache_salt: str | None = None,
                  lora_request: LoRARequest | None = None) -> str:
    params = params or SamplingParams()
    request_id = str(next(self._ids)) if request_id is None else str(request_id)
    if request_id in self.groups:
      raise ValueError(f"request id {request_id!r} is already in use")
    ids = self.tokenize(prompt)
    matcher = self.validate(ids, params)
    if lora_request is not None:
      self.add_lora(lora_request)
      cache_salt = self._lora_salt(cache_salt, lora_request)
    seed = params.seed if params.seed is not None else int(self._seed_rng.integers(1 << 31))
    metrics = RequestMetrics(arrival_time=time.monotonic() if arrival_time is None else arrival_time)
    seqs: list[Sequence] = []
    for i in range(params.n):
      seq = Sequence(seq_id=request_id if params.n == 1 else f"{i}_{request_id}",
                     group_id=request_id, index=i, prompt_token_ids=list(ids), params=params,
                     seed=(seed + i * 0x9E3779B1) & 0xFFFFFFFF,
                     metrics=metrics if i == 0 else dataclasses.replace(metrics, token_times=[]),
                     cache_salt=cache_salt, lora=lora_request,
                     wait_for=seqs[0] if seqs else None,
                     spec_state=self.proposer and self.proposer.new_state(),
                     matcher=matcher if matcher is None or i == 0 else matcher.deep_copy())
      if self.tokenizer is not None:
        seq.detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
      seqs.append(seq)
    self.groups[request_id] = _Group(request_id, prompt if isinstance(prompt, str) else None, ids,
                                     params, seqs)
    for seq in seqs:
      self.scheduler.add(seq)
    return request_id

  def abort(self, request_id: str) -> bool:
    """Stop a request wherever it is and free everything it holds. False if unknown."""
    group = self.groups.pop(str(request_id), None)
    if group is None:
      return False
    for seq in group.seqs:
      seq.matcher = None
      if not seq.finished:
        seq.finish_reason = "abort"
        self.scheduler.finish(seq)
    return True

  def adopt(self, group: _Group) -> None:
    """Take over a request another engine ran (disaggregated serving). A sequence holding
    pages of this engine's pool with the K/V of its first `num_computed_tokens` tokens runs on
    from there; one holding none (preempted elsewhere) is computed again here, first in line."""
    self.groups[group.request_id] = group
    for seq in group.seqs:
      if seq.finished:
        continue
      # Speculation's state describes drafts of the engine that had the sequence.
      seq.spec_state = self.proposer and self.proposer.new_state()
      seq.draft_lag = 0
      if seq.pages:
        self._cache_pages(seq)
        self.scheduler._admit(seq)
      else:
        seq.num_computed_tokens, seq.status = 0, Status.WAITING
        self.scheduler.waiting.appendleft(seq)

  def has_unfinished_requests(self) -> bool:
    return bool(self.groups)

  def follow(self):
    """On a process other than the leader of several: run the leader's steps until it
    closes."""
    self.runner.follow()

  def close(self):
    """Stop compiling in the background, and release the other processes of a multi-process
    mesh."""
    self.compiler.close()
    self.runner.close()

  def running_request_ids(self) -> set[str]:
    """Requests with a sequence in the running batch (what a failed step would have run)."""
    return {seq.group_id for seq in self.scheduler.running}

  # -- weights, pausing and sleeping ----------------------------------------------------------
  def pause_generation(self) -> None:
    """Run no step until `resume_generation` (`step` returns nothing meanwhile): requests in
    flight keep their place and their tokens, and new ones may be added. While paused (or
    idle) the weights may be updated and the engine put to sleep."""
    self._paused = True

  def resume_generation(self) -> None:
    self._paused = False

  @property
  def is_paused(self) -> bool:
    return self._paused

  @property
  def is_sleeping(self) -> bool:
    return self._sleep_level > 0

  def _quiet(self, what: str) -> None:
    """Refuse `what` while steps may run on requests in flight; let them be recomputed (their
    tokens kept) otherwise: their K/V and every cached prefix were computed on weights about to
    change or go."""
    if self.groups and not self._paused:
      raise EngineStateError(f"{what}: {len(self.groups)} request(s) in flight; call "
                             f"pause_generation() first (they go on after "
                             f"resume_generation()), or let them finish")
    if self.runner._multiprocess:
      raise ParameterError("num_processes", f"{what} does not run on a mesh of several "
                                            f"processes yet")

  def _forget_kv(self) -> None:
    self.scheduler.preempt_all()  # tokens kept, K/V recomputed when they run again
    self.blocks.forget_cached()

  def update_weights(self, params: dict) -> None:
    """Run `params` from the next step on: jinfer's params tree of this model (the stacked
    layout `LLMEngine.from_parts` takes, float), every leaf of the model's shape. A leaf of the
    engine's dtype placed as the engine places it (`weight_shardings`) is used without a copy
    (the engine then shares it: a trainer must not donate or delete it); other leaves are cast
    and put onto the engine's devices. A quantized engine quantizes them as it quantized its
    own (int8, w8a8 without SmoothQuant, int4 RTN: round to nearest, no calibration). Nothing
    compiles again. Idle or paused only (`pause_generation`): requests in flight keep their
    tokens and go on on the new weights, their K/V recomputed, and the prefix cache is dropped.
    A bad tree raises a ParameterError naming the leaf, and the engine keeps its weights."""
    self._quiet("update_weights")
    m = self.config.model
    options = weight_quantization.check_config(m.quantization, m.quantization_config)
    if m.quantization == "gguf" or weight_quantization.calibrated(m.quantization, options):
      what = ("keeps a GGUF file's blocks" if m.quantization == "gguf" else
              f"calibrates on text ({options}), which every update would redo")
      raise ParameterError("quantization", f"update_weights quantizes by rounding to nearest; "
                           f"this engine's quantization={m.quantization!r} {what}")
    params = weight_update.checked(params, param_shapes(self.model_config, self.dtype))
    with self.guard.suspended():
      _, run_params = self._run_layout(params)
      self._forget_kv()
      self.runner.set_params(run_params)

  def load_weights(self, named_arrays) -> None:
    """`update_weights` from every tensor of the model by its HF name (a dict, or (name,
    array) pairs, as vLLM's `load_weights` takes them; numpy or JAX arrays in transformers'
    layouts). A WeightError names a tensor that is missing, misshapen or maps to nothing."""
    self._quiet("load_weights")
    with self.guard.suspended():
      params = weight_update.from_hf(self.model_config, named_arrays, self.dtype)
    self.update_weights(params)

  def weight_shardings(self) -> dict:
    """Where `update_weights` puts each leaf of jinfer's params tree (a float engine without
    duplicated KV heads runs leaves placed so as they are)."""
    return self.runner.param_shardings

  def sleep(self, level: int = 1) -> None:
    """Free device memory, idle or paused: the KV cache, and the weights: moved to host memory
    (`level=1`) or dropped (`level=2`; `update_weights` or `load_weights` then brings new
    ones). Requests in flight are recomputed after `wake_up`, as after an update. Sleeping
    again is a no-op, except that level 2 drops the host copy of a level-1 sleep."""
    if level not in (1, 2):
      raise ParameterError("level", f"sleep level must be 1 (weights to host memory) or 2 "
                                    f"(weights dropped), got {level!r}")
    if level <= self._sleep_level:
      return
    self._quiet("sleep")
    self.compiler.join()  # its compiles read the weights and the cache that sleep lets go
    with self.guard.suspended():
      if not self._sleep_level:
        self._forget_kv()
        self.runner.free_kv_cache()
      self.runner.offload_params(keep=level == 1)
    self._sleep_level = level

  def wake_up(self) -> None:
    """Back from `sleep`: the weights (from host memory, or those an update brought while
    asleep) and an empty KV cache on the devices; nothing compiles. A no-op when awake."""
    if not self._sleep_level:
      return
    if not self.runner.has_params:
      raise EngineStateError("wake_up: the weights were dropped (sleep(level=2)); give new "
                             "ones with update_weights() or load_weights() first")
    with self.guard.suspended():
      if self.runner.stacked_params is None:
        self.runner.restore_params()
      self.runner.allocate_kv_cache()
    self._sleep_level = 0

  # -- the loop -----------------------------------------------------------------------------
  def step(self) -> list[RequestOutput]:
    if self._paused:
      return []
    if self._sleep_level and self.groups:
      raise EngineStateError("the engine is asleep: wake_up() before generating")
    c = self.compiler if self._ahead and not self.compiler.done else None
    # Until every bucket is compiled, a step fits the largest compiled one.
    batch = self.scheduler.schedule(None if c is None else c.largest)
    if not batch.seqs:
      return []
    if self._ahead and not self.guard.armed:
      self.guard.arm()  # on the thread that runs the steps
    compiles = self.guard.count
    try:
      return self._step(batch, c)
    finally:
      if self.guard.count != compiles:
        self._compiled_on_serving_path(self.guard.count - compiles, batch)

  def _compiled_on_serving_path(self, n: int, batch: ScheduledBatch):
    shape = (f"{batch.num_tokens} tokens of {len(batch.seqs)} sequences"
             f"{', verify' if any(batch.num_drafts) else ''}")
    log.warning("%d compile(s) on the serving path after startup, in a step of %s (bucket %d): "
                "%s", n, shape, self.buckets.pick(batch.num_tokens),
                ", ".join(self.guard.names[-n:]))
    if self.config.kernels.strict_compiles:
      raise CompileOnServingPath(f"{n} compile(s) in a step of {shape} after startup "
                                 f"(strict_compiles)")

  def _step(self, batch: ScheduledBatch, c: StepCompiler | None) -> list[RequestOutput]:
    if c is not None and batch.num_tokens >= c.largest:
      c.want(2 * c.largest)  # chunked, or the batch held back, for want of a larger bucket
    t_step = time.monotonic()
    touched: dict[str, _Group] = {}
    resets = self._cache_resets()
    try:
      drafts = None
      if self.proposer is not None:
        t0 = time.monotonic()
        self._fill_drafts(batch)
      inp = self._build_step_input(batch, touched, c)
      if inp is None:
        return self._emit(touched.values())
      if self.proposer is not None:
        # Timed to the drafts' arrival: the target cannot start before them anyway.
        drafts = jax.block_until_ready(self.proposer.propose(batch, inp))
        self.spec_stats.proposer_seconds += time.monotonic() - t0
      res = self.runner.run(inp, drafts)
    except Exception as e:
      return self._fail_batch(batch, e, self._cache_resets() != resets, touched)
    now = time.monotonic()
    self.num_steps += 1
    if res.expert_load is not None:
      self.expert_tokens += res.expert_load
    row = 0
    for i, (seq, n, m) in enumerate(zip(batch.seqs, batch.num_new_tokens, batch.num_drafts)):
      row += n
      group = self.groups.get(seq.group_id)
      if group is None:
        continue
      if res.prompt_logprobs is not None and seq.params.prompt_logprobs is not None:
        self._record_prompt_logprobs(seq, res.prompt_logprobs, row - n, n)
      if seq.num_computed_tokens < len(seq.prompt_token_ids):
        self.prompt_tokens += min(n, len(seq.prompt_token_ids) - seq.num_computed_tokens)
      if seq.num_computed_tokens + n < seq.num_tokens:  # a prefill chunk that is not the last
        seq.num_computed_tokens += n
        self._cache_pages(seq)
        continue
      # Rows whose K/V stays: the sequence's own tokens, then the drafts it keeps (accepted,
      # and not cut off by a stop). The rest roll back.
      a = 0 if res.num_accepted is None else int(res.num_accepted[i])
      if self.proposer is not None:
        self.spec_stats.record(self.proposer.depth(m), a)
        self.proposer.on_verified(seq, m, a,
                                  None if res.proposals is None else res.proposals[i])
        spec = self.config.speculative
        if m and spec.min_accepted_per_step is not None:
          after_verify(seq, spec.num_speculative_tokens, a, spec.min_accepted_per_step)
      kept = 0
      try:
        if res.num_accepted is None:
          self._append_token(seq, res.sample, i, now)
        else:
          for j in range(a + 1):  # the accepted drafts, then the target's token
            self._append_token(seq, res.sample, (i, j), now)
            kept = min(j + 1, a)
            if seq.finish_reason is not None:
              break
      except Exception as e:  # one request's failure must not hurt the others
        seq.finish_reason, seq.stop_reason = "error", repr(e)
      seq.num_computed_tokens += n - m + kept
      self._cache_pages(seq)
      if seq.finish_reason is not None:
        self.scheduler.finish(seq)
      else:
        self.scheduler.rollback(seq)
        if self.hand_off_prefilled:
          self.scheduler.running.remove(seq)
          self.handoffs.append(seq)
      touched[group.request_id] = group
    if self.spec_stats is not None:
      self.spec_stats.step_seconds += time.monotonic() - t_step
    return self._emit(touched.values())

  def _cache_pages(self, seq: Sequence):
    """Offer the sequence's full pages to the prefix cache: only tokens whose K/V both the
    target's and any draft model's caches hold."""
    seq.pages_offered = self.blocks.cache_full_pages(
        seq.pages, seq.token_ids, seq.num_computed_tokens - seq.draft_lag, seq.cache_salt,
        seq.page_hashes, seq.pages_offered)

  def _cache_resets(self) -> int:
    return self.runner.cache_resets + (self.proposer.cache_resets if self.proposer else 0)

  def _lookahead(self, seq: Sequence) -> int:
    """Draft rows `seq` may verify this step: k (or a tree's nodes), fewer near its token limits
    (a step yields up to depth + 1 tokens, and each row takes a slot), none while the running
    batch is too large for speculation to pay or while the sequence's drafts keep failing."""
    spec = self.config.speculative
    if (spec.disable_by_batch_size is not None
        and len(self.scheduler.running) > spec.disable_by_batch_size) or paused(seq):
      return 0
    if self._ahead and not self.compiler.finished:  # the verify steps are still compiling
      return 0
    if seq.matcher is not None and not self.proposer.host_drafts:
      # Each verify row of a constrained sequence is masked for its own draft prefix, which the
      # host computes as it builds the step; a device proposer's drafts would have to be waited
      # for, so with a draft model a constrained sequence decodes one token a step.
      return 0
    p = seq.params
    max_tokens = p.max_tokens if p.max_tokens is not None else self.max_model_len
    room = self.max_model_len - seq.num_tokens - 1
    depth = max(0, min(spec.num_speculative_tokens, max_tokens - len(seq.output_token_ids) - 1,
                       room))
    return min(self.proposer.lookahead(seq, depth), room)

  def _fill_drafts(self, batch: ScheduledBatch):
    """Let the proposer fill the draft rows the scheduler gave; none in a step that carries
    prompt logprobs (that step variant verifies nothing)."""
    if not any(batch.num_drafts):
      return
    if any(s.params.prompt_logprobs is not None
           and s.num_computed_tokens < len(s.prompt_token_ids) for s in batch.seqs):
      for i, m in enumerate(batch.num_drafts):
        batch.num_new_tokens[i] -= m
        batch.num_drafts[i] = 0
      return
    self.proposer.fill(batch)
    if self.buckets.tree is None:
      # A chain is cut at its first draft the constraint refuses: no draft after it could be
      # accepted, and its rows would be verified for nothing.
      for i, seq in enumerate(batch.seqs):
        m = batch.num_drafts[i]
        if m and seq.matcher is not None:
          ok = seq.matcher.validate_tokens(batch.draft_tokens[i][:m])
          if ok < m:
            batch.draft_tokens[i] = batch.draft_tokens[i][:ok]
            batch.num_new_tokens[i] -= m - ok
            batch.num_drafts[i] = ok

  def _emit(self, groups: Iterable[_Group]) -> list[RequestOutput]:
    """The outputs of these requests now; finished ones are forgotten."""
    groups = list(groups)
    outputs = [self._output(g) for g in groups]
    for g, o in zip(groups, outputs):
      if o.finished:
        self.groups.pop(o.request_id, None)
        for seq in g.seqs:
          seq.matcher = None
    return outputs

  def _build_step_input(self, batch: ScheduledBatch, failed: dict[str, _Group],
                        compiler: StepCompiler | None) -> StepInput | None:
    """The step's input, in the smallest (compiled) bucket that holds it. A sequence whose row
    cannot be built fails alone and leaves the batch, as a failed device step fails only the
    requests it ran; None when no sequence is left."""
    pick = None
    if compiler is not None:
      def pick(num_tokens: int) -> int:
        compiler.want(num_tokens)
        return compiler.pick(num_tokens)
    while batch.seqs:
      try:
        return build_step_input(batch, self.buckets, self.config.cache.page_size, self.eos_ids,
                                pick, self.grammars and self.grammars.fill)
      except RowError as e:
        log.error("dropped a sequence from the step", exc_info=e)
        seq = batch.seqs.pop(e.index)
        for column in (batch.num_new_tokens, batch.num_drafts, batch.draft_tokens):
          del column[e.index]
        self._fail(seq, f"its step input could not be built: {e.error!r}", failed)
    return None

  def _fail_batch(self, batch: ScheduledBatch, error: Exception, cache_lost: bool,
                  failed: dict[str, _Group]) -> list[RequestOutput]:
    """A step that raised fails the requests it ran; the others go on. If the KV cache went with
    it, every cached token is gone: the prefix cache forgets them and the running sequences are
    recomputed."""
    log.error("engine step failed (%d sequences)", len(batch.seqs), exc_info=error)
    for seq in batch.seqs:
      self._fail(seq, f"engine step failed: {error!r}", failed)
    if cache_lost:
      self.scheduler.preempt_all()
      self.blocks.forget_cached()
    return self._emit(failed.values())

  def _fail(self, seq: Sequence, reason: str, failed: dict[str, _Group]):
    """End `seq` with an error; its request joins `failed`, to be reported."""
    if seq.finished or seq.group_id not in self.groups:
      return
    seq.finish_reason, seq.stop_reason = "error", reason
    self.scheduler.finish(seq)
    failed[seq.group_id] = self.groups[seq.group_id]

  def _append_token(self, seq: Sequence, out: SampleOutput, row: int | tuple[int, int],
                    now: float):
    """Append the token at `row` of the step's output (a verify step's: (sequence, index))."""
    p = seq.params
    token = int(out.tokens[row])
    seq.output_token_ids.append(token)
    self.generation_tokens += 1
    seq.mark_token_time(now)
    constraint_done = False
    if seq.matcher is not None:
      if not seq.matcher.consume_token(token):  # the mask allowed it: a limit hit, or a bug
        raise RuntimeError(f"structured outputs: token {token} broke the constraint: "
                           f"{seq.matcher.get_error()}")
      # Nothing but EOS may follow: the output is complete (EOS itself included).
      constraint_done = seq.matcher.is_stopped()
    if p.logprobs is not None:
      entry = {token: float(out.logprobs[row])}
      for tid, lp in zip(out.top_ids[row][:p.logprobs], out.top_logprobs[row][:p.logprobs]):
        entry.setdefault(int(tid), float(lp))
      seq.output_logprobs.append(entry)
    n_out = len(seq.output_token_ids)
    if token in p.stop_token_ids and n_out >= p.min_tokens:
      seq.finish_reason, seq.stop_reason = "stop", token
    elif not p.ignore_eos and token in self.eos_ids and n_out >= p.min_tokens:
      seq.finish_reason = "stop"
    else:
      seq.text += seq.detok.add(token) if seq.detok else ""
      if p.stop and n_out >= p.min_tokens and self._check_stop_strings(seq):
        return
      if constraint_done:
        seq.finish_reason = "stop"
    if seq.finish_reason is None:
      max_tokens = p.max_tokens if p.max_tokens is not None else self.max_model_len
      if n_out >= max_tokens or seq.num_tokens >= self.max_model_len:
        seq.finish_reason = "length"
    if seq.detok and (seq.finish_reason == "length" or constraint_done):
      seq.text += seq.detok.flush()

  def _record_prompt_logprobs(self, seq: Sequence, plp, first_row: int, n: int):
    """Rows first_row.. hold positions num_computed..; position p predicts prompt token p+1."""
    k = seq.params.prompt_logprobs
    if not seq.prompt_logprobs:
      seq.prompt_logprobs.append(None)
    start = seq.num_computed_tokens
    for j in range(n):
      target = start + j + 1
      if target >= len(seq.prompt_token_ids) or target < len(seq.prompt_logprobs):
        continue  # past the prompt, or already recorded before a preemption
      r = first_row + j
      entry = {seq.prompt_token_ids[target]: float(plp.target[r])}
      for tid, lp in zip(plp.top_ids[r, :k], plp.top_logprobs[r, :k]):
        entry.setdefault(int(tid), float(lp))
      seq.prompt_logprobs.append(entry)

  def _check_stop_strings(self, seq: Sequence) -> bool:
    longest = max(map(len, seq.params.stop))
    # Only the tail can hold a new match: earlier text was checked on earlier tokens.
    start = max(0, seq.sent_text_len - longest)
    hits = [(seq.text.find(s, start), s) for s in seq.params.stop]
    hits = [(i, s) for i, s in hits if i >= 0]
    if not hits:
      return False
    i, s = min(hits)
    seq.text = seq.text[:i + len(s)] if seq.params.include_stop_str_in_output else seq.text[:i]
    seq.finish_reason, seq.stop_reason = "stop", s
    return True

  def _output(self, group: _Group) -> RequestOutput:
    comps = []
    for seq in group.seqs:
      text = seq.text
      if not seq.finished and seq.params.stop:
        # Hold back what could still become a stop string, so it is never streamed.
        text = text[:max(seq.sent_text_len, len(text) - max(map(len, seq.params.stop)) + 1)]
      logprobs = seq.output_logprobs if seq.params.logprobs is not None else None
      comps.append(CompletionOutput(
          index=seq.index, text=text, token_ids=list(seq.output_token_ids),
          finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, logprobs=logprobs,
          delta_text=text[seq.sent_text_len:],
          delta_token_ids=seq.output_token_ids[seq.sent_tokens:],
          delta_logprobs=logprobs[seq.sent_tokens:] if logprobs is not None else None))
      seq.sent_text_len, seq.sent_tokens = len(text), len(seq.output_token_ids)
    lead = group.seqs[0]
    if group.finished and lead.metrics.finished_time is None:
      lead.metrics.finished_time = time.monotonic()
    return RequestOutput(request_id=group.request_id, prompt=group.prompt,
                         prompt_token_ids=group.prompt_token_ids, outputs=comps,
                         finished=group.finished, metrics=lead.metrics,
                         num_cached_tokens=lead.num_cached_tokens,
                         prompt_logprobs=(lead.prompt_logprobs if group.params.prompt_logprobs
                                          is not None else None),
                         error=next((s.stop_reason for s in group.seqs
                                     if s.finish_reason == "error"), None))

  def run_to_completion(self, request_ids: Iterable[str] | None = None) -> dict[str, RequestOutput]:
    """Step until every request (or the given ones) finished; their final outputs by id."""
    if self._paused and self.groups:
      raise EngineStateError("the engine is paused: resume_generation() before running "
                             "requests to completion")
    wanted = set(request_ids) if request_ids is not None else None
    final: dict[str, RequestOutput] = {}
    while self.has_unfinished_requests():
      for o in self.step():
        if o.finished and (wanted is None or o.request_id in wanted):
          final[o.request_id] = o
      if wanted is not None and wanted <= set(final):
        break
    return final

  # -- numbers ------------------------------------------------------------------------------
  def stats(self) -> EngineStats:
    running = self.scheduler.running
    b, spec, ps = self.blocks, self.runner.spec, self.config.cache.page_size
    groups = self.config.kv_groups
    present = np.zeros((len(running), groups.num_groups))  # pages each sequence holds per group
    used = 0  # computed tokens in those pages
    for i, seq in enumerate(running):
      for g, pages in enumerate(seq.pages):
        absent = pages.count(-1)
        present[i, g] = len(pages) - absent
        used += seq.num_computed_tokens - ps * absent
    held = int(present.sum()) * ps
    page_bytes = spec.bytes_per_token * ps
    return EngineStats(
        num_running=len(running), num_waiting=len(self.scheduler.waiting),
        kv_utilization=used / held if held else 0.0,
        kv_pages_used=1.0 - b.num_free_pages / b.num_usable_pages,
        prefix_hit_rate=b.prefix_hits / b.prefix_queries if b.prefix_queries else 0.0,
        num_preemptions=self.scheduler.num_preemptions, prompt_tokens=self.prompt_tokens,
        generation_tokens=self.generation_tokens, num_steps=self.num_steps,
        weight_bytes=self.runner.weight_bytes, kv_cache_bytes=self.runner.kv_cache_bytes,
        # as if every layer kept the token: a group's slots are its layers
        kv_bytes_per_token=spec.bytes_per_token * self.model_config.num_layers // groups.num_slots,
        kv_pages_per_gib=2**30 / page_bytes, kv_group_windows=groups.windows,
        kv_bytes_per_seq=tuple(float(x) for x in (present.mean(0) if running else
                                                  np.zeros(groups.num_groups)) * page_bytes),
        compiles_after_startup=self.guard.count, buckets_compiled=len(self.compiler.ready),
        buckets_total=len(self.compiler.buckets),
        expert_load=(None if self.expert_tokens is None else
                     ExpertLoad.of(self.model_config.moe_layer_ids, self.expert_tokens)),
        spec=self.spec_stats.copy() if self.spec_stats is not None else None)
