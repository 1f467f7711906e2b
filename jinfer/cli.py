"""The `jinfer` command: generate, chat, bench, quantize, serve, precompile, plan, bench-serve."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from jinfer import logs
from jinfer.serving.options import ServerOptions
from jinfer.serving.tool_parsers import PARSERS
from jinfer.loader import DEFAULT_MODEL
from jinfer.tokenizer import NoChatTemplate


def _field_help() -> dict[str, str]:
  """Each engine option's help: the comment lines above its field in its config section and the
  comment after it, so the section stays the one place an option is described."""
  import inspect
  import re

  from jinfer.engine.engine_config import SECTIONS
  out = {}
  for cls in SECTIONS.values():
    above = []
    for line in inspect.getsource(cls).splitlines():
      code, _, comment = line.partition("#")
      field = re.match(r"\s+(\w+): ", code)
      if field:
        out[field.group(1)] = " ".join(above + [comment.strip()]).strip()
        above = []
      elif comment and not code.strip():
        above.append(comment.strip())
      else:
        above = []
  return out


def _config_only_names() -> tuple[str, ...]:
  from jinfer.weights.builtin import CONFIG_ONLY_MODELS
  return CONFIG_ONLY_MODELS


# Short flags kept from before the options were generated.
_ALIASES = {"tensor_parallel_size": "-tp", "context_parallel_size": "-cp",
            "data_parallel_size": "-dp"}


def _add_engine_args(p, *, skip: tuple[str, ...] = (), **defaults):
  """A flag per engine option (vLLM's names: --max-model-len, --tensor-parallel-size,
  --speculative-config JSON, ...), grouped by config section, help from the field's comment;
  `defaults` override the sections'; `skip`: options this command sets itself."""
  from jinfer.engine.engine_config import KV_TRANSFER, SPECULATIVE, option_fields
  helps = _field_help()
  p.add_argument("--dtype", default="auto", choices=DTYPES,
                 help="weights and activations; auto: float32 on the CPU, bfloat16 elsewhere")
  groups = {}
  for section, f in option_fields():
    if f.name in skip:
      continue
    if section not in groups:
      groups[section] = p.add_argument_group(f"engine options: {section}")
    flags = ["--" + f.name.replace("_", "-")] + ([_ALIASES[f.name]] if f.name in _ALIASES else [])
    kind = str(f.type)
    kw = dict(default=defaults.get(f.name, f.default), help=helps.get(f.name) or None)
    if kind == "bool":
      kw["action"] = argparse.BooleanOptionalAction
    elif kind == "bool | None":
      kw.update(type=_bool, metavar="{true,false}")
    elif kind.startswith("int"):
      kw["type"] = int
    elif kind.startswith("float"):
      kw["type"] = float
    elif kind.startswith("dict"):
      kw["metavar"] = "JSON"
    groups[section].add_argument(*flags, **kw)
  p.set_defaults(_engine_skip=skip)
  if SPECULATIVE not in skip:
    p.add_argument_group("engine options: speculative").add_argument(
        "--speculative-config", metavar="JSON", default=defaults.get(SPECULATIVE),
        help="speculative decoding, as JSON: {\"method\": \"ngram\" | \"draft_model\" | "
             "\"medusa\", \"num_speculative_tokens\": k, ...} (see SpeculativeConfig)")
  if KV_TRANSFER not in skip:
    p.add_argument_group("engine options: disaggregated prefill and decode").add_argument(
        "--kv-transfer-config", metavar="JSON", default=defaults.get(KV_TRANSFER),
        help="prefill and decode on separate devices, as JSON: {\"kv_connector\": "
             "\"in_process\", \"prefill_devices\": N, \"decode_devices\": M, "
             "\"prefill_tensor_parallel_size\": T, \"decode_tensor_parallel_size\": T, "
             "\"prefill_num_pages\": P} (see KVTransferConfig)")


DTYPES = ("auto", "bfloat16", "float16", "float32")  # vLLM's --dtype choices


def _dtype(args):
  """`--dtype` as `LLM(dtype=)` takes it: None for auto (the platform's default)."""
  import jax.numpy as jnp
  name = getattr(args, "dtype", "auto")
  return None if name == "auto" else jnp.dtype(name)


def _bool(text: str) -> bool:
  if text.lower() not in ("true", "false"):
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
  return text.lower() == "true"


def _engine_config(args, **override):
  from jinfer.engine.engine_config import KV_TRANSFER, SPECULATIVE, EngineConfig, option_fields
  from jinfer.weights.builtin import resolve_speculative_model
  names = [f.name for _, f in option_fields()] + [SPECULATIVE, KV_TRANSFER]
  # A command's own flag of an option's name (generate's request --seed, bench's prompt --seed)
  # is not that engine option.
  skip = getattr(args, "_engine_skip", ())
  options = {n: getattr(args, n) for n in names if hasattr(args, n) and n not in skip}
  if options.get(SPECULATIVE) is not None:
    options[SPECULATIVE] = resolve_speculative_model(options[SPECULATIVE])
  return EngineConfig.of(**{**options, **override})


def _engine(args, **override):
  from jinfer.engine.engine import LLMEngine
  # One-shot commands run in the startup buckets only (a long prompt is chunked to them):
  # compiling every bucket costs more than it saves here.
  return LLMEngine(args.model, dtype=_dtype(args), config=_engine_config(args, **override),
                   warmup="never")


def _params(args):
  from jinfer.sampling.params import SamplingParams, StructuredOutputsParams
  constraint = None
  if getattr(args, "json_schema", None) is not None:
    schema = args.json_schema
    if not schema.lstrip().startswith("{"):  # a file holding the schema
      with open(schema) as fh:
        schema = fh.read()
    constraint = StructuredOutputsParams(json=schema)
  elif getattr(args, "regex", None) is not None:
    constraint = StructuredOutputsParams(regex=args.regex)
  elif getattr(args, "choice", None):
    constraint = StructuredOutputsParams(choice=args.choice)
  return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        max_tokens=args.max_tokens, seed=args.seed,
                        structured_outputs=constraint)


def _stream(engine, prompt, params, lora=None) -> str:
  """Run one request, printing text as it comes; returns the whole text. An empty answer says
  why on stderr (an instruct model asked for a raw completion often ends its turn at once)."""
  rid = engine.add_request(None, prompt, params, lora_request=lora)
  text, finish = "", None
  while engine.has_unfinished_requests():
    for out in engine.step():
      if out.request_id == rid:
        delta = out.outputs[0].delta_text
        text += delta
        finish = out.outputs[0].finish_reason
        print(delta, end="", flush=True)
  print()
  if not text.strip():
    print(f"jinfer: the model produced no text (finish reason: {finish})", file=sys.stderr)
  return text


def cmd_generate(args):
  lora, override = None, {}
  if args.lora is not None:  # one adapter: slots as wide as its rank
    from jinfer.engine.lora_slots import LoRARequest
    from jinfer.weights.peft_adapter import AdapterError, adapter_rank
    try:
      override = dict(enable_lora=True, max_lora_rank=adapter_rank(args.lora))
    except AdapterError as e:
      raise SystemExit(f"error: --lora: {e}") from None
    lora = LoRARequest("lora", 1, args.lora)
  engine = _engine(args, **override)
  prompt = args.prompt
  if not args.raw and engine.tokenizer.chat_template is not None:
    # As `ollama run` and `mlx_lm.generate` do: an instruct model answers a user turn.
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                  tokenize=True)
  _stream(engine, prompt, _params(args), lora)


def cmd_chat(args):
  engine = _engine(args)
  messages = [{"role": "system", "content": args.system}] if args.system else []
  print("jinfer chat: type a message, an empty line or Ctrl-D to quit.", file=sys.stderr)
  while True:
    try:
      line = input("> ")
    except EOFError:
      break
    if not line.strip():
      break
    messages.append({"role": "user", "content": line})
    try:
      prompt = engine.tokenizer.apply_chat_template(messages, tokenize=True)
    except NoChatTemplate as e:
      raise SystemExit(f"error: {e} (`jinfer generate` completes text)") from None
    try:
      reply = _stream(engine, prompt, _params(args))
    except ValueError as e:  # e.g. the conversation outgrew max_model_len
      print(f"error: {e}", file=sys.stderr)
      messages.pop()
      continue
    messages.append({"role": "assistant", "content": reply})


def cmd_bench(args):
  import json

  from jinfer.bench.offline import RandomWorkload, run_offline
  from jinfer.engine.data_parallel import create_engine
  workload = RandomWorkload(num_prompts=args.num_prompts, input_len_min=args.input_len_min,
                            input_len_max=args.input_len_max, output_len=args.output_len,
                            output_len_min=args.output_len_min, seed=args.seed)
  config = _engine_config(args, max_model_len=args.max_model_len or workload.max_len)
  # Every bucket compiled first, so that no compile runs beside the timed run.
  engine = create_engine(args.model, dtype=_dtype(args), config=config, warmup="now")
  summary = {"model": args.model, **run_offline(engine, workload)}
  text = json.dumps(summary, indent=2)
  print(text)
  if args.out:
    with open(args.out, "w") as fh:
      fh.write(text + "\n")


def cmd_quantize(args):
  from jinfer.engine.engine import LLMEngine
  engine = LLMEngine(args.model, dtype=_dtype(args), config=_engine_config(args), warmup=False)
  engine.save_quantized(args.out)
  print(f"saved {args.model} ({args.quantization}) to {args.out}: "
        f"{engine.stats().weight_bytes / 2**20:.0f} MiB of weights", file=sys.stderr)


# What `jinfer serve` imports beyond the library: the `serve` extra.
SERVE_EXTRA = ("fastapi", "uvicorn")


def _require_serve_extra() -> None:
  import importlib.util
  missing = [m for m in SERVE_EXTRA if importlib.util.find_spec(m) is None]
  if missing:
    print(f"jinfer serve needs {' and '.join(missing)}, which are not installed; install the "
          f"serve extra:\n  pip install \"jinfer[serve]\"", file=sys.stderr)
    sys.exit(1)


def cmd_serve(args):
  _require_serve_extra()
  from jinfer.serving.adapters import parse_lora_modules
  from jinfer.serving.server import serve
  from jinfer.parallel.distributed import DistributedConfig
  config = _engine_config(args)
  dist = DistributedConfig(coordinator_address=args.coordinator_address,
                           num_processes=args.num_processes, process_id=args.process_id)
  try:
    lora_modules = parse_lora_modules(args.lora_modules)
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  options = ServerOptions(
      host=args.host, port=args.port, api_key=args.api_key,
      allowed_hosts=tuple(args.allowed_hosts), allowed_origins=tuple(args.allowed_origins),
      max_request_bytes=args.max_request_bytes, header_timeout=args.header_timeout,
      body_timeout=args.body_timeout, max_connections=args.max_connections,
      max_waiting=args.max_waiting, shutdown_timeout=args.shutdown_timeout,
      enable_auto_tool_choice=args.enable_auto_tool_choice,
      tool_call_parser=args.tool_call_parser,
      lora_modules=lora_modules,
      allow_runtime_lora_updating=args.allow_runtime_lora_updating,
      lora_allowed_roots=tuple(args.lora_allowed_roots))
  serve(args.model, options=options, served_model_name=args.served_model_name, config=config,
        distributed_config=dist, dtype=_dtype(args))


def cmd_precompile(args) -> dict:
  """Build the engine `jinfer serve` would, with its full warmup, so that every step it compiles
  lands in the persistent compilation cache; a server started later with the same options (and
  cache) loads them instead of compiling. Prints and returns what it did."""
  import json
  import time

  from jinfer.engine import compilation_cache
  from jinfer.engine.data_parallel import create_engine
  start = time.perf_counter()
  config = _engine_config(args)
  # Before anything compiles, so that loading the weights is cached too.
  cache = compilation_cache.enable()
  compiled, loaded = compilation_cache.compiles(), compilation_cache.cache_hits()
  # Every bucket, not some.
  engine = create_engine(args.model, dtype=_dtype(args), config=config, warmup="now")
  engine.close()
  summary = {"model": args.model, "compilation_cache": cache,
             "compiled": compilation_cache.compiles() - compiled,
             "loaded_from_cache": compilation_cache.cache_hits() - loaded,
             "seconds": round(time.perf_counter() - start, 1)}
  print(json.dumps(summary))
  return summary


def cmd_plan(args) -> dict:
  """Build the steps `jinfer serve` would run, with the same options, for a target this machine
  need not have, and say whether they fit; prints the plan (JSON with --json)."""
  import json

  import jax

  from jinfer.plan import plan
  from jinfer.targets import CompilerMissing
  # A plan runs nothing here: jax's own backends stay on the CPU, where a venv holding the TPU
  # and GPU compilers would otherwise try each (and warn) at start.
  jax.config.update("jax_platforms", "cpu")
  try:
    p = plan(args.model, args.target, config=_engine_config(args), dtype=_dtype(args),
             gpu_memory_utilization=args.gpu_memory_utilization, context_len=args.context_len,
             buckets=args.buckets)
  except CompilerMissing as e:
    print(f"jinfer: error: {e}", file=sys.stderr)
    sys.exit(2)
  out = p.to_json()
  print(json.dumps(out, indent=2) if args.json else p.report())
  return out


def _add_multi_process_args(p):
  p.add_argument("--coordinator-address", default=None,
                 help="host:port of process 0, for one process per host")
  p.add_argument("--num-processes", type=int, default=1)
  p.add_argument("--process-id", type=int, default=0,
                 help="0 serves HTTP; the others run its steps")


def cmd_bench_serve(args):
  import json
  import math

  from jinfer.bench.load_generator import LoadConfig, parse_goodput, run_load
  cfg = LoadConfig(url=args.url, model=args.model, num_requests=args.num_requests,
                   max_concurrency=args.max_concurrency,
                   request_rate=math.inf if args.request_rate is None else args.request_rate,
                   input_len=tuple(args.input_len), output_len=args.output_len,
                   vocab_size=args.vocab_size, temperature=args.temperature,
                   max_duration=args.max_duration, seed=args.seed,
                   goodput=parse_goodput(args.goodput), api_key=args.api_key)
  result = json.dumps(run_load(cfg), indent=2)
  print(result)
  if args.output:
    with open(args.output, "w") as fh:
      fh.write(result + "\n")


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="jinfer", description="JAX/Pallas LLM inference")
  sub = ap.add_subparsers(dest="command", required=True)

  def common(p, max_tokens=256, temperature=0.7):
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="built-in name, HF model directory or .gguf file")
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=temperature)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    # generate and chat run one LLMEngine (no data-parallel front end); `--seed` above seeds
    # the request. One sequence at a time: the KV pool holds one (by default it holds
    # max_num_seqs half-length ones: 3 GB for SmolLM2, zeroed at start) and the steps are
    # compiled for one.
    _add_engine_args(p, skip=("seed", "data_parallel_size", "kv_transfer_config"),
                     max_num_seqs=1)

  p = sub.add_parser("generate", help="answer one prompt, streaming the text")
  common(p, temperature=0.0)
  p.add_argument("--raw", action="store_true",
                 help="complete the prompt as plain text instead of a chat turn")
  constrain = p.add_mutually_exclusive_group()
  constrain.add_argument("--json-schema", metavar="SCHEMA",
                         help="answer with JSON that validates against this schema (its JSON "
                              "text, or a file holding it)")
  constrain.add_argument("--regex", help="answer with text that matches this regex")
  constrain.add_argument("--choice", action="append", metavar="TEXT",
                         help="answer with one of these strings (repeat the option)")
  p.add_argument("--lora", metavar="PATH", default=None,
                 help="answer with this LoRA adapter (a PEFT directory, or a shipped adapter's "
                      "name such as smollm2-135m-signoff)")
  p.add_argument("prompt")
  p.set_defaults(fn=cmd_generate)

  p = sub.add_parser("chat", help="interactive chat with the model's chat template")
  common(p)
  p.add_argument("--system", default=None, help="system message")
  p.set_defaults(fn=cmd_chat)

  p = sub.add_parser("bench", help="offline throughput on random prompts; prints JSON")
  p.add_argument("--model", default=DEFAULT_MODEL,
                 help="built-in name, HF model directory or .gguf file")
  p.add_argument("--num-prompts", type=int, default=64)
  p.add_argument("--input-len-min", type=int, default=32)
  p.add_argument("--input-len-max", type=int, default=512)
  p.add_argument("--output-len", type=int, default=128, help="the (longest) output length")
  p.add_argument("--output-len-min", type=int, default=None,
                 help="output lengths uniform in [this, --output-len] (default: all equal)")
  p.add_argument("--seed", type=int, default=0, help="numpy seed of the prompts")
  p.add_argument("--out", default=None, help="also write the JSON to this file")
  # One engine, or prefill and decode engines (--kv-transfer-config); max_model_len defaults
  # to the longest prompt + output the workload can make.
  _add_engine_args(p, skip=("seed", "data_parallel_size"), max_model_len=None)
  p.set_defaults(fn=cmd_bench)

  p = sub.add_parser("quantize", help="quantize a model once (AWQ/GPTQ calibrate) and save it; "
                                      "`--model DIR` then loads it as it is")
  p.add_argument("--model", default=DEFAULT_MODEL)
  p.add_argument("--out", required=True, help="directory to save the quantized model into")
  _add_engine_args(p, skip=("data_parallel_size", "kv_transfer_config"))
  p.set_defaults(fn=cmd_quantize)

  p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the `serve` extra)")
  serving = ServerOptions()  # the defaults
  p.add_argument("--model", default=DEFAULT_MODEL,
                 help="built-in name, HF model directory or .gguf file")
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--port", type=int, default=8000)
  p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1")
  p.add_argument("--served-model-name", default=None, help="the model's name in the API")
  p.add_argument("--max-waiting", type=int, default=serving.max_waiting,
                 help="sequences waiting to be scheduled beyond which requests get 429")
  p.add_argument("--shutdown-timeout", type=float, default=serving.shutdown_timeout,
                 help="seconds in-flight requests may run on after SIGTERM before being aborted")
  p.add_argument("--allowed-hosts", nargs="*", default=[], metavar="HOST",
                 help="without --api-key, Host names accepted besides the bound address "
                      "(* for any)")
  p.add_argument("--allowed-origins", nargs="*", default=[], metavar="ORIGIN",
                 help="origins browsers may call the server from, e.g. http://localhost:3000 "
                      "(CORS; * for any; default none)")
  p.add_argument("--max-request-bytes", type=int, default=serving.max_request_bytes,
                 help="larger request bodies get 413")
  p.add_argument("--header-timeout", type=float, default=serving.header_timeout,
                 help="seconds a connection may take to send a request's headers")
  p.add_argument("--body-timeout", type=float, default=serving.body_timeout,
                 help="seconds a request may take to send its body (then 408)")
  p.add_argument("--max-connections", type=int, default=serving.max_connections,
                 help="requests beyond this many open connections get 503")
  p.add_argument("--enable-auto-tool-choice", action="store_true",
                 help='answer tool_choice "auto" (the default with tools) by parsing the '
                      "model's calls; needs --tool-call-parser")
  p.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                 help="the tool-call format of the model's chat template (a template without "
                      "one gets jinfer's default tool prompt and hermes)")
  p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                 help="LoRA adapters served by name (the request's `model`; needs "
                      "--enable-lora); PATH may be a shipped adapter's name; vLLM's JSON form "
                      '{"name": ..., "path": ...} works too')
  p.add_argument("--allow-runtime-lora-updating", action="store_true",
                 help="let clients load and unload adapters (/v1/load_lora_adapter, "
                      "/v1/unload_lora_adapter) from under --lora-allowed-roots")
  p.add_argument("--lora-allowed-roots", nargs="+", default=[], metavar="DIR",
                 help="directories run-time loads may read adapters from (default: those of "
                      "--lora-modules and the shipped adapters')")
  _add_engine_args(p)
  _add_multi_process_args(p)
  p.set_defaults(fn=cmd_serve)

  p = sub.add_parser("precompile", help="fill the compilation cache for `jinfer serve` with the "
                                        "same options ahead of time (for a deployment image)")
  p.add_argument("--model", default=DEFAULT_MODEL,
                 help="built-in name, HF model directory or .gguf file")
  _add_engine_args(p)
  p.set_defaults(fn=cmd_precompile)

  from jinfer.targets import TARGETS
  p = sub.add_parser("plan", help="will this model and these options fit and build on a TPU "
                                  "slice or GPU? (its real compiler, no hardware needed)")
  p.add_argument("--model", default=DEFAULT_MODEL,
                 help="built-in name, HF model directory, .gguf file, config.json, or a "
                      "shipped config: " + ", ".join(_config_only_names()))
  p.add_argument("--target", required=True, choices=list(TARGETS))
  p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                 help="the share of each device's HBM the weights, KV pool and step may use")
  p.add_argument("--context-len", type=int, default=None,
                 help="tokens of context per sequence in the decode estimates (default: half "
                      "max_model_len)")
  p.add_argument("--buckets", type=int, nargs="*", default=None, metavar="T",
                 help="build only these token buckets (default: every step serve warms up)")
  p.add_argument("--json", action="store_true", help="print the plan as JSON")
  _add_engine_args(p, skip=("data_parallel_size", "kv_transfer_config"))
  p.set_defaults(fn=cmd_plan)

  p = sub.add_parser("bench-serve", help="load a local server with random prompts; JSON figures")
  p.add_argument("--url", default="http://127.0.0.1:8000", help="a loopback address only")
  p.add_argument("--model", default=None, help="default: the first model the server lists")
  p.add_argument("--num-requests", type=int, default=32)
  p.add_argument("--max-concurrency", type=int, default=None)
  p.add_argument("--request-rate", type=float, default=None,
                 help="Poisson arrivals per second (default: all at once)")
  p.add_argument("--input-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"),
                 help="prompt tokens, drawn uniformly")
  p.add_argument("--output-len", type=int, default=64)
  p.add_argument("--vocab-size", type=int, default=10_000,
                 help="prompt token ids are drawn below this")
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--max-duration", type=float, default=600.0,
                 help="seconds; requests still running then are cut")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--goodput", nargs="*", default=[], metavar="METRIC:MS",
                 help="SLOs for goodput, e.g. ttft:500 tpot:100 e2el:5000")
  p.add_argument("--api-key", default=None)
  p.add_argument("--output", default=None, help="also write the JSON here")
  p.set_defaults(fn=cmd_bench_serve)

  ap.add_argument("-q", "--quiet", action="store_true",
                  help="no progress messages (loading, compiling) on stderr")
  return ap


# Commands that end when their answer is printed, with nothing running in the background
# (their engines compile no bucket ahead of need).
ONE_SHOT = ("generate", "chat")


def main(argv: list[str] | None = None) -> str:
  """Runs a command; returns its name."""
  args = parser().parse_args(argv)
  logs.configure(logging.WARNING if args.quiet else logging.INFO)
  try:
    args.fn(args)
  except (ValueError, FileNotFoundError, RuntimeError) as e:
    print(f"jinfer: error: {e}", file=sys.stderr)
    sys.exit(2)
  return args.command


def run() -> None:
  """The `jinfer` console script: `main`, and after a one-shot command the process ends at once.
  The interpreter's own teardown (collecting and freeing every traced program, executable and
  array) took 0.6 s of a 5 s `jinfer generate`, and nothing in it matters once the answer is
  out: a compiled step reaches the compilation cache as it compiles."""
  if main() in ONE_SHOT:
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
  run()
