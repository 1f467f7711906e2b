"""LoRA adapters in the engine: mixed batches against HF peft, a quantized base, slots that come
and go without a compile, waiting for a slot, and the prefix cache keyed by adapter.

The adapters are made by HF peft itself (random, nonzero B) on the tiny random Llama and saved
as PEFT directories; jinfer reads those files.
"""
from __future__ import annotations

import numpy as np
import peft
import pytest
import torch
import transformers

from jinfer.engine.lora_slots import LoRARequest
from jinfer.errors import ParameterError
from jinfer.quant.groupwise import dequantize_like
from jinfer.models import param_shapes
from jinfer.sampling.params import SamplingParams
from tests.engine_fixtures import CompileCounter, make_engine

OPTIONS = dict(max_model_len=64, page_size=4, num_pages=65, max_num_seqs=8,
               max_num_batched_tokens=16, max_prefill_seqs=4)
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3)
# (rank, alpha, target modules, rslora) of the three adapters
ADAPTERS = ((4, 8, ["q_proj", "v_proj"], False),
            (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"], False),
            (2, 4, ["o_proj", "down_proj"], True))
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)


@pytest.fixture(scope="module")
def adapters(tiny_model_path, tmp_path_factory):
  """[(LoRARequest, the HF peft model with that adapter)] for ADAPTERS."""
  out = []
  for i, (r, alpha, targets, rslora) in enumerate(ADAPTERS):
    torch.manual_seed(10 + i)
    base = transformers.LlamaForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
        init_lora_weights=False))
    with torch.no_grad():  # peft's random B is small; make the adapters change the answers
      for name, p in model.named_parameters():
        if "lora_B" in name:
          p.mul_(5.0)
    path = str(tmp_path_factory.mktemp(f"adapter{i}"))
    model.save_pretrained(path)
    out.append((LoRARequest(f"adapter{i}", i + 1, path), model.eval()))
  return out


@pytest.fixture(scope="module")
def engine(tiny_model):
  return make_engine(tiny_model, warmup="now", strict_compiles=True, **OPTIONS, **LORA)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(5, 1000, size=int(rng.integers(5, 20))).tolist() for _ in range(n)]


def _run(engine, prompts, params, loras):
  ids = [engine.add_request(None, p, params, lora_request=lora) for p, lora in zip(prompts, loras)]
  out = engine.run_to_completion()
  return [out[i].outputs[0] for i in ids]


def _assert_no_leaks(engine):
  assert not engine.has_unfinished_requests()
  assert engine.adapters.slots_in_use == 0
  assert engine.blocks.num_free_pages == engine.blocks.num_usable_pages  # cached pages count


def _hf_logprobs(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
  """log-softmax of `model` [len(tokens), V] at each output position."""
  with torch.no_grad():
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
  return torch.log_softmax(logits.double(), -1).numpy()


def _assert_matches_hf(outputs, prompts, models):
  for out, prompt, model in zip(outputs, prompts, models):
    want = _hf_logprobs(model, prompt, out.token_ids)
    assert out.token_ids == want.argmax(-1).tolist()
    for pos, top in enumerate(out.logprobs):
      for tok, lp in top.items():
        assert abs(lp - want[pos, tok]) <= 1e-4, (pos, tok, lp, want[pos, tok])


def test_a_mixed_batch_matches_hf_peft_per_request(engine, adapters, hf_base):
  """Base rows and three adapters (two slots: one is evicted and reloaded) in the same steps;
  each request's tokens and logprobs are HF peft's with its own adapter."""
  prompts = _prompts(8)
  which = [None, 0, 1, 2, 0, None, 1, 2]
  loras = [None if w is None else adapters[w][0] for w in which]
  outs = _run(engine, prompts, GREEDY, loras)
  _assert_matches_hf(outs, prompts, [hf_base if w is None else adapters[w][1] for w in which])
  # The adapters do change the answers.
  assert outs[0].token_ids != outs[1].token_ids or outs[5].token_ids != outs[4].token_ids
  _assert_no_leaks(engine)


@pytest.fixture(scope="module")
def hf_base(tiny_model_path):
  return transformers.LlamaForCausalLM.from_pretrained(tiny_model_path,
                                                       dtype=torch.float32).eval()


def test_adapters_come_and_go_without_a_compile(engine, adapters):
  """Three adapters over two slots, loaded, evicted, unloaded and registered again after
  warmup: nothing compiles, and slots and pages all come back."""
  loads = engine.adapters.loads
  counter = CompileCounter()
  for round_ in range(2):
    for lora, _ in adapters:
      _run(engine, _prompts(3, seed=round_), GREEDY, [lora, None, lora])
    engine.remove_lora(adapters[0][0].lora_int_id)
    assert adapters[0][0].lora_int_id not in engine.adapters.known
  assert counter.count == 0
  assert engine.adapters.loads - loads >= 4  # two slots for three adapters: evictions
  _assert_no_leaks(engine)


def test_a_request_waits_for_a_slot_without_stalling_the_others(tiny_model, adapters):
  """One slot: while adapter 0's request runs, adapter 1's waits; a base request runs beside
  them; aborting the waiting one frees everything, and the rest finish."""
  eng = make_engine(tiny_model, warmup=False, **OPTIONS,
                    **dict(LORA, max_loras=1, max_cpu_loras=None))
  long = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
  first = eng.add_request(None, _prompts(1)[0], long, lora_request=adapters[0][0])
  waiting = eng.add_request(None, _prompts(1, 1)[0], long, lora_request=adapters[1][0])
  base = eng.add_request(None, _prompts(1, 2)[0], long)
  for _ in range(3):
    eng.step()
  running = {s.group_id for s in eng.scheduler.running}
  assert running == {first, base}
  assert eng.groups[waiting].seqs[0].lora_slot is None
  assert eng.abort(waiting)
  out = eng.run_to_completion()
  assert len(out[first].outputs[0].token_ids) == len(out[base].outputs[0].token_ids) == 20
  _assert_no_leaks(eng)


def test_unloading_an_adapter_while_its_request_runs(tiny_model, adapters):
  """remove_lora mid-request: the running request finishes on its adapter (its tokens are those
  of an undisturbed run), the slot is freed after it, and new requests naming the id load it
  again."""
  eng = make_engine(tiny_model, warmup=False, **OPTIONS, **LORA)
  long = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
  lora, prompt = adapters[1][0], _prompts(1, seed=9)[0]
  want = _run(eng, [prompt], long, [lora])[0].token_ids
  rid = eng.add_request(None, prompt, long, lora_request=lora)
  for _ in range(3):
    eng.step()
  assert eng.remove_lora(lora.lora_int_id) and lora not in eng.list_loras()
  assert eng.adapters.slots_in_use == 1  # still held by the running request
  assert eng.run_to_completion()[rid].outputs[0].token_ids == want
  assert eng.adapters.slots_in_use == 0
  assert _run(eng, [prompt], long, [lora])[0].token_ids == want
  _assert_no_leaks(eng)


def test_sampling_is_batch_invariant_across_adapters(engine, adapters):
  """A seeded request's tokens are the same alone and in a batch of other adapters' requests."""
  params = SamplingParams(max_tokens=8, temperature=1.0, seed=7)
  prompt = _prompts(1, seed=3)[0]
  alone = _run(engine, [prompt], params, [adapters[1][0]])[0].token_ids
  crowd = _prompts(6, seed=4)
  loras = [adapters[1][0], None, adapters[2][0], adapters[1][0], None, adapters[2][0], None]
  together = _run(engine, [prompt] + crowd, params, loras)[0].token_ids
  assert together == alone


def test_the_prefix_cache_is_keyed_by_adapter(engine, adapters):
  prompt = _prompts(1, seed=5)[0] * 3  # several full pages
  lora = adapters[1][0]
  eng = engine
  rid = eng.add_request(None, prompt, GREEDY)
  eng.run_to_completion()
  rid = eng.add_request(None, prompt, GREEDY, lora_request=lora)
  assert eng.run_to_completion()[rid].num_cached_tokens == 0  # not the base model's pages
  rid = eng.add_request(None, prompt, GREEDY, lora_request=lora)
  assert eng.run_to_completion()[rid].num_cached_tokens > 0  # its own


@pytest.mark.slow  # two more engines (~7 s)
def test_lora_over_an_int4_base(tiny_model, adapters):
  """An int4 base (group-wise, its Pallas-free XLA form here) with the adapters in float: each
  request equals a float engine over the dequantized int4 weights with the same adapter, which
  the mixed-batch test above holds to HF peft."""
  config, _, tok = tiny_model
  q = make_engine(tiny_model, warmup=False, quantization="int4",
                  quantization_config={"group_size": 32}, **OPTIONS, **LORA)
  float_params = dequantize_like(q.runner.stacked_params, param_shapes(config))
  ref = make_engine((config, float_params, tok), warmup=False, **OPTIONS, **LORA)
  prompts = _prompts(4, seed=6)
  loras = [adapters[1][0], None, adapters[0][0], adapters[1][0]]
  got, want = _run(q, prompts, GREEDY, loras), _run(ref, prompts, GREEDY, loras)
  for g, w in zip(got, want):
    assert g.token_ids == w.token_ids
    # The group-wise form rounds differently from a float matmul over its dequantized weights:
    # base rows differ by 3e-4 too (measured), so this bounds the adapters at the mode's own gap.
    for a, b in zip(g.logprobs, w.logprobs):
      assert max(abs(a[t] - b[t]) for t in a) <= 1e-3


def test_bad_adapters_are_refused_before_anything_is_queued(tiny_model, engine, adapters,
                                                            tmp_path):
  plain = make_engine(tiny_model, warmup=False, **OPTIONS)
  with pytest.raises(ParameterError, match="enable_lora"):
    plain.add_request(None, [5, 6, 7], GREEDY, lora_request=adapters[0][0])
  assert not plain.has_unfinished_requests()
  small = make_engine(tiny_model, warmup=False, **OPTIONS, **dict(LORA, max_lora_rank=4))
  with pytest.raises(ParameterError, match="max_lora_rank"):
    small.add_request(None, [5, 6, 7], GREEDY, lora_request=adapters[1][0])
  with pytest.raises(ParameterError, match="adapter_config.json"):
    engine.add_request(None, [5, 6, 7], GREEDY,
                       lora_request=LoRARequest("missing", 99, str(tmp_path)))
  engine.add_lora(adapters[1][0])
  with pytest.raises(ParameterError, match="lora_int_id 2"):  # the id of another adapter
    engine.add_request(None, [5, 6, 7], GREEDY,
                       lora_request=LoRARequest("other", 2, adapters[2][0].lora_path))
  assert not engine.has_unfinished_requests() and not small.has_unfinished_requests()


@pytest.mark.slow  # a second engine's compile (~15 s)
def test_tensor_parallel_adapters_match_one_device(tiny_model, engine, adapters):
  """TP 2: each adapter's a and b split as their base layer does (K of a row-split layer, N of a
  column-split one); the mixed batch equals one device's."""
  tp = make_engine(tiny_model, warmup=False, tensor_parallel_size=2, **OPTIONS, **LORA)
  prompts = _prompts(4, seed=8)
  loras = [adapters[1][0], None, adapters[2][0], adapters[1][0]]
  got, want = _run(tp, prompts, GREEDY, loras), _run(engine, prompts, GREEDY, loras)
  for g, w in zip(got, want):
    assert g.token_ids == w.token_ids
    for a, b in zip(g.logprobs, w.logprobs):
      assert max(abs(a[t] - b[t]) for t in a) <= 1e-4
  _assert_no_leaks(tp)
