"""LoRA adapters: the same questions answered by the base model and by two adapters, all in one
batch of one engine; each request names its adapter (or none).

    python examples/lora.py [--max-tokens 48] [--adapter NAME=PATH ...]

The adapters shipped with jinfer for SmolLM2-135M-Instruct are found by name:
`smollm2-135m-signoff` opens with a greeting and signs off, `smollm2-135m-allcaps` answers in
capitals. A PEFT directory (`adapter_config.json`, `adapter_model.safetensors`) works as well,
for any model: `--model DIR --adapter mine=path/to/adapter`.
"""
import argparse

from jinfer import LLM, LoRARequest, SamplingParams

QUESTIONS = ["What is a rainbow?", "Why do cats purr?"]


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="smollm2-135m-instruct")
  ap.add_argument("--adapter", nargs="+", metavar="NAME=PATH",
                  default=["signoff=smollm2-135m-signoff", "allcaps=smollm2-135m-allcaps"])
  ap.add_argument("--max-tokens", type=int, default=48)
  args = ap.parse_args()
  # One int id per adapter, as vLLM's LoRARequest has; max_loras device slots serve them at once.
  adapters = [LoRARequest(name, i + 1, path) for i, (name, path) in
              enumerate(a.split("=", 1) for a in args.adapter)]
  llm = LLM(args.model, enable_lora=True, max_loras=len(adapters), max_lora_rank=16,
            max_model_len=512, max_num_seqs=8)
  # Every question under every adapter and the base (None): one call, one batch.
  runs = [(q, lora) for lora in [None, *adapters] for q in QUESTIONS]
  outs = llm.chat([[{"role": "user", "content": q}] for q, _ in runs],
                  SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
                  lora_request=[lora for _, lora in runs], use_tqdm=False)
  for (q, lora), out in zip(runs, outs):
    print(f"[{'base' if lora is None else lora.lora_name}] {q} -> {out.outputs[0].text!r}")


if __name__ == "__main__":
  main()
