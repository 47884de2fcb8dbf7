"""Exact speculative decoding of the composed distribution, with a draft model (by default the merge of the experts).

decoding.py      the speculative loop: a draft proposes K tokens, the components score K+1 positions in one pass
acceptance.py    the acceptance rule of Leviathan et al. (2023) on probability tensors, exactly
draft_length.py  K chosen each round from the acceptance rate and the round times seen so far
drafts.py        the merged draft: θ_b + Σ_i λ_i (θ_i − θ_b), for full experts and for LoRA experts
"""

# Private to mergecompose.composition, whose __init__ exports what is public.
__all__: list[str] = []
