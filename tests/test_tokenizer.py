"""Tokenizer vs HF transformers on the SmolLM2 GGUF: encode, decode, chat template, streaming."""
from __future__ import annotations

import json

import gguf
import pytest
import transformers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, processors

from jinfer.tokenizer import IncrementalDetokenizer, NoChatTemplate, Tokenizer
from jinfer.weights.gguf_file import gguf_value, open_gguf
from tests.tiny_gguf import write_tiny_gguf

TEXTS = [
    "Hello, world!",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { x[i] = i * 2; }\t// tabs\r\n",
    "naïve café, Straße, Ωμέγα, привет мир",
    "日本語のテキストと中文字符，한국어도",
    "emoji 🎉🙂👍🏽 👨‍👩‍👧 flags 🇫🇷",
    "   leading spaces, trailing   \n\n\n  blank lines \t\t tabs   ",
    "numbers 1234567 3.14159 1e-10 0x1F 2024-06-01",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "an <|endoftext|> in the middle<|im_end|>",
    "it's they're we've I'm you'll he'd",
    "\u00a0non-breaking\u200bzero-width\ufeffbom",
    "",
]
MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one word."},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Japan? 日本"}]
SYSTEM = [{"role": "system", "content": "You are terse."}]


@pytest.fixture(scope="module")
def ours(smollm2_gguf) -> Tokenizer:
  return Tokenizer.from_gguf(smollm2_gguf)


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_hf(ours, hf_smollm2_tokenizer, text):
  hf = hf_smollm2_tokenizer
  for add in (True, False):
    assert ours.encode(text, add_special_tokens=add) == hf(text, add_special_tokens=add).input_ids
  ids = ours.encode(text)
  for skip in (True, False):
    assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
  assert ours.decode(ids, skip_special_tokens=False) == text  # byte-level BPE is lossless


@pytest.mark.slow
def test_properties_match_hf(ours, hf_smollm2_tokenizer):
  hf = hf_smollm2_tokenizer
  assert ours.vocab_size == len(hf) == 49152
  assert ours.bos_token_id == hf.bos_token_id == 1
  assert ours.eos_token_ids == (hf.eos_token_id,) == (2,)
  assert ours.chat_template == hf.chat_template


@pytest.mark.slow
@pytest.mark.parametrize("system", [False, True], ids=["no-system", "system"])
@pytest.mark.parametrize("generation_prompt", [True, False], ids=["gen", "no-gen"])
def test_chat_template_matches_hf(ours, hf_smollm2_tokenizer, system, generation_prompt):
  messages = (SYSTEM if system else []) + MESSAGES
  ref = hf_smollm2_tokenizer.apply_chat_template(
      messages, add_generation_prompt=generation_prompt, tokenize=False)
  assert ours.apply_chat_template(messages, add_generation_prompt=generation_prompt) == ref
  ids = ours.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
  assert ids == hf_smollm2_tokenizer(ref, add_special_tokens=False).input_ids


def test_incremental_detokenizer_holds_back_partial_characters(ours):
  text = "Grüße 日本語 🎉👍🏽 👨‍👩‍👧 done<|im_end|> after"
  ids = ours.encode(text)
  detok = IncrementalDetokenizer(ours)
  deltas = [detok.add(i) for i in ids]
  assert "" in deltas  # some tokens end inside a multi-byte character ...
  assert not any("\ufffd" in d for d in deltas)  # ... and nothing half-decoded gets out
  assert "".join(deltas) + detok.flush() == ours.decode(ids)

  detok = IncrementalDetokenizer(ours, skip_special_tokens=False)
  assert "".join(detok.add(i) for i in ids) + detok.flush() == text


def test_incremental_detokenizer_flushes_a_cut_character(ours):
  ids = ours.encode("ok 🎉")
  cut = ids[:-1]  # the emoji's last byte is missing
  detok = IncrementalDetokenizer(ours)
  streamed = "".join(detok.add(i) for i in cut)
  assert "\ufffd" not in streamed
  assert streamed + detok.flush() == ours.decode(cut)
  assert ours.decode(cut).endswith("\ufffd")


def test_incremental_detokenizer_keeps_sentencepiece_spaces(tmp_path):
  """Metaspace decoders drop the first token's leading space; a stream must not drop it for
  every token. Llama-2-style decoder, with byte fallback for a character split over 3 tokens."""
  vocab = {"<unk>": 0, "\u2581Hello": 1, "\u2581world": 2, "\u2581": 3}
  vocab |= {f"<0x{b:02X}>": 4 + b for b in range(256)}
  backend = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
  backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                       decoders.Fuse(), decoders.Strip(" ", 1, 0)])
  backend.save(str(tmp_path / "tokenizer.json"))
  tok = Tokenizer.from_dir(str(tmp_path))
  ids = [1, 2, 3] + [4 + b for b in "日".encode()] + [2]
  assert tok.decode(ids) == "Hello world 日 world"
  detok = IncrementalDetokenizer(tok)
  deltas = [detok.add(i) for i in ids]
  assert deltas == ["Hello", " world", " ", "", "", "日", " world"]
  assert detok.flush() == ""


def test_max_token_bytes_bounds_the_token_count(ours):
  """What lets a server refuse a prompt from its byte size, without tokenizing it."""
  assert ours.max_token_bytes == 162  # "\n" and 80 spaces, in the byte alphabet
  for text in TEXTS + ["\n" + " " * 500, "=" * 1000, "<|im_end|>" * 50, "\u00e9" * 300]:
    n = len(ours.encode(text, add_special_tokens=False))
    assert n * ours.max_token_bytes >= len(text.encode("utf-8"))


def test_chat_template_variables_and_normalizers(tmp_path):
  backend = HFTokenizer(models.BPE(vocab={"<unk>": 0, "a": 1}, merges=[], unk_token="<unk>"))
  backend.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": "<unk>", "chat_template": "{{ bos_token }}{% for m in messages %}"
      "{{ m.content }}{% endfor %}{% if tone %}{{ raise_exception(tone) }}{% endif %}"}))
  tok = Tokenizer.from_dir(str(tmp_path))
  # What template kwargs can set: not the helpers it calls.
  assert tok.chat_template_variables == {"bos_token", "messages", "tone"}
  assert tok.max_token_bytes == len("<unk>")
  backend.normalizer = normalizers.NFKC()  # "ｈｉ" (6 bytes) becomes "hi" (2)
  backend.save(str(tmp_path / "tokenizer.json"))
  assert Tokenizer.from_dir(str(tmp_path)).max_token_bytes is None


@pytest.fixture(scope="module")
def saved_dir(hf_smollm2_tokenizer, tmp_path_factory):
  path = tmp_path_factory.mktemp("tok")
  hf_smollm2_tokenizer.save_pretrained(path)
  return path


@pytest.mark.slow
def test_from_dir_round_trip(ours, saved_dir):
  loaded = Tokenizer.from_dir(str(saved_dir))
  for text in TEXTS:
    assert loaded.encode(text) == ours.encode(text)
    assert loaded.decode(ours.encode(text)) == ours.decode(ours.encode(text))
  assert loaded.apply_chat_template(SYSTEM + MESSAGES) == ours.apply_chat_template(SYSTEM + MESSAGES)
  assert (loaded.vocab_size, loaded.bos_token_id, loaded.eos_token_ids) == \
      (ours.vocab_size, ours.bos_token_id, ours.eos_token_ids)


def _copy_dir(src, dst):
  for f in src.iterdir():
    (dst / f.name).write_bytes(f.read_bytes())


@pytest.mark.slow
def test_from_dir_bos_post_processor_and_custom_template_match_hf(saved_dir, tmp_path):
  """BOS from tokenizer.json's post-processor (transformers 5 ignores the config's add_bos_token
  when a tokenizer.json exists), and a template using HF's jinja extras."""
  _copy_dir(saved_dir, tmp_path)
  backend = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
  backend.post_processor = processors.TemplateProcessing(
      single="<|im_start|>:0 $A:0", pair="<|im_start|>:0 $A:0 $B:1",
      special_tokens=[("<|im_start|>", 1)])
  backend.save(str(tmp_path / "tokenizer.json"))
  cfg_file = tmp_path / "tokenizer_config.json"
  cfg_file.write_text(json.dumps(json.loads(cfg_file.read_text()) | {"add_eos_token": True}))
  (tmp_path / "chat_template.jinja").write_text(
      "{% for m in messages %}{% if m.role == 'tool' %}{% continue %}{% endif %}"
      "{{ bos_token }}{{ m.role }}: {% generation %}{{ m.content }}{% endgeneration %}"
      "{% if m.meta is defined %} {{ m.meta | tojson }}{% endif %}{{ eos_token }}\n"
      "{% endfor %}{% if add_generation_prompt %}{{ bos_token }}assistant ({{ mood }}):{% endif %}")
  hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  ours = Tokenizer.from_dir(str(tmp_path))
  for text in TEXTS[:4]:
    assert ours.encode(text) == hf(text).input_ids
    assert ours.encode(text)[0] == ours.bos_token_id
  messages = [{"role": "user", "content": "a <b> & 'c'", "meta": {"k": ["ü", 1, None]}},
              {"role": "tool", "content": "skipped"}, {"role": "user", "content": "x", "meta": None}]
  assert ours.apply_chat_template(messages, mood="calm") == \
      hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, mood="calm")
  (tmp_path / "chat_template.jinja").write_text(
      "{% for m in messages %}[{{ m.reasoning_content }}|{{ m.thinking }}]{% endfor %}")
  reasoning = [{"role": "assistant", "content": "", "reasoning": "hmm"}]
  assert Tokenizer.from_dir(str(tmp_path)).apply_chat_template(reasoning) == \
      transformers.AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(
          reasoning, tokenize=False, add_generation_prompt=True) == "[hmm|hmm]"


@pytest.mark.slow
def test_gguf_variant_matches_hf(smollm2_gguf, tmp_path):
  """SmolLM2's vocabulary under another pre-tokenizer (a split regex), with BOS/EOS added and a
  user-defined token: each GGUF switch is handled as transformers handles it."""
  src = open_gguf(smollm2_gguf)
  tokens = gguf_value(src, "tokenizer.ggml.tokens")
  types = gguf_value(src, "tokenizer.ggml.token_type")
  types[4] = 4  # <reponame>: USER_DEFINED, an added token that is not special
  path = str(tmp_path / "variant.gguf")
  w = gguf.GGUFWriter(path, "llama")
  w.add_block_count(1)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("llama-bpe")
  w.add_token_list(tokens)
  w.add_token_types(types)
  w.add_token_merges(gguf_value(src, "tokenizer.ggml.merges"))
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_add_bos_token(True)
  w.add_add_eos_token(True)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="variant.gguf")
  ours = Tokenizer.from_gguf(path)
  for text in TEXTS + ["see <reponame> here"]:
    ids = hf(text).input_ids
    assert ours.encode(text) == ids, text
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
  assert ours.encode("x")[0] == 1 and ours.encode("x")[-1] == 2


@pytest.mark.slow
def test_raise_exception_in_template(saved_dir, tmp_path):
  _copy_dir(saved_dir, tmp_path)
  (tmp_path / "chat_template.jinja").write_text(
      "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be user') }}"
      "{% endif %}{{ strftime_now('%Y') }}")
  ours = Tokenizer.from_dir(str(tmp_path))
  assert ours.apply_chat_template([{"role": "user", "content": ""}]).isdigit()
  with pytest.raises(Exception, match="first message must be user"):
    ours.apply_chat_template([{"role": "assistant", "content": ""}])


def test_gguf_without_merges_is_rejected(tmp_path):
  path = str(tmp_path / "tiny.gguf")
  write_tiny_gguf(path)  # a vocabulary but no merges
  with pytest.raises(ValueError, match="merges"):
    Tokenizer.from_gguf(path)


def test_gguf_sentencepiece_tokenizer_is_rejected(tmp_path):
  """SentencePiece vocabularies are built for Gemma files only (Llama 2's needs another
  normalizer)."""
  path = str(tmp_path / "spm.gguf")
  w = gguf.GGUFWriter(path, "llama")
  w.add_tokenizer_model("llama")
  w.add_token_list(["<unk>", "<s>", "</s>"])
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model='llama' \(architecture "
                                       r"'llama'\) is not supported"):
    Tokenizer.from_gguf(path)


def test_gguf_tables_are_transformers_tables():
  """The split regexes and byte alphabet are copies; transformers is not a runtime dependency."""
  from transformers.convert_slow_tokenizer import bytes_to_unicode
  from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
  from jinfer import tokenizer
  assert tokenizer._PRE_TOKENIZER_SPLITS == GGUF_PRE_TOKENIZER_SPLITS
  assert tokenizer._bytes_to_unicode() == bytes_to_unicode()


def test_no_chat_template_is_refused_naming_the_model_unless_one_is_given():
  backend = HFTokenizer(models.WordLevel({"hi": 0, "<unk>": 1}, unk_token="<unk>"))
  tok = Tokenizer(backend, special_tokens={"bos_token": None, "eos_token": None,
                                           "unk_token": "<unk>", "pad_token": None},
                  eos_token_ids=(), chat_template=None)
  tok.name = "gemma-3-270m"
  chat = [{"role": "user", "content": "hi"}]
  with pytest.raises(NoChatTemplate, match=r"gemma-3-270m has no chat template.*chat_template="):
    tok.apply_chat_template(chat)
  assert tok.apply_chat_template(chat, chat_template="{{ messages[0]['content'] }}") == "hi"
