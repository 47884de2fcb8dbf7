"""`--quiet` for lm-eval: its log lines, its progress bars and the stderr of the `git describe` it runs, silenced.

lm-eval logs through its own handler (set up once, on a stream it keeps), draws tqdm bars on
`sys.stderr` with no switch for most of them (tqdm reads `TQDM_DISABLE` only when it is imported), and
records the commit of the working directory by running `git describe --always` in a subprocess
(`lm_eval.loggers.utils.get_git_commit_hash`), whose "fatal: not a git repository" goes straight to the
terminal. So, for the duration of the block: logging is disabled, `sys.stderr` is /dev/null, and so is
the process's file descriptor 2, which subprocesses inherit. Exceptions still propagate (and are
reported after the block, by the caller); stdout (lm-eval's results table) is untouched.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_lm_eval(quiet: bool = True) -> Iterator[None]:
    """Silence lm-eval's logs, bars and subprocess stderr inside the block (nothing, unless `quiet`); restore all
    three on exit."""
    if not quiet:
        yield
        return
    previous_disable = logging.root.manager.disable
    sys.stderr.flush()
    saved_descriptor = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        logging.disable(logging.CRITICAL)
        try:
            with contextlib.redirect_stderr(devnull):
                yield
        finally:
            os.dup2(saved_descriptor, 2)
            os.close(saved_descriptor)
            logging.disable(previous_disable)
