"""Training runs that produce jinfer's artifacts, apart from the serving path: they import the
library downward and nothing imports them.

  distill       a draft model distilled from its target (`python -m jinfer.training.distill`)
  medusa_train  Medusa-1 heads, self-distilled (`python -m jinfer.training.medusa_train`)
  chat_data     their training text: chat prompts written for this project, the teacher's answers
  online        online learning: the engine's rollouts, a reward, GRPO steps on a LoRA pushed
                back with `update_lora` (`examples/online_learning.py`)
"""
