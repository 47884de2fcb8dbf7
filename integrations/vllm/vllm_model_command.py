"""`mergecompose vllm-model`: write the folder that serves a composition in vLLM.

The folder is written by `mergecompose.integrations.vllm.folder.build_vllm_model`.
"""

from __future__ import annotations

from mergecompose.core.cli_common import add_common_flags, add_composition_arguments, declare_paths
from mergecompose.integrations.vllm.folder import build_vllm_model


def add_commands(subparsers) -> None:
    command = subparsers.add_parser(
        "vllm-model",
        help="write a vLLM model folder that composes a base with experts (no checkpoint copy)",
        description="Write a small folder (config.json, the base's tokenizer) that vLLM loads as one composed model: "
        "`vllm serve DIR`, `LLM(model=DIR)`, `lm_eval --model vllm --model_args pretrained=DIR`. "
        "Needs mergecompose installed beside vLLM (docs/guides/vllm.md).",
    )
    add_composition_arguments(command, "the base model folder (safetensors and a tokenizer)")
    add_common_flags(command, out="the model folder to write", out_required=True)
    declare_paths(command, inputs=("base", "experts"), not_paths=("names",))
    command.set_defaults(func=run_vllm_model)


def run_vllm_model(args) -> int:
    folder = build_vllm_model(args.out, args.base, args.experts, args.weights, args.names, overwrite=args.overwrite)
    if not args.quiet:
        print(f"wrote {folder}: serve it with `vllm serve {folder}` in an environment with vLLM and mergecompose")
    return 0
