"""Quickstart: load a model and complete a few prompts.

    python examples/quickstart.py [--model smollm2-135m-instruct] [--max-tokens 32]

`--model` is a built-in name (the default, fetched and verified on first use), an HF model
directory or a .gguf file.
"""
import argparse

from jinfer import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:",
    "def fibonacci(n):",
]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default="smollm2-135m-instruct")
  ap.add_argument("--max-tokens", type=int, default=32)
  ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                  help="compile every step shape up front (off: on first use, quicker for a "
                       "handful of prompts)")
  args = ap.parse_args(argv)

  # Engine options go by keyword, with vLLM's names; these keep the KV cache small.
  llm = LLM(args.model, max_model_len=256, max_num_seqs=8, warmup=args.warmup)
  params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.max_tokens, seed=0)
  for out in llm.generate(PROMPTS, params):
    completion = out.outputs[0]
    print(f"{out.prompt!r} -> {completion.text!r} ({len(completion.token_ids)} tokens, "
          f"{completion.finish_reason})")


if __name__ == "__main__":
  main()
