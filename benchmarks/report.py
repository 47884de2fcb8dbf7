"""What every benchmark does last: write its results as JSON."""

from __future__ import annotations

import json
from pathlib import Path


def write_results(results: dict, out: str | Path) -> None:
    """Write `results` to `out` (parents created) as indented JSON, and say where."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
