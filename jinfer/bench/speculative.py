"""Speculative decoding on SmolLM2-135M-Instruct: output tokens/s with speculation off, with n-gram
prompt lookup, with the distilled draft and with Medusa heads (a chain of each head's best
guess, and the default candidate tree), at batch 1, 8 and 64, on two workloads:

  chat    held-out chat prompts (`jinfer.training.chat_data.eval_prompts`, subjects the draft
          never saw), through the chat template, greedy, up to --max-tokens each (natural
          text: answers end at EOS);
  random  vLLM's random-token workload (`jinfer bench`'s: prompts of consecutive token ids from
          a random offset, 32-512 tokens), greedy, exactly --max-tokens each (EOS ignored).

Batch b submits b requests at once and runs them to completion (batch 1: --single-requests
requests one after another). The engines share the target's weights and are all warmed up
first; every repetition runs every (batch, workload) on each engine back to back, so a load
change on a shared machine hits all alike, and medians over --repeats are reported. Acceptance
and mean tokens per step are set against E = (1 - alpha^(k+1)) / (1 - alpha); for Medusa the
acceptance per position is each head's (how often its depth was accepted once reached), and a
tree's E is also estimated from the heads' held-back hit rates (`expected_tokens_per_step_tree`).

    python -m jinfer.bench.speculative --out bench_spec.json
    python -m jinfer.bench.speculative --methods off medusa_chain medusa_tree --batches 1 8 \
        --workloads chat --out bench_medusa.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from jinfer.bench.machine import machine_info
from jinfer.bench.offline import RandomWorkload
from jinfer.bench.report import emit
from jinfer.engine.engine import LLMEngine
from jinfer.engine.engine_config import EngineConfig
from jinfer.engine.speculative.medusa_heads import heads_meta
from jinfer.loader import DEFAULT_MODEL, load_model
from jinfer.sampling.params import SamplingParams
from jinfer.sampling.tree import chain_choices, expected_length
from jinfer.training.chat_data import eval_prompts
from jinfer.weights.builtin import checkpoint_path

# The trained artifacts installed with the package.
DRAFT = checkpoint_path("smollm2-135m-draft")
MEDUSA = checkpoint_path("smollm2-135m-medusa")


def workload(name: str, batch: int, engine: LLMEngine, max_tokens: int, seed: int):
  """(prompts, sampling params) of one run."""
  if name == "chat":
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True)
               for p in eval_prompts()[seed * batch:(seed + 1) * batch]]
    return prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens)
  w = RandomWorkload(num_prompts=batch, output_len=max_tokens, seed=seed)
  return w.prompts(engine.model_config.vocab_size), w.sampling_params()[0]


def run(engine: LLMEngine, prompts, params, one_at_a_time: bool) -> dict:
  """Output tokens/s of the prompts, and what speculation did meanwhile."""
  before = engine.stats()
  t0 = time.monotonic()
  out_tokens = 0
  for group in ([[p] for p in prompts] if one_at_a_time else [prompts]):
    rids = [engine.add_request(None, p, params) for p in group]
    final = engine.run_to_completion(rids)
    out_tokens += sum(len(final[r].outputs[0].token_ids) for r in rids)
  wall = time.monotonic() - t0
  after = engine.stats()
  r = {"output_tokens": out_tokens, "wall_s": wall, "output_tokens_per_s": out_tokens / wall,
       "steps": after.num_steps - before.num_steps}
  if after.spec is not None:
    r["spec"] = after.spec.since(before.spec).summary()
  return r


def main():
  ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}",
                              description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default=DEFAULT_MODEL)
  ap.add_argument("--draft", default=DRAFT)
  ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
  ap.add_argument("--medusa", default=MEDUSA, help="Medusa heads checkpoint")
  ap.add_argument("--medusa-heads", type=int, default=4, help="heads used (the tree's depth)")
  ap.add_argument("--medusa-choices", default=None,
                  help="the tree as JSON paths (default: the best tree for the heads)")
  ap.add_argument("--ngram", default="2,4", help="prompt_lookup_min,max")
  ap.add_argument("--disable-by-batch-size", type=int, default=None,
                  help="speculate only in steps of at most this many sequences")
  ap.add_argument("--min-accepted-per-step", type=float, default=None,
                  help="pause a sequence's speculation while its drafts keep failing")
  ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
  ap.add_argument("--workloads", nargs="+", default=["chat", "random"])
  ap.add_argument("--methods", nargs="+", default=["off", "ngram", "draft"],
                  help="off ngram draft medusa_chain medusa_tree")
  ap.add_argument("--quantization", default=None, choices=("int8", "w8a8"),
                  help="the target's weights (every engine alike)")
  ap.add_argument("--max-tokens", type=int, default=128)
  ap.add_argument("--single-requests", type=int, default=3)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--out", default=None)
  args = ap.parse_args()

  config, params, tokenizer = load_model(args.model)
  lo, hi = (int(x) for x in args.ngram.split(","))
  specs = {"off": None,
           "ngram": {"method": "ngram", "num_speculative_tokens": args.k,
                     "prompt_lookup_min": lo, "prompt_lookup_max": hi},
           "draft": {"method": "draft_model", "num_speculative_tokens": args.k,
                     "model": args.draft},
           "medusa_chain": {"method": "medusa", "num_speculative_tokens": args.medusa_heads,
                            "model": args.medusa,
                            "medusa_choices": chain_choices(args.medusa_heads)},
           "medusa_tree": {"method": "medusa", "num_speculative_tokens": args.medusa_heads,
                           "model": args.medusa}}
  if args.medusa_choices:
    specs["medusa_tree"]["medusa_choices"] = json.loads(args.medusa_choices)
  for spec in specs.values():
    if spec is not None and args.disable_by_batch_size is not None:
      spec["disable_by_batch_size"] = args.disable_by_batch_size
    if spec is not None and args.min_accepted_per_step is not None:
      spec["min_accepted_per_step"] = args.min_accepted_per_step
  # 40 pages a sequence, and at least one whole max_model_len sequence (64 pages)
  base = EngineConfig.of(max_model_len=1024, max_num_seqs=max(args.batches),
                      max_num_batched_tokens=512, num_pages=1 + max(max(args.batches) * 40, 64),
                      quantization=args.quantization)
  engines = {}
  for m in args.methods:
    t0 = time.monotonic()
    engines[m] = LLMEngine.from_parts(config, params, tokenizer, warmup="now",
                                      config=base.replace(speculative_config=specs[m]))
    print(f"{m}: warm in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)

  report = {"machine": machine_info(), "model": args.model,
            "engine": {k: getattr(base, k) for k in ("max_model_len", "max_num_seqs",
                                                     "max_num_batched_tokens", "num_pages",
                                                     "quantization")},
            "speculative_configs": {m: engines[m].config.speculative.to_dict()
                                    if specs[m] else None for m in args.methods},
            "max_tokens": args.max_tokens, "repeats": args.repeats, "runs": []}
  results: dict[tuple, list[dict]] = {}
  for rep in range(args.repeats):
    for b in args.batches:
      for w in args.workloads:
        n = args.single_requests if b == 1 else b
        for m in args.methods:
          prompts, sp = workload(w, n, engines[m], args.max_tokens, seed=rep)
          r = run(engines[m], prompts, sp, one_at_a_time=b == 1)
          r.update(repeat=rep, batch=b, workload=w, method=m,
                   load_avg_1m=round(os.getloadavg()[0], 2))
          report["runs"].append(r)
          results.setdefault((b, w, m), []).append(r)
          print(json.dumps({k: r[k] for k in ("repeat", "batch", "workload", "method",
                                              "output_tokens_per_s", "load_avg_1m")}),
                file=sys.stderr, flush=True)

  summary = []
  for (b, w, m), rs in results.items():
    off = results.get((b, w, "off"))
    s = {"batch": b, "workload": w, "method": m,
         "output_tokens_per_s": float(np.median([r["output_tokens_per_s"] for r in rs]))}
    if off is not None:  # per-repeat ratios (neighbours in time), then their median
      s["speedup_vs_off"] = float(np.median([r["output_tokens_per_s"] / o["output_tokens_per_s"]
                                             for r, o in zip(rs, off)]))
    if "spec" in rs[0]:
      keys = ("acceptance_rate", "alpha", "mean_tokens_per_verify", "tokens_per_full_step",
              "expected_tokens_per_full_step", "proposer_time_share")
      s.update({k: float(np.median([r["spec"][k] for r in rs])) for k in keys})
      s["acceptance_per_position"] = np.median(
          [r["spec"]["acceptance_per_position"] for r in rs], axis=0).tolist()
    tree = engines[m].config.speculative.tree() if specs[m] else None
    hits = heads_meta(args.medusa).get("rank_hits") if tree else None
    if hits:  # a tree's E from the heads' held-back hit rates, beside the one measured
      s["expected_tokens_per_step_tree"] = expected_length(tree.choices, hits)
    summary.append(s)
  report["summary"] = summary
  emit(report, args.out)


if __name__ == "__main__":
  main()
