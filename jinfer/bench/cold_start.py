"""Cold start: a fresh process running `LLM()` (load, warmup), one chat answer ("What is the
capital of France?", 32 greedy tokens: `answer_s` counts from the process start) and a small
mixed workload, timed end to end; A/B against an earlier git revision in the same run. Prints
JSON. `--speculative-config JSON` builds the `LLM` with it (in every case).

Workload: 8 requests, random-token prompts of 10-400 tokens (numpy seed 0), 16 new tokens each,
greedy, EOS ignored, all submitted at once. Each case runs in its own Python process and its
time counts from the process start (imports included):
  * `baseline`: the tree at `--baseline-rev` (checked out into a temporary git worktree);
  * `cold`: this tree with an empty compilation cache;
  * `warm`: this tree again on the cache the cold run filled; it must compile nothing on the
    serving path (its background may finish buckets the cold run did not reach).
The three must produce the same tokens.

    python -m jinfer.bench.cold_start --baseline-rev e98eba4 --out cold_start.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from jinfer.bench.machine import machine_info
from jinfer.bench.report import emit

_CHILD = r"""
import json, sys, time
t0 = float(sys.argv[1])
import jax
import numpy as np
counts = {"compiles": 0, "cache_hits": 0}
def on_duration(event, duration, **_):
  if event == "/jax/core/compile/backend_compile_duration":
    counts["compiles"] += 1
def on_event(event, **_):
  if event == "/jax/compilation_cache/cache_hits":
    counts["cache_hits"] += 1
jax.monitoring.register_event_duration_secs_listener(on_duration)
jax.monitoring.register_event_listener(on_event)
from jinfer import LLM, SamplingParams
t_import = time.time() - t0
llm = LLM(warmup=True, **json.loads(sys.argv[2]))
t_ready = time.time() - t0
answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                  SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0]
t_answer = time.time() - t0
rng = np.random.default_rng(0)
prompts = [rng.integers(100, 40000, int(n)).tolist() for n in rng.integers(10, 401, 8)]
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                    use_tqdm=False)
t_done = time.time() - t0
print(json.dumps({"import_s": t_import, "ready_s": t_ready, "answer_s": t_answer,
                  "answer": answer.outputs[0].text, "workload_s": t_done - t_answer,
                  "total_s": t_done, "compiles": counts["compiles"] - counts["cache_hits"],
                  "serving_path_compiles": llm.engine.stats().compiles_after_startup,
                  "cache_hits": counts["cache_hits"],
                  "tokens": [answer.outputs[0].token_ids] + [o.outputs[0].token_ids
                                                             for o in outs]}))
"""


def _run(tree: str, cache_dir: str, options: dict) -> dict:
  env = dict(os.environ, PYTHONPATH=tree, JINFER_COMPILATION_CACHE_DIR=cache_dir,
             JAX_COMPILATION_CACHE_DIR="")
  t0 = time.time()
  proc = subprocess.run([sys.executable, "-c", _CHILD, repr(t0), json.dumps(options)], cwd=tree,
                        env=env, capture_output=True, text=True)
  if proc.returncode != 0:
    raise RuntimeError(f"the run in {tree} failed:\n{proc.stderr[-3000:]}")
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  out["wall_s"] = time.time() - t0
  out["load_avg_1m"] = round(os.getloadavg()[0], 2)
  return out


def main(argv: list[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}",
                              description=__doc__.split("\n\n")[0])
  ap.add_argument("--baseline-rev", default=None, help="git revision to compare against")
  ap.add_argument("--speculative-config", default=None, type=json.loads,
                  help="JSON, passed to LLM() in every case")
  ap.add_argument("--out", default=None, help="also write the JSON here")
  args = ap.parse_args(argv)
  options = {} if args.speculative_config is None else {
      "speculative_config": args.speculative_config}
  # The source tree this module lives in: the cases run it (and a worktree of its history).
  here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  report: dict = {"machine": machine_info(), "cases": {}}
  with tempfile.TemporaryDirectory() as tmp:
    if args.baseline_rev:
      base = os.path.join(tmp, "baseline")
      subprocess.run(["git", "-C", here, "worktree", "add", "--detach", base, args.baseline_rev],
                     check=True, capture_output=True)
      try:
        report["cases"]["baseline"] = _run(base, os.path.join(tmp, "cache-baseline"), options)
      finally:
        subprocess.run(["git", "-C", here, "worktree", "remove", "--force", base],
                       capture_output=True)
    cache = os.path.join(tmp, "cache")
    report["cases"]["cold"] = _run(here, cache, options)
    report["cases"]["warm"] = _run(here, cache, options)
  cases = report["cases"]
  tokens = [c.pop("tokens") for c in cases.values()]
  report["same_tokens"] = all(t == tokens[0] for t in tokens)
  if "baseline" in cases:
    report["speedup_cold"] = cases["baseline"]["wall_s"] / cases["cold"]["wall_s"]
    report["speedup_warm"] = cases["baseline"]["wall_s"] / cases["warm"]["wall_s"]
  # The background may still compile buckets a shorter earlier run did not reach (its exit
  # finishes the bucket under way, not the rest): what must be zero is the serving path's.
  for name, case in cases.items():
    assert case["serving_path_compiles"] == 0, f"the {name} run compiled on the serving path"
  assert report["same_tokens"], "the cases produced different tokens"
  emit(report, args.out)
  return report


if __name__ == "__main__":
  main()
