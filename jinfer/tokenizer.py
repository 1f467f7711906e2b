"""Tokenizers: HF `tokenizers` from tokenizer.json or rebuilt from GGUF metadata, jinja2 chat
templates rendered the way transformers renders them, and streaming detokenization.

`from_gguf` rebuilds the tokenizer exactly as transformers does for
`AutoTokenizer.from_pretrained(dir, gguf_file=...)` (transformers/integrations/gguf/
gguf_tokenizer_mapping.py), control tokens added as special, user-defined tokens as plain added
tokens:
  * "gpt2": byte-level BPE, the vocabulary respelled into the byte alphabet, the split regex
    picked by `tokenizer.ggml.pre` (GPT-2's own when the name is not listed, e.g. SmolLM2's
    "smollm");
  * "llama" (SentencePiece) in a Gemma file: the file has tokens and scores but no merges.
    Gemma's SentencePiece model is BPE with byte fallback; its merges are rebuilt from the
    vocabulary (every split of a token into two tokens), ranked by the merged token's place in
    the file, spaces spelled "▁" by a normalizer, no prefix space.
"""
from __future__ import annotations

import datetime
import functools
import json
import os
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from jinfer.weights.gguf_file import gguf_value, open_gguf

# Names a message's reasoning comes under; transformers fills the first two from any of them.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# `tokenizer.ggml.pre` -> split regex: transformers' GGUF_PRE_TOKENIZER_SPLITS (5.x). Names not
# listed (SmolLM2's "smollm", GPT-2's "gpt-2", ...) keep the GPT-2 byte-level regex.
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte alphabet: every byte as a printable character (transformers' bytes_to_unicode)."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
      list(range(ord("®"), ord("ÿ") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


def _byte_level_bpe(reader, tokens: list[str], types: list[int],
                    path: str) -> tuple[HFTokenizer, dict[str, int]]:
  """A "gpt2" file's tokenizer with its control tokens added, and its vocabulary."""
  merges: list[str] | None = gguf_value(reader, "tokenizer.ggml.merges")
  if not merges:
    raise ValueError(f"{path}: no tokenizer.ggml.merges metadata")
  spelling = _bytes_to_unicode()
  alphabet = set(spelling.values())
  # Tokens outside the byte alphabet (some files store added tokens as raw text) are respelled.
  vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
           for i, t in enumerate(tokens)}
  backend = HFTokenizer(models.BPE(
      vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
      continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
  split = _PRE_TOKENIZER_SPLITS.get(gguf_value(reader, "tokenizer.ggml.pre"))
  if split is None:
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  else:
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  backend.decoder = decoders.ByteLevel()
  # A control token spelled outside the byte alphabet is a llama.cpp mislabel; transformers
  # skips it, so the vocabulary keeps the size the model expects.
  backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                              for t, k in zip(tokens, types)
                              if k == _CONTROL and set(t) <= alphabet])
  return backend, vocab


def _gemma_sentencepiece(tokens: list[str],
                         types: list[int]) -> tuple[HFTokenizer, dict[str, int]]:
  """Gemma's SentencePiece BPE from a GGUF vocabulary (transformers' `gemma_tokenizer`), with its
  control tokens added, and its vocabulary.

  Tokens of two or more spaces are stored as spaces but looked up as "▁"s, so they are respelled
  first. Merges: every split of a token into two vocabulary tokens, ranked by the merged token's
  position in the file (Gemma's scores do not follow its merge order), then longer left parts.
  """
  spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
  vocab = {t: i for i, t in enumerate(spelled)}
  merges = []
  for token, rank in vocab.items():
    pairs = [(token[:j], token[j:]) for j in range(1, len(token))
             if token[:j] in vocab and token[j:] in vocab]
    pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
    merges.extend((rank, -len(left), -len(right), left, right) for left, right in pairs)
  merges.sort(key=lambda m: m[:3])  # a stable sort: ties keep the order they were found in
  backend = HFTokenizer(models.BPE(vocab=vocab, merges=[(m[3], m[4]) for m in merges],
                                   dropout=None, unk_token="<unk>", fuse_unk=True,
                                   byte_fallback=True))
  backend.normalizer = normalizers.Replace(" ", "\u2581")
  backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
  backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                       decoders.Fuse()])
  backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                              for t, k in zip(tokens, types) if k == _CONTROL])
  return backend, vocab


def _bos_eos_post_processor(bos: tuple[str, int] | None,
                            eos: tuple[str, int] | None) -> processors.TemplateProcessing:
  """The post-processor transformers' `update_post_processor` writes for add_bos/add_eos."""
  b = f"{bos[0]}:0 " if bos else ""
  e = f" {eos[0]}:0" if eos else ""
  single = f"{b}$A:0{e}"
  pair = f"{single}{' ' + bos[0] + ':1' if bos else ''} $B:1{' ' + eos[0] + ':1' if eos else ''}"
  return processors.TemplateProcessing(single=single, pair=pair,
                                       special_tokens=[t for t in (bos, eos) if t])


class _GenerationTag(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}` renders its body (HF uses it for assistant masks)."""
  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

  def _render(self, caller) -> str:
    return caller()


def _raise_exception(message: str):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
  # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _chat_template_env() -> jinja2.Environment:
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[_GenerationTag, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env


class Tokenizer:
  """Text <-> token ids, plus the model's chat template."""

  def __init__(self, backend: HFTokenizer, *, special_tokens: dict[str, str | None],
               eos_token_ids: tuple[int, ...], chat_template: str | None):
    self._backend = backend
    # bos_token / eos_token / unk_token / pad_token: chat templates read them by these names.
    self._special_tokens = special_tokens
    self._eos_token_ids = eos_token_ids
    self._chat_template = chat_template
    self._compiled: jinja2.Template | None = None
    self.name: str | None = None  # the model it was loaded with, for messages

  @classmethod
  def from_gguf(cls, path: str) -> "Tokenizer":
    reader = open_gguf(path)
    kind = gguf_value(reader, "tokenizer.ggml.model")
    arch = gguf_value(reader, "general.architecture")
    tokens: list[str] = gguf_value(reader, "tokenizer.ggml.tokens")
    if not tokens:
      raise ValueError(f"{path}: no tokenizer.ggml.tokens metadata")
    types: list[int] = gguf_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
      backend, vocab = _byte_level_bpe(reader, tokens, types, path)
    elif kind == "llama" and arch in _GEMMA_ARCHITECTURES:
      backend, vocab = _gemma_sentencepiece(tokens, types)
    else:
      raise ValueError(f"{path}: tokenizer.ggml.model={kind!r} (architecture {arch!r}) is not "
                       f"supported; jinfer builds byte-level BPE ('gpt2') tokenizers, and "
                       f"SentencePiece ('llama') ones of Gemma files, from GGUF metadata")
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED and t in vocab])

    def token_of(key: str) -> str | None:
      i = gguf_value(reader, f"tokenizer.ggml.{key}_token_id")
      return None if i is None else tokens[i]

    special = {"bos_token": token_of("bos"), "eos_token": token_of("eos"),
               "unk_token": token_of("unknown"), "pad_token": token_of("padding")}
    tokenizer = cls._assemble(
        backend, special, extra_eos_ids=[
            i for k in ("eos", "eot", "eom")
            if (i := gguf_value(reader, f"tokenizer.ggml.{k}_token_id")) is not None],
        chat_template=gguf_value(reader, "tokenizer.chat_template"))
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
    add_bos = gguf_value(reader, "tokenizer.ggml.add_bos_token", kind == "llama")
    add_eos = gguf_value(reader, "tokenizer.ggml.add_eos_token", False)
    bos, eos = special["bos_token"], special["eos_token"]
    backend.post_processor = _bos_eos_post_processor(
        (bos, backend.token_to_id(bos)) if add_bos and bos else None,
        (eos, backend.token_to_id(eos)) if add_eos and eos else None)
    return tokenizer

  @classmethod
  def from_dir(cls, path: str) -> "Tokenizer":
    """An HF tokenizer directory: tokenizer.json, tokenizer_config.json, chat_template.jinja."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
      raise FileNotFoundError(f"{path}: no tokenizer.json")
    backend = HFTokenizer.from_file(file)
    cfg = _read_json(os.path.join(path, "tokenizer_config.json"))

    def token(name: str) -> str | None:
      t = cfg.get(name)
      return t.get("content") if isinstance(t, dict) else t

    special = {k: token(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
      template = {t["name"]: t["template"] for t in template}.get("default")
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.exists(jinja_file):  # transformers >= 4.43 saves the template here
      with open(jinja_file) as fh:
        template = fh.read()
    gen_eos = _read_json(os.path.join(path, "generation_config.json")).get("eos_token_id")
    extra_eos = gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]
    # BOS/EOS come from tokenizer.json's post-processor: transformers 5 ignores the config's
    # add_bos_token/add_eos_token whenever a tokenizer.json exists.
    return cls._assemble(backend, special, extra_eos_ids=extra_eos, chat_template=template)

  @classmethod
  def _assemble(cls, backend: HFTokenizer, special: dict[str, str | None], *,
                extra_eos_ids: list[int], chat_template: str | None) -> "Tokenizer":
    """transformers' TokenizersBackend adds named special tokens the backend lacks as special."""
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    backend.add_special_tokens([AddedToken(t, special=True) for t in dict.fromkeys(special.values())
                                if t is not None and t not in added])
    eos_ids = [backend.token_to_id(special["eos_token"])] if special["eos_token"] else []
    return cls(backend, special_tokens=special,
               eos_token_ids=tuple(dict.fromkeys(eos_ids + list(extra_eos_ids))),
               chat_template=chat_template)

  @property
  def vocab_size(self) -> int:
    return self._backend.get_vocab_size(with_added_tokens=True)

  def to_json(self) -> str:
    """The tokenizer as `tokenizers` serializes it (tokenizer.json), e.g. for a grammar engine
    that reads the vocabulary itself."""
    return self._backend.to_str()

  @property
  def bos_token_id(self) -> int | None:
    bos = self._special_tokens["bos_token"]
    return None if bos is None else self._backend.token_to_id(bos)

  @property
  def eos_token_ids(self) -> tuple[int, ...]:
    return self._eos_token_ids

  @property
  def chat_template(self) -> str | None:
    return self._chat_template

  @functools.cached_property
  def max_token_bytes(self) -> int | None:
    """The most UTF-8 bytes of text one token can stand for, so that a text of more than
    `n * max_token_bytes` bytes encodes to more than n tokens: the longest spelling in the
    vocabulary (a byte-level spelling is at least as long as the bytes it stands for). None
    when a normalizer rewrites the text first (NFKC, say, can shrink it)."""
    if self._backend.normalizer is not None:
      return None
    return max(len(t.encode("utf-8")) for t in self._backend.get_vocab(with_added_tokens=True))

  @functools.cached_property
  def chat_template_variables(self) -> frozenset[str]:
    """The names the chat template reads from its context: what template kwargs can set."""
    if self._chat_template is None:
      return frozenset()
    env = _chat_template_env()
    names = jinja2.meta.find_undeclared_variables(env.parse(self._chat_template))
    return frozenset(names - set(env.globals))

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    # encode_batch releases the GIL; encode holds it throughout, for seconds on a long text,
    # while no other thread (a server's event loop, say) runs.
    return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

  def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
    return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                          tokenize: bool = False, chat_template: str | None = None,
                          **kwargs) -> str | list[int]:
    """Render `messages` with the chat template (`chat_template`: this one instead), as
    transformers' `apply_chat_template` does.

    `kwargs` reach the template as variables (tools, documents, enable_thinking, ...) and
    override the special token strings it also sees.
    """
    if chat_template is not None:
      compiled = _chat_template_env().from_string(chat_template)
    elif self._chat_template is None:
      raise NoChatTemplate(
          f"{self.name or 'this model'} has no chat template: it is a base model that completes "
          f"text (use generate / the completions API). To chat with it anyway, give a chat "
          f"template (chat_template=..., a Jinja string as transformers takes it).")
    else:
      if self._compiled is None:
        self._compiled = _chat_template_env().from_string(self._chat_template)
      compiled = self._compiled
    # transformers drops None-valued keys (templates handle a missing key, not a literal None)
    # and passes a message's reasoning under every name templates read it by.
    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    for i, m in enumerate(chat):
      reasoning = next((m[k] for k in _REASONING_FIELDS if k in m), None)
      if reasoning is not None:
        chat[i] = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    context = {k: v for k, v in self._special_tokens.items() if v is not None}
    context |= {"tools": None, "documents": None} | kwargs
    text = compiled.render(messages=chat, add_generation_prompt=add_generation_prompt, **context)
    return self.encode(text, add_special_tokens=False) if tokenize else text


class NoChatTemplate(ValueError):
  """A chat was asked of a tokenizer without a chat template, and none was given."""


def _read_json(file: str) -> dict:
  if not os.path.exists(file):
    return {}
  try:
    with open(file) as fh:
      return json.load(fh)
  except json.JSONDecodeError as e:
    raise ValueError(f"{file}: not valid JSON ({e})") from None


class IncrementalDetokenizer:
  """Token ids in one at a time, text deltas out, never half a UTF-8 character.

  Each step decodes only a short window: the tokens since the previous emission plus the ones
  before them (`prefix`), and emits what the new tokens add to the prefix's text. Decoding the
  prefix too keeps decoders that treat a sequence's first token specially (SentencePiece drops
  its leading space) consistent between the two strings. While the text ends in U+FFFD the newest
  token ended inside a multi-byte character, so nothing is emitted until it completes.
  """

  def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
    self._tokenizer = tokenizer
    self._skip = skip_special_tokens
    self._ids: list[int] = []
    self._prefix = 0  # window start
    self._read = 0  # tokens up to here have been emitted

  def add(self, token_id: int) -> str:
    """Feed one token; return the text it completes ("" while a character is incomplete)."""
    self._ids.append(int(token_id))
    decode = self._tokenizer.decode
    prefix_text = decode(self._ids[self._prefix:self._read], skip_special_tokens=self._skip)
    text = decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
    if text.endswith("\ufffd") or len(text) <= len(prefix_text):
      return ""
    self._prefix, self._read = self._read, len(self._ids)
    return text[len(prefix_text):]

  def flush(self) -> str:
    """Emit whatever is held back (a trailing incomplete character decodes to U+FFFD)."""
    decode = self._tokenizer.decode
    prefix_text = decode(self._ids[self._prefix:self._read], skip_special_tokens=self._skip)
    text = decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
    self._prefix = self._read = len(self._ids)
    return text[len(prefix_text):]
