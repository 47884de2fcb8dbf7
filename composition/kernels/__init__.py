"""The CPU kernels behind `ComposedLM`'s speed.

few_row_linear.py  linears over a few rows in oneDNN's packed layout; `FewRowKernel` times its two kernels
stacked_lora.py    LoRA experts on one base: the factors stacked, one product for every expert (`StackedLoRA`)
mixed_head.py      the components' last hidden states mixed before one output-layer pass (`MixedHead`)
"""

# Private to mergecompose.composition, whose __init__ exports what is public.
__all__: list[str] = []
