"""The analysis tests' shared batch of the tiny models' token ids."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def batches():
    """One batch of 3 rows of 10 random ids of the tiny vocabulary, the first row left-padded by 3."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (3, 10), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    return [{"input_ids": ids, "attention_mask": mask}]
