"""mergecompose: merge fine-tuned experts in parameter space, compose them in probability space, and compare.

The packages are layers; each imports only those below it (`pyproject.toml`, `[tool.importlinter]`):

    mergecompose.cli            the `mergecompose` command line
    mergecompose.studies        the studies: letters, skills, math/code, predict sweeps (task types, their commands)
    mergecompose.experiments    the compare pipeline: `mergecompose compare`, task types and compare kinds by name
    mergecompose.analysis       overlap diagnostics and the merge-or-compose verdict
    mergecompose.integrations   lm-eval and vLLM (each needs its optional extra)
    mergecompose.composition    the composition rule, `ComposedLM`, remedies, speculative decoding
    mergecompose.merging        task vectors, merge methods, mergekit merges
    mergecompose.core           the ground floor: io, locks, model sources, adapters, CLI flags, tiny models, training
"""
