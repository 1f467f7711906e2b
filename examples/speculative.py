"""Speculative decoding: the same chat questions answered plainly, with n-gram prompt lookup and
with the distilled draft model shipped with jinfer; the tokens are the same, and the
acceptance statistics say how many steps speculation saved.

    python examples/speculative.py [--model smollm2-135m-instruct] [--methods ngram draft]
        [--k 3] [--max-tokens 64]

A proposer guesses the next k tokens of each sequence; one step of the target model checks them
all and keeps the longest run it would have produced itself, plus its own next token. Each
accepted guess is a step saved; nothing about the output changes. The shipped draft
(`smollm2-135m-draft`, found by name) belongs to SmolLM2-135M-Instruct: with another `--model`, use
`--methods ngram`.
"""
import argparse
import gc
import time

from jinfer import LLM, SamplingParams

DRAFT = "smollm2-135m-draft"  # a shipped checkpoint's name resolves from any directory
QUESTIONS = [
    # Answers that repeat the question's text: prompt lookup shines here.
    "Repeat this list exactly, then say how many items it has: Mercury, Venus, Earth, Mars, "
    "Jupiter, Saturn, Uranus, Neptune.",
    "Fix the typo in this code and show it whole:\ndef add(a, b):\n    retrun a + b",
    # Free answers: the draft model has to guess.
    "Explain photosynthesis in simple terms.",
    "What are three interesting facts about octopuses?",
]


def decode(args, speculative_config=None) -> tuple[list[list[int]], float, dict | None]:
  """(each prompt's tokens, seconds, speculation statistics) of one engine."""
  # Timed against each other: every step compiled first ("now"), none beside the timed run.
  llm = LLM(args.model, max_model_len=512, max_num_seqs=len(QUESTIONS),
            warmup="now" if args.warmup else False, speculative_config=speculative_config)
  params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
  t0 = time.perf_counter()
  outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params, use_tqdm=False)
  seconds = time.perf_counter() - t0
  spec = llm.engine.stats().spec
  del llm
  gc.collect()  # one engine's KV cache at a time
  return [o.outputs[0].token_ids for o in outs], seconds, spec and spec.summary()


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default="smollm2-135m-instruct")
  ap.add_argument("--methods", nargs="+", choices=("ngram", "draft"), default=["ngram", "draft"])
  ap.add_argument("--draft", default=DRAFT, help="the draft model: a checkpoint's name or path")
  ap.add_argument("--k", type=int, default=3, help="tokens proposed per step")
  ap.add_argument("--max-tokens", type=int, default=64)
  ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                  help="compile every step shape up front (off: on first use)")
  args = ap.parse_args(argv)

  configs = {
      "ngram": {"method": "ngram", "num_speculative_tokens": args.k},
      "draft": {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k},
  }
  timed = "" if args.warmup else ", compiles included"
  plain, seconds, _ = decode(args)
  print(f"plain: {sum(map(len, plain))} tokens in {seconds:.2f} s{timed}")
  for method in args.methods:
    tokens, seconds, spec = decode(args, configs[method])
    same = tokens == plain
    print(f"{method}: {sum(map(len, tokens))} tokens in {seconds:.2f} s{timed}; "
          f"{'the same tokens as plain decoding' if same else 'DIFFERENT tokens'}")
    print(f"  {spec['num_accepted_tokens']} of {spec['num_draft_tokens']} proposed tokens "
          f"accepted ({spec['acceptance_rate']:.0%}); by position: "
          + ", ".join(f"{a:.0%}" for a in spec["acceptance_per_position"]))
    print(f"  {spec['mean_tokens_per_verify']:.2f} tokens per step that checked proposals")


if __name__ == "__main__":
  main()
