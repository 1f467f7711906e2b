"""What the HTTP server binds to, whom it answers and how much it accepts (README, "Security")."""
from __future__ import annotations

import dataclasses

from jinfer.serving.tool_parsers import PARSERS


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerOptions:
  host: str = "127.0.0.1"
  port: int = 8000
  api_key: str | None = None  # required as `Authorization: Bearer KEY` on /v1 and the docs
  # Without an API key the server answers only requests whose Host names the bound address
  # (or localhost for a loopback or wildcard one) or one of these: a web page that rebinds its
  # own DNS name to this machine cannot read the answers. "*" accepts any Host.
  allowed_hosts: tuple[str, ...] = ()
  # Origins a browser may call this server from (CORS); "*" for any. None by default: requests
  # that a web page on another origin makes are refused.
  allowed_origins: tuple[str, ...] = ()
  max_request_bytes: int = 8 << 20  # request bodies beyond this get 413
  header_timeout: float = 10.0  # seconds a connection may take to send a request's headers
  body_timeout: float = 30.0  # seconds a request may take to send its body (then 408)
  max_connections: int = 512  # requests beyond this many open connections or tasks get 503
  max_waiting: int = 256  # sequences waiting to be scheduled beyond which requests get 429
  shutdown_timeout: float = 30.0  # seconds in-flight requests may run on after SIGTERM
  # vLLM's tool flags: a model whose chat template writes the tools itself answers tool_choice
  # "auto" only with both, the parser matching its format (hermes, llama3_json, mistral). A
  # template without a tool format gets jinfer's default tool prompt and the hermes parser.
  enable_auto_tool_choice: bool = False
  tool_call_parser: str | None = None
  # LoRA (the engine needs enable_lora): adapters served by name from the start, (name, path)
  # pairs; whether clients may load and unload more, and from under which directories
  # (jinfer/serving/adapters.py; default: the startup adapters' and the shipped ones').
  lora_modules: tuple[tuple[str, str], ...] = ()
  allow_runtime_lora_updating: bool = False
  lora_allowed_roots: tuple[str, ...] = ()

  def __post_init__(self):
    for name in ("max_request_bytes", "max_connections", "max_waiting"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    for name in ("header_timeout", "body_timeout", "shutdown_timeout"):
      if not getattr(self, name) > 0:
        raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
    if self.enable_auto_tool_choice and self.tool_call_parser is None:
      raise ValueError("enable_auto_tool_choice needs tool_call_parser: the parser of the "
                       "model's tool-call format")
    if self.tool_call_parser is not None:
      if self.tool_call_parser not in PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(sorted(PARSERS))}, got "
                         f"{self.tool_call_parser!r}")
    object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))
    object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))
    object.__setattr__(self, "lora_modules", tuple(map(tuple, self.lora_modules)))
    object.__setattr__(self, "lora_allowed_roots", tuple(self.lora_allowed_roots))
