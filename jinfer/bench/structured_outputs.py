"""What structured outputs cost: grammar compile time (cold and cached) and, at batch 1, 16 and
64, the decode step with every row under a JSON schema against the same step unconstrained.
Prints one JSON object.

Per batch size B, B requests of `--context` random prompt tokens are prefilled, then up to
`--steps` decode steps are timed while all B decode (medians): the whole engine step, the part
of it spent filling the rows' token masks on the host (llguidance, before the step; the engine
does not overlap it with the device step), and on its own the jitted sampler over [B, V] logits
with and without a mask (the mask's device cost), at temperature 1 and greedy. The schema asks
for an array of at least 40 objects, so no row can end inside the timed steps; unconstrained
rows ignore EOS.

    python -m jinfer.bench.structured_outputs [--batches 1,16,64] [--steps 16]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.bench.machine import machine_info
from jinfer.bench.report import emit
from jinfer.engine.engine import LLMEngine
from jinfer.engine.engine_config import EngineConfig
from jinfer.loader import DEFAULT_MODEL
from jinfer.sampling.grammar import GrammarCompiler, mask_words
from jinfer.sampling.params import SamplingParams, StructuredOutputsParams
from jinfer.sampling.sample import SamplingTensors, sample

# A typical API schema: nested objects, enums, bounded numbers and arrays.
SCHEMA = {
    "type": "object",
    "properties": {
        "people": {"type": "array", "minItems": 40, "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "role": {"enum": ["admin", "user", "guest"]},
                "address": {"type": "object", "properties": {
                    "city": {"type": "string"}, "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                    "required": ["city", "zip"], "additionalProperties": False},
                "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 5},
            },
            "required": ["name", "age", "role"], "additionalProperties": False}},
    },
    "required": ["people"],
}


def _median_ms(xs: list[float]) -> float | None:
  return round(1000 * statistics.median(xs), 3) if xs else None


def compile_times(engine: LLMEngine, repeats: int) -> dict:
  """Seconds to build llguidance's tokenizer, then the schema's first compile (cold) and a
  cached one; a fresh compiler each repeat (medians)."""
  tok, cold, cached = [], [], []
  for _ in range(repeats):
    c = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, engine.eos_ids)
    t0 = time.perf_counter()
    c.ll_tokenizer
    t1 = time.perf_counter()
    c.matcher(StructuredOutputsParams(json=SCHEMA))
    t2 = time.perf_counter()
    c.matcher(StructuredOutputsParams(json=SCHEMA))
    t3 = time.perf_counter()
    tok.append(t1 - t0), cold.append(t2 - t1), cached.append(t3 - t2)
  return {"tokenizer_ms": _median_ms(tok), "cold_ms": _median_ms(cold),
          "cached_ms": _median_ms(cached)}


def _max_tokens(b: int, steps: int) -> int:
  """Enough that no request ends before the last one's prompt is in and `steps` more ran: the
  first ones admitted decode while the others prefill, in what their decode rows leave of the
  token budget (at least one prompt a step)."""
  return steps + b + 16


def decode_steps(engine: LLMEngine, b: int, context: int, steps: int, constrained: bool) -> dict:
  rng = np.random.default_rng(b)
  so = StructuredOutputsParams(json=SCHEMA) if constrained else None
  params = SamplingParams(temperature=1.0, seed=0, ignore_eos=not so, structured_outputs=so,
                          max_tokens=_max_tokens(b, steps))
  rids = [engine.add_request(None, rng.integers(100, 40000, context).tolist(), params)
          for _ in range(b)]
  fill = engine.grammars.fill
  fill_s = [0.0]

  def timed_fill(*args):
    t0 = time.perf_counter()
    fill(*args)
    fill_s[0] += time.perf_counter() - t0

  engine.grammars.fill = timed_fill
  step_times, fill_times = [], []
  try:
    while len(step_times) < steps:
      decoding = all(s.num_computed_tokens >= len(s.prompt_token_ids)
                     for s in engine.scheduler.running) and len(engine.scheduler.running) == b
      fill_s[0] = 0.0
      t0 = time.perf_counter()
      outs = engine.step()
      dt = time.perf_counter() - t0
      if any(o.finished for o in outs):
        break
      if decoding:
        step_times.append(dt)
        fill_times.append(fill_s[0])
  finally:
    engine.grammars.fill = fill
    for r in rids:
      engine.abort(r)
  return {"step_ms": _median_ms(step_times), "mask_fill_ms": _median_ms(fill_times),
          "steps": len(step_times)}


def sampler_ms(b: int, vocab: int, repeats: int, temperature: float = 1.0) -> dict:
  """The jitted sampler over [B, V] logits: no row masked, and every row masked (half the
  tokens allowed), medians."""
  rng = np.random.default_rng(0)
  s = lambda x: jnp.full((b,), x)
  st = SamplingTensors(
      temperature=s(temperature), top_k=s(1 << 30), top_p=s(1.0), min_p=s(0.0),
      repetition_penalty=s(1.0), presence_penalty=s(0.0), frequency_penalty=s(0.0),
      seeds=jnp.zeros(b, jnp.uint32), gen_idx=jnp.zeros(b, jnp.int32),
      history=jnp.full((b, 1), -1, jnp.int32), prompt_lens=jnp.zeros(b, jnp.int32),
      banned=jnp.full((b, 1), -1, jnp.int32), num_logprobs=jnp.zeros(b, jnp.int32),
      allowed=jnp.full((b, mask_words(vocab)), -1, jnp.int32))
  logits = jnp.asarray(rng.standard_normal((b, vocab)), jnp.float32)
  run = jax.jit(sample)
  masked = st.replace(allowed=jnp.asarray(
      rng.integers(-2**31, 2**31, (b, mask_words(vocab))), jnp.int32))
  out = {}
  for name, tensors in (("unmasked_ms", st), ("masked_ms", masked)):
    jax.block_until_ready(run(logits, tensors))
    times = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(run(logits, tensors))
      times.append(time.perf_counter() - t0)
    out[name] = _median_ms(times)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default=DEFAULT_MODEL)
  ap.add_argument("--batches", default="1,16,64")
  ap.add_argument("--context", type=int, default=16)
  ap.add_argument("--steps", type=int, default=16)
  ap.add_argument("--out")
  args = ap.parse_args(argv)
  batches = [int(b) for b in args.batches.split(",")]
  budget, max_len = max(64, max(batches)), args.context + _max_tokens(max(batches), args.steps)
  engine = LLMEngine(args.model, warmup=False, config=EngineConfig.of(
      max_model_len=max_len, max_num_seqs=max(batches), max_num_batched_tokens=budget,
      # Pages for every sequence at full length: no preemption in the timed steps.
      page_size=16, num_pages=max(batches) * -(-max_len // 16) + 1))
  report = {"machine": machine_info(), "model": args.model, "context": args.context,
            "schema": json.dumps(SCHEMA), "compile": compile_times(engine, 5), "batches": {}}
  for b in batches:
    decode_steps(engine, b, args.context, 3, constrained=True)  # compiles the step's shapes
    row = {"unconstrained": decode_steps(engine, b, args.context, args.steps, False),
           "json_schema": decode_steps(engine, b, args.context, args.steps, True),
           "sampler": sampler_ms(b, engine.model_config.vocab_size, 20),
           "greedy_sampler": sampler_ms(b, engine.model_config.vocab_size, 20, 0.0)}
    if row["unconstrained"]["step_ms"] and row["json_schema"]["step_ms"]:
      row["step_overhead"] = round(row["json_schema"]["step_ms"]
                                   / row["unconstrained"]["step_ms"] - 1, 3)
    report["batches"][b] = row
    print(json.dumps({b: row}), file=sys.stderr)  # as it comes: the whole run takes minutes
  emit(report, args.out)


if __name__ == "__main__":
  main()
