"""Streaming from asyncio: several requests generate at once, each printing its tokens as they
come (what the HTTP server does for `"stream": true`).

    python examples/async_streaming.py [--model smollm2-135m-instruct] [--max-tokens 32]

`AsyncLLMEngine` runs an `LLMEngine` on a background thread, so the event loop stays free while
the device works. `generate` queues a request and returns its stream at once; iterating the stream
gives one output per engine step with the text and token ids new since the last
(`delta_text`, `delta_token_ids`). Leaving the loop early (or cancelling the task) aborts the
request and frees its pages.
"""
import argparse
import asyncio

from jinfer import EngineConfig, LLMEngine, SamplingParams
from jinfer.engine.async_engine import AsyncLLMEngine

PROMPTS = {
    "sea": "Here is a short poem about the sea:",
    "code": "def fibonacci(n):",
    "story": "Once upon a time, in a small village,",
}


async def stream(engine: AsyncLLMEngine, name: str, prompt: str, params: SamplingParams) -> str:
  text = ""
  async for out in engine.generate(prompt, params):
    delta = out.outputs[0].delta_text
    text += delta
    print(f"[{name}] +{delta!r}", flush=True)
  print(f"[{name}] done: {out.outputs[0].finish_reason}", flush=True)
  return text


async def run(args) -> dict[str, str]:
  engine = AsyncLLMEngine(LLMEngine(args.model, warmup=args.warmup, config=EngineConfig.of(
      max_model_len=256, max_num_seqs=8)))
  engine.start()
  try:
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    texts = await asyncio.gather(*(stream(engine, name, prompt, params)
                                   for name, prompt in PROMPTS.items()))
  finally:
    await engine.shutdown()
  return dict(zip(PROMPTS, texts))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default="smollm2-135m-instruct")
  ap.add_argument("--max-tokens", type=int, default=32)
  ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                  help="compile every step shape up front (off: on first use)")
  args = ap.parse_args(argv)
  for name, text in asyncio.run(run(args)).items():
    print(f"{name}: {PROMPTS[name]!r} -> {text!r}")


if __name__ == "__main__":
  main()
