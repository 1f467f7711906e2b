"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`, as vLLM users know it."""
from __future__ import annotations

import atexit
import numbers
from collections.abc import Sequence as Seq
from typing import Any

import numpy as np
from tqdm import tqdm

from jinfer.engine.data_parallel import DataParallelEngine, create_engine
from jinfer.engine.disaggregated import DisaggregatedEngine
from jinfer.engine.engine import LLMEngine
from jinfer.engine.engine_config import EngineConfig
from jinfer.engine.lora_slots import LoRARequest
from jinfer.engine.request import RequestOutput
from jinfer.errors import EngineStateError, ParameterError
from jinfer.parallel import distributed
from jinfer.parallel.distributed import DistributedConfig
from jinfer.sampling.params import SamplingParams
from jinfer.loader import DEFAULT_MODEL
from jinfer.weights.builtin import resolve_speculative_model

# A prompt as vLLM's `generate` takes it: text, token ids, or a dict of either.
Prompt = str | list[int] | dict[str, Any]


class LLM:
  """`model`: a built-in name (default `smollm2-135m-instruct`), an HF directory or a .gguf file.

  Engine options (`max_model_len`, `max_num_seqs`, `page_size`, ...) go by keyword; see
  `EngineConfig`. `skip_tokenizer_init=True` serves token-id prompts from a model without a
  tokenizer (outputs then carry token ids and no text).
  """

  def __init__(self, model: str = DEFAULT_MODEL, *, dtype=None, warmup: bool | str = True,
               skip_tokenizer_init: bool = False, coordinator_address: str | None = None,
               num_processes: int = 1, process_id: int = 0, **engine_options: Any):
    # Several processes (one per host) run one mesh: every process makes the same `LLM`;
    # process 0 returns to generate, the others run its steps until it closes, then return.
    # With kv_transfer_config's "jax_transfer", process 0 prefills and the others decode.
    if engine_options.get("speculative_config") is not None:
      engine_options["speculative_config"] = resolve_speculative_model(
          engine_options["speculative_config"])
    dist = DistributedConfig(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id)
    distributed.initialize(dist)
    self.is_leader = dist.is_leader
    config = EngineConfig.of(**engine_options)
    self.engine = create_engine(model, dtype=dtype, config=config,
                                warmup=warmup if self.is_leader or config.runs_own_steps
                                else False, skip_tokenizer_init=skip_tokenizer_init)
    self.tokenizer = self.engine.tokenizer
    if not self.is_leader:
      self.engine.follow()
    elif num_processes > 1:
      atexit.register(self.close)

  def close(self):
    """Release the other processes (several processes only; idempotent)."""
    self.engine.close()

  def save_quantized(self, path: str) -> None:
    """Save the quantized weights this LLM runs; `LLM(path)` loads them without quantizing or
    calibrating again (see `LLMEngine.save_quantized`)."""
    self.engine.save_quantized(path)

  # -- weights, pausing and sleeping (see LLMEngine and docs/online-learning.md) ------------
  def _engine(self, what: str) -> LLMEngine | DataParallelEngine:
    if isinstance(self.engine, DisaggregatedEngine):
      raise ParameterError("kv_transfer_config", f"{what} does not run on prefill and decode "
                                                 f"engines (kv_transfer_config) yet")
    return self.engine

  def update_weights(self, params: dict) -> None:
    """Run new weights, jinfer's params tree (`LLMEngine.update_weights`)."""
    self._engine("update_weights").update_weights(params)

  def load_weights(self, named_arrays) -> None:
    """Run new weights given by HF tensor names (`LLMEngine.load_weights`)."""
    self._engine("load_weights").load_weights(named_arrays)

  def pause_generation(self) -> None:
    self._engine("pause_generation").pause_generation()

  def resume_generation(self) -> None:
    self._engine("resume_generation").resume_generation()

  def sleep(self, level: int = 1) -> None:
    """Free the KV cache and move the weights to host memory (1) or drop them (2)."""
    self._engine("sleep").sleep(level)

  def wake_up(self) -> None:
    self._engine("wake_up").wake_up()

  def update_lora(self, name_or_id: str | int, tensors: dict) -> None:
    """Replace a registered adapter's weights in place, by name or id (see
    `LLMEngine.update_lora`): PEFT tensor names or jinfer's trainer layout, checked whole
    before anything is written; no compile; its prefix-cache entries are not reused."""
    self._engine("update_lora").update_lora(name_or_id, tensors)

  def generate(self, prompts: Prompt | Seq[Prompt],
               sampling_params: SamplingParams | Seq[SamplingParams] | None = None, *,
               use_tqdm: bool = True,
               lora_request: LoRARequest | Seq[LoRARequest | None] | None = None
               ) -> list[RequestOutput]:
    """Outputs in prompt order. A prompt is text, a list of token ids, or (as in vLLM) a dict
    `{"prompt": text}` or `{"prompt_token_ids": ids}`; one prompt or a list of them, mixed.
    `lora_request`: the LoRA adapter for every prompt, or one per prompt (None: the base
    model), with `enable_lora=True`. Every prompt and adapter is validated before any is
    queued."""
    if not self.is_leader:
      raise RuntimeError("only process 0 generates; this process ran its steps until it closed")
    if isinstance(prompts, np.ndarray):
      prompts = prompts.tolist()
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, Seq) and prompts and _is_token_id(prompts[0])):
      prompts = [prompts]
    if not isinstance(prompts, Seq):
      raise ParameterError("prompts", f"expected a prompt or a list of prompts, got "
                                      f"{type(prompts).__name__}")
    prompts = [_prompt(p, i) for i, p in enumerate(prompts)]
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
      params = [sampling_params or SamplingParams()] * len(prompts)
    else:
      params = list(sampling_params)
      if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    if lora_request is None or isinstance(lora_request, LoRARequest):
      loras = [lora_request] * len(prompts)
    else:
      loras = list(lora_request)
      if len(loras) != len(prompts):
        raise ParameterError("lora_request", f"{len(loras)} lora requests for {len(prompts)} "
                                             f"prompts")
    eng = self.engine
    if eng.is_sleeping or eng.is_paused:
      raise EngineStateError("generate: the engine is " + (
          "asleep: wake_up() first" if eng.is_sleeping else "paused: resume_generation() first"))
    ids = [eng.tokenize(p) for p in prompts]
    for i, (tok, sp) in enumerate(zip(ids, params)):
      try:
        eng.validate(tok, sp)
      except ValueError as e:
        raise ValueError(f"prompt {i}: {e}") from None
    for lora in {lora for lora in loras if lora is not None}:
      eng.add_lora(lora)
    rids = [eng.add_request(None, p, sp, lora_request=lora)
            for p, sp, lora in zip(prompts, params, loras)]
    final: dict[str, RequestOutput] = {}
    with tqdm(total=len(rids), disable=not use_tqdm, desc="generate") as bar:
      while len(final) < len(rids):
        for o in eng.step():
          if o.finished:
            final[o.request_id] = o
            bar.update(1)
    return [final[r] for r in rids]

  def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
           sampling_params: SamplingParams | None = None, *, use_tqdm: bool = True,
           chat_template: str | None = None,
           lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
           **template_kwargs: Any) -> list[RequestOutput]:
    """One conversation (a list of messages) or several; the chat template (the model's, or
    `chat_template`) ends each with the assistant's turn. `lora_request` as in `generate`."""
    convs = [messages] if messages and isinstance(messages[0], dict) else messages
    prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                                  chat_template=chat_template, **template_kwargs)
               for c in convs]
    return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)


def _is_token_id(x) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _prompt(p, i: int) -> str | list[int]:
  """Prompt `i` as text or token ids; a ParameterError naming what is wrong with it."""
  if isinstance(p, dict):
    keys = set(p) & {"prompt", "prompt_token_ids"}
    other = sorted(set(p) - keys, key=str)
    if len(keys) != 1 or other:
      raise ParameterError("prompts", f"prompt {i}: a dict prompt has exactly one of the keys "
                                      f"'prompt' (text) and 'prompt_token_ids' (a list of ints); "
                                      f"got keys {sorted(p, key=str)}")
    key = keys.pop()
    p = p[key]
    if key == "prompt" and not isinstance(p, str):
      raise ParameterError("prompts", f"prompt {i}: 'prompt' must be text, got "
                                      f"{type(p).__name__}")
    if key == "prompt_token_ids" and isinstance(p, str):
      raise ParameterError("prompts", f"prompt {i}: 'prompt_token_ids' must be a list of ints, "
                                      f"got text (use 'prompt' for text)")
  if isinstance(p, str):
    return p
  if isinstance(p, np.ndarray):
    p = p.tolist()
  if isinstance(p, Seq) and all(_is_token_id(t) for t in p):
    return [int(t) for t in p]
  if isinstance(p, Seq):
    bad = next(t for t in p if not _is_token_id(t))
    raise ParameterError("prompts", f"prompt {i}: token ids must be ints, got {bad!r}")
  raise ParameterError("prompts", f"prompt {i}: expected text, a list of token ids or a dict "
                                  f"with 'prompt' or 'prompt_token_ids', got {type(p).__name__}")
