"""The learner engine: the policy model, the GRPO update and its state; no storage.

One component a file, read in this order:
  batch.py      the typed Batch of whole groups and the Scores (pi_old, reference) computed for it
  model.py      PolicyLM: each prompt computed once for its G responses, packed rows, log-probs, scoring
  paths.py      which of those paths a model takes, from what its layers are (attention, window, recurrent)
  pi_old.py     where pi_old comes from (learn.old_logprobs: sampler, recompute, auto)
  loss.py       the run's loss as grpo.core takes it (LossSpec, made once from the config)
  loop.py       train: minibatches, microbatches, the clipped loss of grpo.core, guards and metrics
  state.py      Learner: policy (LoRA adapters), AdamW, RNG, reference; build, move, save
  warm.py       the learner one learn hands to the next iteration's in the same process
  precision.py  learn.mixed_precision: bf16 autocast or float32, and why
  kernels.py    the device's kernels: log-probs (chunked torch, or Liger's fused linear cross-entropy), attention
  sharding.py   learn.sharding=fsdp2: fully_shard per decoder layer, state through Distributed Checkpoint
  rank.py       what every learner process runs (in-process, or a torchrun rank)
  launch.py     starting the torchrun processes of learn.num_processes > 1
  nodes.py      learn.nodes > 1: the nodes meet through storage
  sft.py        the warm start on this learner: cross-entropy as the loss with advantage 1, conversations as a Batch

Precision and memory, as on a GPU: the weights and AdamW state stay float32 (master weights);
learn.mixed_precision=bf16 runs the forwards under bf16 autocast; checkpoints are written in the base
model's dtype, with the float32 master weights beside them when that dtype is narrower, so the next
iteration resumes exactly. Log-probs never materialize float32 (B, T, V) logits
(grpo/learner/kernels.py). stages/learn.py joins the data, hands a warm Learner from one iteration
to the next and commits.
"""

from grpo.errors import LearnError
from grpo.learner.batch import Batch, Scores
from grpo.learner.loop import Update, train
from grpo.learner.model import PolicyLM, forward_logprobs, score
from grpo.learner.state import ADAPTER_DIR, MASTER_WEIGHTS, STATE_DCP, Learner

__all__ = [
    "ADAPTER_DIR",
    "Batch",
    "LearnError",
    "Learner",
    "MASTER_WEIGHTS",
    "PolicyLM",
    "STATE_DCP",
    "Scores",
    "Update",
    "forward_logprobs",
    "score",
    "train",
]
