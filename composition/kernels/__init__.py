"""The CPU kernels behind `ComposedLM`'s speed.

few_row_linear.py  linears over a few rows with the faster kernel, weights packed where that pays (`FewRowLinears`)
few_row_kernel.py  the two dense kernels over a few rows, x @ Wᵀ and W @ xᵀ; `FewRowKernel` times them
packed_weights.py  a linear's weight in oneDNN's packed layout, in place; siblings packed as one (`PackedGroup`)
stacked_lora.py    LoRA experts on one base: the factors stacked, one product for every expert (`StackedLoRA`)
mixed_head.py      the components' last hidden states mixed before one output-layer pass (`MixedHead`)
"""

# Private to mergecompose.composition, whose __init__ exports what is public.
__all__: list[str] = []
