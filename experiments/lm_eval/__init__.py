"""`type: lm_eval` compares: given checkpoints (full or LoRA, local or hub), their merges and compositions,
scored by lm-eval. The modules, under `mergecompose.experiments.lm_eval`:

    config   the typed config (`LmEvalCompareConfig`), validated as a whole at load time
    preflight  what the run needs of devices, models, vocabularies, task files and metrics, before any model loads
    catalog  which lm-eval tasks exist and which run model-written code (lm-eval's task index)
    systems  the systems as lm-eval models; merges (mergekit) and dense LoRA experts, cached
    cells    one (system, task) cell: lm-eval's `simple_evaluate`, records with 95 % intervals
    report   results.md and bars.png
    run      the whole compare, registered as the compare kind `lm_eval` (`mergecompose.experiments.plugins`)

It needs the `lm-eval` extra; `mergecompose.experiments.compare` imports it only when lm-eval is installed.
"""

from mergecompose.experiments.lm_eval.lm_eval_compare import run_lm_eval_compare
from mergecompose.experiments.lm_eval.lm_eval_config import LmEvalCompareConfig

__all__ = ["LmEvalCompareConfig", "run_lm_eval_compare"]
