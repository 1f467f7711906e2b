"""Every engine option is a flag of every command that builds an engine, generated from the
config sections' fields (help from their comments), and the flags give the EngineConfig they
spell; flat options and nested sections are one config."""
from __future__ import annotations

import pytest

from jinfer import cli
from jinfer.engine.engine_config import (KV_TRANSFER, SPECULATIVE, CacheConfig, EngineConfig, ModelOptions,
                                         option_fields)
from jinfer.errors import ParameterError

FIELDS = [f.name for _, f in option_fields()] + [SPECULATIVE, KV_TRANSFER]
# What each command sets itself instead (its own --seed; one engine, no data-parallel front end).
OWN = {"serve": (), "quantize": ("data_parallel_size", KV_TRANSFER),
       "bench": ("seed", "data_parallel_size"),
       "generate": ("seed", "data_parallel_size", KV_TRANSFER),
       "chat": ("seed", "data_parallel_size", KV_TRANSFER)}


def _subparser(command: str):
  ap = cli.parser()
  return next(a for a in ap._subparsers._group_actions if a.dest == "command").choices[command]


@pytest.mark.parametrize("command", list(OWN))
def test_every_engine_option_is_a_flag(command):
  flags = {o for a in _subparser(command)._actions for o in a.option_strings}
  missing = [f for f in FIELDS
             if f not in OWN[command] and "--" + f.replace("_", "-") not in flags]
  assert missing == []


def test_options_have_help():
  helps = cli._field_help()
  assert [f for f in FIELDS if f not in (SPECULATIVE, KV_TRANSFER) and not helps.get(f)] == []
  assert "token budget of one step" in helps["max_num_batched_tokens"]


def test_flags_spell_the_config():
  args = cli.parser().parse_args([
      "serve", "--page-size", "8", "--no-enable-prefix-caching", "--quantization", "int8",
      "-tp", "2", "--scan-layers", "false", "--num-pages", "40",
      "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
  config = cli._engine_config(args)
  assert config.cache == CacheConfig(page_size=8, enable_prefix_caching=False, num_pages=40)
  assert (config.model.quantization, config.parallel.tensor_parallel_size,
          config.kernels.scan_layers) == ("int8", 2, False)
  assert config.speculative.num_speculative_tokens == 3
  assert config.replace(page_size=None, enable_prefix_caching=True, quantization=None,
                        tensor_parallel_size=1, scan_layers=None, num_pages=None,
                        speculative_config=None) == EngineConfig()


def test_flat_options_and_sections_are_one_config():
  flat = EngineConfig.of(max_model_len=512, page_size=32, seed=3)
  assert flat == EngineConfig(model=ModelOptions(max_model_len=512, seed=3),
                              cache=CacheConfig(page_size=32))
  assert EngineConfig.of(**flat.options()) == flat
  with pytest.raises(ParameterError, match="unknown engine option 'max_len'") as e:
    EngineConfig.of(max_len=512)
  assert e.value.param == "max_len"


def test_a_bad_option_names_its_field():
  args = cli.parser().parse_args(["serve", "--max-num-batched-tokens", "100"])
  with pytest.raises(ParameterError, match="power of two") as e:
    cli._engine_config(args)
  assert e.value.param == "max_num_batched_tokens"
