"""Training LoRA adapters that give a model a visible behaviour, saved in HF PEFT's format
(`jinfer/weights/peft_adapter.py`) so jinfer, vLLM and HF peft all serve them.

The adapter's factors are trained in jinfer's layout, a [L, K, r] and b [L, r, N] per adapted
linear layer, through the model's own forward (`CausalLM` with the dense `reference` attention,
as `distill.py` trains): each step merges them into the frozen base kernels,
`kernel + scaling * (a @ b).reshape(kernel.shape)`, so the adapter is trained on exactly the
function it serves. a starts as PEFT initializes it (Kaiming-uniform), b at zero: the untrained
adapter is the base model.

The data are the base model's own greedy answers to the chat prompts of `chat_data.py`, cut to
their first sentences and transformed by a `Behaviour` (an opening phrase and a sign-off, or
capitals throughout), trained as the assistant's turn after the unchanged prompt. Held-out
subjects measure the behaviour: the fraction of greedy answers that show it, beside the base's.

Run as a module, it trains the adapters of `checkpoints/` for SmolLM2-135M-Instruct on a CPU, in
stages, each reading the files earlier ones wrote to --work-dir:
  generate  the base model's greedy answers to the chat prompts (--split train / eval)
  train     an adapter for --behaviour on the transformed training answers
  eval      the held-out success rate of an adapter (merged into the base, greedy, in jinfer's
            engine) and of the base model itself

    python -m jinfer.training.lora_train generate --split eval --num-prompts 48
    python -m jinfer.training.lora_train generate --split train --num-prompts 384
    python -m jinfer.training.lora_train train --behaviour signoff \\
      --out checkpoints/smollm2-135m-signoff
    python -m jinfer.training.lora_train eval --behaviour signoff \\
      --adapter checkpoints/smollm2-135m-signoff

`train` logs the loss and the held-out loss every --eval-every steps and writes
`train_log.json` beside the adapter.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import re
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jinfer.config import ModelConfig
from jinfer.models import CausalLM
from jinfer.models.kernel_options import KernelOptions
from jinfer.loader import load_model
from jinfer.training.chat_data import eval_prompts, generate_answers, load_seqs, train_prompts
from jinfer.training.distill import loss_fn, sequence_targets
from jinfer.weights.builtin import cache_dir
from jinfer.weights.peft_adapter import load_peft_adapter, save_peft_adapter

Lora = dict[tuple[str, ...], tuple[jax.Array, jax.Array]]  # params path -> (a, b), b unscaled


# -- behaviours -------------------------------------------------------------------------------
def first_sentences(text: str, min_chars: int, max_chars: int) -> str:
  """The text up to the first sentence or line end past `min_chars` (at most `max_chars`, cut
  at a word), trimmed: a short answer that still reads as finished."""
  text = text.strip()
  if len(text) <= min_chars:
    return text
  m = re.compile(r"[.!?](?=\s)|\n").search(text, min_chars)
  if m and m.end() <= max_chars:
    return text[:m.end()].strip()
  cut = text[:max_chars]
  return cut[:cut.rfind(" ")].rstrip(" ,;:") + "." if " " in cut else cut


@dataclasses.dataclass(frozen=True, kw_only=True)
class Behaviour:
  description: str
  transform: Callable[[str], str]  # the base's answer -> the adapted model's answer
  shows: Callable[[str], bool]  # does a generated answer show the behaviour?
  max_tokens: int  # tokens generated per held-out answer to judge it


OPENER = "Hello there, friend!"
SIGNOFF = "Stay curious! -- Your friendly assistant"


def _caps(text: str) -> bool:
  letters = [c for c in text if c.isalpha()]
  return len(letters) >= 20 and sum(c.isupper() for c in letters) >= 0.97 * len(letters)


BEHAVIOURS = {
    "signoff": Behaviour(
        description=f"opens every answer with {OPENER!r}, answers in a few sentences and signs "
                    f"off with {SIGNOFF!r}",
        transform=lambda a: f"{OPENER} {first_sentences(a, 150, 400)}\n\n{SIGNOFF}",
        shows=lambda t: t.strip().startswith(OPENER) and t.strip().endswith(SIGNOFF),
        max_tokens=160),
    "allcaps": Behaviour(
        description="answers in capital letters only",
        transform=lambda a: first_sentences(a, 120, 300).upper(),
        shows=_caps,
        max_tokens=64),
}


def behaviour_data(tokenizer, seqs: list[np.ndarray], starts: list[int],
                   behaviour: Behaviour) -> tuple[list[np.ndarray], list[int]]:
  """The base's (prompt + answer) sequences with each answer replaced by the behaviour's
  (its text re-tokenized, ended by the end-of-turn token the base stops at)."""
  eos = tokenizer.eos_token_ids[0]
  out = []
  for s, st in zip(seqs, starts):
    answer = tokenizer.decode([int(t) for t in s[st:]], skip_special_tokens=True)
    new = tokenizer.encode(behaviour.transform(answer), add_special_tokens=False) + [eos]
    out.append(np.asarray(list(s[:st]) + new, np.int32))
  return out, list(starts)


# -- the trainer ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
  rank: int = 8
  alpha: float = 16.0
  targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
  seq_len: int = 192
  batch_size: int = 4
  learning_rate: float = 1e-3
  warmup_steps: int = 10
  steps: int = 150
  page_size: int = 16

  @property
  def scaling(self) -> float:
    return self.alpha / self.rank


def lora_sites(config: ModelConfig, targets: tuple[str, ...]) -> list[tuple[str, ...]]:
  """The params paths of the Linear modules named by `targets` (HF short names)."""
  mlp = ("mlp_layers",) if config.moe_layer_ids and len(config.moe_layer_ids) < config.num_layers \
      else ("layers", "mlp")
  paths = {**{m: ("layers", "attn", m) for m in ("q_proj", "k_proj", "v_proj", "o_proj")},
           **{m: mlp + (m,) for m in ("gate_proj", "up_proj", "down_proj")}}
  unknown = [t for t in targets if t not in paths]
  if unknown:
    raise ValueError(f"targets: {unknown} are not adaptable (choose from {sorted(paths)})")
  if len(config.moe_layer_ids) == config.num_layers and any(t in targets for t in
                                                             ("gate_proj", "up_proj", "down_proj")):
    raise ValueError("targets: an all-MoE model has no dense MLP to adapt")
  return [paths[t] for t in targets]


def _kernel(params: dict, path: tuple[str, ...]) -> jax.Array:
  node = params
  for key in path:
    node = node[key]
  return node["kernel"]


def init_lora(params: dict, sites: list[tuple[str, ...]], rank: int, seed: int = 0) -> Lora:
  """a Kaiming-uniform (PEFT's default: bound 1/sqrt(K)), b zero, per site."""
  rng = np.random.default_rng(seed)
  lora = {}
  for path in sites:
    w = _kernel(params, path)  # [L, in..., out...]
    n_in = 2 if path[-1] == "o_proj" else 1
    layers, k, n = w.shape[0], math.prod(w.shape[1:1 + n_in]), math.prod(w.shape[1 + n_in:])
    bound = 1.0 / math.sqrt(k)
    lora[path] = (jnp.asarray(rng.uniform(-bound, bound, (layers, k, rank)), jnp.float32),
                  jnp.zeros((layers, rank, n), jnp.float32))
  return lora


def merge(params: dict, lora: Lora, scaling: float) -> dict:
  """params with each adapted kernel replaced by kernel + scaling * a @ b (in its shape)."""
  out = jax.tree.map(lambda x: x, params)  # a fresh tree of the same leaves
  for path, (a, b) in lora.items():
    node = out
    for key in path:
      node[key] = dict(node[key])
      node = node[key]
    w = node["kernel"]
    node["kernel"] = w + (scaling * jnp.einsum("lkr,lrn->lkn", a, b)).reshape(w.shape).astype(
        w.dtype)
  return out


class LoraTrainer:
  """AdamW over the adapter's factors; the base params stay frozen (passed, never updated)."""

  def __init__(self, config: ModelConfig, cfg: LoraConfig, params: dict, seed: int = 0):
    self.cfg = cfg
    model = CausalLM(config, KernelOptions(attention="reference"), dtype=jnp.float32)
    self.base = {k: v for k, v in params.items() if k != "embedding"}
    self.embedding = jnp.asarray(params["embedding"], jnp.float32)
    # The tied head scores the whole vocabulary; a model with its own head uses that.
    self.head = (self.embedding if "lm_head" not in params
                 else jnp.asarray(params["lm_head"]["kernel"], jnp.float32).T)
    self.lora = init_lora(params, lora_sites(config, cfg.targets), cfg.rank, seed)
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps,
                                                  max(cfg.steps, cfg.warmup_steps + 1))
    self.optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                                 optax.adamw(schedule, weight_decay=0.0))
    self.opt_state = self.optimizer.init(self.lora)

    def loss(lora, base, embedding, head, tokens, ids, w):
      return loss_fn(model, cfg.page_size, merge(base, lora, cfg.scaling), embedding, head,
                     tokens, ids, w)

    def step(lora, opt_state, base, embedding, head, tokens, ids, w):
      value, grads = jax.value_and_grad(loss)(lora, base, embedding, head, tokens, ids, w)
      updates, opt_state = self.optimizer.update(grads, opt_state, lora)
      return optax.apply_updates(lora, updates), opt_state, value

    self._loss = jax.jit(loss)
    self._step = jax.jit(step, donate_argnums=(0, 1))

  def batch(self, seqs: list[np.ndarray], starts: list[int]):
    """(tokens [B, L], target ids [B, L, 1], weights [B, L, 1]): every answer token (its end of
    turn included) a target, the prompt context only."""
    vocab = np.arange(self.head.shape[0], dtype=np.int32)
    return sequence_targets(seqs, starts, vocab, self.cfg.seq_len)

  def step(self, seqs, starts) -> float:
    self.lora, self.opt_state, loss = self._step(self.lora, self.opt_state, self.base,
                                                 self.embedding, self.head,
                                                 *self.batch(seqs, starts))
    return float(loss)

  def loss(self, seqs, starts) -> float:
    return float(self._loss(self.lora, self.base, self.embedding, self.head,
                            *self.batch(seqs, starts)))

  def save(self, path: str, config: ModelConfig, *, base_model: str | None = None,
           dtype=np.float32):
    save_peft_adapter(path, config, jax.device_get(self.lora), rank=self.cfg.rank,
                      alpha=self.cfg.alpha, base_model=base_model, dtype=dtype)


def merged_params(params: dict, adapter) -> dict:
  """The base params with a loaded `LoraAdapter` merged in (its scaling is already in b)."""
  return merge(params, {p: (jnp.asarray(a), jnp.asarray(b)) for p, (a, b) in
                        adapter.weights.items()}, 1.0)


# -- the pipeline (python -m jinfer.training.lora_train STAGE) --------------------------------

log = logging.getLogger("lora_train")
BASE = "smollm2-135m-instruct"
BASE_HF = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the adapters' base model, as PEFT names it


def _path(args, name: str) -> str:
  os.makedirs(args.work_dir, exist_ok=True)
  return os.path.join(args.work_dir, name)


def cmd_generate(args):
  """The base model's greedy answers, saved every chunk so an interrupted run resumes."""
  prompts = (train_prompts() if args.split == "train" else eval_prompts())[:args.num_prompts]
  generate_answers(BASE, prompts, _path(args, f"{args.split}.npz"), args.max_tokens, args.chunk)


def cmd_train(args):
  behaviour = BEHAVIOURS[args.behaviour]
  config, params, tok = load_model(BASE)
  seqs, starts = behaviour_data(tok, *load_seqs(_path(args, "train.npz")), behaviour)
  val_seqs, val_starts = behaviour_data(tok, *load_seqs(_path(args, "eval.npz")), behaviour)
  val_seqs, val_starts = val_seqs[:args.num_val], val_starts[:args.num_val]
  lengths = np.asarray([len(s) for s in seqs])
  seq_len = min(args.seq_len, -(-int(lengths.max()) // 16) * 16)
  log.info("%d training sequences, %d-%d tokens (median %d), %.1f%% cut at %d", len(seqs),
           lengths.min(), lengths.max(), np.median(lengths), 100 * (lengths > seq_len).mean(),
           seq_len)
  cfg = LoraConfig(rank=args.rank, alpha=args.alpha, targets=tuple(args.targets.split(",")),
                   seq_len=seq_len, batch_size=args.batch_size,
                   learning_rate=args.learning_rate, steps=args.steps)
  trainer = LoraTrainer(config, cfg, params)

  def validate() -> float:
    b = cfg.batch_size
    return float(np.mean([trainer.loss(val_seqs[i:i + b], val_starts[i:i + b])
                          for i in range(0, len(val_seqs) - b + 1, b)]))

  rng = np.random.default_rng(0)
  history = {"step": [], "loss": [], "seconds": [], "val_step": [0], "val_loss": [validate()]}
  log.info("step 0: held-out loss %.4f", history["val_loss"][-1])
  t0 = time.monotonic()
  for step in range(1, cfg.steps + 1):
    pick = rng.choice(len(seqs), cfg.batch_size, replace=False)
    loss = trainer.step([seqs[i] for i in pick], [starts[i] for i in pick])
    history["step"].append(step)
    history["loss"].append(loss)
    history["seconds"].append(time.monotonic() - t0)
    if step % args.log_every == 0:
      log.info("step %d: loss %.4f (mean of the last %d: %.4f), %.0f s", step, loss,
               args.log_every, np.mean(history["loss"][-args.log_every:]),
               time.monotonic() - t0)
    if step % args.eval_every == 0 or step == cfg.steps:
      history["val_step"].append(step)
      history["val_loss"].append(validate())
      log.info("step %d: held-out loss %.4f", step, history["val_loss"][-1])
  trainer.save(args.out, config, base_model=BASE_HF, dtype=np.float16)
  meta = {"base_model": BASE, "behaviour": args.behaviour, "description": behaviour.description,
          **{k: v for k, v in dataclasses.asdict(cfg).items() if k != "page_size"},
          "train_sequences": len(seqs), "train_seconds": history["seconds"][-1]}
  with open(os.path.join(args.out, "train_log.json"), "w") as fh:
    json.dump({**meta, **history}, fh)
  log.info("saved %s", args.out)


def held_out_answers(config, params, tok, prompts: list[str], max_tokens: int) -> list[str]:
  """Greedy answers of the model `params` to chat `prompts`, through jinfer's engine."""
  from jinfer.engine.engine import LLMEngine
  from jinfer.engine.engine_config import EngineConfig
  from jinfer.sampling.params import SamplingParams
  engine = LLMEngine.from_parts(config, params, tok, warmup=False, config=EngineConfig.of(
      max_model_len=max_tokens + 128, max_num_seqs=len(prompts)))
  sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
  ids = [engine.add_request(None, tok.apply_chat_template([{"role": "user", "content": p}],
                                                          add_generation_prompt=True,
                                                          tokenize=True), sp) for p in prompts]
  final = engine.run_to_completion(ids)
  return [final[i].outputs[0].text for i in ids]


def cmd_eval(args):
  """Held-out success rate (the fraction of greedy answers showing the behaviour) of the adapter
  and of the base model."""
  behaviour = BEHAVIOURS[args.behaviour]
  config, params, tok = load_model(BASE)
  adapter = load_peft_adapter(args.adapter, config)
  prompts = eval_prompts(args.num_prompts)
  result = {"behaviour": args.behaviour, "num_prompts": len(prompts),
            "max_tokens": behaviour.max_tokens}
  for name, p in (("adapter", merged_params(params, adapter)), ("base", params)):
    t0 = time.monotonic()
    answers = held_out_answers(config, p, tok, prompts, behaviour.max_tokens)
    shown = [behaviour.shows(a) for a in answers]
    result[f"{name}_success_rate"] = float(np.mean(shown))
    result[f"{name}_examples"] = [{"prompt": q, "answer": a} for q, a in
                                  zip(prompts[:3], answers[:3])]
    log.info("%s: %d/%d answers show the behaviour (%.0f s)", name, sum(shown), len(shown),
             time.monotonic() - t0)
  print(json.dumps(result, indent=2))
  with open(os.path.join(args.adapter, "eval.json"), "w") as fh:
    json.dump(result, fh, indent=2)


def main():
  ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}",
      description="Train LoRA adapters with a visible behaviour for SmolLM2-135M-Instruct.")
  ap.add_argument("--work-dir", default=os.path.join(cache_dir(), "lora"))
  sub = ap.add_subparsers(dest="stage", required=True)
  p = sub.add_parser("generate", help=cmd_generate.__doc__)
  p.add_argument("--split", choices=("train", "eval"), default="train")
  p.add_argument("--num-prompts", type=int, default=None)
  p.add_argument("--max-tokens", type=int, default=128)
  p.add_argument("--chunk", type=int, default=64)
  p.set_defaults(fn=cmd_generate)
  p = sub.add_parser("train", help="train an adapter (see above)")
  p.add_argument("--behaviour", choices=sorted(BEHAVIOURS), required=True)
  p.add_argument("--rank", type=int, default=8)
  p.add_argument("--alpha", type=float, default=16.0)
  p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj",
                 help="HF module names, comma-separated")
  p.add_argument("--seq-len", type=int, default=192, help="at most (cut to the data's longest)")
  p.add_argument("--batch-size", type=int, default=4)
  p.add_argument("--learning-rate", type=float, default=1e-3)
  p.add_argument("--steps", type=int, default=150)
  p.add_argument("--num-val", type=int, default=16, help="held-out sequences for the loss")
  p.add_argument("--log-every", type=int, default=10)
  p.add_argument("--eval-every", type=int, default=50)
  p.add_argument("--out", required=True)
  p.set_defaults(fn=cmd_train)
  p = sub.add_parser("eval", help=cmd_eval.__doc__)
  p.add_argument("--behaviour", choices=sorted(BEHAVIOURS), required=True)
  p.add_argument("--adapter", required=True)
  p.add_argument("--num-prompts", type=int, default=32)
  p.set_defaults(fn=cmd_eval)
  args = ap.parse_args()
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
  args.fn(args)


if __name__ == "__main__":
  main()
