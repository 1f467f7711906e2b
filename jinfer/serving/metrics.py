"""The server's /metrics page in the Prometheus text exposition format (version 0.0.4).

Latency histograms are observed per finished engine request on the event loop; token counters
and gauges are read from the engine's stats snapshot when the page is scraped, so the engine
keeps one set of books. Bucket bounds follow vLLM's, so dashboards built for it read these too.
"""
from __future__ import annotations

import bisect
import collections

from jinfer.engine.async_engine import AsyncLLMEngine
from jinfer.engine.request import RequestOutput

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def _escape(value: str) -> str:
  return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(x: float) -> str:
  return repr(float(x)) if x != float("inf") else "+Inf"


class Histogram:

  def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
    self.name, self.help, self.bounds = name, help_text, buckets
    self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
    self.sum = 0.0

  def observe(self, value: float):
    self.counts[bisect.bisect_left(self.bounds, value)] += 1
    self.sum += value

  def render(self, labels: str) -> list[str]:
    lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
    total = 0
    for bound, count in zip(self.bounds + (float("inf"),), self.counts):
      total += count
      lines.append(f'{self.name}_bucket{{{labels},le="{_number(bound)}"}} {total}')
    lines += [f"{self.name}_sum{{{labels}}} {_number(self.sum)}",
              f"{self.name}_count{{{labels}}} {total}"]
    return lines


class ServerMetrics:

  def __init__(self, engine: AsyncLLMEngine, model_name: str):
    self.engine = engine
    self.labels = f'model_name="{_escape(model_name)}"'
    self.ttft = Histogram("jinfer_time_to_first_token_seconds",
                          "Time from arrival to the first output token.", _TTFT_BUCKETS)
    self.tpot = Histogram("jinfer_time_per_output_token_seconds",
                          "Mean time per output token after the first, per request.",
                          _TPOT_BUCKETS)
    self.e2e = Histogram("jinfer_e2e_request_latency_seconds",
                         "Time from arrival to the last output token.", _E2E_BUCKETS)
    self.queue = Histogram("jinfer_request_queue_time_seconds",
                           "Time from arrival to first being scheduled.", _TTFT_BUCKETS)
    self.finished: collections.Counter[str] = collections.Counter()  # by finish reason

  def observe_finished(self, out: RequestOutput):
    m = out.metrics
    for hist, value in ((self.ttft, m.ttft), (self.tpot, m.tpot), (self.e2e, m.e2e),
                        (self.queue, m.queue_time)):
      if value is not None:
        hist.observe(value)
    for c in out.outputs:
      self.finished[c.finish_reason] += 1

  def observe_unfinished(self, reason: str):
    """A request that ended without finishing: "abort" (client gone, shutdown) or "error"."""
    self.finished[reason] += 1

  def render(self) -> str:
    s = self.engine.stats()
    lab = self.labels
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, value: float):
      lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}",
                    f"{name}{{{lab}}} {_number(value)}"])

    metric("jinfer_num_requests_running", "gauge", "Sequences in the running batch.",
           s.num_running)
    metric("jinfer_num_requests_waiting", "gauge", "Sequences waiting to be scheduled.",
           s.num_waiting)
    metric("jinfer_kv_cache_usage_perc", "gauge", "Fraction of KV cache pages allocated.",
           s.kv_pages_used)
    metric("jinfer_kv_cache_utilization_perc", "gauge",
           "Token slots used in the allocated KV cache pages.", s.kv_utilization)
    name = "jinfer_kv_cache_bytes_per_seq"
    lines += [f"# HELP {name} KV bytes a running sequence holds on average, by KV group (window: "
              f"the group's sliding window, or none for full attention).",
              f"# TYPE {name} gauge"]
    lines += [f'{name}{{{lab},group="{g}",window="{w or "none"}"}} {_number(b)}'
              for g, (w, b) in enumerate(zip(s.kv_group_windows, s.kv_bytes_per_seq))]
    metric("jinfer_prefix_cache_hit_rate", "gauge",
           "Prompt tokens served from the prefix cache / prompt tokens looked up.",
           s.prefix_hit_rate)
    metric("jinfer_num_preemptions_total", "counter", "Sequences preempted for KV cache pages.",
           s.num_preemptions)
    metric("jinfer_prompt_tokens_total", "counter",
           "Prompt tokens computed (prefix cache hits excluded).", s.prompt_tokens)
    metric("jinfer_generation_tokens_total", "counter", "Tokens generated.",
           s.generation_tokens)
    metric("jinfer_engine_steps_total", "counter", "Engine steps run.", s.num_steps)
    metric("jinfer_compiles_after_startup_total", "counter",
           "XLA compiles (or compilation cache loads) on the serving path after startup; each "
           "stalled every request (the log names the step's shape).", s.compiles_after_startup)
    metric("jinfer_step_buckets_compiled", "gauge",
           "Token buckets compiled so far (the rest compile in the background).",
           s.buckets_compiled)
    if s.spec is not None:  # speculative decoding, named as vLLM names it
      sp = s.spec
      metric("jinfer_spec_decode_num_drafts_total", "counter",
             "Sequence-steps that verified draft tokens.", sp.num_verified)
      metric("jinfer_spec_decode_num_draft_tokens_total", "counter", "Draft tokens verified.",
             sp.num_draft_tokens)
      metric("jinfer_spec_decode_num_accepted_tokens_total", "counter",
             "Draft tokens accepted.", sp.num_accepted_tokens)
      name = "jinfer_spec_decode_num_accepted_tokens_per_pos_total"
      lines += [f"# HELP {name} Draft tokens accepted, by position in the draft (0 = first).",
                f"# TYPE {name} counter"]
      lines += [f'{name}{{{lab},position="{i}"}} {n}'
                for i, n in enumerate(sp.accepted_per_position)]
      metric("jinfer_spec_decode_mean_tokens_per_verify", "gauge",
             "Tokens a sequence gains per step that verifies drafts.", sp.mean_tokens_per_verify)
      metric("jinfer_spec_decode_alpha", "gauge",
             "Accepted drafts / drafts tested: the per-draft acceptance probability.", sp.alpha)
      metric("jinfer_spec_decode_expected_tokens_per_full_step", "gauge",
             "E = (1 - alpha^(k+1)) / (1 - alpha): tokens a full verify step should yield.",
             sp.expected_tokens_per_full_step)
      metric("jinfer_spec_decode_tokens_per_full_step", "gauge",
             "Tokens a full verify step yielded, measured.", sp.tokens_per_full_step)
      metric("jinfer_spec_decode_proposer_time_share", "gauge",
             "Fraction of engine step time spent proposing drafts.", sp.proposer_time_share)
    name = "jinfer_requests_finished_total"
    lines += [f"# HELP {name} Requests ended, by reason: stop and length count samples, "
              f"abort and error count engine requests.",
              f"# TYPE {name} counter"]
    for reason in sorted(self.finished):
      lines.append(f'{name}{{{lab},finished_reason="{_escape(reason)}"}} {self.finished[reason]}')
    for hist in (self.ttft, self.tpot, self.e2e, self.queue):
      lines += hist.render(lab)
    return "\n".join(lines) + "\n"
