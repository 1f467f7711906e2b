"""`update_lora`: an adapter's weights replaced in place. Afterwards the engine generates what a
fresh engine with the new adapter's files generates, token for token (greedy and seeded), with
nothing compiled, and no prefix cached under the old weights is reused; bad tensors are refused
naming the tensor, and the old adapter stays; a request running with the adapter goes on as if
it had started under the new weights.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from jinfer.engine.lora_slots import LoRARequest
from jinfer.errors import ParameterError
from jinfer.sampling.params import SamplingParams
from jinfer.training.lora_train import init_lora, lora_sites
from jinfer.weights.peft_adapter import AdapterError, save_peft_adapter
from tests.engine_fixtures import ROLLOUT, CompileCounter, make_engine

RANK, ALPHA = 4, 8.0
TARGETS = ("q_proj", "v_proj", "o_proj", "up_proj")
PARAMS = [SamplingParams(temperature=0.0, max_tokens=6),
          SamplingParams(temperature=0.9, max_tokens=6, seed=11)]


def _factors(tiny_model, seed: int) -> dict:
  config, params, _ = tiny_model
  lora = init_lora(params, lora_sites(config, TARGETS), RANK, seed=seed)
  rng = np.random.default_rng(seed)
  return {p: (np.asarray(a), rng.normal(0, 0.5, b.shape).astype(np.float32))
          for p, (a, b) in lora.items()}


@pytest.fixture(scope="module")
def versions(tiny_model, tmp_path_factory):
  """Three adapters' (directory, trainer-layout factors): v1 and v2 of one adapter, and another."""
  out = []
  for seed in (1, 2, 3):
    factors = _factors(tiny_model, seed)
    path = str(tmp_path_factory.mktemp(f"update_v{seed}"))
    save_peft_adapter(path, tiny_model[0], factors, rank=RANK, alpha=ALPHA)
    out.append((path, factors))
  return out


@pytest.fixture(scope="module")
def engine(tiny_model):
  return make_engine(tiny_model, warmup=False, **ROLLOUT)


def _prompts() -> list[list[int]]:
  rng = np.random.default_rng(5)
  return [rng.integers(5, 1000, size=int(rng.integers(6, 20))).tolist() for _ in range(4)]


def _run(engine, lora: LoRARequest | None):
  """Each prompt under each of PARAMS: (token ids, prefix-cached prompt tokens) per request."""
  ids = [engine.add_request(None, p, sp, lora_request=lora)
         for p in _prompts() for sp in PARAMS]
  final = engine.run_to_completion(ids)
  return [final[i].outputs[0].token_ids for i in ids], [final[i].num_cached_tokens for i in ids]


@pytest.mark.slow  # a second engine and five batches: 38 s on a loaded 2-core machine
def test_update_then_generate_equals_a_fresh_engine(tiny_model, engine, versions):
  """One slot and one host copy (ROLLOUT) for two adapters. v1 from files, then v2 pushed as
  PEFT tensors and again in the trainer's layout: the tokens are a fresh engine's with v2's
  files, nothing compiles, the prompts cached under v1 are computed again, and an eviction by
  another adapter brings back v2."""
  (v1, _), (v2, f2), (other, _) = versions
  lora = LoRARequest("policy", 1, v1)
  before, cold = _run(engine, lora)  # cold: what the requests take from each other's pages
  assert _run(engine, lora)[1] != cold  # now they hit the pages cached under v1
  counter = CompileCounter()
  engine.update_lora("policy", load_file(os.path.join(v2, "adapter_model.safetensors")))
  after, cached = _run(engine, lora)
  assert cached == cold  # nothing reused from v1's pages
  _run(engine, LoRARequest("other", 2, other))  # takes the one slot and the one host copy
  engine.update_lora(1, f2)  # by id, the trainer's layout: the same weights
  again, _ = _run(engine, lora)
  assert counter.count == 0
  fresh = make_engine(tiny_model, warmup=False, **ROLLOUT)
  want, _ = _run(fresh, LoRARequest("policy", 1, v2))
  assert after == want and again == want
  assert after != before
  assert engine.adapters.slots_in_use == 0
  assert engine.blocks.num_free_pages == engine.blocks.num_usable_pages


def _bad_updates(path: str, factors: dict):
  tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
  name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
  site = ("layers", "attn", "q_proj")
  a, b = factors[site]
  yield {k: v for k, v in tensors.items() if k != name}, f"missing tensor '{name}'"
  rows = tensors[name].shape[0]
  yield {**tensors, name: tensors[name][:, :2]}, rf"tensor '{name}' has shape \({rows}, 2\)"
  yield ({**tensors, name: np.full_like(tensors[name], np.nan)},
         f"tensor '{name}' has non-finite values")
  yield {**tensors, name: tensors[name].astype(np.int32)}, f"tensor '{name}' has dtype int32"
  extra = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
  yield {**tensors, extra: tensors[name]}, f"tensor '{extra}'"
  yield {**factors, site: (a[..., :2], b[:, :2])}, r"\('layers', 'attn', 'q_proj'\) has a"
  yield {**factors, ("layers", "attn", "rotary"): (a, b)}, "not an adaptable module"
  yield [], "tensors must be a non-empty dict"


def test_bad_tensors_are_refused_and_the_old_adapter_stays(engine, versions):
  (v1, f1), _, _ = versions
  lora = LoRARequest("policy", 1, v1)
  engine.add_lora(lora)
  engine.update_lora("policy", f1)  # v1 again, from memory now
  want, _ = _run(engine, lora)
  for tensors, message in _bad_updates(v1, f1):
    with pytest.raises(AdapterError, match=message) as e:
      engine.update_lora("policy", tensors)
    assert e.value.param == "tensors"
  with pytest.raises(ParameterError, match="no adapter 'nope' is registered"):
    engine.update_lora("nope", f1)
  assert _run(engine, lora)[0] == want


def test_a_running_request_goes_on_under_the_new_weights(engine, versions):
  """Updated after three steps, a greedy request's remaining tokens are those the new adapter
  gives after its tokens so far."""
  (v1, f1), (_, f2), _ = versions
  lora = LoRARequest("policy", 1, v1)
  engine.add_lora(lora)
  engine.update_lora(1, f1)
  prompt = _prompts()[0]
  params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
  rid = engine.add_request(None, prompt, params, lora_request=lora)
  for _ in range(3):
    engine.step()
  so_far = list(engine.groups[rid].seqs[0].output_token_ids)
  assert 0 < len(so_far) < 10
  preemptions = engine.scheduler.num_preemptions
  engine.update_lora(1, f2)
  assert engine.scheduler.num_preemptions == preemptions + 1
  out = engine.run_to_completion([rid])[rid].outputs[0].token_ids
  assert out[:len(so_far)] == so_far
  rest = dict(vars(params), max_tokens=10 - len(so_far))
  cont = engine.add_request(None, prompt + so_far, SamplingParams(**rest), lora_request=lora)
  assert out[len(so_far):] == engine.run_to_completion([cont])[cont].outputs[0].token_ids
  assert engine.blocks.num_free_pages == engine.blocks.num_usable_pages
