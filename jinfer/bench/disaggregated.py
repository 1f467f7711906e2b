"""Colocated against disaggregated prefill/decode under a mixed load, on the same devices.

The load: `--decoders` requests with short prompts and long outputs start together; once they
are decoding, `--long-prompts` requests with long prompts and short outputs arrive one every
`--interval` seconds. What it reports, per layout: inter-token latency of the decoders (P50,
P99, max: does a long prefill stall them?), TTFT of the long prompts, and for the
disaggregated layout the TTFT split (queue, prefill), the hand-over time and the K/V bytes
copied per request. Layouts over `--devices` devices, each engine of `--tp` devices:
  colocated       data_parallel_size = devices / tp engines, each prefilling and decoding;
  disaggregated   kv_transfer_config: the first half of the devices prefill, the rest decode;
  processes       the same split across two processes on this host (`kv_connector:
                  "jax_transfer"`, each process half the devices): pages move over JAX's
                  transfer API, requests and tokens over a socket.
Both compile every step shape before their timed run. Random weights of a Llama shape, float32
on the CPU, bfloat16 elsewhere.

On host devices every device is a slice of the same CPU cores, so a prefill step and a decode
step running "side by side" still compete for the cores: the figures show the scheduling
effect (a decode step no longer carries a prefill chunk, and is not held back until the
prefill step ends), not what separate chips give.

  python -m jinfer.bench.disaggregated --devices 2 --out disagg.json
  python -m jinfer.bench.disaggregated --devices 8 --tp 2 --shape smollm2   # a multi-chip host
"""
from __future__ import annotations

import argparse
import sys
import time


def parse_args(argv=None):
  ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}",
                              description=__doc__.split("\n\n")[0])
  ap.add_argument("--devices", type=int, default=2, help="devices used (host devices on CPU)")
  ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size of every engine")
  ap.add_argument("--shape", default="small", choices=("small", "smollm2"))
  ap.add_argument("--decoders", type=int, default=8)
  ap.add_argument("--decoder-prompt-len", type=int, default=32)
  ap.add_argument("--decoder-output-len", type=int, default=96)
  ap.add_argument("--long-prompts", type=int, default=6)
  ap.add_argument("--long-prompt-len", type=int, default=480)
  ap.add_argument("--long-output-len", type=int, default=8)
  ap.add_argument("--interval", type=float, default=0.5, help="seconds between long prompts")
  ap.add_argument("--max-num-batched-tokens", type=int, default=256)
  ap.add_argument("--layouts", nargs="*", default=["colocated", "disaggregated"])
  ap.add_argument("--out", default=None)
  # Set on the two processes the "processes" layout starts.
  ap.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
  ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
  return ap.parse_args(argv)


def _two_processes(argv: list[str]) -> dict:
  """The "processes" layout: this module run as process 0 and 1 on loopback; process 0's
  entry."""
  import json
  import os
  import socket
  import subprocess
  import tempfile
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "entry.json")
    procs = [subprocess.Popen([sys.executable, "-m", __spec__.name, *argv, "--layouts",
                               "processes", "--process-id", str(i), "--port", str(port),
                               "--out", out]) for i in (0, 1)]
    codes = [p.wait() for p in procs]
    if codes != [0, 0]:
      raise RuntimeError(f"the two processes exited with {codes}")
    with open(out) as fh:
      return json.load(fh)


def main(argv=None):
  args = parse_args(argv)
  child = args.process_id is not None
  import jax
  if jax.config.jax_platforms in (None, "", "cpu"):
    jax.config.update("jax_num_cpu_devices", args.devices // 2 if child else args.devices)
  if child:
    from jinfer.parallel import distributed
    distributed.initialize(distributed.DistributedConfig(
        coordinator_address=f"127.0.0.1:{args.port}", num_processes=2,
        process_id=args.process_id))
  import numpy as np

  from jinfer.bench.machine import machine_info
  from jinfer.bench.random_model import random_llama
  from jinfer.bench.offline import _percentiles, transfer_summary
  from jinfer.bench.report import emit
  from jinfer.engine.data_parallel import DataParallelEngine
  from jinfer.engine.disaggregated import DisaggregatedEngine
  from jinfer.engine.engine import LLMEngine
  from jinfer.engine.engine_config import EngineConfig, default_dtype
  from jinfer.sampling.params import SamplingParams

  dtype = default_dtype()
  cfg, params = random_llama(args.shape, dtype)
  rng = np.random.default_rng(0)
  decoders = [rng.integers(0, cfg.vocab_size, args.decoder_prompt_len).tolist()
              for _ in range(args.decoders)]
  longs = [rng.integers(0, cfg.vocab_size, args.long_prompt_len).tolist()
           for _ in range(args.long_prompts)]
  dec_sp = SamplingParams(max_tokens=args.decoder_output_len, temperature=0.0, ignore_eos=True)
  long_sp = SamplingParams(max_tokens=args.long_output_len, temperature=0.0, ignore_eos=True)
  max_len = max(args.decoder_prompt_len + args.decoder_output_len,
                args.long_prompt_len + args.long_output_len)
  base = dict(max_model_len=max_len, max_num_seqs=args.decoders + args.long_prompts,
              max_num_batched_tokens=args.max_num_batched_tokens,
              tensor_parallel_size=args.tp, compilation_cache=False)
  n_engines = args.devices // args.tp
  layouts = {
      "colocated": dict(data_parallel_size=n_engines),
      "disaggregated": dict(kv_transfer_config={
          "prefill_devices": args.devices // 2, "decode_devices": args.devices // 2}),
      "processes": dict(kv_transfer_config={
          "kv_connector": "jax_transfer", "prefill_devices": args.devices // 2}),
  }
  report = {"machine": machine_info(), "shape": args.shape, "dtype": np.dtype(dtype).name,
            "args": vars(args), "layouts": {}}
  for name in args.layouts:
    if name == "processes" and not child:
      report["layouts"][name] = _two_processes(
          [a for a in (argv or sys.argv[1:]) if a not in args.layouts and a != "--layouts"])
      continue
    config = EngineConfig.of(**base, **layouts[name])
    cls = (DisaggregatedEngine if name != "colocated" else
           DataParallelEngine if n_engines > 1 else LLMEngine)
    t0 = time.monotonic()
    engine = cls.from_parts(cfg, params, None, config=config, dtype=dtype, warmup="now")
    warmup_s = time.monotonic() - t0
    if child and args.process_id > 0:
      engine.follow()  # decodes until process 0 closes
      return
    load_start = _load()
    t0 = time.monotonic()
    dec_ids = [engine.add_request(None, p, dec_sp) for p in decoders]
    arrivals = [(None, p) for p in longs]
    long_ids, final, started, first = [], {}, None, set()
    while engine.has_unfinished_requests() or arrivals:
      now = time.monotonic()
      if started is None and first >= set(dec_ids):
        started = now  # every decoder has its first token: the long prompts start arriving
      if started is not None and arrivals and now >= started + len(long_ids) * args.interval:
        long_ids.append(engine.add_request(None, arrivals.pop(0)[1], long_sp))
      for o in engine.step():
        first.add(o.request_id)
        if o.finished:
          final[o.request_id] = o
    wall = time.monotonic() - t0
    dec = [final[r] for r in dec_ids]
    lng = [final[r] for r in long_ids]
    entry = {
        "options": layouts[name], "warmup_s": round(warmup_s, 1), "wall_s": round(wall, 2),
        "decoders_itl_s": {**_percentiles([x for o in dec for x in o.metrics.itl]),
                           "max": max(x for o in dec for x in o.metrics.itl)},
        "long_prompts_ttft_s": _percentiles([o.metrics.ttft for o in lng]),
        "decoders_ttft_s": _percentiles([o.metrics.ttft for o in dec]),
        "output_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in dec + lng) / wall,
        "kv_transfer": transfer_summary([o.metrics for o in dec + lng]),
        "load_avg_1m": {"start": load_start, "end": _load()},
    }
    report["layouts"][name] = entry
    print(name, entry, file=sys.stderr, flush=True)
    engine.close()
    del engine
    if child:  # for the parent to report
      import json
      with open(args.out, "w") as fh:
        json.dump(entry, fh)
      return
  emit(report, args.out)


def _load() -> float | None:
  import os
  return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


if __name__ == "__main__":
  main()
