"""Distill a small draft model for SmolLM2-135M-Instruct (speculative decoding).

Stages, each reading the previous ones' files from --work-dir:
  generate   the teacher's own greedy answers to the training chat prompts (SeqKD data)
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from chat_prompts import train_prompts  # noqa: E402

from jinfer.weights.builtin import cache_dir  # noqa: E402

log = logging.getLogger("distill")
TEACHER = "smollm2-135m-instruct"


def _work_dir(args) -> str:
  os.makedirs(args.work_dir, exist_ok=True)
  return args.work_dir


def cmd_generate(args):
  """Greedy teacher answers, saved every chunk so an interrupted run resumes."""
  from jinfer import LLM, SamplingParams
  path = os.path.join(_work_dir(args), "seqkd.npz")
  prompts = train_prompts()[:args.num_prompts]
  seqs: list[np.ndarray] = []
  prompt_lens: list[int] = []
  if os.path.exists(path):
    old = np.load(path)
    seqs = np.split(old["tokens"], old["offsets"][1:-1])
    prompt_lens = old["prompt_lens"].tolist()
  llm = LLM(TEACHER, max_model_len=args.max_tokens + 128, max_num_seqs=64)
  params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
  t0 = time.monotonic()
  for start in range(len(seqs), len(prompts), args.chunk):
    chunk = prompts[start:start + args.chunk]
    ids = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                             add_generation_prompt=True, tokenize=True)
           for p in chunk]
    outs = llm.generate(ids, params, use_tqdm=False)
    for p, o in zip(ids, outs):
      seqs.append(np.asarray(p + o.outputs[0].token_ids, np.int32))
      prompt_lens.append(len(p))
    offsets = np.cumsum([0] + [len(s) for s in seqs])
    np.savez(path, tokens=np.concatenate(seqs), offsets=offsets,
             prompt_lens=np.asarray(prompt_lens, np.int32))
    n_out = int(offsets[-1]) - sum(prompt_lens)
    log.info("%d/%d prompts, %d answer tokens, %.0f s", len(seqs), len(prompts), n_out,
             time.monotonic() - t0)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--work-dir", default=os.path.join(cache_dir(), "distill"))
  sub = ap.add_subparsers(dest="stage", required=True)
  p = sub.add_parser("generate", help=cmd_generate.__doc__)
  p.add_argument("--num-prompts", type=int, default=len(train_prompts()))
  p.add_argument("--max-tokens", type=int, default=256)
  p.add_argument("--chunk", type=int, default=128)
  p.set_defaults(fn=cmd_generate)
  args = ap.parse_args()
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
  args.fn(args)


if __name__ == "__main__":
  main()
