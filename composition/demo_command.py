"""`mergecompose demo`: composed generation with two LoRA experts on one tiny random base."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from mergecompose.composition import ComposedLM
from mergecompose.core.cli_common import add_common_flags, declare_paths
from mergecompose.core.tiny import random_llama, random_lora_adapter, tiny_llama_config


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = subparsers.add_parser("demo", help="composed greedy generation on a tiny random model (no downloads)")
    demo.add_argument("--max-new-tokens", type=int, default=12)
    demo.add_argument("--seed", type=int, default=0)
    add_common_flags(demo)
    declare_paths(demo, outputs=())
    demo.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    config = tiny_llama_config()
    base = random_llama(config, seed=args.seed)
    with tempfile.TemporaryDirectory() as folder:
        adapters = {
            name: random_lora_adapter(base, Path(folder) / name, seed=args.seed + 1 + index)
            for index, name in enumerate(["expert_a", "expert_b"])
        }
        composed = ComposedLM.from_adapters(
            random_llama(config, seed=args.seed), {k: str(v) for k, v in adapters.items()}
        )
    prompts = torch.tensor([[0, 0, 5, 9, 14], [7, 3, 22, 40, 11]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    generated = composed.generate(prompts, mask, max_new_tokens=args.max_new_tokens, eos_token_id=2, pad_token_id=0)
    base_only = base.generate(
        prompts,
        attention_mask=mask,
        max_new_tokens=args.max_new_tokens,
        do_sample=False,
        eos_token_id=2,
        pad_token_id=0,
    )
    if not args.quiet:
        print("Composed greedy decoding: tiny random Llama base + 2 random LoRA experts on one shared base copy")
    print(f"{'row':<4} {'prompt':<20} {'base alone':<40} composed")
    for row in range(prompts.shape[0]):
        prompt = prompts[row][mask[row].bool()].tolist()
        print(f"{row:<4} {str(prompt):<20} {str(base_only[row, 5:].tolist()):<40} {generated[row, 5:].tolist()}")
    return 0
