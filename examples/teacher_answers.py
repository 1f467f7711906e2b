"""Token sequences on disk, and the model's own greedy answers to the shipped chat prompts: the
training text of both self-distillation scripts (`distill_draft.py`'s SeqKD draft and
`train_medusa.py`'s heads)."""
from __future__ import annotations

import logging
import os
import time

import numpy as np

log = logging.getLogger("teacher_answers")


def save_seqs(path: str, seqs: list[np.ndarray], starts: list[int]):
  offsets = np.cumsum([0] + [len(s) for s in seqs])
  np.savez(path, tokens=np.concatenate(seqs).astype(np.int32), offsets=offsets,
           prompt_lens=np.asarray(starts, np.int32))


def load_seqs(path: str) -> tuple[list[np.ndarray], list[int]]:
  """(token sequences, where each one's trained part starts)."""
  d = np.load(path)
  return np.split(d["tokens"], d["offsets"][1:-1]), d["prompt_lens"].tolist()


def generate_answers(model: str, prompts: list[str], path: str, max_tokens: int, chunk: int):
  """Greedy answers of `model` to `prompts` through its chat template, saved to `path` (prompt +
  answer per sequence) every `chunk` prompts, so an interrupted run resumes."""
  from jinfer import LLM, SamplingParams
  seqs, starts = load_seqs(path) if os.path.exists(path) else ([], [])
  llm = LLM(model, max_model_len=max_tokens + 128, max_num_seqs=64)
  params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
  t0 = time.monotonic()
  for start in range(len(seqs), len(prompts), chunk):
    ids = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                             add_generation_prompt=True, tokenize=True)
           for p in prompts[start:start + chunk]]
    outs = llm.generate(ids, params, use_tqdm=False)
    for p, o in zip(ids, outs):
      seqs.append(np.asarray(p + o.outputs[0].token_ids, np.int32))
      starts.append(len(p))
    save_seqs(path, seqs, starts)
    log.info("%d/%d prompts, %d answer tokens, %.0f s", len(seqs), len(prompts),
             sum(map(len, seqs)) - sum(starts), time.monotonic() - t0)
