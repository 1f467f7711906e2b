"""`LLM.generate` takes prompts as vLLM does: text, token ids, `{"prompt": text}` and
`{"prompt_token_ids": ids}`, alone or in lists, mixed; anything else is a ParameterError that
says what is wrong before anything is queued."""
from __future__ import annotations

import numpy as np
import pytest

import jinfer
from jinfer import LLM, SamplingParams
from jinfer.errors import ParameterError

GREEDY = SamplingParams(temperature=0.0, max_tokens=3)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
  # Scanned, one sequence at a time: the few steps these tests run compile in seconds.
  return LLM(tiny_model_dir, warmup=False, max_model_len=64, max_num_seqs=1,
             max_num_batched_tokens=16, scan_layers=True)


def _tokens(outs) -> list[tuple[list[int], list[int]]]:
  return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]


def test_dict_prompts_are_the_text_and_ids_they_hold(llm):
  text = "t5 t9 t17 t3"
  ids = llm.tokenizer.encode(text)
  want = _tokens(llm.generate([text], GREEDY, use_tqdm=False))
  assert want[0][0] == ids
  # one dict alone, and a list mixing every kind
  assert _tokens(llm.generate({"prompt": text}, GREEDY, use_tqdm=False)) == want
  assert _tokens(llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)) == want
  mixed = [{"prompt": text}, text, {"prompt_token_ids": ids}, ids, np.array(ids)]
  assert _tokens(llm.generate(mixed, GREEDY, use_tqdm=False)) == want * 5


@pytest.mark.parametrize("prompts, match", [
    ({"text": "t5"}, r"prompt 0: a dict prompt has exactly one of the keys 'prompt' .*got keys "
                     r"\['text'\]"),
    ([{"prompt": "t5", "prompt_token_ids": [5]}], r"exactly one of the keys"),
    (["t5", {"prompt": [5, 6]}], r"prompt 1: 'prompt' must be text, got list"),
    ([{"prompt_token_ids": "t5 t6"}], r"'prompt_token_ids' must be a list of ints, got text"),
    ([[5, "6"]], r"prompt 0: token ids must be ints, got '6'"),
    ([3.5], r"prompt 0: expected text, a list of token ids or a dict .* got float"),
    (7, r"expected a prompt or a list of prompts, got int"),
])
def test_bad_prompts_name_what_is_wrong_and_queue_nothing(llm, prompts, match):
  with pytest.raises(ParameterError, match=match) as e:
    llm.generate(prompts, GREEDY, use_tqdm=False)
  assert e.value.param == "prompts"
  assert not llm.engine.has_unfinished_requests()


def test_async_engine_is_exported():
  from jinfer.engine.async_engine import AsyncLLMEngine
  assert jinfer.AsyncLLMEngine is AsyncLLMEngine and "AsyncLLMEngine" in jinfer.__all__
