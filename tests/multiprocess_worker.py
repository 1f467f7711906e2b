"""One process of a multi-process run (tests/test_parallel.py starts two on loopback).

argv: model directory, coordinator port, process id, devices per process, then a JSON object of
engine options and prompts (and optionally the heartbeat timeout). Process 0 prints the greedy tokens and their logprobs as JSON on stdout.
"""
from __future__ import annotations

import json
import sys

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
          num_processes=2, process_id=pid, warmup=False, **spec["options"])
if llm.is_leader:
  print("generating", file=sys.stderr, flush=True)
  outs = [o.outputs[0] for o in llm.generate(
      spec["prompts"], SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0,
                                      logprobs=1), use_tqdm=False)]
  print(json.dumps({"tokens": [o.token_ids for o in outs],
                    "logprobs": [[lp[t] for lp, t in zip(o.logprobs, o.token_ids)]
                                 for o in outs]}), flush=True)
  llm.close()
