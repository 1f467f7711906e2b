"""Shared builders for engine tests: a tiny random Llama with SmolLM2's tokenizer."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import jax
import numpy as np
import torch
import transformers
from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

from jinfer.config import ModelConfig
from jinfer.engine.engine import LLMEngine
from jinfer.engine.engine_config import EngineConfig
from jinfer.tokenizer import Tokenizer
from jinfer.weights.safetensors_dir import load_safetensors_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def tiny_loaded(path: str, gguf: str, *, seed: int = 0, num_layers: int = 2):
  """(config, params, tokenizer) of a random Llama (2 layers) over SmolLM2's vocabulary."""
  tok = Tokenizer.from_gguf(gguf)
  torch.manual_seed(seed)
  cfg = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=num_layers, num_attention_heads=4,
                                 num_key_value_heads=2,
                                 max_position_embeddings=1024, tie_word_embeddings=True,
                                 eos_token_id=list(tok.eos_token_ids))
  hf = transformers.LlamaForCausalLM(cfg)
  # Random weights give near-uniform logits; sharpen them so greedy decoding has clear winners.
  with torch.no_grad():
    hf.model.embed_tokens.weight.mul_(40.0)
  hf.save_pretrained(path)
  config = ModelConfig.from_hf_dir(path)
  return config, load_safetensors_dir(path, config), tok


TINY_DIR_VOCAB = 128


def tiny_hf_dir(path: str, num_layers: int = 1) -> str:
  """An HF model directory of a one-layer (`num_layers`) random Llama over `TINY_DIR_VOCAB`
  tokens, with a word-level tokenizer (`t0`..`t127`; anything else reads as `t2`): the
  cheapest model that `LLM(path)` and the command line load like any other."""
  torch.manual_seed(0)
  config = transformers.LlamaConfig(
      vocab_size=TINY_DIR_VOCAB, hidden_size=32, intermediate_size=64,
      num_hidden_layers=num_layers,
      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
      bos_token_id=0, eos_token_id=1)
  transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
  # jinfer loads a tokenizer with every model; a word-level one over the ids is enough here.
  tok = HFTokenizer(models.WordLevel({f"t{i}": i for i in range(TINY_DIR_VOCAB)}, unk_token="t2"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as fh:
    # A chat template of the plainest kind: each message's content on a line of its own.
    json.dump({"bos_token": "t0", "eos_token": "t1",
               "chat_template": "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"}, fh)
  return path


class CompileCounter:
  """Counts XLA backend compiles on this thread (the one that runs the steps) from the moment it
  is made; an engine's background compiler runs on its own thread and is not counted. A hit in
  the persistent compilation cache is not a compile."""

  def __init__(self):
    self.compiles = self.cache_hits = 0
    self._thread = threading.get_ident()
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)
    jax.monitoring.register_event_listener(self._on_event)

  @property
  def count(self) -> int:
    return self.compiles - self.cache_hits

  def _on_duration(self, event: str, duration: float, **_):
    if event == "/jax/core/compile/backend_compile_duration" and self._here():
      self.compiles += 1

  def _on_event(self, event: str, **_):
    if event == "/jax/compilation_cache/cache_hits" and self._here():
      self.cache_hits += 1

  def _here(self) -> bool:
    return threading.get_ident() == self._thread


# A small engine: buckets of 1 to 8 tokens (long prompts are chunked) and a pool of 32 pages of 4
# tokens that runs out, so sequences are preempted and recomputed. Modules that build their engine
# with these options load its compiled steps from the compilation cache instead of compiling them.
SMALL_POOL = dict(max_model_len=64, page_size=4, num_pages=33, max_num_seqs=6,
                  max_num_batched_tokens=8, max_prefill_seqs=2)


# A LoRA engine reporting rollout logprobs (tests/test_rollout_logprobs.py, test_update_lora.py):
# 16-token steps chunk a 40-token prompt; one slot and one host copy, so a second adapter
# evicts the first from both.
ROLLOUT = dict(max_model_len=64, page_size=4, num_pages=80, max_num_seqs=8,
               max_num_batched_tokens=16, max_prefill_seqs=4, enable_lora=True, max_loras=1,
               max_lora_rank=8, max_cpu_loras=1, logprobs_mode="processed_logprobs")


# The real SmolLM2's engine options wherever the test does not need its own: an engine with these
# options compiles its six steps once per session (and per cache), the others load them. 59 usable
# pages (944 tokens) for 8 sequences of up to 512: a long batch is preempted.
SMOLLM2 = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=32, num_pages=60)


def make_engine(loaded, warmup: bool | str = True, **options) -> LLMEngine:
  return LLMEngine.from_parts(*loaded, config=EngineConfig.of(**options), warmup=warmup)


def random_prompts(n: int, seed: int = 0, lo: int = 5, hi: int = 60) -> list[list[int]]:
  """n prompts of lo..hi-1 random ids from SmolLM2's vocabulary (past its special tokens)."""
  rng = np.random.default_rng(seed)
  return [rng.integers(3, 49000, rng.integers(lo, hi)).tolist() for _ in range(n)]


def run_tokens(engine, prompts, params) -> list[list[int]]:
  """Run the prompts together to completion; each one's output tokens."""
  rids = [engine.add_request(None, p, params) for p in prompts]
  final = engine.run_to_completion(rids)
  return [final[r].outputs[0].token_ids for r in rids]


def prefix_sharing_prompts() -> list[list[int]]:
  """Eight random prompts, then three that share a 40-token prefix: a batch with prefix hits."""
  shared = random_prompts(1, seed=9, lo=40, hi=41)[0]
  return random_prompts(8, seed=1) + [shared + p[:5] for p in random_prompts(3, seed=2)]


def assert_batch_matches(engine, prompts, params, want):
  """Run `prompts` together: their outputs are `want`, the pool forced a preemption and the
  prefix cache hit. Returns the engine's stats after the run."""
  before = engine.stats()
  assert run_tokens(engine, prompts, params) == want
  after = engine.stats()
  assert after.num_preemptions > before.num_preemptions, "the pool was meant to force preemption"
  assert after.prefix_hit_rate > 0
  return after


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def spawn_process(model_dir: str, port: int, pid: int, spec: dict, devices: int = 4):
  """One process of a two-process run on loopback (tests/multiprocess_worker.py)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return subprocess.Popen([sys.executable, os.path.join(root, "tests", "multiprocess_worker.py"),
                           model_dir, str(port), str(pid), str(devices), json.dumps(spec)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=dict(os.environ, PYTHONPATH=root))


def kill_the_follower_once_it_ran(model_dir: str, spec: dict):
  """Two processes of `spec` (with `then_killed`): once process 0 has printed its results and
  generates again, process 1 is killed. Process 0 (still running) and its stderr lines so far."""
  import signal
  import time
  port = free_port()
  leader, follower = [spawn_process(model_dir, port, pid, spec) for pid in (0, 1)]
  lines, t0 = [], time.monotonic()
  while "generating again" not in (line := leader.stderr.readline()):
    lines.append(line)
    assert time.monotonic() - t0 < 600 and leader.poll() is None, "".join(lines[-40:])
  follower.send_signal(signal.SIGKILL)
  return leader, lines
