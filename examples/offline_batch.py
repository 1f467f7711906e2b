"""Offline batch inference: many prompts in one `generate` call, each with its own sampling
settings, seeded so that a second run gives the same text.

    python examples/offline_batch.py [--model smollm2-135m-instruct] [--num-prompts 24]
        [--max-tokens 48]

The engine batches the requests continuously: they enter and leave the running batch as they
arrive and finish, whatever their settings. A request with a seed draws the same tokens alone or
inside any batch.
"""
import argparse
import time

from jinfer import LLM, SamplingParams

SUBJECTS = ["the Moon", "honeybees", "volcanoes", "jazz", "the Roman Empire", "coffee",
            "black holes", "chess", "rainforests", "the printing press", "glaciers", "owls"]
TEMPLATES = ["Write one sentence about {}.", "Give a fun fact about {}."]

# Three ways to sample, by name: greedy, a creative one, and a focused one with two samples.
SETTINGS = {
    "greedy": dict(temperature=0.0),
    "creative": dict(temperature=1.0, top_p=0.9),
    "focused": dict(temperature=0.7, top_k=20, repetition_penalty=1.1, n=2),
}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default="smollm2-135m-instruct")
  ap.add_argument("--num-prompts", type=int, default=24)
  ap.add_argument("--max-tokens", type=int, default=48)
  ap.add_argument("--max-num-seqs", type=int, default=16, help="sequences in a batch at most")
  ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                  help="compile every step shape up front (off: on first use)")
  args = ap.parse_args(argv)

  llm = LLM(args.model, max_model_len=256, max_num_seqs=args.max_num_seqs, warmup=args.warmup)
  questions = [t.format(s) for s in SUBJECTS for t in TEMPLATES]
  prompts, params, names = [], [], []
  for i in range(args.num_prompts):
    name = list(SETTINGS)[i % len(SETTINGS)]
    prompts.append(questions[i % len(questions)])
    # The seed makes each request's draws its own: the same whatever else runs beside it.
    params.append(SamplingParams(**SETTINGS[name], max_tokens=args.max_tokens, seed=i))
    names.append(name)

  t0 = time.perf_counter()
  outputs = llm.generate(prompts, params, use_tqdm=False)
  seconds = time.perf_counter() - t0
  tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
  print(f"{len(prompts)} prompts, {tokens} tokens in {seconds:.2f} s "
        f"({tokens / seconds:.0f} tokens/s)")
  for name in SETTINGS:
    i = names.index(name)
    for c in outputs[i].outputs:
      print(f"[{name}] {prompts[i]!r} -> {c.text!r}")

  # Run again, in a different order: seeded requests give back exactly the same tokens.
  order = list(reversed(range(len(prompts))))
  again = llm.generate([prompts[i] for i in order], [params[i] for i in order], use_tqdm=False)
  same = all([c.token_ids for c in outputs[i].outputs] == [c.token_ids for c in o.outputs]
             for i, o in zip(order, again))
  print(f"second run, reversed order: {'the same tokens' if same else 'DIFFERENT tokens'}")


if __name__ == "__main__":
  main()
