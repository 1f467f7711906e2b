"""Long context under context parallelism (ring attention): needle retrieval and perplexity.

Two experiments on one model (default: Gemma-3-270M, trained for a 32k context), first with
the prompt's KV pages and query rows spread over `--cp` devices (ring attention), then, with
`--baseline` (the default), on one device:
  (a) needle in a haystack: at each length in `--lengths` and each depth in `--depths`, filler
      text with "The secret passcode is NNNNN." inserted at that fraction of it; a model with a
      chat template is asked "What is the secret passcode?" in a user turn, a base model (no
      template, Gemma-3-270M) gets the text and "What is the secret passcode? The secret
      passcode is" to complete. A greedy answer of a few tokens counts when it has the number;
  (b) perplexity by position: one text of the longest length, the logprob of every prompt token,
      mean NLL and perplexity per position bucket.
The CP run repeats part of the one-device run: the needles at `--cp-lengths` and the first
`--cp-ppl-tokens` tokens of the perplexity text. Against the one-device run it gives the largest
|logprob difference| over those prompt tokens and every generated token, and whether the greedy
answers are identical: ring attention is exact, so they should agree to float32 rounding. Prints
one JSON object (with the machine, and each run's KV cache size and the process's peak memory)
and writes it to `--out`, and a plot (accuracy vs length, perplexity vs position) to `--plot`.

    python -m jinfer.bench.long_context [--model NAME] [--cp 2 --devices 2]
        [--lengths 1024,2048,4096,8192,16384] [--depths 0.1,0.5,0.9] [--cp-lengths 8192|all]
        [--cp-ppl-tokens 2048] [--layout zigzag|plain] [--quick] [--no-baseline]
        [--out F.json] [--plot F.png]

The defaults fit a shared 2-core CPU in 10-13 minutes: one device does 1k-16k tokens at
three depths and perplexity over 16k tokens, CP over 2 host devices the 8k needles and 2k tokens
of perplexity (CP on 2 host devices costs about twice one device's time; 8 of them on 2 cores,
several times more, and ~20 GB of memory at 4k; one device alone does three 32k needles and
32k tokens of perplexity in ~10 minutes: `--devices 1 --cp 1 --no-baseline --lengths 32000`).
On a host with 8 accelerator chips, the whole experiment at 32k (32,000 tokens: the answer must
fit in the model's 32,768):

    python -m jinfer.bench.long_context --cp 8 --lengths 1024,2048,4096,8192,16384,32000
        --depths 0.1,0.3,0.5,0.7,0.9 --cp-lengths all --cp-ppl-tokens 32000
        --max-num-batched-tokens 2048

A prompt-logprob step projects every row to the vocabulary (262,144 for Gemma-3: a [T, V]
float32 array is 1 GiB at T = 1024), so `--max-num-batched-tokens` sizes that too.
On the CPU, `--devices` fake devices are made (XLA host platform); on an accelerator the real
ones are used. The filler is CPython's own documentation (`pydoc_data`), so nothing is
downloaded. Timings include loading and, with `--no-warmup`, each step shape's first compile.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import re
import resource
import sys
import time

MODEL = "gemma-3-270m"
LENGTHS = (1024, 2048, 4096, 8192, 16384)
DEPTHS = (0.1, 0.5, 0.9)
# What the CP run repeats of the one-device run by default: the 8k needles and the first
# tokens of the perplexity text. On 2 host devices CP costs about twice one device's time.
CP_LENGTHS = (8192,)
CP_PPL_TOKENS = 2048
QUICK_LENGTHS = (256, 512)
QUICK_DEPTHS = (0.25, 0.75)
NEEDLE = "The secret passcode is {}."
QUESTION = "What is the secret passcode? Answer with the number only."
# A base model completes text: the needle's own words, asked again after the haystack.
CUE = "What is the secret passcode? The secret passcode is"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}",
                             description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default=MODEL, help="a built-in name, an HF directory or a .gguf")
  p.add_argument("--devices", type=int, default=2, help="fake CPU devices to make (CPU only)")
  p.add_argument("--cp", type=int, default=None,
                 help="context_parallel_size, a power of two (default: --devices)")
  p.add_argument("--layout", choices=("zigzag", "plain"), default="zigzag")
  p.add_argument("--lengths", default=None, help="comma-separated prompt lengths in tokens")
  p.add_argument("--depths", default=None, help="comma-separated needle depths in (0, 1)")
  p.add_argument("--cp-lengths", default=None,
                 help="the lengths the CP run does too, comma-separated, or 'all' (default "
                      f"{','.join(map(str, CP_LENGTHS))}; all of them without --baseline)")
  p.add_argument("--cp-ppl-tokens", type=int, default=CP_PPL_TOKENS,
                 help="the CP run's perplexity covers this many first tokens of the text")
  p.add_argument("--buckets", type=int, default=8, help="position buckets for perplexity")
  p.add_argument("--answer-tokens", type=int, default=12)
  p.add_argument("--max-num-batched-tokens", type=int, default=512)
  p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                 help="run the same on one device and compare")
  p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                 help="compile every step shape before timing (off: compile on first use)")
  p.add_argument("--quick", action="store_true",
                 help=f"lengths {QUICK_LENGTHS}, depths {QUICK_DEPTHS}, all of them with CP "
                      f"(tests)")
  p.add_argument("--seed", type=int, default=0, help="draws the passcodes")
  p.add_argument("--out", default="long_context.json")
  p.add_argument("--plot", default="long_context.png", help="'' for no plot")
  args = p.parse_args(argv)
  args.cp = args.devices if args.cp is None else args.cp
  lengths = QUICK_LENGTHS if args.quick else LENGTHS
  depths = QUICK_DEPTHS if args.quick else DEPTHS
  args.lengths = sorted(int(x) for x in args.lengths.split(",")) if args.lengths else list(lengths)
  args.depths = [float(x) for x in args.depths.split(",")] if args.depths else list(depths)
  if not all(0.0 <= d <= 1.0 for d in args.depths):
    p.error("depths must lie in [0, 1]")
  if args.cp_lengths == "all" or (args.cp_lengths is None and (args.quick or not args.baseline)):
    args.cp_lengths = list(args.lengths)
  elif args.cp_lengths is None:
    args.cp_lengths = [n for n in CP_LENGTHS if n in args.lengths] or args.lengths[-1:]
  else:
    args.cp_lengths = sorted(int(x) for x in args.cp_lengths.split(","))
  if not set(args.cp_lengths) <= set(args.lengths):
    p.error("--cp-lengths must be among --lengths")
  if args.quick or not args.baseline:  # the CP run is the whole experiment
    args.cp_ppl_tokens = max(args.lengths)
  return args


def init_devices(n: int) -> None:
  """Ask for `n` CPU devices. Must run before jax makes its backends: the option sizes the CPU
  client at creation. It only shapes the CPU client, so on an accelerator it changes nothing."""
  import jax
  jax.config.update("jax_num_cpu_devices", n)


# -- text ------------------------------------------------------------------------------------

def filler_sentences() -> list[str]:
  """English sentences from the topic help that ships with every CPython (a fixed text)."""
  from pydoc_data.topics import topics
  text = " ".join(topics[k] for k in sorted(topics))
  text = re.sub(r"\s+", " ", text)
  sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z])", text)
  # Drop code fragments and very long runs: the haystack should read as prose. The topics
  # repeat whole passages (one section under several names): keep each sentence once, or late
  # positions of the perplexity text copy earlier ones (a third of them past 12k tokens did).
  return list(dict.fromkeys(s for s in sentences if 30 <= len(s) <= 300 and ">>>" not in s
                            and "passcode" not in s))


class NeedleBuilder:
  """Prompts of about `length` tokens with the needle at a given depth of the filler.

  A model with a chat template is asked `QUESTION` in a user turn; a base model (no template)
  gets the haystack as plain text and a cue to complete, `CUE`, which it continues with the
  number when it has retrieved it."""

  def __init__(self, tokenizer, sentences: list[str]):
    self.tok = tokenizer
    self.sentences = sentences
    self.chat = tokenizer.chat_template is not None
    # Sentences are joined by spaces; a leading space tokenizes as it will inside the haystack.
    self.counts = [len(tokenizer.encode(" " + s, add_special_tokens=False)) for s in sentences]
    self.overhead = len(self._prompt(""))
    # Tokens before the haystack (BOS, and a template's system prompt and role header): where
    # two prompts that differ only in their haystack first differ.
    a, b = self._prompt("A"), self._prompt("B")
    self.prefix = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)

  def _prompt(self, haystack: str) -> list[int]:
    if not self.chat:
      return self.tok.encode(f"{haystack}\n\n{CUE}")
    msg = {"role": "user", "content": f"{haystack}\n\n{QUESTION}"}
    return self.tok.apply_chat_template([msg], add_generation_prompt=True, tokenize=True)

  def build(self, length: int, depth: float, passcode: str) -> tuple[list[int], int]:
    """(prompt ids, token index where the needle starts); the prompt is at most `length`."""
    needle = NEEDLE.format(passcode)
    budget = length - self.overhead - len(self.tok.encode(" " + needle, add_special_tokens=False))
    chosen, used, i = [], 0, 0
    while used + self.counts[i % len(self.counts)] <= budget:
      chosen.append(self.sentences[i % len(self.sentences)])
      used += self.counts[i % len(self.counts)]
      i += 1
    at = round(depth * len(chosen))
    ids = self._prompt(" ".join(chosen[:at] + [needle] + chosen[at:]))
    # Token counts of separately encoded sentences can differ by a merge at the joins: trim
    # whole sentences from the end until the prompt fits.
    while len(ids) > length and len(chosen) > at:
      chosen.pop()
      ids = self._prompt(" ".join(chosen[:at] + [needle] + chosen[at:]))
    needle_at = self.prefix + len(self.tok.encode(" ".join(chosen[:at]), add_special_tokens=False))
    return ids, needle_at


# -- experiments -----------------------------------------------------------------------------

def run_needles(llm, trials: list[dict], answer_tokens: int) -> tuple[list[dict], float]:
  from jinfer import SamplingParams
  sp = SamplingParams(temperature=0.0, max_tokens=answer_tokens, logprobs=0)
  t0 = time.perf_counter()
  outs = llm.generate([t["prompt_ids"] for t in trials], sp, use_tqdm=False)
  seconds = time.perf_counter() - t0
  results = []
  for t, o in zip(trials, outs):
    c = o.outputs[0]
    results.append({"length": t["length"], "depth": t["depth"],
                    "answer": c.text, "found": t["passcode"] in c.text,
                    "token_ids": list(c.token_ids),
                    "logprobs": [lp[tid] for tid, lp in zip(c.token_ids, c.logprobs)]})
  return results, seconds


def run_perplexity(llm, ids: list[int]) -> tuple[list[float], float]:
  """Logprob of each prompt token 1..n-1 given those before it."""
  from jinfer import SamplingParams
  sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
  t0 = time.perf_counter()
  out = llm.generate([ids], sp, use_tqdm=False)[0]
  seconds = time.perf_counter() - t0
  return [e[tid] for tid, e in zip(ids[1:], out.prompt_logprobs[1:])], seconds


def perplexity_buckets(logprobs: list[float], n_buckets: int, span: int) -> list[dict]:
  """Mean NLL and perplexity over equal runs of predicted positions (position p: token p), the
  runs cut from `span` positions: a run over a prefix of the text shares the full text's
  buckets (and leaves the rest out)."""
  n = len(logprobs)
  edges = [min(round(i * span / n_buckets), n) for i in range(n_buckets + 1)]
  out = []
  for lo, hi in zip(edges, edges[1:]):
    if hi == lo:
      break
    nll = -sum(logprobs[lo:hi]) / max(hi - lo, 1)
    out.append({"positions": [lo + 1, hi], "mean_nll": round(nll, 4),
                "perplexity": round(math.exp(nll), 3)})
  return out


def _progress(msg: str) -> None:
  # stderr, so that stdout stays one JSON object.
  print(msg, file=sys.stderr, flush=True)


def run_engine(args, cp: int, trials: list[dict], ppl_ids: list[int]) -> dict:
  from jinfer import LLM
  lengths = sorted({t["length"] for t in trials})
  max_model_len = max(lengths[-1], len(ppl_ids)) + args.answer_tokens + 16
  t0 = time.perf_counter()
  pages_per_seq = -(-max_model_len // 16)
  llm = LLM(args.model, context_parallel_size=cp, context_layout=args.layout,
            max_model_len=max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=len(args.depths), max_prefill_seqs=len(args.depths), page_size=16,
            # Room for a whole length's trials at once, so no sequence is ever preempted.
            num_pages=len(args.depths) * pages_per_seq + 1,
            # The haystacks share their opening sentences: without a prefix cache every prompt
            # runs in full, so each length's timing and logprobs come from its own prefill.
            enable_prompt_logprobs=True, enable_prefix_caching=False, warmup=args.warmup,
            # Both runs scanned (a sharded one always is): the comparison isolates ring
            # attention, and no unrolled decode bucket compiles every layer.
            scan_layers=True)
  engine_s = time.perf_counter() - t0
  _progress(f"CP={cp} engine ready ({engine_s:.1f} s)")
  needle, needle_s = [], {}
  for length in lengths:
    group = [t for t in trials if t["length"] == length]
    res, needle_s[length] = run_needles(llm, group, args.answer_tokens)
    needle += res
    _progress(f"CP={cp} length {length}: {sum(r['found'] for r in res)}/{len(res)} found "
              f"({needle_s[length]:.1f} s)")
  logprobs, ppl_s = run_perplexity(llm, ppl_ids)
  _progress(f"CP={cp} perplexity over {len(ppl_ids)} tokens ({ppl_s:.1f} s)")
  stats = llm.engine.stats()
  # What the KV cache holds for these lengths: every depth of the longest at once.
  memory = {"max_model_len": max_model_len, "num_pages": llm.engine.blocks.num_usable_pages,
            "kv_bytes_per_token": stats.kv_bytes_per_token,
            "kv_cache_bytes": stats.kv_cache_bytes, "weight_bytes": stats.weight_bytes,
            "num_preemptions": stats.num_preemptions}
  llm.engine.close()
  del llm
  gc.collect()
  return {"needle": needle, "ppl_logprobs": logprobs, "lengths": lengths, "memory": memory,
          "timings": {"engine_s": round(engine_s, 2),
                      "needle_s_by_length": {str(k): round(v, 2) for k, v in needle_s.items()},
                      "perplexity_s": round(ppl_s, 2)}}


def summarize(args, trials: list[dict], run: dict) -> dict:
  rows = [{"length": t["length"], "depth": t["depth"], "prompt_tokens": len(t["prompt_ids"]),
           "needle_token": t["needle_token"], "passcode": t["passcode"],
           "answer": r["answer"], "found": r["found"]} for t, r in zip(trials, run["needle"])]

  def acc(sel) -> float:
    sel = list(sel)
    return round(sum(r["found"] for r in sel) / len(sel), 3)

  lp = run["ppl_logprobs"]
  nll = -sum(lp) / len(lp)
  return {
      "needle": {
          "accuracy": acc(rows),
          "accuracy_by_length": {str(n): acc(r for r in rows if r["length"] == n)
                                 for n in run["lengths"]},
          "accuracy_by_depth": {str(d): acc(r for r in rows if r["depth"] == d)
                                for d in args.depths},
          "trials": rows},
      "perplexity": {"tokens": len(lp) + 1, "mean_nll": round(nll, 4),
                     "perplexity": round(math.exp(nll), 3),
                     "buckets": perplexity_buckets(lp, args.buckets, args.ppl_positions)},
      "memory": run["memory"],
      "timings": run["timings"]}


def compare(cp_run: dict, one_run: dict) -> dict:
  """How far the CP run is from the one-device run (the same computation, reordered) over
  what both ran: the CP run's trials, and its perplexity text, a prefix of the other's (causal
  attention: a token's logprob does not depend on what follows)."""
  one = {(r["length"], r["depth"]): r for r in one_run["needle"]}
  pairs = [(a, one[a["length"], a["depth"]]) for a in cp_run["needle"]]
  prompt_diff = max(abs(a - b) for a, b in zip(cp_run["ppl_logprobs"], one_run["ppl_logprobs"]))
  same = [a["token_ids"] == b["token_ids"] for a, b in pairs]
  # Generated tokens' logprobs compare only while the two answers agree token for token.
  out_diff = 0.0
  for a, b in pairs:
    for ta, tb, la, lb in zip(a["token_ids"], b["token_ids"], a["logprobs"], b["logprobs"]):
      if ta != tb:
        break
      out_diff = max(out_diff, abs(la - lb))
  return {"prompt_logprobs_compared": len(cp_run["ppl_logprobs"]),
          "max_abs_prompt_logprob_diff": prompt_diff,
          "max_abs_answer_logprob_diff": out_diff,
          "max_abs_logprob_diff": max(prompt_diff, out_diff),
          "greedy_answers_identical": all(same),
          "identical_answers": sum(same), "answers": len(same)}


def plot(result: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")  # no display; writes files only
  import matplotlib.pyplot as plt

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  cp = result["context_parallel_size"]
  runs = [(f"CP={cp} ({result['context_layout']})", result["cp"], "-o")]
  if result.get("one_device"):
    runs.append(("one device", result["one_device"], "--x"))
  for label, r, style in runs:
    by_len = r["needle"]["accuracy_by_length"]
    ax1.plot([int(k) for k in by_len], list(by_len.values()), style, label=label)
    b = r["perplexity"]["buckets"]
    ax2.plot([(x["positions"][0] + x["positions"][1]) / 2 for x in b],
             [x["perplexity"] for x in b], style, label=label)
  ax1.set(xscale="log", xlabel="prompt length (tokens)", ylabel="needle accuracy",
          ylim=(-0.05, 1.05), title="needle in a haystack")
  ax1.set_xticks(result["lengths"], [str(n) for n in result["lengths"]])
  ax1.minorticks_off()
  tokens = max(r["perplexity"]["tokens"] for _, r, _ in runs)
  ax2.set(xlabel="token position", ylabel="perplexity",
          title=f"perplexity by position ({tokens} tokens)")
  for ax in (ax1, ax2):
    ax.grid(alpha=0.3)
    ax.legend()
  fig.suptitle(result["model"])
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
  args = parse_args(argv)
  if args.plot:  # fail now, not after the minutes of work the plot is made of
    import importlib.util
    if importlib.util.find_spec("matplotlib") is None:
      raise SystemExit("jinfer.bench.long_context: --plot needs matplotlib, which is not "
                       "installed: pip install \"jinfer[plot]\" (or pass --plot '' for no plot)")
  init_devices(args.devices)
  import jax
  import numpy as np

  from jinfer.bench.machine import machine_info
  from jinfer.bench.report import emit
  from jinfer.tokenizer import Tokenizer
  from jinfer.weights.builtin import builtin_gguf_path, is_builtin

  t_start = time.perf_counter()
  machine = machine_info()
  path = builtin_gguf_path(args.model) if is_builtin(args.model) else args.model
  tok = (Tokenizer.from_gguf(path) if path.endswith(".gguf") else Tokenizer.from_dir(path))

  sentences = filler_sentences()
  builder = NeedleBuilder(tok, sentences)
  rng = np.random.default_rng(args.seed)
  trials = []
  for length in args.lengths:
    for depth in args.depths:
      code = str(rng.integers(10000, 100000))
      ids, at = builder.build(length, depth, code)
      trials.append({"length": length, "depth": depth, "passcode": code, "prompt_ids": ids,
                     "needle_token": at})
  # The perplexity text starts elsewhere in the filler than the haystacks do.
  ppl_text = " ".join(sentences[len(sentences) // 2:] + sentences[:len(sentences) // 2])
  ppl_ids = tok.encode(ppl_text)[:max(args.lengths)]
  args.ppl_positions = len(ppl_ids) - 1

  result = {"machine": machine, "model": args.model, "context_parallel_size": args.cp,
            "context_layout": args.layout, "devices": jax.device_count(),
            "lengths": args.lengths, "depths": args.depths, "cp_lengths": args.cp_lengths,
            "prompt_style": "chat template" if builder.chat else "completion",
            "max_num_batched_tokens": args.max_num_batched_tokens, "warmup": args.warmup,
            "filler": "CPython pydoc_data topics, whitespace collapsed"}
  cp_trials = [t for t in trials if t["length"] in args.cp_lengths]
  cp_run = run_engine(args, args.cp, cp_trials, ppl_ids[:args.cp_ppl_tokens])
  result["cp"] = summarize(args, cp_trials, cp_run)
  if args.baseline:
    one_run = run_engine(args, 1, trials, ppl_ids)
    result["one_device"] = summarize(args, trials, one_run)
    result["cp_vs_one_device"] = compare(cp_run, one_run)
  result["total_s"] = round(time.perf_counter() - t_start, 2)
  if hasattr(os, "getloadavg"):
    result["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
  # Peak resident memory of this process (Linux reports KiB): every engine's, compiles included.
  result["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)

  emit(result, args.out)
  if args.plot:
    plot(result, args.plot)
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
