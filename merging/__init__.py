"""Parameter-space merging: task vectors, merge methods in memory, mergekit merges on disk, LoRA experts.

    θ = θ_base + λ · merge_i(w_i, τ_i),    τ_i = θ_i − θ_base

The defaults follow the papers (TIES: global trim, sign elected on the unweighted trimmed task
vectors, disjoint mean by count; DARE: rescale by 1/(1 − p)); `MERGEKIT_MODE` and `PEFT_MODE`
select the libraries' definitions. See `merging.registry` for the methods and `merging.settings`
for their parameters. `train_model` (`merging.training`) is the one training loop, for full
models and LoRA adapters alike.
"""

from merging.checkpoints import CheckpointMergeConfig, merge_checkpoints
from merging.lora import LoraTrainingConfig, combine_lora_adapters, lora_delta_weights, train_lora_expert
from merging.merge import MERGEKIT_MODE, PEFT_MODE, merge
from merging.registry import METHODS, register, validate_merge_params
from merging.settings import MergeSettings
from merging.task_vector import TaskVector
from merging.training import OptimizerSettings, TrainingLog, train_model

__all__ = [
    "METHODS",
    "MERGEKIT_MODE",
    "PEFT_MODE",
    "CheckpointMergeConfig",
    "LoraTrainingConfig",
    "MergeSettings",
    "OptimizerSettings",
    "TaskVector",
    "TrainingLog",
    "combine_lora_adapters",
    "lora_delta_weights",
    "merge",
    "merge_checkpoints",
    "register",
    "train_lora_expert",
    "train_model",
    "validate_merge_params",
]
