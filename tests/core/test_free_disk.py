"""The pre-flight's disk check: an estimate larger than the free space of the output's disk is refused before any
work, naming the flag, the folder, both sizes and what the estimate is for."""

from __future__ import annotations

import shutil

import pytest

from mergecompose.core.cli_common import check_free_disk


def test_an_estimate_larger_than_the_free_space_is_refused(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    # The unit follows the size (a nearly full disk reads in MB), so the pattern takes any.
    with pytest.raises(
        OSError, match=r"`--out` '.*not_yet/out': the checkpoints need about [\d.]+ (bytes|KB|MB|GB), and its disk has"
    ):
        check_free_disk(tmp_path / "not_yet" / "out", free * 2, "the checkpoints")
    assert not (tmp_path / "not_yet").exists()
    with pytest.raises(OSError, match=r"need about 1000000000\.0 GB, and its disk has [\d.]+ (bytes|KB|MB|GB) free"):
        check_free_disk(tmp_path / "out", 10**18, "the checkpoints")


def test_an_estimate_that_fits_passes(tmp_path):
    check_free_disk(tmp_path / "out", 1024, "the checkpoints")
