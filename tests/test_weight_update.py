"""Weights updated in place (`update_weights`, `load_weights`), pausing, sleeping and waking.

The reference for new weights is a fresh engine built on them (and, for HF-named tensors,
transformers' own greedy decoding of the model they came from); the tiny random Llama over
SmolLM2's vocabulary with the SMALL_POOL options, whose steps test_engine compiles too.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import NamedSharding

from jinfer import LLM
from jinfer.engine.data_parallel import DataParallelEngine
from jinfer.engine.engine import LLMEngine
from jinfer.engine.engine_config import EngineConfig
from jinfer.errors import EngineStateError, ParameterError
from jinfer.sampling.params import SamplingParams
from jinfer.weights.hf_layout import WeightError
from tests.engine_fixtures import SMALL_POOL, CompileCounter, make_engine, run_tokens

N = 10  # tokens out
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=N, ignore_eos=True)
PROMPTS = [[101, 7, 2024, 9], list(range(300, 318)), [45, 46, 47, 48, 49, 50, 51]]


def perturbed(params: dict, seed: int) -> dict:
  """New weights as numpy arrays: every leaf plus noise of a tenth of its scale, the layers'
  kernels 8 times larger (the fixture's model, its embedding scaled up, mostly repeats the last
  token; these change its greedy outputs)."""
  rng = np.random.default_rng(seed)
  noisy = lambda a: np.asarray(a) + rng.normal(0, 0.1 * float(np.std(a)) + 1e-3, a.shape)
  out = jax.tree.map(lambda a: noisy(a).astype(np.float32), params)
  out["layers"] = jax.tree.map(lambda a: a * 8 if a.ndim >= 3 else a, out["layers"])
  return out


def host_copy(params: dict) -> dict:
  return jax.tree.map(np.array, params)


def leaves_are(tree: dict, other: dict) -> bool:
  return all(a is b for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(other)))


def no_leaks(engine: LLMEngine) -> None:
  engine.blocks.check_consistency()
  assert engine.blocks.num_free_pages == engine.blocks.num_usable_pages and not engine.groups


def outputs(engine: LLMEngine) -> list[list[int]]:
  """Every prompt's greedy and seeded tokens, run together."""
  rids = [engine.add_request(None, p, sp) for sp in (GREEDY, SEEDED) for p in PROMPTS]
  final = engine.run_to_completion(rids)
  return [final[r].outputs[0].token_ids for r in rids]


@pytest.fixture(scope="module")
def weights(tiny_model):
  """(A, B): the tiny model's weights and new ones."""
  return host_copy(tiny_model[1]), perturbed(tiny_model[1], seed=1)


@pytest.fixture(scope="module")
def idle(tiny_model, weights):
  """An engine that compiles nothing ahead (the tests here run no step on it)."""
  config, _, tok = tiny_model
  return make_engine((config, host_copy(weights[0]), tok), warmup=False, **SMALL_POOL)


# -- bad input: an error naming it, and the old weights kept --------------------------------
def _edited(params: dict, path: tuple[str, ...], value=None) -> dict:
  """A copy of the tree with the leaf at `path` set to `value` (None: taken out)."""
  out = jax.tree.map(lambda a: a, params)
  node = out
  for key in path[:-1]:
    node = node[key]
  if value is None:
    del node[path[-1]]
  else:
    node[path[-1]] = value
  return out


@pytest.mark.parametrize("bad, says", [
    (lambda p: _edited(p, ("layers", "attn", "q_proj", "kernel")),
     r"params\['layers'\]\['attn'\]\['q_proj'\]\['kernel'\] is missing"),
    (lambda p: _edited(p, ("embedding",), p["embedding"][:, :8]),
     r"params\['embedding'\] has shape \(49152, 8\), expected \(49152, 64\)"),
    (lambda p: _edited(p, ("norm", "scale"), p["norm"]["scale"].astype(np.int32)),
     r"params\['norm'\]\['scale'\] has dtype int32, expected a floating-point"),
    (lambda p: _edited(p, ("layers", "attn", "extra"), np.zeros(3, np.float32)),
     r"params\['layers'\]\['attn'\]\['extra'\] is not a parameter of this model"),
    (lambda p: [p], r"params: expected jinfer's params tree"),
])
def test_a_bad_params_tree_is_named_and_changes_nothing(idle, weights, bad, says):
  before = idle.runner.stacked_params
  with pytest.raises(ParameterError, match=says):
    idle.update_weights(bad(weights[1]))
  assert idle.runner.stacked_params is before


def test_bad_hf_tensors_are_named_and_change_nothing(idle, tiny_model_path):
  from safetensors.numpy import load_file
  named = load_file(f"{tiny_model_path}/model.safetensors")
  before = idle.runner.stacked_params
  cases = [
      ({k: v for k, v in named.items() if k != "model.layers.1.mlp.up_proj.weight"},
       r"missing tensor 'model.layers.1.mlp.up_proj.weight'"),
      ({**named, "model.layers.0.self_attn.q_proj.weight": named[
          "model.layers.0.self_attn.q_proj.weight"][:32]},
       r"tensor 'model.layers.0.self_attn.q_proj.weight' has shape \(32, 64\), expected "
       r"\(64, 64\)"),
      ({**named, "model.layers.0.mlp.gate.weight": np.zeros((4, 64), np.float32)},
       r"1 tensor\(s\) map to no parameter of this model: 'model.layers.0.mlp.gate.weight'"),
      ({**named, "model.norm.weight": np.ones(64, np.int64)},
       r"tensor 'model.norm.weight' has dtype int64"),
      ({**named, "lm_head.weight": named["model.embed_tokens.weight"] + 1},
       r"'lm_head.weight' differs from 'model.embed_tokens.weight'"),
  ]
  for tensors, says in cases:
    with pytest.raises(WeightError, match=says):
      idle.load_weights(tensors)
    assert idle.runner.stacked_params is before
  # A tied model's head may come along equal to the embedding, as a state_dict holds it; pairs
  # do as well as a dict.
  idle.load_weights(list({**named, "lm_head.weight": named["model.embed_tokens.weight"]}.items()))
  for a, b in zip(jax.tree.leaves(idle.runner.stacked_params), jax.tree.leaves(before)):
    np.testing.assert_array_equal(a, b)


def test_requests_in_flight_need_a_pause(idle, weights):
  rid = idle.add_request(None, PROMPTS[0], GREEDY)
  before = idle.runner.stacked_params
  for call in (lambda: idle.update_weights(weights[1]), lambda: idle.sleep(1)):
    with pytest.raises(EngineStateError, match=r"1 request\(s\) in flight; call "
                                               r"pause_generation\(\) first"):
      call()
  assert idle.runner.stacked_params is before and idle.runner.kv_cache is not None
  idle.pause_generation()
  assert idle.step() == []  # paused: nothing runs
  with pytest.raises(EngineStateError, match="paused: resume_generation"):
    idle.run_to_completion()
  idle.resume_generation()
  assert idle.abort(rid)
  no_leaks(idle)


# -- placement: no copy where none is needed, the engine's layout otherwise ------------------
def test_arrays_placed_as_the_engine_places_them_are_used_without_a_copy(idle, weights):
  new = jax.device_put(weights[1], idle.weight_shardings())
  idle.update_weights(new)
  assert leaves_are(idle.runner.stacked_params, new)
  a = idle.runner.stacked_params["layers"]["attn"]["q_proj"]["kernel"]
  assert a.unsafe_buffer_pointer() == new["layers"]["attn"]["q_proj"]["kernel"
                                                            ].unsafe_buffer_pointer()
  idle.update_weights(weights[0])  # numpy: copied onto the device
  assert not leaves_are(idle.runner.stacked_params, weights[0])
  np.testing.assert_array_equal(idle.runner.stacked_params["embedding"], weights[0]["embedding"])


def test_tensor_parallel_reshards_and_keeps_what_is_sharded_already(tiny_model, weights):
  config, _, tok = tiny_model
  engine = make_engine((config, weights[0], tok), warmup=False, tensor_parallel_size=2,
                       **SMALL_POOL)
  shardings = engine.weight_shardings()
  assert isinstance(shardings["embedding"], NamedSharding)
  engine.update_weights(weights[1])  # numpy, resharded onto the mesh
  for a, s, want in zip(jax.tree.leaves(engine.runner.stacked_params),
                        jax.tree.leaves(shardings), jax.tree.leaves(weights[1])):
    assert a.sharding == s
    np.testing.assert_array_equal(a, want)
  # Arrays on one device of the mesh, and in bfloat16: put onto the mesh, cast to float32.
  one = jax.device_put(jax.tree.map(lambda a: a.astype(jax.numpy.bfloat16), weights[0]),
                       jax.devices()[0])
  engine.update_weights(one)
  q = engine.runner.stacked_params["layers"]["attn"]["q_proj"]["kernel"]
  assert q.dtype == np.float32 and q.sharding == shardings["layers"]["attn"]["q_proj"]["kernel"]
  sharded = jax.device_put(weights[1], shardings)
  engine.update_weights(sharded)
  assert leaves_are(engine.runner.stacked_params, sharded)


@pytest.mark.slow
def test_data_parallel_ranks_update_pause_and_sleep_alike(tiny_model, weights):
  config, _, tok = tiny_model
  dp = DataParallelEngine.from_parts(config, weights[0], tok, warmup=False,
                                     config=EngineConfig.of(data_parallel_size=2, **SMALL_POOL))
  rid = dp.add_request(None, PROMPTS[0], GREEDY)
  with pytest.raises(EngineStateError, match="in flight"):
    dp.update_weights(weights[1])
  dp.pause_generation()
  assert dp.is_paused and dp.step() == []
  dp.update_weights(weights[1])
  for rank, e in enumerate(dp.engines):
    q = e.runner.stacked_params["layers"]["attn"]["q_proj"]["kernel"]
    assert q.devices() == {jax.devices()[rank]}
    np.testing.assert_array_equal(q, weights[1]["layers"]["attn"]["q_proj"]["kernel"])
  dp.sleep(1)
  assert dp.is_sleeping and all(e.runner.kv_cache is None for e in dp.engines)
  dp.wake_up()
  dp.resume_generation()
  assert dp.abort(rid)
  for e in dp.engines:
    no_leaks(e)


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    dict(quantization="int8"),  # re-quantized, round to nearest
    dict(tensor_parallel_size=4),  # 2 KV heads over 4 shards: each held twice
], ids=["int8", "tp4-kv-heads-repeated"])
def test_new_weights_are_laid_out_as_a_fresh_engine_lays_them_out(tiny_model, weights,
                                                                   options):
  config, _, tok = tiny_model
  build = lambda p: make_engine((config, p, tok), warmup=False, **options, **SMALL_POOL)
  engine, fresh = build(weights[0]), build(weights[1])
  engine.update_weights(weights[1])
  got, want = engine.runner.stacked_params, fresh.runner.stacked_params
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.dtype == b.dtype and a.shape == b.shape and a.sharding == b.sharding
    np.testing.assert_array_equal(a, b)
  assert (any(a.dtype == np.int8 for a in jax.tree.leaves(got)) if "quantization" in options
          else got["layers"]["attn"]["k_proj"]["kernel"].shape[2] == 4)


# -- sleeping: device memory freed, states named ---------------------------------------------
def device_bytes() -> int:
  return sum(a.nbytes for a in jax.live_arrays() if a.sharding.memory_kind == "device")


def test_sleep_frees_device_memory_and_wake_restores_it(idle, weights):
  idle.update_weights(weights[0])  # numpy: arrays of the engine's own
  stats = idle.stats()
  held = stats.weight_bytes + stats.kv_cache_bytes
  before = device_bytes()
  idle.sleep(1)
  assert before - device_bytes() >= held
  assert sum(a.nbytes for a in jax.live_arrays()
             if a.sharding.memory_kind == "pinned_host") >= stats.weight_bytes
  idle.sleep(1)  # asleep already: nothing to do
  idle.wake_up()
  assert device_bytes() - before < held  # back, once
  idle.wake_up()  # awake already: nothing to do
  for a, b in zip(jax.tree.leaves(idle.runner.stacked_params), jax.tree.leaves(weights[0])):
    np.testing.assert_array_equal(a, b)
  assert idle.stats().kv_cache_bytes == stats.kv_cache_bytes


def test_level_2_needs_new_weights_and_asleep_nothing_generates(idle, weights, tiny_model_dir):
  with pytest.raises(ParameterError, match="sleep level must be 1"):
    idle.sleep(3)
  idle.sleep(1)
  idle.sleep(2)  # deeper: the host copy goes too
  assert not idle.runner.has_params
  with pytest.raises(EngineStateError, match=r"weights were dropped \(sleep\(level=2\)\)"):
    idle.wake_up()
  rid = idle.add_request(None, PROMPTS[0], GREEDY)
  with pytest.raises(EngineStateError, match="asleep: wake_up"):
    idle.step()
  idle.abort(rid)
  new = jax.device_put(weights[1], idle.weight_shardings())
  idle.update_weights(new)  # asleep: the weights go to the devices, the cache stays freed
  assert idle.runner.kv_cache is None
  idle.wake_up()
  assert leaves_are(idle.runner.stacked_params, new) and idle.runner.kv_cache is not None
  no_leaks(idle)

  llm = LLM(tiny_model_dir, warmup=False, max_model_len=32, max_num_seqs=2)
  for stop, says in ((lambda: llm.sleep(1), "asleep: wake_up"),
                     (llm.pause_generation, "paused: resume_generation")):
    stop()
    with pytest.raises(EngineStateError, match=says):
      llm.generate(["t5 t6"], use_tqdm=False)
    assert not llm.engine.groups  # refused before anything was queued
    llm.wake_up()
    llm.resume_generation()


# -- generating on new weights ---------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_model, weights):
  """On weights A, its steps compiled ahead; a compile while serving raises."""
  config, _, tok = tiny_model
  return make_engine((config, host_copy(weights[0]), tok), strict_compiles=True, **SMALL_POOL)


@pytest.fixture(scope="module")
def fresh(tiny_model, weights):
  """Built on weights B."""
  config, _, tok = tiny_model
  return make_engine((config, weights[1], tok), **SMALL_POOL)


@pytest.mark.slow
def test_update_then_generate_equals_a_fresh_engine(engine, fresh, weights):
  before, want = outputs(engine), outputs(fresh)
  assert all(a != b for a, b in zip(before, want))
  counter = CompileCounter()
  engine.update_weights(weights[1])
  assert outputs(engine) == want  # greedy and seeded, token for token
  engine.update_weights(jax.device_put(weights[0], engine.weight_shardings()))
  assert outputs(engine) == before
  assert counter.count == 0 and engine.stats().compiles_after_startup == 0
  no_leaks(engine)


@pytest.mark.slow
def test_a_prefix_cached_on_old_weights_is_never_reused(engine, fresh, weights):
  shared = list(range(1000, 1024))  # six full pages
  prompt = [shared + [7, 8], shared + [9]]
  run_tokens(engine, prompt, GREEDY)
  rid = engine.add_request(None, prompt[0], GREEDY)
  assert engine.run_to_completion([rid])[rid].num_cached_tokens > 0  # the cache works
  engine.update_weights(weights[1])
  rid = engine.add_request(None, prompt[1], GREEDY)
  out = engine.run_to_completion([rid])[rid]
  assert out.num_cached_tokens == 0
  assert out.outputs[0].token_ids == run_tokens(fresh, [prompt[1]], GREEDY)[0]
  rid = engine.add_request(None, prompt[1], GREEDY)
  assert engine.run_to_completion([rid])[rid].num_cached_tokens > 0  # new weights' pages
  engine.update_weights(weights[0])
  no_leaks(engine)


@pytest.mark.slow
def test_requests_paused_across_an_update_go_on_on_the_new_weights(engine, fresh, weights):
  """The documented semantics: tokens out before the pause stay; the rest are the new weights'
  continuation of prompt + those tokens (their K/V recomputed), with no page leaked."""
  rids = [engine.add_request(None, p, GREEDY) for p in PROMPTS]
  while min(len(engine.groups[r].seqs[0].output_token_ids) for r in rids) < 3:
    engine.step()
  engine.pause_generation()
  assert engine.step() == []
  kept = {r: list(engine.groups[r].seqs[0].output_token_ids) for r in rids}
  engine.update_weights(weights[1])
  assert not engine.scheduler.running  # preempted: their K/V was the old weights'
  engine.resume_generation()
  final = engine.run_to_completion(rids)
  for r, p in zip(rids, PROMPTS):
    k = kept[r]
    rest = run_tokens(fresh, [p + k], SamplingParams(temperature=0.0, max_tokens=N - len(k),
                                                     ignore_eos=True))[0]
    assert final[r].outputs[0].token_ids == k + rest
  engine.update_weights(weights[0])
  no_leaks(engine)


@pytest.mark.slow
def test_outputs_after_wake_are_those_before_and_nothing_compiles(engine, weights):
  before = outputs(engine)
  counter = CompileCounter()
  engine.sleep(1)
  engine.wake_up()
  assert outputs(engine) == before
  engine.sleep(2)
  engine.update_weights(weights[0])
  engine.wake_up()
  assert outputs(engine) == before
  assert counter.count == 0 and engine.stats().compiles_after_startup == 0
  no_leaks(engine)


@pytest.mark.slow
def test_load_weights_runs_what_transformers_runs(engine, weights, tiny_model):
  """HF-named tensors from a transformers model's state_dict (its tied head included): the
  engine's greedy tokens are transformers' own."""
  config = tiny_model[0]
  torch.manual_seed(5)
  hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=config.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
      tie_word_embeddings=True)).eval()
  hf.generation_config.eos_token_id = None  # ignore_eos, as the engine runs
  with torch.no_grad():
    hf.model.embed_tokens.weight.mul_(40.0)  # clear greedy winners, as the fixture's model
    for name, w in hf.named_parameters():
      if "layers" in name and w.ndim == 2:
        w.mul_(8.0)  # not only the last token repeated, as `perturbed` says
    want = [hf.generate(torch.tensor([p]), max_new_tokens=N, do_sample=False)[0, len(p):]
            .tolist() for p in PROMPTS]
  engine.load_weights({k: v.numpy() for k, v in hf.state_dict().items()})
  assert run_tokens(engine, PROMPTS, GREEDY) == want
  engine.update_weights(weights[0])
  no_leaks(engine)
