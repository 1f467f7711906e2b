"""Online learning in one process: the engine generates, a programmatic reward scores, an optax
step trains a LoRA through the model's own forward, `update_lora` pushes it, repeat.

Each round, every prompt is sampled k times (one request with `n=k`: the k samples share the
prompt's prefill), at a temperature with no top-k/top-p, with the engine's
`logprobs_mode="processed_logprobs"`: each token's logprob under the distribution it was drawn
from. The reward of each sample is normalized within its prompt's group (GRPO's advantage,
(r - mean) / (std + eps); no value model) and the LoRA takes a step on GRPO's clipped surrogate,
min(ratio A, clip(ratio, 1 - eps, 1 + eps) A) per completion token, averaged per sequence, with
ratio = exp(logp_now - logp_rollout) and no KL term. The rollout logprobs are the denominator:
the trainer recomputes them, teacher-forced, with `CausalLM` itself (the dense `reference`
attention, the adapter merged into the kernels, as `lora_train.py` trains) and, because the
engine is batch-invariant, the two differ only by float32 rounding, the same function summed in
two orders (`max_logprob_gap` reports it every round: ~1e-6 on a tiny model, up to 5e-5 over
SmolLM2's sampled tokens): the first inner step is on-policy.

    python examples/online_learning.py  # SmolLM2, a length target (docs/online-learning.md)
"""
from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jinfer.config import ModelConfig
from jinfer.engine.engine import LLMEngine
from jinfer.engine.engine_config import EngineConfig
from jinfer.engine.lora_slots import LoRARequest
from jinfer.errors import ParameterError
from jinfer.models import CausalLM
from jinfer.models.kernel_options import KernelOptions
from jinfer.sampling.params import SamplingParams
from jinfer.training.distill import _forward
from jinfer.training.lora_train import init_lora, lora_sites, merge
from jinfer.weights.peft_adapter import save_peft_adapter

# (prompt token ids, completion token ids, completion text) -> reward
Reward = Callable[[list[int], list[int], str], float]


def length_reward(target: int, max_tokens: int) -> Reward:
  """1 for a completion of exactly `target` tokens (its end-of-turn token included), falling
  linearly to 0 at `max_tokens` away; a completion cut by max_tokens counts as max_tokens."""
  return lambda prompt, tokens, text: 1.0 - min(abs(len(tokens) - target), max_tokens) / max_tokens


@dataclasses.dataclass(frozen=True, kw_only=True)
class OnlineConfig:
  samples_per_prompt: int = 4  # k: the group whose rewards normalize each other
  max_tokens: int = 32  # per completion
  temperature: float = 1.0  # the rollout's, and the trainer's logprobs'
  rank: int = 8
  alpha: float = 16.0
  targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
  learning_rate: float = 1e-3
  inner_steps: int = 1  # optimizer steps per round on the same rollouts
  # Sequences per forward/backward pass; their gradients add up to the round's batch (the
  # trainer's activations, and its [B, L, V] logits, grow with it).
  micro_batch: int = 8
  clip_eps: float = 0.2
  page_size: int = 16  # the trainer's scratch cache
  seed: int = 0

  def __post_init__(self):
    if self.samples_per_prompt < 2:
      raise ParameterError("samples_per_prompt", "samples_per_prompt must be >= 2: the advantage "
                           "compares a group's samples")
    if self.temperature <= 0:
      raise ParameterError("temperature", "temperature must be > 0: greedy rollouts give a group "
                           "nothing to compare")
    if self.micro_batch < 1:
      raise ParameterError("micro_batch", f"micro_batch must be >= 1, got {self.micro_batch}")


def group_advantages(rewards: np.ndarray, eps: float = 1e-6) -> np.ndarray:
  """rewards [P, k] -> (r - group mean) / (group std + eps) [P, k]; a group of equal rewards
  teaches nothing (0)."""
  mean = rewards.mean(axis=1, keepdims=True)
  return (rewards - mean) / (rewards.std(axis=1, keepdims=True) + eps)


@dataclasses.dataclass
class Rollouts:
  """One round's samples, prompt-major: sample j of prompt i is row i * k + j."""
  prompts: list[list[int]]
  completions: list[list[int]]
  texts: list[str]
  logprobs: list[list[float]]  # the engine's, per completion token
  prefill_tokens: int  # prompt tokens the engine computed for them (the rest came from cache)


def split_params(params: dict) -> tuple[dict, jax.Array, jax.Array]:
  """(the params but the embedding, the embedding [V, E], the LM head [V, E]: the tied
  embedding, or the model's own head) in float32, as the trainer's forward takes them."""
  embedding = jnp.asarray(params["embedding"], jnp.float32)
  head = (embedding if "lm_head" not in params
          else jnp.asarray(params["lm_head"]["kernel"], jnp.float32).T)
  return {k: v for k, v in params.items() if k != "embedding"}, embedding, head


def sequence_logits(model: CausalLM, page_size: int, lora, scaling: float, base: dict,
                    embedding: jax.Array, head: jax.Array, tokens: jax.Array) -> jax.Array:
  """The logits at every position of tokens [B, L], teacher-forced through `model` with the
  adapter merged into the kernels: [B, L, V]."""
  hidden = _forward(model, page_size, merge(base, lora, scaling), embedding, tokens)  # [B, L, E]
  return hidden @ head.T


def token_logprobs(model: CausalLM, page_size: int, temperature: float, lora, scaling: float,
                   base: dict, embedding: jax.Array, head: jax.Array,
                   tokens: jax.Array) -> jax.Array:
  """log p(tokens[:, p + 1] | tokens[:, :p + 1]) at `temperature`: [B, L - 1] for tokens
  [B, L]."""
  logits = sequence_logits(model, page_size, lora, scaling, base, embedding, head, tokens)
  logp = jax.nn.log_softmax(logits[:, :-1] / temperature, axis=-1)
  return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def _surrogate(logp_fn, clip_eps: float, lora, frozen, tokens, mask, old, adv):
  """GRPO's clipped surrogate (negated, to minimize) and the largest |logp - old| on a trained
  token. tokens [B, L]; mask, old [B, L - 1]; adv [B]."""
  logp = logp_fn(lora, frozen, tokens)
  ratio = jnp.exp(logp - old)
  a = adv[:, None]
  surr = jnp.minimum(ratio * a, jnp.clip(ratio, 1 - clip_eps, 1 + clip_eps) * a)
  per_seq = jnp.sum(surr * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
  gap = jnp.max(jnp.where(mask > 0, jnp.abs(logp - old), 0.0))
  return -jnp.sum(per_seq), gap  # summed: micro-batches add up, the step divides by B


class PolicyTrainer:
  """Adam over a LoRA's factors (`lora_train`'s layout: a [L, K, r], b [L, r, N] unscaled); the
  base params stay frozen. a starts as PEFT initializes it, b at zero: round 0 is the base."""

  def __init__(self, config: ModelConfig, params: dict, cfg: OnlineConfig):
    self.cfg, self.config = cfg, config
    model = CausalLM(config, KernelOptions(attention="reference"), dtype=jnp.float32)
    self.scaling = cfg.alpha / cfg.rank
    # Arguments of the jitted functions, not constants in them: XLA would fold the head's
    # transpose (and more) at compile time.
    self.frozen = split_params(params)  # (base, embedding, head)
    self.lora = init_lora(params, lora_sites(config, cfg.targets), cfg.rank, cfg.seed)
    self.optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(cfg.learning_rate))
    self.opt_state = self.optimizer.init(self.lora)
    logp = lambda lora, frozen, tokens: token_logprobs(model, cfg.page_size, cfg.temperature,
                                                       lora, self.scaling, *frozen, tokens)
    loss = functools.partial(_surrogate, logp, cfg.clip_eps)

    def apply(lora, opt_state, grads, scale):
      grads = jax.tree.map(lambda g: g * scale, grads)
      updates, opt_state = self.optimizer.update(grads, opt_state, lora)
      return optax.apply_updates(lora, updates), opt_state

    self._grads = jax.jit(jax.value_and_grad(loss, has_aux=True))
    self._apply = jax.jit(apply, donate_argnums=(0, 1))

  def batch(self, r: Rollouts, length: int):
    """(tokens [B, length], mask [B, length - 1], old logprobs [B, length - 1]): position p
    predicts token p + 1; the completion's tokens are trained."""
    b = len(r.completions)
    tokens = np.zeros((b, length), np.int32)
    mask = np.zeros((b, length - 1), np.float32)
    old = np.zeros((b, length - 1), np.float32)
    k = len(r.completions) // len(r.prompts)
    for i, (comp, lps) in enumerate(zip(r.completions, r.logprobs)):
      prompt = r.prompts[i // k]
      seq = prompt + comp
      tokens[i, :len(seq)] = seq
      lo = len(prompt) - 1
      mask[i, lo:lo + len(comp)] = 1.0
      old[i, lo:lo + len(comp)] = lps
    return tokens, mask, old

  def step(self, r: Rollouts, advantages: np.ndarray, length: int) -> tuple[float, float]:
    """cfg.inner_steps optimizer steps over the whole batch, micro-batch by micro-batch; (the
    last step's loss, the first step's largest logprob gap between trainer and rollout). The
    batch size must be a multiple of cfg.micro_batch (one compiled shape)."""
    tokens, mask, old = self.batch(r, length)
    adv = advantages.reshape(-1).astype(np.float32)
    b, m = len(adv), self.micro_size(len(adv))
    gaps = []
    for _ in range(self.cfg.inner_steps):
      total, grads, gap = 0.0, None, 0.0
      for i in range(0, b, m):
        part = slice(i, i + m)
        (value, g), gr = self._grads(self.lora, self.frozen, tokens[part], mask[part],
                                     old[part], adv[part])
        total += float(value)
        gap = max(gap, float(g))
        grads = gr if grads is None else jax.tree.map(jnp.add, grads, gr)
      self.lora, self.opt_state = self._apply(self.lora, self.opt_state, grads,
                                              np.float32(1.0 / b))
      gaps.append(gap)
    return total / b, gaps[0]

  def micro_size(self, b: int) -> int:
    """Sequences per pass for a batch of b; ParameterError unless they divide it."""
    m = min(self.cfg.micro_batch, b)
    if b % m:
      raise ParameterError("micro_batch", f"{b} sequences a round is not a multiple of "
                           f"micro_batch={m}")
    return m

  def host_lora(self) -> dict:
    return jax.device_get(self.lora)


@dataclasses.dataclass
class RoundStats:
  round: int
  reward_mean: float
  reward_min: float
  reward_max: float
  mean_tokens: float
  loss: float
  max_logprob_gap: float  # |trainer - rollout| logprob on the first inner step, over all tokens
  prefill_tokens: int
  rollout_seconds: float
  train_seconds: float
  update_seconds: float


class OnlineLoop:
  """An engine serving one trainable adapter (`name`), and its trainer, over the same base
  params. `engine_options` add to (or override) the loop's own engine options."""

  def __init__(self, config: ModelConfig, params: dict, tokenizer, cfg: OnlineConfig,
               reward: Reward, *, name: str = "policy", work_dir: str | None = None,
               **engine_options):
    self.cfg, self.reward = cfg, reward
    self.trainer = PolicyTrainer(config, params, cfg)
    # Round 0's adapter (b = 0: the base model) is registered from files, as any adapter is;
    # from then on update_lora replaces its weights in place.
    self._dir = work_dir or tempfile.mkdtemp(prefix="jinfer-online-")
    path = os.path.join(self._dir, name)
    save_peft_adapter(path, config, self.trainer.host_lora(), rank=cfg.rank, alpha=cfg.alpha)
    self.lora = LoRARequest(name, 1, path)
    options = dict(enable_lora=True, max_loras=1, max_lora_rank=cfg.rank,
                   logprobs_mode="processed_logprobs", **engine_options)
    self.engine = LLMEngine.from_parts(config, params, tokenizer, warmup=False,
                                       config=EngineConfig.of(**options))
    self.engine.add_lora(self.lora)
    self.history: list[RoundStats] = []
    self.last: Rollouts | None = None  # the latest round's samples

  def rollout(self, prompts: list[list[int]], seed: int) -> Rollouts:
    cfg, eng = self.cfg, self.engine
    prefill = eng.prompt_tokens
    ids = [eng.add_request(None, p, SamplingParams(
        n=cfg.samples_per_prompt, temperature=cfg.temperature, max_tokens=cfg.max_tokens,
        logprobs=0, seed=seed + i), lora_request=self.lora) for i, p in enumerate(prompts)]
    final = eng.run_to_completion(ids)
    comps, texts, lps = [], [], []
    for rid in ids:
      for out in sorted(final[rid].outputs, key=lambda o: o.index):
        comps.append(list(out.token_ids))
        texts.append(out.text)
        lps.append([entry[t] for t, entry in zip(out.token_ids, out.logprobs)])
    return Rollouts([list(p) for p in prompts], comps, texts, lps, eng.prompt_tokens - prefill)

  def run_round(self, prompts: list[list[int]]) -> RoundStats:
    cfg = self.cfg
    self.trainer.micro_size(len(prompts) * cfg.samples_per_prompt)  # before anything is queued
    n = len(self.history)
    t0 = time.monotonic()
    r = self.last = self.rollout(prompts, seed=cfg.seed + 1000 * n)
    t1 = time.monotonic()
    k = cfg.samples_per_prompt
    rewards = np.asarray([self.reward(r.prompts[i // k], c, t)
                          for i, (c, t) in enumerate(zip(r.completions, r.texts))],
                         np.float32).reshape(len(prompts), k)
    # One length for every round (a multiple of the trainer's page size): one compile.
    longest = max(len(p) for p in prompts) + cfg.max_tokens
    length = -(-longest // cfg.page_size) * cfg.page_size
    loss, gap = self.trainer.step(r, group_advantages(rewards), length)
    t2 = time.monotonic()
    self.engine.update_lora(self.lora.lora_name, self.trainer.host_lora())
    t3 = time.monotonic()
    stats = RoundStats(round=n, reward_mean=float(rewards.mean()),
                       reward_min=float(rewards.min()), reward_max=float(rewards.max()),
                       mean_tokens=float(np.mean([len(c) for c in r.completions])), loss=loss,
                       max_logprob_gap=gap, prefill_tokens=r.prefill_tokens,
                       rollout_seconds=t1 - t0, train_seconds=t2 - t1, update_seconds=t3 - t2)
    self.history.append(stats)
    return stats
