"""One process of a multi-process run (the tests start two on loopback).

argv: model directory, coordinator port, process id, devices per process, then a JSON object of
engine options and prompts, and optionally: the heartbeat timeout, seeded samples too,
ignore_eos, requests to abort, to be killed after. Process 0 prints the tokens and their
logprobs as JSON on stdout (and, disaggregated, what the decode process reports holding).
"""
from __future__ import annotations

import json
import sys
import time

import jax

model, port, pid, ndev, spec = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \
    json.loads(sys.argv[5])
jax.config.update("jax_num_cpu_devices", ndev)

from jinfer import LLM, SamplingParams  # noqa: E402  (after the device count is set)
from jinfer.parallel import distributed  # noqa: E402

if "heartbeat_timeout_s" in spec:  # joined here with it; LLM then finds the runtime joined
  distributed.initialize(distributed.DistributedConfig(
      coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
      heartbeat_timeout_s=spec["heartbeat_timeout_s"]))
llm = LLM(model, skip_tokenizer_init=True, coordinator_address=f"127.0.0.1:{port}",
          num_processes=2, process_id=pid, warmup=spec.get("warmup", False), **spec["options"])


def leaks(engines) -> list[str]:
  """What any engine of this process still holds (pages, requests)."""
  out = []
  for e in engines:
    e.blocks.check_consistency()
    if e.blocks.num_free_pages != e.blocks.num_usable_pages or e.groups:
      out.append(f"{e.blocks.num_usable_pages - e.blocks.num_free_pages} pages, "
                 f"{len(e.groups)} requests")
  return out


if llm.is_leader:
  print("generating", file=sys.stderr, flush=True)
  run = dict(max_tokens=spec["max_tokens"], ignore_eos=spec.get("ignore_eos", False))
  params = [SamplingParams(**run, temperature=0.0, logprobs=1)]
  if spec.get("seeded"):
    params.append(SamplingParams(**run, temperature=1.0, top_p=0.9, seed=7))
  engine = llm.engine
  rids = [engine.add_request(None, p, sp) for p in spec["prompts"] for sp in params]
  # `abort`: requests aborted once their first token is out (their pages in flight or on the
  # decode side), the others run to the end.
  aborts = {rids[i] for i in spec.get("abort", [])}
  final = {}
  while engine.has_unfinished_requests():
    for o in engine.step():
      if o.request_id in aborts:
        assert engine.abort(o.request_id)
        aborts.discard(o.request_id)
      elif o.finished:
        final[o.request_id] = o.outputs[0]
  outs = [final.get(r) for r in rids]
  report = {"tokens": [o and o.token_ids for o in outs],
            "logprobs": [[lp[t] for lp, t in zip(o.logprobs, o.token_ids)]
                         if o is not None and o.logprobs else None for o in outs],
            "leaks": leaks(getattr(engine, "prefill", [engine]))}
  if getattr(engine, "remote", None):  # disaggregated: what the decode process reports holding
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10 and any(r.stats.kv_pages_used or r.stats.num_running
                                            for r in engine.remote):
      engine.step()  # reads what it sent last (an abort's effect comes after the last token)
      time.sleep(0.05)
    report["decode"] = [dict(pages_used=r.stats.kv_pages_used, running=r.stats.num_running,
                             preemptions=r.stats.num_preemptions) for r in engine.remote]
  print(json.dumps(report), flush=True)
  if spec.get("then_killed"):  # the test kills the other process during this one
    print("generating again", file=sys.stderr, flush=True)
    llm.generate(spec["prompts"], SamplingParams(max_tokens=60, ignore_eos=True),
                 use_tqdm=False)
  llm.close()
