"""`jinfer bench-serve`: load an OpenAI-compatible server on this machine and measure it.

Random token-id prompts go to `/v1/completions` as streams, either at a fixed concurrency or as
Poisson arrivals at a given rate (both bounds may apply), bounded in request count and in time.
The figures follow vLLM's `bench serve`: TTFT is the time to the first streamed chunk, ITL the
gaps between chunks, TPOT a request's (E2E - TTFT) / (output tokens - 1), and goodput the
requests per second that met every given SLO. Standard library only: it needs no server extra.
Only loopback addresses are accepted: this tool is for measuring a server on this machine.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import http.client
import ipaddress
import json
import math
import os
import platform
import threading
import time
import urllib.parse

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadConfig:
  url: str = "http://127.0.0.1:8000"
  model: str | None = None  # None: the first model the server lists
  num_requests: int = 32
  max_concurrency: int | None = None  # None: no limit beyond the arrival process
  request_rate: float = math.inf  # requests/s of a Poisson process; inf: all at once
  input_len: tuple[int, int] = (32, 256)  # prompt tokens, drawn uniformly in [lo, hi]
  output_len: int = 64  # max_tokens, with ignore_eos so every request generates them all
  vocab_size: int = 10_000  # prompt token ids are drawn from [0, vocab_size)
  temperature: float = 0.0
  max_duration: float = 600.0  # seconds; requests still running then are cut and fail
  seed: int = 0
  goodput: dict[str, float] = dataclasses.field(default_factory=dict)  # metric -> SLO in ms
  api_key: str | None = None

  def __post_init__(self):
    lo, hi = self.input_len
    if not 1 <= lo <= hi:
      raise ValueError(f"input_len must be 1 <= lo <= hi, got {self.input_len}")
    if self.num_requests < 1 or self.output_len < 1:
      raise ValueError("num_requests and output_len must be >= 1")
    if self.max_concurrency is not None and self.max_concurrency < 1:
      raise ValueError("max_concurrency must be >= 1")
    if not self.request_rate > 0:
      raise ValueError("request_rate must be > 0 (inf: all at once)")
    bad = set(self.goodput) - set(SLO_METRICS)
    if bad:
      raise ValueError(f"goodput metrics are {', '.join(SLO_METRICS)}; got {', '.join(bad)}")
    loopback_address(self.url)


@dataclasses.dataclass
class RequestResult:
  prompt_len: int
  ok: bool = False
  error: str | None = None
  output_tokens: int = 0
  ttft: float = 0.0  # seconds
  itl: list[float] = dataclasses.field(default_factory=list)
  latency: float = 0.0

  @property
  def tpot(self) -> float:
    return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def loopback_address(url: str) -> tuple[str, int, str]:
  """(host, port, path prefix) of an http URL on this machine; anything else raises."""
  u = urllib.parse.urlsplit(url)
  if u.scheme != "http":
    raise ValueError(f"{url}: only http:// URLs are supported")
  host = u.hostname or ""
  if host != "localhost":
    try:
      loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
      loopback = False
    if not loopback:
      raise ValueError(f"{url}: the load generator only targets loopback addresses "
                       f"(127.0.0.0/8, ::1, localhost)")
  return host, u.port or 80, u.path.rstrip("/")


class _Client:

  def __init__(self, cfg: LoadConfig):
    self.cfg = cfg
    self.host, self.port, self.prefix = loopback_address(cfg.url)
    self.headers = {"Content-Type": "application/json"}
    if cfg.api_key:
      self.headers["Authorization"] = f"Bearer {cfg.api_key}"

  def connect(self, timeout: float) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(self.host, self.port, timeout=max(timeout, 0.001))

  def first_model(self) -> str:
    conn = self.connect(30)
    try:
      conn.request("GET", f"{self.prefix}/v1/models", headers=self.headers)
      resp = conn.getresponse()
      body = json.loads(resp.read())
      if resp.status != 200:
        raise RuntimeError(f"GET /v1/models: {resp.status} {body}")
      return body["data"][0]["id"]
    finally:
      conn.close()

  def complete(self, model: str, prompt: list[int], deadline: float) -> RequestResult:
    cfg = self.cfg
    res = RequestResult(prompt_len=len(prompt))
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": cfg.output_len,
                       "temperature": cfg.temperature, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}})
    start = time.perf_counter()
    conn = self.connect(deadline - start)
    last = start
    try:
      conn.request("POST", f"{self.prefix}/v1/completions", body=body, headers=self.headers)
      resp = conn.getresponse()
      if resp.status != 200:
        res.error = f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}"
        return res
      for line in resp:  # http.client undoes the chunked transfer encoding
        now = time.perf_counter()
        if now > deadline:
          res.error = "cut at max_duration"
          return res
        if not line.startswith(b"data: "):
          continue
        data = line[6:].strip()
        if data == b"[DONE]":
          break
        event = json.loads(data)
        if "error" in event:
          res.error = str(event["error"].get("message"))
          return res
        if event.get("choices"):
          if res.ttft == 0.0:
            res.ttft = now - start
          else:
            res.itl.append(now - last)
          last = now
        elif event.get("usage"):
          res.output_tokens = event["usage"]["completion_tokens"]
      res.latency = time.perf_counter() - start
      res.ok = res.ttft > 0.0
      if not res.output_tokens:  # a server that sent no usage: one token per chunk
        res.output_tokens = len(res.itl) + 1
      if not res.ok:
        res.error = "the stream carried no tokens"
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
      res.error = "cut at max_duration" if time.perf_counter() > deadline else repr(e)
    finally:
      conn.close()  # closing mid-stream is a disconnect: the server aborts the request
    return res


def _percentiles(values_s: list[float]) -> dict[str, float]:
  """Mean, std and p50/p90/p99 in milliseconds."""
  if not values_s:
    return {k: 0.0 for k in ("mean", "std", "p50", "p90", "p99")}
  ms = np.asarray(values_s) * 1000.0
  return {"mean": float(ms.mean()), "std": float(ms.std()),
          **{f"p{q}": float(np.percentile(ms, q)) for q in (50, 90, 99)}}


def summarize(cfg: LoadConfig, results: list[RequestResult], duration: float) -> dict:
  ok = [r for r in results if r.ok]
  n_in = sum(r.prompt_len for r in ok)
  n_out = sum(r.output_tokens for r in ok)
  good = [r for r in ok if all(
      {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}[k] * 1000.0 <= slo
      for k, slo in cfg.goodput.items())]
  errors: dict[str, int] = {}
  for r in results:
    if not r.ok:
      errors[r.error] = errors.get(r.error, 0) + 1
  return {
      "completed": len(ok), "failed": len(results) - len(ok),
      "not_sent": cfg.num_requests - len(results), "errors": errors,
      "duration_s": duration, "total_input_tokens": n_in, "total_output_tokens": n_out,
      "request_throughput": len(ok) / duration, "output_throughput": n_out / duration,
      "total_token_throughput": (n_in + n_out) / duration,
      "request_goodput": len(good) / duration if cfg.goodput else None,
      "ttft_ms": _percentiles([r.ttft for r in ok]),
      "tpot_ms": _percentiles([r.tpot for r in ok if r.output_tokens > 1]),
      "itl_ms": _percentiles([x for r in ok for x in r.itl]),
      "e2el_ms": _percentiles([r.latency for r in ok]),
  }


def run_load(cfg: LoadConfig) -> dict:
  """Send the load, wait for it (at most `max_duration`), and return the figures as a dict."""
  client = _Client(cfg)
  model = cfg.model or client.first_model()
  rng = np.random.default_rng(cfg.seed)
  lens = rng.integers(cfg.input_len[0], cfg.input_len[1] + 1, size=cfg.num_requests)
  prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in lens]
  gaps = (rng.exponential(1.0 / cfg.request_rate, size=cfg.num_requests)
          if math.isfinite(cfg.request_rate) else np.zeros(cfg.num_requests))
  slots = threading.BoundedSemaphore(cfg.max_concurrency or cfg.num_requests)

  def one(prompt: list[int], deadline: float) -> RequestResult:
    try:
      return client.complete(model, prompt, deadline)
    finally:
      slots.release()

  start = time.perf_counter()
  deadline = start + cfg.max_duration
  futures = []
  workers = min(cfg.max_concurrency or cfg.num_requests, cfg.num_requests)
  with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
    next_arrival = start
    for prompt, gap in zip(prompts, gaps):
      next_arrival += gap
      wait = next_arrival - time.perf_counter()
      if wait > 0:
        time.sleep(min(wait, max(deadline - time.perf_counter(), 0.0)))
      if not slots.acquire(timeout=max(deadline - time.perf_counter(), 0.0)):
        break
      if time.perf_counter() >= deadline:
        slots.release()
        break
      futures.append(pool.submit(one, prompt, deadline))
    results = [f.result() for f in futures]
  duration = time.perf_counter() - start
  summary = summarize(cfg, results, duration)
  return {"config": {**dataclasses.asdict(cfg), "api_key": None, "model": model,
                     "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate)
                     else "inf"},
          "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                      "python": platform.python_version()},
          **summary}


def parse_goodput(items: list[str]) -> dict[str, float]:
  """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
  out = {}
  for item in items:
    name, sep, value = item.partition(":")
    if not sep:
      raise ValueError(f"goodput SLO {item!r}: expected METRIC:MILLISECONDS")
    out[name] = float(value)
  return out
