"""Disaggregated serving: prefill and decode on separate device groups.

`kv_transfer_config` splits the devices: the first group's engines (each on
`prefill_tensor_parallel_size` devices, with its own page pool, scheduler and prefix cache)
compute prompts; the second group's engines decode. Within each group a request goes to the
engine that has seen its prefix unless it is too busy, else to the least-loaded one
(`PrefixRouter`). The prefill engine computes its prompt, samples its first token (streamed at
once: the first token never waits for the copy) and parks it (`LLMEngine.hand_off_prefilled`).
The coordinator then gathers the pages the sequence uses on the prefill devices and starts their
copy onto the chosen decode engine's devices (`PageCopier.send`; dispatched, not waited for), and
releases the prefill pages at once: the gathered copy holds their K/V. At most
`max_num_seqs` copies wait per decode engine; beyond that sequences stay parked with their
pages, which holds the prefill side back once its pool fills. When that decode engine is between
steps and has room (a free seat under `max_num_seqs` and the pages), the staged pages are
written into pages of its pool (block table translated: the sequence's page list is the new one)
and the sequence decodes there. Pages the decode pool already caches for the same prefix are
shared, not written again.

Every engine steps on its own thread, and `step` returns as soon as any engine's step is done,
so decode steps never wait behind a long prefill step. Whatever touches an engine's pool,
scheduler or cache (adding, aborting, handing over, adopting) happens only between that
engine's steps, on the caller's thread.

Preemption on the decode side recomputes on the prefill side: a decode engine leaves the
sequences it preempts waiting (`Scheduler.admit_waiting` is off there); they go back, output
tokens and all, to a prefill engine, whose prefix cache most likely still holds the prompt's
pages, and come back through the same hand-over with their next token. Decode steps thus never
carry a prefill chunk.

Speculative decoding runs on the decode side ("ngram" or "medusa": a draft model's own cache is
not handed over); the prefill engines do not speculate. A request samples n = 1 sequence here.

Across processes (`kv_connector: "jax_transfer"`, under `jax.distributed`), process 0 runs this
coordinator with its prefill engines and serves; every other process runs it with its decode
engines only (`follow`). A decode engine of another process is a `_RemoteEngine` here: the
hand-over gathers the pages on the prefill devices and offers them to JAX's transfer API
(`TransferEndpoint`), and sends the request (its sequence, the pages' layout and the offer's
number) over the processes' socket (`jinfer/parallel/peer_link.py`). The decode process pulls
the pages onto its devices at once (which frees the prefill side's copy), writes them into its
pool when it has room, and sends back, after each of its steps, the outputs, the sequences it
preempted (recomputed on the prefill side, as in one process) and the ones it took in. A
request's times are on process 0's clock: the decode process shifts the ones it stamps.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import time
from typing import Any

import jax
import numpy as np

from jinfer.engine.engine import EngineStats, LLMEngine, _Group
from jinfer.engine.engine_config import EngineConfig
from jinfer.engine.front_end import FrontEnd, combined_stats
from jinfer.engine.prefix_router import PrefixRouter
from jinfer.engine.kv_transfer import (PageCopier, PageReceiver, PageScatter, PageSender,
                                       TransferEndpoint, _error)
from jinfer.engine.request import RequestOutput, Sequence, Status
from jinfer.errors import ParameterError
from jinfer.models.kv_groups import KVGroups
from jinfer.parallel import distributed, peer_link
from jinfer.parallel.peer_link import PeerLink, PeerLost
from jinfer.sampling.params import SamplingParams
from pallas_kernels.kv_cache_layout import SINK_PAGE

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.5  # how often a busy decode process sends its engines' stats


@dataclasses.dataclass(eq=False)
class _Transfer:
  """A sequence whose pages left the prefill side and are not yet in a decode engine's pool."""
  group: _Group
  seq: Sequence
  dst: LLMEngine
  scatter: PageScatter
  staged: Any  # the pages' K/V on the decode devices (the copy may still be running)
  num_pages: int
  # Per KV group: (its pages' count by position, how many lead ones a window group gave back).
  # The staged pages are every group's present ones, group after group.
  layout: list[tuple[int, int]]


@dataclasses.dataclass(eq=False)
class _RemoteEngine:
  """A decode engine of another process, as process 0 sees it (`jax_transfer`)."""
  link: PeerLink
  index: int  # among that process's decode engines
  max_num_seqs: int
  num_kv_heads: int
  num_devices: int
  bytes_per_page: int
  stats: EngineStats
  requests: set[str] = dataclasses.field(default_factory=set)  # it holds, or is sent
  staged: set[str] = dataclasses.field(default_factory=set)  # sent, not yet in its pool


class DisaggregatedEngine(FrontEnd):
  """Prefill and decode engines behind the one-engine interface (`LLM` and the server drive it
  unchanged); see the module docstring."""

  def _check(self, config: EngineConfig) -> None:
    config.kv_transfer.groups(config.parallel.tensor_parallel_size)

  def _build(self, model_config, params, tokenizer, config: EngineConfig, dtype,
             warmup: bool | str):
    kvt = self.kv_transfer = config.kv_transfer
    tp = config.parallel.tensor_parallel_size
    prefill_devices, decode_devices = kvt.groups(tp)
    base = config.replace(kv_transfer_config=None)
    pre = base.replace(tensor_parallel_size=kvt.prefill_tensor_parallel_size or tp,
                       num_pages=kvt.prefill_num_pages or config.cache.num_pages,
                       speculative_config=None)
    if kvt.prefill_num_pages is not None:
      max_len = min(config.model.max_model_len, model_config.max_position_embeddings)
      need = KVGroups.of(model_config, max_len,
                         hybrid=not config.cache.disable_hybrid_kv_cache_manager).page_need(
          max_len, config.cache.page_size_for(jax.default_backend()),
          config.scheduler.max_num_batched_tokens)
      if kvt.prefill_num_pages - 1 < need:
        raise _error(f"prefill_num_pages={kvt.prefill_num_pages} cannot hold one sequence of "
                     f"max_model_len={max_len} ({need} pages + the sink page)")
    dec = base.replace(tensor_parallel_size=kvt.decode_tensor_parallel_size or tp)
    spec = config.speculative
    if spec is None or spec.method == "ngram":
      # A decode engine's steps carry a token per sequence (and its drafts), never a prefill
      # chunk: larger token buckets would only be compiled.
      rows = config.scheduler.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))
      budget = min(config.scheduler.max_num_batched_tokens, 1 << (rows - 1).bit_length())
      dec = dec.replace(max_num_batched_tokens=budget,
                        max_prefill_seqs=min(config.scheduler.max_prefill_seqs, budget))
    make = lambda cfg, devices: LLMEngine.from_parts(model_config, params, tokenizer, config=cfg,
                                                     dtype=dtype, warmup=False, devices=devices)
    self.prefill = [make(pre, d) for d in prefill_devices]
    self.decode = [make(dec, d) for d in decode_devices]
    for e in self.prefill:
      e.hand_off_prefilled = True
    for e in self.decode:
      e.scheduler.admit_waiting = False
    self.copiers = {(p, d): PageCopier(p.runner, d.runner)
                    for p in self.prefill for d in self.decode}
    e0 = (self.decode or self.prefill)[0]
    self.model_config, self.tokenizer, self.config = e0.model_config, tokenizer, e0.config
    self.max_model_len = e0.max_model_len
    # Each side's engines are picked for the prefix they have seen (their prefix caches).
    self._routers = {side: PrefixRouter.over(e0, config.scheduler.max_num_seqs)
                     for side in ("prefill", "decode")}
    engines = self.prefill + self.decode
    # One thread per engine: its compile guard counts compiles on the thread that steps it.
    self._threads = {e: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jinfer-pd")
                     for e in engines}
    self._timer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jinfer-kv")
    self._inflight: dict[LLMEngine, concurrent.futures.Future] = {}
    # Where each unfinished request is: an engine (queued for it, or in it) or a transfer.
    self._where: dict[str, LLMEngine | _Transfer] = {}
    self._adds: dict[LLMEngine, list[tuple]] = {e: [] for e in self.prefill}
    self._adopts: dict[LLMEngine, list[_Group]] = {e: [] for e in self.prefill}
    self._transfers: collections.deque[_Transfer] = collections.deque()
    self._aborts: set[str] = set()
    self._resets: dict[LLMEngine, int] = {}  # prefill engines' cache rebuilds seen
    self._outputs: list[RequestOutput] = []  # of requests that failed between steps
    # Seeds drawn as one engine draws them, so unseeded sampling matches the colocated engine.
    self._seed_rng = np.random.default_rng(config.model.seed)
    self._ids = itertools.count()
    self.num_transfers = self.transfer_bytes = 0
    # Across processes: process 0's view of the other processes' decode engines, or a decode
    # process's link to process 0 (and what it sends after each step).
    self.remote: list[_RemoteEngine] = []
    self._peers: dict[PeerLink, list[_RemoteEngine]] = {}  # each process's engines
    self._leader: PeerLink | None = None
    self._returned: list[_Group] = []
    self._adopted: list[str] = []
    self._closing = self._changed = False
    self._stats_sent = 0.0  # when a decode process last sent its engines' stats
    if not kvt.in_process:
      self._join(tokenizer, warmup)
      return
    t0 = time.monotonic()
    if warmup:
      self._warm(engines, warmup)
      for (p, d), c in self.copiers.items():
        c.compile(p.runner.kv_cache, d.runner.kv_cache, p.config.max_pages_per_seq)
    self.warmup_seconds = time.monotonic() - t0

  def _warm(self, engines: list[LLMEngine], warmup: bool | str):
    rest = warmup if isinstance(warmup, str) else None
    with concurrent.futures.ThreadPoolExecutor(len(engines)) as pool:
      list(pool.map(lambda e: e.warmup(rest), engines))

  # -- across processes ------------------------------------------------------------------------
  def _join(self, tokenizer, warmup: bool | str):
    """`jax_transfer`: process 0 listens, shares where (one broadcast, every process), warms
    its engines and takes each decode process's greeting; a decode process warms its engines,
    then connects and greets."""
    kvt, local = self.kv_transfer, jax.local_devices()
    self._endpoint = TransferEndpoint(local[0], kvt.kv_ip)
    names = {"tokenizer": tokenizer} if tokenizer is not None else {}
    leads = jax.process_index() == 0
    if leads:
      listener, address, key = peer_link.listen(kvt.kv_ip)
      where = distributed.broadcast_json(
          {"address": address, "key": key.hex(), "transfer": self._endpoint.address}, True)
    else:
      where = distributed.broadcast_json()
    self._peer_transfer = where["transfer"]
    t0 = time.monotonic()
    if warmup:
      self._warm(self.prefill + self.decode, warmup)
    self.receivers = {d: PageReceiver(d.runner, self._endpoint) for d in self.decode}
    if warmup:
      for d, r in self.receivers.items():
        r.compile(d.runner.kv_cache, d.config.max_pages_per_seq)
    if not leads:
      conn = peer_link.connect(where["address"], bytes.fromhex(where["key"]))
      conn.send({"process": jax.process_index(), "engines": [
          dict(max_num_seqs=d.scheduler.config.max_num_seqs,
               num_kv_heads=d.runner.config.num_kv_heads,
               num_devices=len(d.runner.mesh.devices.flat),
               bytes_per_page=self.receivers[d].bytes_per_page, stats=d.stats())
          for d in self.decode]})
      # What to add to a time here to read it on process 0's clock. Each process's monotonic
      # clock is tied to its wall clock, which hosts keep in step (on one host it is the same
      # clock): a round trip's halves would be uneven by however busy process 0 is.
      self._clock_offset = conn.recv() - _monotonic_from_wall()
      self._leader = PeerLink(conn, "the prefill process (process 0)", names)
    else:
      for _ in range(jax.process_count() - 1):
        conn = listener.accept()
        hello = conn.recv()
        conn.send(_monotonic_from_wall())
        link = PeerLink(conn, f"decode process {hello['process']}", names)
        self._peers[link] = [_RemoteEngine(link, i, **e) for i, e in enumerate(hello["engines"])]
        self.remote += self._peers[link]
      listener.close()
      self.senders = {(p, r): PageSender(p.runner, r.num_kv_heads, r.num_devices,
                                         self._endpoint)
                      for p in self.prefill for r in self.remote}
      if warmup:
        for (p, r), sender in self.senders.items():
          sender.gather.compile(p.runner.kv_cache, p.config.max_pages_per_seq)
    self.warmup_seconds = time.monotonic() - t0

  def follow(self):
    """On a decode process: decode what process 0 hands over until it closes, sending back
    after each step what came of it."""
    try:
      while not self._closing:
        outputs = self._step(wait_for_peer=True)
        returned, self._returned = self._returned, []
        adopted, self._adopted = self._adopted, []
        # Every change is reported, an abort's too: process 0 reads the stats sent last.
        if outputs or returned or adopted or self._changed:
          self._changed = False
          shift = self._clock_offset
          for g in returned:
            leaving(g, shift)
          # Stats cost a walk over every running sequence's pages: not every step, but always
          # once the engines are idle (what process 0 reads when everything has ended).
          now, stats = time.monotonic(), None
          if (now - self._stats_sent >= STATS_INTERVAL_S
              or not any(d.scheduler.running for d in self.decode)):
            stats, self._stats_sent = [d.stats() for d in self.decode], now
          self._leader.send(dict(
              outputs=[dataclasses.replace(o, metrics=o.metrics and o.metrics.shifted(shift))
                       for o in outputs],
              returned=returned, adopted=adopted, stats=stats))
    finally:
      self.close()

  def _read_peers(self):
    """Apply what the other processes sent (raises PeerLost if one is gone)."""
    if self._leader is not None:
      messages = self._leader.receive()
      self._changed |= bool(messages)
      for kind, *args in messages:
        if kind == "adopt":
          self._pull(*args)
        elif kind == "abort":
          self._aborts.add(args[0])
        elif kind == "close":
          self._closing = True
      return
    for link, mine in self._peers.items():
      for msg in link.receive():
        for e, st in zip(mine, msg["stats"] or ()):
          e.stats = st
        for rid in msg["adopted"]:
          for e in mine:
            e.staged.discard(rid)
        for o in msg["outputs"]:
          where = self._where.get(o.request_id)
          if where in mine:
            self._outputs.append(o)
            if o.finished:
              where.requests.discard(o.request_id)
              where.staged.discard(o.request_id)
        for group in msg["returned"]:
          where = self._where.get(group.request_id)
          if where in mine:
            where.requests.discard(group.request_id)
            where.staged.discard(group.request_id)
            arriving(group, self.prefill[0])
            self._return(group)

  def _pull(self, index: int, uuid: int, num_padded: int, sharded: bool, group: _Group,
            layout: list[tuple[int, int]], num_pages: int):
    """On a decode process: pull a hand-over's pages onto decode engine `index`'s devices now
    (freeing process 0's copy), to be written into its pool when it has room."""
    d = self.decode[index]
    receiver = self.receivers[d]
    seq = group.seqs[0]
    arriving(group, d, -self._clock_offset)
    try:
      staged = receiver.pull(d.runner.kv_cache, self._peer_transfer, uuid, num_padded, sharded)
    except Exception as e:  # noqa: BLE001 - the request's own failure, reported as its error
      log.error("KV transfer of request %s failed", group.request_id, exc_info=e)
      return self._fail(group, f"KV transfer failed: {e!r}")
    self._timer.submit(_mark_done, staged, seq.metrics)
    t = _Transfer(group, seq, d, receiver, staged, num_pages, layout)
    self._transfers.append(t)
    self._where[group.request_id] = t

  # -- what reports read: the decode side's ---------------------------------------------------
  @property
  def blocks(self):
    return (self.decode or self.prefill)[0].blocks

  @property
  def runner(self):
    return (self.decode or self.prefill)[0].runner

  # -- requests -----------------------------------------------------------------------------
  def tokenize(self, prompt: str | list[int]) -> list[int]:
    return self.prefill[0].tokenize(prompt)

  def validate(self, prompt_token_ids: list[int], params: SamplingParams):
    if params.n > 1:
      raise ParameterError("n", "n > 1 does not run with kv_transfer_config yet: send n "
                                "requests")
    return self.prefill[0].validate(prompt_token_ids, params)

  def load(self, engine: LLMEngine | _RemoteEngine) -> int:
    """Sequences an engine holds or will be given."""
    if isinstance(engine, _RemoteEngine):
      return len(engine.requests)
    s = engine.scheduler
    return (len(s.running) + len(s.waiting) + len(engine.handoffs)
            + len(self._adds.get(engine, ()))
            + len(self._adopts.get(engine, ())) + sum(t.dst is engine for t in self._transfers))

  def add_request(self, request_id: str | None, prompt: str | list[int],
                  params: SamplingParams | None = None, *, arrival_time: float | None = None,
                  cache_salt: str | None = None, lora_request=None) -> str:
    if lora_request is not None:
      raise ParameterError("lora_request", "the disaggregated engine does not run LoRA "
                                           "adapters yet")
    params = params or SamplingParams()
    request_id = str(next(self._ids)) if request_id is None else str(request_id)
    if request_id in self._where:
      raise ValueError(f"request id {request_id!r} is already in use")
    ids = self.tokenize(prompt)
    self.validate(ids, params)
    if params.seed is None:
      params = dataclasses.replace(params, seed=int(self._seed_rng.integers(1 << 31)))
    engine = self._route("prefill", self.prefill, ids, cache_salt)
    arrival = time.monotonic() if arrival_time is None else arrival_time
    self._adds[engine].append((request_id, prompt, params, arrival, cache_salt))
    self._where[request_id] = engine
    return request_id

  def abort(self, request_id: str) -> bool:
    """Stop a request wherever it is (in an engine, or its pages in flight between them) and free
    what it holds; applied between the steps of the engine that has it. False if unknown."""
    request_id = str(request_id)
    if request_id not in self._where:
      return False
    self._aborts.add(request_id)
    self._apply_aborts()
    return True

  def has_unfinished_requests(self) -> bool:
    return bool(self._where or self._outputs)

  def running_request_ids(self) -> set[str]:
    return set().union(*(e.running_request_ids() for e in self.prefill + self.decode))

  def close(self):
    """Stop every engine; on process 0 across processes, release the decode processes too."""
    for link in self._peers:
      try:
        link.send(("close",))
      except PeerLost:
        pass
      link.close()
    self._peers, self.remote = {}, []
    if self._leader is not None:
      self._leader.close()
    for pool in [*self._threads.values(), self._timer]:
      pool.shutdown(wait=True)
    for e in self.prefill + self.decode:
      e.close()

  def wait_until_compiled(self) -> None:
    for e in self.prefill + self.decode:
      e.wait_until_compiled()

  # -- the loop -----------------------------------------------------------------------------
  def step(self) -> list[RequestOutput]:
    """Start a step on every idle engine that has work, wait until one (any) is done, or
    another process's news arrives, and return what it produced, with the hand-overs it made
    started."""
    return self._step(wait_for_peer=any(r.requests for r in self.remote))

  def _step(self, wait_for_peer: bool) -> list[RequestOutput]:
    self._between_steps()
    waits = list(self._inflight.values())
    if wait_for_peer:
      waits += [link.ready for link in self._peers] + (
          [self._leader.ready] if self._leader else [])
    if waits:
      concurrent.futures.wait(waits, return_when=concurrent.futures.FIRST_COMPLETED)
      for e, fut in list(self._inflight.items()):
        if fut.done():
          del self._inflight[e]
          self._outputs += self._collect(e, fut.result())
      self._between_steps()
    out, self._outputs = self._outputs, []
    for o in out:
      if o.finished:
        self._where.pop(o.request_id, None)
    return out

  def _idle(self, engine: LLMEngine) -> bool:
    return engine not in self._inflight

  def _between_steps(self):
    """Everything that touches an idle engine, then start the idle engines that have work."""
    self._read_peers()
    self._apply_aborts()
    for e in self.prefill:
      if self._idle(e):
        self._send_parked(e)
        for group in self._adopts[e]:
          e.adopt(group)
        self._adopts[e].clear()
        for rid, prompt, params, arrival, salt in self._adds[e]:
          e.add_request(rid, prompt, params, arrival_time=arrival, cache_salt=salt)
        self._adds[e].clear()
    for t in list(self._transfers):
      if self._idle(t.dst):
        self._receive(t)
    for e in self.prefill + self.decode:
      s = e.scheduler
      if self._idle(e) and (s.running or (s.admit_waiting and s.waiting)):
        self._inflight[e] = self._threads[e].submit(e.step)

  def _collect(self, engine: LLMEngine, outputs: list[RequestOutput]) -> list[RequestOutput]:
    """After `engine`'s step: start the hand-overs of a prefill engine's finished prompts, or
    send a decode engine's preempted sequences back to be recomputed on the prefill side."""
    if engine.hand_off_prefilled:
      if engine.runner.cache_resets != self._resets.get(engine, 0):
        # A failed step took the cache: the parked sequences' K/V went with it.
        self._resets[engine] = engine.runner.cache_resets
        for seq in engine.handoffs:
          for pages in seq.pages:
            engine.blocks.release(pages)
          seq.pages, seq.num_computed_tokens, seq.status = [], 0, Status.WAITING
          engine.scheduler.waiting.appendleft(seq)
        engine.handoffs.clear()
      self._send_parked(engine)
    else:
      while engine.scheduler.waiting:
        seq = engine.scheduler.waiting.popleft()
        group = engine.groups.pop(seq.group_id)
        if self._leader is not None:  # to process 0, after this step
          self._returned.append(group)
          self._where.pop(group.request_id, None)
        else:
          self._return(group)
    return outputs

  def _route(self, side: str, engines: list, token_ids: list[int], cache_salt):
    return engines[self._routers[side].route(token_ids, cache_salt,
                                             [self.load(e) for e in engines])]

  def _return(self, group: _Group):
    """A sequence the decode side preempted, to be recomputed on the prefill side (most likely
    where its prompt's pages are still cached)."""
    dst = self._route("prefill", self.prefill, group.prompt_token_ids, group.seqs[0].cache_salt)
    self._adopts[dst].append(group)
    self._where[group.request_id] = dst

  def _send_parked(self, engine: LLMEngine):
    """Start the hand-over of a prefill engine's parked sequences while the decode side has
    room to stage them (at most `max_num_seqs` copies waiting per decode engine). The rest stay
    parked with their pages, which holds that prefill engine back once its pool fills: staged
    copies never pile up on the decode devices."""
    keep, dests = [], self.decode or self.remote
    for seq in engine.handoffs:
      # Where the prompt's prefix went before (its pages may be shared there), else the
      # least-loaded engine with room.
      dst = self._route("decode", dests, seq.prompt_token_ids, seq.cache_salt)
      if not self._can_stage(dst):
        dst = min(dests, key=self.load)
      if self._can_stage(dst):
        self._send(engine, seq, dst)
      else:
        keep.append(seq)
    engine.handoffs[:] = keep

  def _can_stage(self, dst: LLMEngine | _RemoteEngine) -> bool:
    if isinstance(dst, _RemoteEngine):
      return len(dst.staged) < dst.max_num_seqs
    return sum(t.dst is dst for t in self._transfers) < dst.scheduler.config.max_num_seqs

  def _send(self, src: LLMEngine, seq: Sequence, dst: LLMEngine | _RemoteEngine):
    group = src.groups.pop(seq.group_id)
    seq.metrics.handoff_time = time.monotonic()
    seq.metrics.transfer_done_time = seq.metrics.decode_start_time = None
    # Only the pages the sequence holds: a window group's given-back ones (-1) lead its list.
    present = [p for pages in seq.pages for p in pages if p >= 0]
    layout = [(len(pages), pages.count(-1)) for pages in seq.pages]
    remote = isinstance(dst, _RemoteEngine)
    try:
      if remote:
        sender = self.senders[(src, dst)]
        staged, sharded = sender.send(src.runner.kv_cache, present), sender.sharded
      else:
        staged = self.copiers[(src, dst)].send(src.runner.kv_cache, present)
    except Exception as e:  # noqa: BLE001 - the request's own failure, reported as its error
      staged, error = None, e
    n = len(present)
    # The gathered copy holds the K/V now (JAX orders the next step's in-place writes after the
    # gather that reads them): the prefill pool gets its pages back at once.
    for pages in seq.pages:
      src.blocks.release(pages)
    seq.pages = []
    if staged is None:
      log.error("KV transfer of request %s failed", group.request_id, exc_info=error)
      return self._fail(group, f"KV transfer failed: {error!r}")
    nbytes = n * (dst.bytes_per_page if remote else self.copiers[(src, dst)].bytes_per_page)
    seq.metrics.kv_transfer_bytes += nbytes
    self.num_transfers += 1
    self.transfer_bytes += nbytes
    if remote:
      leaving(group)
      uuid, num_padded = staged
      dst.link.send(("adopt", dst.index, uuid, num_padded, sharded, group, layout, n))
      dst.requests.add(group.request_id)
      dst.staged.add(group.request_id)
      self._where[group.request_id] = dst
      return
    self._timer.submit(_mark_done, staged, seq.metrics)
    t = _Transfer(group, seq, dst, self.copiers[(src, dst)].scatter, staged, n, layout)
    self._transfers.append(t)
    self._where[group.request_id] = t

  def _receive(self, t: _Transfer):
    """Write a transfer's pages into its (idle) decode engine's pool, if it has room now."""
    d, seq = t.dst, t.seq
    s, blocks = d.scheduler, d.blocks
    # Room for the newcomer and a page of growth for everyone running, so admitting it does not
    # at once preempt someone else.
    if (len(s.running) >= s.config.max_num_seqs
        or blocks.num_free_pages < t.num_pages + len(s.running)):
      return
    self._transfers.remove(t)
    shared = [[] for _ in t.layout]
    if seq.params.prompt_logprobs is None:
      shared = blocks.match_prefix(seq.token_ids[:seq.num_computed_tokens + 1], seq.cache_salt,
                                   seq.page_hashes)
    # Each group's pages by position: one the decode pool already holds for this prefix is
    # shared and not written (its slot in the copy goes to the sink page); the rest are fresh.
    pages, targets, num_fresh = [], [], 0
    for (length, absent), hits in zip(t.layout, shared):
      hits = hits + [-1] * (length - len(hits))
      row = [-1] * absent + [h if h >= 0 else None for h in hits[absent:]]
      blocks.release([h for h in hits[:absent] if h >= 0])  # a hit the sequence does not need
      num_fresh += row.count(None)
      pages.append(row)
    fresh = iter(blocks.allocate(num_fresh))
    for row in pages:
      for i in range(len(row)):
        if row[i] is None:
          row[i] = next(fresh)
          targets.append(row[i])
        elif row[i] >= 0:
          targets.append(SINK_PAGE)
    try:
      cache = t.scatter.receive(d.runner.kv_cache, t.staged, targets)
    except Exception as e:  # noqa: BLE001 - fails this request (and, if the cache went, recomputes)
      log.error("KV transfer of request %s failed", t.group.request_id, exc_info=e)
      for row in pages:
        blocks.release(row)
      if d.runner.kv_cache.is_deleted():
        # The donated cache went with the failed call: every sequence it held is recomputed on
        # the prefill side, as a failed step's would be.
        d.runner.kv_cache = d.runner._allocate()
        d.runner.cache_resets += 1
        s.preempt_all()
        blocks.forget_cached()
        self._collect(d, [])
      return self._fail(t.group, f"KV transfer failed: {e!r}")
    d.runner.kv_cache = cache
    seq.pages, seq.pages_offered = pages, 0
    seq.metrics.decode_start_time = time.monotonic()
    d.adopt(t.group)
    self._where[t.group.request_id] = d
    self._adopted.append(t.group.request_id)

  def _fail(self, group: _Group, reason: str):
    """End a request that is in no engine with an error."""
    for seq in group.seqs:
      if not seq.finished:
        seq.finish_reason, seq.stop_reason, seq.status = "error", reason, Status.FINISHED
    self._outputs.append((self.decode or self.prefill)[0]._output(group))

  def _apply_aborts(self):
    for rid in list(self._aborts):
      where = self._where.get(rid)
      if isinstance(where, _RemoteEngine):  # the decode process frees what it holds
        where.link.send(("abort", rid))
        where.requests.discard(rid)
        where.staged.discard(rid)
      elif isinstance(where, _Transfer):  # its prefill pages are free, no decode page is taken
        self._transfers.remove(where)
        where.seq.finish_reason, where.seq.status = "abort", Status.FINISHED
      elif where is not None:
        if not self._idle(where):
          continue  # applied after its step
        adds = self._adds.get(where, [])
        adds[:] = [a for a in adds if a[0] != rid]
        adopts = self._adopts.get(where, [])
        for g in [g for g in adopts if g.request_id == rid]:
          adopts.remove(g)
          for seq in g.seqs:
            seq.finish_reason, seq.status = "abort", Status.FINISHED
        where.handoffs[:] = [q for q in where.handoffs if q.group_id != rid]
        where.abort(rid)
      self._where.pop(rid, None)
      self._aborts.discard(rid)
      self._changed = True
      # An output of this request already collected is dropped, as one engine's abort does.
      self._outputs = [o for o in self._outputs if o.request_id != rid]

  # -- numbers ------------------------------------------------------------------------------
  def stats(self) -> EngineStats:
    """Counts summed over every engine of both groups; ratios are their mean; steps the busiest
    engine's. The transfers' own counts: `num_transfers`, `transfer_bytes`."""
    per = ([e.stats() for e in self.prefill + self.decode]
           + [r.stats for r in self.remote])  # as each decode process last reported
    waiting = sum(len(a) + len(b) for a, b in zip(self._adds.values(), self._adopts.values()))
    # KV bytes per sequence: the decode side's, where sequences spend their lives.
    return combined_stats(
        per, holders=per[len(self.prefill):] or None,
        num_waiting=sum(s.num_waiting for s in per) + waiting + len(self._transfers))


def leaving(group: _Group, shift: float = 0.0) -> None:
  """Before a request goes to another process: what does not cross processes goes (rebuilt
  there by `arriving`), and its times move `shift` seconds onto that process's clock."""
  for s in group.seqs:
    s.matcher = s.spec_state = s.wait_for = None
    s.metrics = s.metrics.shifted(shift)


def arriving(group: _Group, engine: LLMEngine, shift: float = 0.0) -> None:
  """A request from another process, to run on `engine`: its times moved onto this process's
  clock, its structured-output matcher rebuilt from its grammar and its tokens so far, its
  prefix-cache hash chain left to recompute (Python salts `str` hashes per process)."""
  for s in group.seqs:
    s.metrics = s.metrics.shifted(shift)
    s.page_hashes, s.pages_offered = [], 0
    if s.params.structured_outputs is not None and not s.finished:
      s.matcher = engine.grammars.matcher(s.params.structured_outputs)
      for t in s.output_token_ids:
        s.matcher.consume_token(t)


def _monotonic_from_wall() -> float:
  """This process's monotonic clock less its wall clock."""
  return time.monotonic() - time.time()


def _mark_done(staged, metrics) -> None:
  """On the timing thread: when a transfer's pages have arrived on the decode devices."""
  jax.block_until_ready(staged)
  metrics.transfer_done_time = time.monotonic()
