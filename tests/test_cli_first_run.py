"""The command line on a first run: `serve` without its extra says what to install, requests
without a seed repeat from run to run (as the library's do), shipped checkpoints are found by
name and a missing one is "not found", and `precompile` fills the compilation cache so that a
second run loads every step from it."""
from __future__ import annotations

import json
import sys
import tomllib

import jax
import pytest

from jinfer import cli
from jinfer.weights.builtin import checkpoint_path

ROOT_PYPROJECT = __file__.rsplit("/tests/", 1)[0] + "/pyproject.toml"


def _extras() -> dict[str, list[str]]:
  with open(ROOT_PYPROJECT, "rb") as fh:
    return tomllib.load(fh)["project"]["optional-dependencies"]


@pytest.mark.parametrize("missing", cli.SERVE_EXTRA)
def test_serve_without_its_extra_prints_the_pip_command(monkeypatch, capsys, missing):
  monkeypatch.setitem(sys.modules, missing, None)  # as if not installed: importing it fails
  with pytest.raises(SystemExit) as e:
    cli.main(["serve", "--model", "no-such-model"])
  assert e.value.code == 1
  err = capsys.readouterr().err
  assert f"needs {missing}" in err and 'pip install "jinfer[serve]"' in err, err


def test_extras_hold_what_the_server_the_readme_client_and_the_plot_need():
  extras = _extras()
  assert set(cli.SERVE_EXTRA) | {"openai"} <= set(extras["serve"])
  assert extras["plot"] == ["matplotlib"] and "jinfer[plot]" in extras["test"]


def _engine_seed(*argv: str) -> int:
  return cli._engine_config(cli.parser().parse_args(list(argv)), max_model_len=64).model.seed


def test_a_commands_own_seed_is_not_the_engines():
  # generate/chat --seed seeds the request, bench --seed the prompts; the engine keeps its
  # default, which seeds requests that bring none
  assert _engine_seed("generate", "--seed", "5", "hi") == 0
  assert _engine_seed("generate", "hi") == 0
  assert _engine_seed("bench", "--seed", "3") == 0
  assert _engine_seed("serve", "--seed", "7") == 7


def _generate(capsys, model: str, *flags: str) -> str:
  cli.main(["-q", "generate", "--model", model, "--temperature", "1.0", "--max-tokens", "12",
            "--raw", *flags, "t5 t6 t7"])
  return capsys.readouterr().out


@pytest.mark.slow  # three engines, ~3 s; quick: test_a_commands_own_seed_is_not_the_engines
def test_generate_without_a_seed_repeats_across_runs(tiny_model_dir, capsys):
  first = _generate(capsys, tiny_model_dir)
  assert _generate(capsys, tiny_model_dir) == first  # a fresh engine: a second run
  assert _generate(capsys, tiny_model_dir, "--seed", "1") != first


def test_shipped_checkpoints_resolve_by_name():
  spec = {"method": "medusa", "model": "smollm2-135m-medusa", "num_speculative_tokens": 2}
  args = cli.parser().parse_args(["serve", "--speculative-config", json.dumps(spec)])
  assert cli._engine_config(args).speculative.model == checkpoint_path("smollm2-135m-medusa")


def test_a_missing_speculative_model_is_not_found(tiny_model_dir, capsys, tmp_path):
  missing = str(tmp_path / "checkpoints" / "smollm2-135m-draft")
  spec = {"method": "draft_model", "model": missing, "num_speculative_tokens": 2}
  with pytest.raises(SystemExit) as e:
    cli.main(["generate", "--model", tiny_model_dir, "--speculative-config", json.dumps(spec),
              "hi"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert f"model {missing!r} not found" in err and "smollm2-135m-draft" in err, err


def _engine_flags(command: str) -> set[str]:
  ap = cli.parser()
  sub = next(a for a in ap._subparsers._group_actions if a.dest == "command").choices[command]
  return {o for a in sub._actions if a.container.title and a.container.title.startswith(
      "engine options") for o in a.option_strings}


def test_precompile_takes_the_engine_options_serve_takes():
  assert _engine_flags("precompile") == _engine_flags("serve") and len(_engine_flags("serve")) > 20


def _precompile(model: str, capsys) -> dict:
  jax.clear_caches()  # what a fresh process has in memory: nothing
  cli.main(["-q", "precompile", "--model", model, "--max-model-len", "64", "--max-num-seqs", "2",
            "--max-num-batched-tokens", "8"])
  return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


# Slow: two engines' warmups, ~5 s with a warm cache. Quick covers: the options test above, and
# tests/test_engine.py::test_no_compiles_after_warmup (warmup compiles every step).
@pytest.mark.slow
def test_precompile_twice_loads_everything_from_the_cache(tiny_model_dir, capsys):
  first = _precompile(tiny_model_dir, capsys)  # compiles, or loads what earlier runs compiled
  second = _precompile(tiny_model_dir, capsys)
  total = first["compiled"] + first["loaded_from_cache"]
  assert total > 0
  assert (second["compiled"], second["loaded_from_cache"]) == (0, total), (first, second)
  assert second["compilation_cache"] == jax.config.jax_compilation_cache_dir
