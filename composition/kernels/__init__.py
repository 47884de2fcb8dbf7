"""CPU kernels behind `ComposedLM`'s speed: each is chosen by measuring on the machine at hand, never by CPU family.

few_rows.py      linears over a few rows in oneDNN's packed layout (`FewRowKernel`, `FewRowLinears`)
stacked_lora.py  LoRA experts on one base: the factors stacked, one product for every expert (`StackedLoRA`)
mixed_head.py    the components' last hidden states mixed before one output-layer pass (`MixedHead`)
"""
