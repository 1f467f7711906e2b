"""Online learning: SmolLM2 learns to answer in a target number of tokens, trained on its own
samples in the same process that serves them (jinfer/training/online.py).

    python examples/online_learning.py [--rounds 30] [--target 8] [--plot docs/online-learning.png]

Every round each question is answered k times (temperature 1, the sampled tokens' logprobs
under that distribution), a length reward scores the answers, a GRPO step trains a LoRA through
the model's own forward, and `update_lora` puts it in the engine for the next round. Prints a
line per round, then the mean reward of the first and last rounds.
"""
import argparse
import json

from jinfer.loader import load_model
from jinfer.training.online import OnlineConfig, OnlineLoop, length_reward

QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 7 times 6?",
             "Which planet is known as the red planet?", "What do bees make?",
             "What is the opposite of hot?", "How many legs does a spider have?",
             "What is frozen water called?"]


def plot(history, path: str, target: int):
  import matplotlib
  matplotlib.use("Agg")  # no display; writes the file only
  import matplotlib.pyplot as plt
  rounds = [h["round"] for h in history]
  fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
  ax.plot(rounds, [h["reward_mean"] for h in history], marker="o", ms=3, label="mean")
  ax.fill_between(rounds, [h["reward_min"] for h in history], [h["reward_max"] for h in history],
                  alpha=0.2, label="min..max")
  ax.set(xlabel="round", ylabel="reward", title="length reward per round")
  ax.legend()
  ax2.plot(rounds, [h["mean_tokens"] for h in history], marker="o", ms=3)
  ax2.axhline(target, color="gray", ls="--", lw=1, label=f"target {target}")
  ax2.set(xlabel="round", ylabel="tokens", title="mean answer length")
  ax2.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="smollm2-135m-instruct")
  ap.add_argument("--rounds", type=int, default=30)
  ap.add_argument("--prompts", type=int, default=len(QUESTIONS), help="questions per round")
  ap.add_argument("--samples", type=int, default=4, help="answers per question (k)")
  ap.add_argument("--max-tokens", type=int, default=32)
  ap.add_argument("--target", type=int, default=8, help="the rewarded answer length in tokens")
  ap.add_argument("--learning-rate", type=float, default=2e-3)
  ap.add_argument("--rank", type=int, default=8)
  ap.add_argument("--json", help="write every round's numbers here")
  ap.add_argument("--plot", help="write the reward curve here (needs matplotlib)")
  args = ap.parse_args()
  config, params, tok = load_model(args.model)
  cfg = OnlineConfig(samples_per_prompt=args.samples, max_tokens=args.max_tokens,
                     learning_rate=args.learning_rate, rank=args.rank)
  prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                     tokenize=True)
             for q in (QUESTIONS * args.prompts)[:args.prompts]]
  longest = max(map(len, prompts))
  loop = OnlineLoop(config, params, tok, cfg, length_reward(args.target, args.max_tokens),
                    max_model_len=longest + args.max_tokens + 1,
                    max_num_seqs=len(prompts) * args.samples, max_num_batched_tokens=256)
  for i in range(args.rounds):
    s = loop.run_round(prompts)
    if i in (0, args.rounds - 1):
      print(f"  {QUESTIONS[0]!r} -> {loop.last.texts[0]!r}")
    print(f"round {s.round}: reward {s.reward_mean:.3f} ({s.reward_min:.2f}..{s.reward_max:.2f}), "
          f"{s.mean_tokens:.1f} tokens, logprob gap {s.max_logprob_gap:.1e}, "
          f"prefill {s.prefill_tokens} tokens, rollout {s.rollout_seconds:.1f} s, "
          f"train {s.train_seconds:.1f} s, update {s.update_seconds * 1e3:.0f} ms", flush=True)
  history = [vars(h) for h in loop.history]
  n = max(1, len(history) // 5)
  first = sum(h["reward_mean"] for h in history[:n]) / n
  last = sum(h["reward_mean"] for h in history[-n:]) / n
  print(f"mean reward: first {n} rounds {first:.3f}, last {n} rounds {last:.3f}")
  if args.json:
    with open(args.json, "w") as fh:
      json.dump({"args": vars(args), "rounds": history}, fh, indent=1)
  if args.plot:
    plot(history, args.plot, args.target)


if __name__ == "__main__":
  main()
