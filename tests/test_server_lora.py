"""LoRA adapters through the OpenAI-compatible server: a real server on a loopback port and the
official `openai` client. Adapters named at startup and loaded at run time are picked by the
request's `model`; their answers are the engine's own with that adapter; what a client may not
load is refused with a 4xx, and the server keeps serving."""
from __future__ import annotations

import concurrent.futures
import json
import os
import shutil

import openai
import peft
import pytest
import torch
import transformers

from jinfer.engine.lora_slots import LoRARequest
from jinfer.sampling.params import SamplingParams
from tests.engine_fixtures import make_engine
from tests.live_server import http, live_server, post_json, wait_idle

pytestmark = pytest.mark.slow  # a server and a second engine (~15 s)

BASE = "tiny"
OPTIONS = dict(max_model_len=64, page_size=4, num_pages=65, max_num_seqs=8,
               max_num_batched_tokens=16, enable_lora=True, max_loras=2, max_lora_rank=8)
PROMPT = [5, 17, 300, 41, 9, 77]


def _adapter(base_path: str, out: str, seed: int, r: int = 4) -> str:
  torch.manual_seed(seed)
  base = transformers.LlamaForCausalLM.from_pretrained(base_path, dtype=torch.float32)
  model = peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=2 * r,
                                                    target_modules=["q_proj", "v_proj", "o_proj"],
                                                    init_lora_weights=False))
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "lora_B" in name:
        p.mul_(5.0)  # change the answers
  model.save_pretrained(out)
  return out


@pytest.fixture(scope="module")
def dirs(tiny_model_path, tmp_path_factory):
  root = tmp_path_factory.mktemp("adapters")
  served = root / "served"
  outside = tmp_path_factory.mktemp("elsewhere")
  return dict(
      one=_adapter(tiny_model_path, str(served / "one"), 1),
      two=_adapter(tiny_model_path, str(served / "two"), 2),
      late=_adapter(tiny_model_path, str(served / "late"), 3),
      big=_adapter(tiny_model_path, str(served / "big"), 4, r=16),  # over max_lora_rank
      outside=_adapter(tiny_model_path, str(outside / "x"), 5),
      served=str(served))


@pytest.fixture(scope="module")
def server(tiny_model, dirs):
  engine = make_engine(tiny_model, warmup=False, **OPTIONS)
  with live_server(engine, BASE, lora_modules=(("one", dirs["one"]), ("two", dirs["two"])),
                   allow_runtime_lora_updating=True) as srv:
    yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
  return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_model, dirs):
  """Each adapter's greedy tokens for PROMPT from an engine of its own (no server)."""
  eng = make_engine(tiny_model, warmup=False, **OPTIONS)
  params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
  out = {}
  for i, name in enumerate((None, "one", "two", "late")):
    lora = None if name is None else LoRARequest(name, i, dirs[name])
    rid = eng.add_request(None, PROMPT, params, lora_request=lora)
    out[name or BASE] = eng.run_to_completion()[rid].outputs[0].text
  return out


def _complete(client, model: str) -> str:
  r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                extra_body={"ignore_eos": True})
  assert r.model == model
  return r.choices[0].text


def _post(server, path: str, body: dict) -> tuple[int, str]:
  status, _, data = http(server.url + path, json.dumps(body).encode(),
                         headers={"Content-Type": "application/json"})
  return status, data.decode()


def test_models_lists_the_base_and_its_adapters(client, dirs):
  cards = {m.id: m for m in client.models.list().data}
  assert list(cards) == [BASE, "one", "two"]
  assert cards["one"].parent == BASE and cards["one"].root == os.path.realpath(dirs["one"])
  assert cards[BASE].parent is None


def test_concurrent_requests_each_get_their_own_adapter(server, client, reference):
  """The base and both adapters at once, three times each: every answer is its own engine's."""
  models = [BASE, "one", "two"] * 3
  with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
    got = list(pool.map(lambda m: _complete(client, m), models))
  assert got == [reference[m] for m in models]
  assert len({reference[m] for m in (BASE, "one", "two")}) == 3  # the adapters matter
  chat = client.chat.completions.create(model="one", max_tokens=4, temperature=0,
                                        messages=[{"role": "user", "content": "hi"}])
  assert chat.model == "one" and chat.choices[0].message.content is not None
  wait_idle(server.engine)
  assert server.engine.adapters.slots_in_use == 0


def test_load_use_and_unload_at_run_time(server, client, dirs, reference):
  with pytest.raises(openai.NotFoundError):
    _complete(client, "late")
  status, text = _post(server, "/v1/load_lora_adapter",
                       {"lora_name": "late", "lora_path": dirs["late"]})
  assert status == 200 and "late" in text, text
  assert _complete(client, "late") == reference["late"]
  assert "late" in [m.id for m in client.models.list().data]
  status, text = _post(server, "/v1/unload_lora_adapter", {"lora_name": "late"})
  assert status == 200, text
  with pytest.raises(openai.NotFoundError):
    _complete(client, "late")
  assert "late" not in [m.id for m in client.models.list().data]


@pytest.mark.parametrize("body, status, says", [
    (lambda d: {"lora_name": "x", "lora_path": d["outside"]}, 403, "outside"),
    (lambda d: {"lora_name": "x", "lora_path": os.path.join(d["served"], "..", "..",
                                                            "elsewhere")}, 403, "outside"),
    (lambda d: {"lora_name": "x", "lora_path": d["big"]}, 400, "max_lora_rank"),
    (lambda d: {"lora_name": "x", "lora_path": os.path.join(d["served"], "nope")}, 400,
     "no such directory"),
    (lambda d: {"lora_name": "one", "lora_path": d["late"]}, 400, "already loaded"),
    (lambda d: {"lora_name": BASE, "lora_path": d["late"]}, 400, "base model"),
    (lambda d: {"lora_name": "x"}, 400, "lora_path"),
])
def test_what_a_client_may_not_load_is_refused(server, client, dirs, body, status, says,
                                               reference):
  got, text = _post(server, "/v1/load_lora_adapter", body(dirs))
  assert got == status and says in text, (got, text)
  assert [m.id for m in client.models.list().data] == [BASE, "one", "two"]
  assert _complete(client, "one") == reference["one"]  # still serving


def test_a_malformed_safetensors_is_refused(server, client, dirs, tmp_path_factory, reference):
  bad = os.path.join(dirs["served"], "broken")
  shutil.copytree(dirs["late"], bad)
  with open(os.path.join(bad, "adapter_model.safetensors"), "wb") as fh:
    fh.write(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
  got, text = _post(server, "/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": bad})
  assert got == 400 and "safetensors" in text, text
  got, text = _post(server, "/v1/unload_lora_adapter", {"lora_name": "never"})
  assert got == 404 and "never" in text, text
  assert _complete(client, BASE) == reference[BASE]


def test_runtime_updates_are_off_without_the_flag(tiny_model, dirs):
  engine = make_engine(tiny_model, warmup=False, **OPTIONS)
  with live_server(engine, BASE, lora_modules=(("one", dirs["one"]),)) as srv:
    status, body = post_json(srv.url + "/v1/load_lora_adapter",
                             json.dumps({"lora_name": "late", "lora_path": dirs["late"]}).encode())
    assert status == 404 and "--allow-runtime-lora-updating" in body["error"]["message"]
    status, _ = post_json(srv.url + "/v1/unload_lora_adapter",
                          json.dumps({"lora_name": "one"}).encode())
    assert status == 404


def test_startup_refuses_a_bad_module(tiny_model, dirs):
  engine = make_engine(tiny_model, warmup=False, **OPTIONS)
  with pytest.raises(ValueError, match="--lora-modules big=.*max_lora_rank"):
    with live_server(engine, BASE, lora_modules=(("big", dirs["big"]),)):
      pass
  plain = make_engine(tiny_model, warmup=False, max_model_len=64, page_size=4, num_pages=65)
  with pytest.raises(ValueError, match="need --enable-lora"):
    with live_server(plain, BASE, lora_modules=(("one", dirs["one"]),)):
      pass


def test_lora_modules_flags_parse_both_forms():
  from jinfer.serving.adapters import parse_lora_modules
  assert parse_lora_modules(["a=/x/y", '{"name": "b", "path": "smollm2-135m-signoff"}']) == (
      ("a", "/x/y"), ("b", "smollm2-135m-signoff"))
  for bad in ["a", "=p", "a=", '{"name": "b"}']:
    with pytest.raises(ValueError, match="--lora-modules"):
      parse_lora_modules([bad])
