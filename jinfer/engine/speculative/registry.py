"""Proposers by method name (`speculative_config["method"]`). Adding a proposer is one module
with a `Proposer` subclass and one entry here (and its name in `config.METHODS`)."""
from __future__ import annotations

from jinfer.engine.speculative.config import SpeculativeConfig
from jinfer.engine.speculative.draft_model import DraftModelProposer
from jinfer.engine.speculative.medusa import MedusaProposer
from jinfer.engine.speculative.ngram import NgramProposer
from jinfer.engine.speculative.proposer import Proposer, Target

PROPOSERS: dict[str, type[Proposer]] = {
    "ngram": NgramProposer,
    "draft_model": DraftModelProposer,
    "medusa": MedusaProposer,
}


def create_proposer(spec: SpeculativeConfig, target: Target) -> Proposer:
  return PROPOSERS[spec.method].create(spec, target)
