"""Sleep and wake (`LLM.sleep`, `LLM.wake_up`): the device bytes each level frees, the seconds
sleeping and waking take (level 2 wakes on new weights: `update_weights` from a host copy,
then `wake_up`), against the baseline of building the engine afresh (load and compile), which
is what a process that let its engine go would pay. Device bytes are the sum over
`jax.live_arrays()` in device memory, and the device's own `memory_stats()` where it has them
(not on the CPU). After every wake the same greedy and seeded requests must give the tokens they
gave before, with nothing compiled. Prints JSON, medians over `--repeats`.

    python -m jinfer.bench.sleep_wake --model smollm2-135m-instruct --repeats 3
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from jinfer import LLM, SamplingParams
from jinfer.bench.machine import machine_info
from jinfer.bench.report import emit


def device_bytes() -> int:
  return sum(a.nbytes for a in jax.live_arrays() if a.sharding.memory_kind == "device")


def stats_in_use() -> int | None:
  stats = jax.local_devices()[0].memory_stats()
  return None if stats is None else stats.get("bytes_in_use")


class Compiles:
  def __init__(self):
    self.count = 0
    jax.monitoring.register_event_duration_secs_listener(self._on)

  def _on(self, event: str, duration: float, **_):
    if event == "/jax/core/compile/backend_compile_duration":
      self.count += 1


def main(argv: list[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default="smollm2-135m-instruct")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--max-model-len", type=int, default=512)
  ap.add_argument("--max-num-batched-tokens", type=int, default=32)
  ap.add_argument("--out")
  args = ap.parse_args(argv)
  machine = machine_info()
  t0 = time.perf_counter()
  llm = LLM(args.model, max_model_len=args.max_model_len, max_num_seqs=8,
            max_num_batched_tokens=args.max_num_batched_tokens, warmup="never")
  build_s = time.perf_counter() - t0
  rng = np.random.default_rng(0)
  prompts = [rng.integers(100, 40000, int(n)).tolist() for n in rng.integers(8, 64, 4)]
  params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
            SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=16, ignore_eos=True)]
  run = lambda: [o.outputs[0].token_ids for sp in params
                 for o in llm.generate(prompts, sp, use_tqdm=False)]
  want = run()
  engine = llm.engine
  host = jax.device_get(engine.runner.stacked_params)  # level 2's new weights
  compiles = Compiles()
  levels = {}
  for level in (1, 2):
    rows = []
    for _ in range(args.repeats):
      bytes_before, in_use_before = device_bytes(), stats_in_use()
      t = time.perf_counter()
      llm.sleep(level)
      sleep_s = time.perf_counter() - t
      freed, in_use_asleep = bytes_before - device_bytes(), stats_in_use()
      t = time.perf_counter()
      if level == 2:
        llm.update_weights(host)
      llm.wake_up()
      wake_s = time.perf_counter() - t
      rows.append(dict(freed_bytes=freed, sleep_s=sleep_s, wake_s=wake_s,
                       stats_freed_bytes=None if in_use_before is None
                       else in_use_before - in_use_asleep,
                       identical=run() == want))
    levels[f"level_{level}"] = {
        "freed_bytes": statistics.median(r["freed_bytes"] for r in rows),
        "memory_stats_freed_bytes": rows[0]["stats_freed_bytes"],
        "sleep_s": statistics.median(r["sleep_s"] for r in rows),
        "wake_s": statistics.median(r["wake_s"] for r in rows),
        "outputs_identical_after_wake": all(r["identical"] for r in rows)}
  s = engine.stats()
  report = {"machine": machine, "model": args.model,
            "weight_bytes": s.weight_bytes, "kv_cache_bytes": s.kv_cache_bytes,
            "baseline_engine_build_s": build_s, **levels,
            "compiles_after_wake": compiles.count,
            "serving_path_compiles": s.compiles_after_startup}
  emit(report, args.out)
  return report


if __name__ == "__main__":
  main()
