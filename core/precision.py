"""Which floating-point type runs fast on a device: bfloat16 only where the hardware has fast bfloat16 kernels.

On a CPU, torch runs bfloat16 matrix products through oneDNN when the CPU has the instructions for it
(AVX-512 on x86, BF16 on Arm); `torch.ops.mkldnn._is_mkldnn_bf16_supported()` says whether it does.
Elsewhere, on an AVX2-only CPU for example, they fall back to a reference kernel, several times slower
than float32 on many rows and slower still in the backward pass (docs/protocols/precision.md has the
measurements), so a training or evaluation run
configured for bfloat16 takes hours longer there than in float32. On CUDA, `torch.cuda.is_bf16_supported()`
answers the same question.

`dtype: auto` in a config means: bfloat16 where it is fast, float32 elsewhere (`resolve_dtype`).
An explicit `bfloat16` on a device where it is slow is kept, with a warning (`slow_dtype_problem`).
"""

from __future__ import annotations

import torch

AUTO = "auto"
# The dtypes a config or a command names, by name.
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def fast_bfloat16(device: str | torch.device = "cpu") -> bool:
    """True if bfloat16 matrix products on `device` run on native kernels rather than a slow fallback."""
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if kind == "cpu":
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return True  # mps and others: their own kernels, no reference fallback to avoid


def resolve_dtype(name: str, device: str | torch.device = "cpu") -> str:
    """A config's dtype name with `auto` resolved: 'bfloat16' where `fast_bfloat16(device)`, else 'float32'."""
    if name != AUTO:
        return name
    return "bfloat16" if fast_bfloat16(device) else "float32"


def slow_dtype_problem(name: str, device: str | torch.device, field: str) -> str | None:
    """Why `field` = `name` will be slow on `device` (bfloat16 without fast kernels), or None."""
    if name != "bfloat16" or fast_bfloat16(device):
        return None
    capability = torch.backends.cpu.get_cpu_capability() if torch.device(device).type == "cpu" else str(device)
    return (
        f"`{field}` is 'bfloat16', but this {torch.device(device).type} ({capability}) has no fast bfloat16 kernels: "
        "torch runs its bfloat16 matrix products through a fallback several times slower than float32; "
        f"set `{field}: auto` (bfloat16 where it is fast, float32 elsewhere) or 'float32'"
    )
