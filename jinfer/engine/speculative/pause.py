"""When a sequence stops speculating for a while: its drafts keep failing.

A verify step costs more than a plain one (on a CPU a 4-row step ~1.3-1.9x a 1-row step), so a
sequence whose proposer guesses badly (a draft model or heads on text unlike what they were
trained on) decodes slower with speculation than without. Each sequence keeps a moving average
of the drafts accepted per verify step; when it falls below `min_accepted_per_step`, the
sequence decodes plainly for its next `PAUSE_TOKENS` tokens, then verifies once more, and its
average decides again. The average starts at k (a sequence is trusted at first: at k = 3 and a
threshold of 0.5, six failed verify steps pause it). The decision reads only the sequence's own
history, and the output never depends on it: speculation emits what plain decoding does.
"""
from __future__ import annotations

from jinfer.engine.request import Sequence

PAUSE_TOKENS = 16  # plain decoding between tries: a probe costs one verify step per 16 tokens
DECAY = 0.7  # weight of the average so far against the newest verify step


def paused(seq: Sequence) -> bool:
  return seq.num_tokens < seq.spec_state.paused_until


def after_verify(seq: Sequence, k: int, num_accepted: int, min_accepted: float) -> None:
  """Record a verify step that accepted `num_accepted` drafts; pause the sequence if its average
  fell below `min_accepted`."""
  st = seq.spec_state
  st.accepted_avg = DECAY * (float(k) if st.accepted_avg is None else st.accepted_avg) + (
      1.0 - DECAY) * num_accepted
  if st.accepted_avg < min_accepted:
    st.paused_until = seq.num_tokens + num_accepted + 1 + PAUSE_TOKENS
