"""Parameter-space merging: task vectors, merge methods in memory, mergekit merges on disk, LoRA experts.

    θ = θ_base + λ · merge_i(w_i, τ_i),    τ_i = θ_i − θ_base

The defaults follow the papers (TIES: global trim, sign elected on the unweighted trimmed task
vectors, disjoint mean by count; DARE: rescale by 1/(1 − p)); `MERGEKIT_MODE` and `PEFT_MODE`
select the libraries' definitions. See `mergecompose.merging.methods` for the methods and
`mergecompose.merging.method_settings` for their parameters. Training (`train_model`, `train_lora_expert`)
lives on the ground floor, `mergecompose.core.training`.
"""

from mergecompose.merging.checkpoints import CheckpointMergeConfig, merge_checkpoints
from mergecompose.merging.lora import combine_lora_adapters, lora_delta_weights
from mergecompose.merging.merge import MERGEKIT_MODE, PEFT_MODE, merge
from mergecompose.merging.method_settings import MergeSettings
from mergecompose.merging.methods import METHODS, register, validate_merge_params
from mergecompose.merging.task_vector import TaskVector

__all__ = [
    "METHODS",
    "MERGEKIT_MODE",
    "PEFT_MODE",
    "CheckpointMergeConfig",
    "MergeSettings",
    "TaskVector",
    "combine_lora_adapters",
    "lora_delta_weights",
    "merge",
    "merge_checkpoints",
    "register",
    "validate_merge_params",
]
