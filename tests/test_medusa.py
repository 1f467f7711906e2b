"""Medusa: candidate trees, tree verification in the model (every node's logits as if its path
were decoded one token at a time, and the accepted path's K/V moved where sequential decoding
would have put it), the tree walk's acceptance, heads in both on-disk formats, and the engine:
greedy and seeded output identical to no speculation, in batches with chunked prefill,
preemption and prefix hits, no page leaks, no compiles after warmup, precise errors."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jinfer.sampling.accept import Typical, VerifyTensors, accept
from jinfer.engine.engine_config import EngineConfig
from jinfer.models import CausalLM
from jinfer.models.kernel_options import KernelOptions
from jinfer.sampling.sample import SamplingTensors
from jinfer.sampling.params import SamplingParams
from jinfer.engine.speculative import medusa_heads as mh
from jinfer.engine.speculative.config import SpeculativeConfig
from jinfer.engine.runner import keep_path
from jinfer.sampling.tree import (Tree, best_choices, chain_choices, default_choices,
                                  expected_length)
from pallas_kernels import AttentionMetadata, KVCacheSpec
from tests.engine_fixtures import (CompileCounter, assert_batch_matches, make_engine,
                                   prefix_sharing_prompts, random_prompts, run_tokens)

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [1, 0, 0]]


# -- the tree ---------------------------------------------------------------------------------
def test_tree_orders_nodes_breadth_first_with_ancestors():
  t = Tree.of([[1, 0], [0], [1], [0, 0], [0, 0, 0]], num_heads=3)
  assert t.choices == ((0,), (1,), (0, 0), (1, 0), (0, 0, 0))
  assert t.parent.tolist() == [0, 0, 0, 1, 2, 3] and t.depth.tolist() == [0, 1, 1, 2, 2, 3]
  assert t.visible[5].tolist() == [True, True, False, True, False, True]
  assert t.path[5].tolist() == [0, 1, 3, 5] and t.path[2].tolist() == [0, 2, 2, 2]
  assert t.topk == 2 and t.nodes_within(1) == 2 and t.depth_of(4) == 2


@pytest.mark.parametrize("choices, says", [
    ([[0, 0]], "lacks its parent"), ([[0], [0]], "listed twice"), ([[0], [0, 0, 0, 0]], "deep"),
    ([], "at least one"), ([[0], [-1]], "integers >= 0"), ([[0], "a"], "integers >= 0")])
def test_a_bad_tree_is_refused(choices, says):
  with pytest.raises(ValueError, match=says):
    Tree.of(choices, num_heads=3)


def test_best_tree_keeps_the_likeliest_paths():
  hits = [[0.6, 0.2, 0.1], [0.4, 0.1, 0.05]]
  got = best_choices(hits, 5)
  # chances 0.6, 0.24, 0.2, 0.1, 0.08, ahead of (0, 1)'s 0.06
  assert got == [(0,), (0, 0), (1,), (2,), (1, 0)]
  for n in range(1, 8):  # every prefix of the growth is a tree
    Tree.of(best_choices(hits, n), num_heads=2)
  assert default_choices(3, num_nodes=6)[0] == (0,)
  assert chain_choices(3) == [(0,), (0, 0), (0, 0, 0)]
  assert expected_length(got, hits) == pytest.approx(1 + 0.6 + 0.24 + 0.2 + 0.1 + 0.08)
  # the best tree of n nodes is expected to yield the most of any n-node tree tried
  assert expected_length(got, hits) > expected_length([(0,), (0, 0), (0, 1), (1,), (2,)], hits)


# -- tree rows in the model -------------------------------------------------------------------
PAD = 32  # every forward pass below runs 32 rows (padding after the real ones): few compiles


def _forward(model, params, cache, tokens, positions, slots, kv_len, tree_mask=None):
  t = len(tokens)
  pad = lambda xs: np.pad(np.asarray(list(xs), np.int32), (0, PAD - t))  # padding: sink page
  width = 1 if tree_mask is None else tree_mask.shape[1]
  mask = None if tree_mask is None else np.pad(tree_mask, ((0, PAD - t), (0, 0)))
  md = AttentionMetadata(
      slot_mapping=jnp.asarray(pad(slots)), block_table=jnp.arange(1, 9)[None],
      kv_lens=jnp.asarray([kv_len], jnp.int32), cu_q_lens=jnp.asarray([0, t], jnp.int32),
      num_seqs=jnp.asarray([1], jnp.int32), max_q_len=PAD, verify_width=width,
      tree_mask=None if mask is None else jnp.asarray(mask))
  logits, _, cache = _apply(model)({"params": params}, jnp.asarray(pad(tokens)),
                                   jnp.asarray(pad(positions)), cache, md, jnp.arange(PAD))
  return np.asarray(logits)[:t], cache, md


def _sequential(model, params, spec, tokens):  # logits of every row of one prefill
  page = spec.page_size
  slots = [(1 + p // page) * page + p % page for p in range(len(tokens))]
  return _forward(model, params, spec.allocate(), tokens, range(len(tokens)), slots,
                  len(tokens))[0]


_jitted = {}


def _apply(model):
  return _jitted.setdefault(id(model), jax.jit(model.apply))


_models = {}


# [xla] slow: the same rows through the XLA backend; test_ragged_paged_attention checks it
# against the reference on tree masks (verify_trees cases), quick.
@pytest.mark.parametrize("attention", [pytest.param("xla", marks=pytest.mark.slow), "reference"])
def test_tree_rows_equal_decoding_each_path_alone(tiny_model, attention):
  """For random trees: each node's logits equal those of its path decoded one token at a time
  (<= 1e-4); after moving an accepted path's K/V, the next token's logits equal sequential
  decoding's too."""
  config, params, _ = tiny_model
  model = _models.setdefault(attention, CausalLM(config, KernelOptions(attention=attention)))
  spec = KVCacheSpec(num_layers=config.num_layers, num_pages=9, page_size=8,
                     num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)
  rng = np.random.default_rng(0)
  for trial in range(3):
    tree = Tree.of(best_choices(rng.dirichlet(np.ones(4), size=3).tolist(), 9), num_heads=3)
    ctx = rng.integers(3, 49000, 10 + 3 * trial).tolist()
    tokens = [ctx[-1]] + rng.integers(3, 49000, tree.num_nodes).tolist()  # root, then nodes
    n = len(ctx) - 1  # cached before the tree step
    page = spec.page_size
    slot = lambda p: (1 + p // page) * page + p % page
    _, cache, _ = _forward(model, params, spec.allocate(), ctx[:-1], range(n),
                           [slot(p) for p in range(n)], n)
    rows = tree.num_nodes + 1
    logits, cache, md = _forward(model, params, cache, tokens, n + tree.depth,
                                 [slot(n + i) for i in range(rows)], n + rows, tree.visible)
    for i in range(rows):
      path = [tokens[j] for j in tree.path[i][1:tree.depth[i] + 1]]
      want = _sequential(model, params, spec, ctx + path)[-1]
      np.testing.assert_allclose(logits[i], want, atol=1e-4, rtol=1e-4)
    # Accept the deepest node's path; decode one more token from the moved K/V.
    best = int(np.argmax(tree.depth))
    d = int(tree.depth[best])
    out = type("Out", (), {"path": jnp.asarray(tree.path[best])[None],
                           "num_accepted": jnp.asarray([d])})
    # The engine's metadata has a slot mapping per KV group: this model's one group.
    cache = keep_path(cache, md.replace(cu_q_lens=jnp.asarray([0, rows], jnp.int32),
                                        slot_mapping=md.slot_mapping[None]), out)
    path = [tokens[j] for j in tree.path[best][1:]]
    nxt = int(rng.integers(3, 49000))
    got, _, _ = _forward(model, params, cache, [nxt], [n + d + 1], [slot(n + d + 1)], n + d + 2)
    want = _sequential(model, params, spec, ctx + path + [nxt])[-1]
    np.testing.assert_allclose(got[0], want, atol=1e-4, rtol=1e-4)


# -- the walk ---------------------------------------------------------------------------------
def _walk(tree, logits_by_node, drafts, temperature=0.0, typical=None):
  """accept for one sequence whose rows are every node of `tree`."""
  r = tree.num_nodes + 1
  v = logits_by_node.shape[1]
  vt = VerifyTensors(draft_tokens=jnp.asarray([drafts], jnp.int32),
                     num_drafts=jnp.asarray([tree.num_nodes], jnp.int32),
                     row_seq=jnp.zeros(r, jnp.int32), row_depth=jnp.arange(r, dtype=jnp.int32),
                     chain=jnp.arange(r, dtype=jnp.int32)[None], ban_rows=jnp.zeros(1, jnp.int32))
  st = SamplingTensors(
      temperature=jnp.asarray([temperature], jnp.float32), top_k=jnp.asarray([v], jnp.int32),
      top_p=jnp.ones(1), min_p=jnp.zeros(1), repetition_penalty=jnp.ones(1),
      presence_penalty=jnp.zeros(1), frequency_penalty=jnp.zeros(1),
      seeds=jnp.zeros(1, jnp.uint32), gen_idx=jnp.zeros(1, jnp.int32),
      history=jnp.full((1, 4), -1, jnp.int32), prompt_lens=jnp.ones(1, jnp.int32),
      banned=jnp.full((1, 2), -1, jnp.int32), num_logprobs=jnp.zeros(1, jnp.int32))
  out = jax.jit(accept, static_argnums=(3, 4))(jnp.asarray(logits_by_node, jnp.float32), st, vt,
                                                tree, typical)
  a = int(out.num_accepted[0])
  return np.asarray(out.sample.tokens[0, :a + 1]).tolist(), int(out.stop_row[0])


def test_the_walk_follows_the_targets_choice_through_any_child():
  tree = Tree.of(TREE, num_heads=3)  # nodes: 1 (0) 2 (1) 3 (2) 4 (0,0) 5 (0,1) 6 (1,0) ...
  v = 32
  drafts = [3, 5, 7, 9, 11, 13, 2, 4, 6]  # node n's token: drafts[n - 1]
  logits = np.zeros((tree.num_nodes + 1, v))
  pick = lambda node, tok: logits.__setitem__((node, tok), 10.0)
  pick(0, 5)  # the root's choice is node 2's token (a second child)
  pick(2, 13)  # then node 6's (its only child)
  pick(6, 6)  # then node 9's
  pick(9, 1)  # and the target's own token after it
  assert _walk(tree, logits, drafts) == ([5, 13, 6, 1], 9)
  logits[6] = 0
  pick(6, 31)  # no child holds the target's token: it ends the step
  assert _walk(tree, logits, drafts) == ([5, 13, 31], 6)
  logits[0] = 0
  pick(0, 8)  # no candidate at all
  assert _walk(tree, logits, drafts) == ([8], 0)


def test_typical_acceptance_takes_a_likely_child_the_draw_did_not():
  tree = Tree.of([[0], [1]], num_heads=1)
  logits = np.zeros((3, 32))
  logits[0, [2, 4]] = 3.0  # two likely tokens (p = 0.29 each), neither drawn by seed 0
  exact = _walk(tree, logits, [2, 4], temperature=1.0)[0]
  assert len(exact) == 1 and exact[0] not in (2, 4)
  typ = _walk(tree, logits, [2, 4], temperature=1.0, typical=Typical(0.09, 0.3))[0]
  assert len(typ) == 2 and typ[0] == 2  # the first child likely enough is taken


# -- heads on disk ----------------------------------------------------------------------------
def test_published_heads_load_as_ours(tiny_model, tmp_path):
  config = tiny_model[0]
  e, v, h, layers = config.hidden_size, config.vocab_size, 2, 1
  rng = np.random.default_rng(0)
  tensors = {}
  for i in range(h):
    tensors[f"{i}.0.linear.weight"] = rng.standard_normal((e, e)).astype(np.float32) * 0.1
    tensors[f"{i}.0.linear.bias"] = rng.standard_normal(e).astype(np.float32) * 0.1
    tensors[f"{i}.{layers}.weight"] = rng.standard_normal((v, e)).astype(np.float32)
  pub = tmp_path / "published"
  pub.mkdir()
  save_file(tensors, str(pub / mh.PUBLISHED_FILE))
  (pub / "config.json").write_text(json.dumps({"medusa_num_heads": h, "medusa_num_layers": 1}))
  theirs, _ = mh.load_heads(str(pub), config)
  mh.save_heads(str(tmp_path / "ours"), theirs, {"hidden_size": e, "vocab_size": v},
                dtype=jnp.float32)
  ours, _ = mh.load_heads(str(tmp_path / "ours"), config)
  x = jnp.asarray(rng.standard_normal((3, e)), jnp.float32)
  want = np.stack([(xi := np.asarray(x)) + 0 for _ in range(h)], 1)
  for i in range(h):  # the published definition, by hand: x + SiLU(W x + b), then W_out x
    y = xi + jax.nn.silu(xi @ tensors[f"{i}.0.linear.weight"].T + tensors[f"{i}.0.linear.bias"])
    want[:, i] = np.asarray(y)
  want = np.einsum("nhe,hve->nhv", want, np.stack([tensors[f"{i}.1.weight"] for i in range(h)]))
  np.testing.assert_allclose(mh.head_logits(theirs, x), want, rtol=1e-4, atol=1e-3)
  np.testing.assert_allclose(mh.head_logits(ours, x), want, rtol=1e-4, atol=1e-3)
  assert mh.heads_meta(str(pub))["num_heads"] == h == mh.heads_meta(str(tmp_path / "ours"))["num_heads"]


# -- the engine -------------------------------------------------------------------------------
SMALL = dict(max_model_len=128, page_size=8, num_pages=24, max_num_seqs=8,
             max_num_batched_tokens=32, max_prefill_seqs=2)
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def heads(tiny_model, tmp_path_factory) -> dict[str, str]:
  """Heads checkpoints for the tiny model: identity heads (zero blocks: their guess is the
  model's next token again, which this model, repeating its last token, mostly confirms) and
  random ones (nearly always wrong)."""
  config = tiny_model[0]
  meta = {"hidden_size": config.hidden_size, "vocab_size": config.vocab_size}
  out = {}
  for name, scale in (("identity", 0.0), ("random", 1.0)):
    p = mh.init_heads(3, config.hidden_size)
    key = jax.random.key(1)
    p = {"w": jax.random.normal(key, p["w"].shape) * scale,
         "b": jax.random.normal(jax.random.fold_in(key, 1), p["b"].shape) * 3 * scale}
    out[name] = str(tmp_path_factory.mktemp(name))
    mh.save_heads(out[name], p, meta)
  return out


_prompts, _run = random_prompts, run_tokens


@pytest.fixture(scope="module")
def baseline(tiny_model):
  return make_engine(tiny_model, warmup=False, **SMALL)


def _medusa(tiny_model, path, tensor_parallel_size=1, **spec):
  return make_engine(tiny_model, warmup=False, **SMALL, tensor_parallel_size=tensor_parallel_size,
                     speculative_config={"method": "medusa", "num_speculative_tokens": 3,
                                         "model": path, "medusa_choices": TREE, **spec})


@pytest.mark.slow
@pytest.mark.parametrize("which", ["identity", "random"])
def test_output_is_the_same_as_without_speculation(tiny_model, heads, baseline, which):
  prompts = prefix_sharing_prompts()
  eng = _medusa(tiny_model, heads[which])
  want = _run(baseline, prompts, GREEDY)
  assert _run(eng, prompts[:1], GREEDY) == want[:1]
  spec = assert_batch_matches(eng, prompts, GREEDY, want).spec
  assert spec.num_verified > 0
  if which == "identity":
    assert spec.mean_tokens_per_verify > 2.5
  else:
    assert spec.acceptance_rate < 0.1
  sampled = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, ignore_eos=True, seed=3,
                           logprobs=2, repetition_penalty=1.2)
  # The walk draws with the sampler's own key: seeded sampling gives the very same tokens.
  base_out = [o for o in _run(baseline, prompts[:4], sampled)]
  assert _run(eng, prompts[:4], sampled) == base_out
  assert not eng.scheduler.running and not eng.scheduler.waiting
  b = eng.blocks
  b.check_consistency()
  assert b.num_free_pages == b.num_usable_pages and not any(b.ref[1:])


@pytest.mark.slow
def test_stops_and_logprobs_as_without_speculation(tiny_model, heads, baseline):
  eng = _medusa(tiny_model, heads["identity"])
  prompt = _prompts(1, seed=3)[0]
  for case in [dict(max_tokens=7), dict(min_tokens=6, max_tokens=9), dict(logprobs=3)]:
    params = SamplingParams(**{**dict(temperature=0.0, max_tokens=20, ignore_eos=True), **case})
    want = baseline.run_to_completion([baseline.add_request(None, prompt, params)])
    got = eng.run_to_completion([eng.add_request(None, prompt, params)])
    (w,), (g,) = want.values(), got.values()
    assert g.outputs[0].token_ids == w.outputs[0].token_ids, case
    if params.logprobs:
      for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
        assert a.keys() == b.keys()
        np.testing.assert_allclose(list(a.values()), list(b.values()), atol=1e-4)


@pytest.mark.slow
def test_a_constrained_sequence_verifies_its_tree(tiny_model, heads, baseline):
  """Under a structured-output constraint each tree node's row is masked for its own path: the
  greedy and seeded outputs are the ones without speculation, and the tree's candidates the
  constraint allows are accepted."""
  from jinfer import StructuredOutputsParams as SO
  from tests.test_structured_outputs import SCHEMA
  eng = _medusa(tiny_model, heads["identity"])
  prompts = _prompts(3, seed=12, lo=5, hi=30)
  constraints = [SO(json=SCHEMA), SO(regex="[a-z ]{4,40}"), SO(regex="[0-9]{5,30}")]
  for temperature in (0.0, 1.0):
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=30,
                             structured_outputs=c) for i, c in enumerate(constraints)]
    want = [_run(baseline, [p], sp)[0] for p, sp in zip(prompts, params)]
    before = eng.stats().spec
    rids = [eng.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    final = eng.run_to_completion(rids)
    assert [final[r].outputs[0].token_ids for r in rids] == want, temperature
    spec = eng.stats().spec.since(before)
    assert spec.num_verified > 0 and spec.num_accepted_tokens > 0, temperature


@pytest.mark.slow
def test_vocabulary_heads_on_a_quantized_target(tiny_model, tmp_path):
  """Heads restricted to a vocabulary project through the target's tied embedding; quantized,
  that embedding is a QArray whose rows are dequantized once at load time."""
  config = tiny_model[0]
  p = mh.init_heads(3, config.hidden_size)  # zero blocks: the identity heads above
  p["vocab"] = np.arange(config.vocab_size, dtype=np.int32)[::-1].copy()  # all, reordered
  mh.save_heads(str(tmp_path), p, {"hidden_size": config.hidden_size,
                                   "vocab_size": config.vocab_size})
  prompts = _prompts(3, seed=4)
  baseline = make_engine(tiny_model, warmup=False, **SMALL, quantization="int8")
  eng = make_engine(tiny_model, warmup=False, **SMALL, quantization="int8",
                    speculative_config={"method": "medusa", "num_speculative_tokens": 3,
                                        "model": str(tmp_path), "medusa_choices": TREE})
  assert _run(eng, prompts, GREEDY) == _run(baseline, prompts, GREEDY)
  # The identity heads guess the target's next token again only if their rows are its own.
  assert eng.stats().spec.mean_tokens_per_verify > 2.5


@pytest.mark.slow  # ~90 s: compiles every bucket's plain and verify step
def test_no_compiles_after_warmup(tiny_model, heads):
  eng = make_engine(tiny_model, warmup="now", **SMALL, speculative_config={
      "method": "medusa", "num_speculative_tokens": 3, "model": heads["identity"]})
  counter = CompileCounter()
  params = [SamplingParams(temperature=t, top_p=tp, max_tokens=m, seed=i, logprobs=lp,
                           presence_penalty=pp, min_tokens=2)
            for i, (t, tp, m, lp, pp) in enumerate(zip([0, 0.7, 1.0] * 2, [1, 0.9] * 3,
                                                       [2, 7, 30] * 2, [None, 3] * 3,
                                                       [0, 0.5, 0] * 2))]
  rids = [eng.add_request(None, p, sp) for p, sp in zip(_prompts(6, seed=4, lo=1), params)]
  eng.abort(rids[4])
  eng.run_to_completion()
  assert counter.count == 0, f"{counter.count} compiles after warmup"
  assert eng.stats().spec.num_verified > 0


@pytest.mark.parametrize("config, says", [
    (dict(model="nowhere"), "model 'nowhere' not found"),
    (dict(medusa_choices=[[0, 0]]), "lacks its parent"),
    (dict(num_speculative_tokens=5), "has 3 heads"),
    (dict(acceptance_method="lucky"), "acceptance_method"),
    (dict(posterior_threshold=0.0), "posterior_threshold")])
def test_a_bad_medusa_config_is_refused_before_the_engine_loads(heads, config, says):
  """Refused when made, or by `resolve()` where it takes the heads' files."""
  with pytest.raises(ValueError, match=says):
    SpeculativeConfig.parse({"method": "medusa", "num_speculative_tokens": 3,
                             "model": heads["identity"], **config}).resolve("cpu")


def test_medusa_with_context_parallelism_is_refused(heads):
  with pytest.raises(ValueError, match="context parallelism"):
    EngineConfig.of(context_parallel_size=2, speculative_config={
        "method": "medusa", "num_speculative_tokens": 3, "model": heads["identity"]})


def test_heads_for_another_model_are_refused(tiny_model, tmp_path):
  p = mh.init_heads(2, tiny_model[0].hidden_size + 8)
  mh.save_heads(str(tmp_path), p, {})
  with pytest.raises(ValueError, match="hidden size"):
    _medusa(tiny_model, str(tmp_path), num_speculative_tokens=2, medusa_choices=[[0]])


@pytest.mark.slow
def test_tensor_parallel_medusa_gives_the_same_tokens(tiny_model, heads, baseline):
  """Heads run on the gathered hidden state of a tensor-parallel step (2 host devices)."""
  prompts = _prompts(4, seed=6)
  eng = _medusa(tiny_model, heads["identity"], medusa_choices=[[0], [1], [0, 0], [0, 0, 0]],
                tensor_parallel_size=2)
  assert _run(eng, prompts, GREEDY) == _run(baseline, prompts, GREEDY)
  assert eng.stats().spec.mean_tokens_per_verify > 2.5


def test_num_speculative_tokens_defaults_to_the_heads_or_the_trees_depth(heads):
  """As vLLM takes k from a speculator's config: the checkpoint's heads, or the depth of the
  tree given; ngram and draft models still need it."""
  spec = SpeculativeConfig.parse({"method": "medusa", "model": heads["identity"]}).resolve("cpu")
  assert spec.num_speculative_tokens == 3 and spec.tree().max_depth <= 3
  tree = SpeculativeConfig.parse({"method": "medusa", "model": heads["identity"],
                                  "medusa_choices": [[0], [1], [0, 0]]}).resolve("cpu")
  assert tree.num_speculative_tokens == 2
  with pytest.raises(ValueError, match="'draft_model' needs num_speculative_tokens"):
    SpeculativeConfig.parse({"method": "draft_model", "model": heads["identity"]})
