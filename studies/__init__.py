"""The studies: experiments built on the compare pipeline, each in one folder with its data generators. The
pipeline (`mergecompose.experiments`) imports none of them; they plug in through the entry points in
`pyproject.toml` (task types and compare kinds) and add their own commands.

mergecompose.studies.letters         the letter-replacement task type (the paper's toy experiment), its overlap sweep
mergecompose.studies.skills          the sequential-skills task type and `mergecompose skills-sweep`
mergecompose.studies.math_code       the real-model study: a math and a code expert on SmolLM2 (`type: math_code`)
mergecompose.studies.predict         `mergecompose predict-sweep`: merge or compose?, fitted over many settings
mergecompose.studies.sweep_commands  the sweeps' commands
"""
