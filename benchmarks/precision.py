"""bfloat16 against float32 on this CPU: the linears of SmolLM2-135M, and what `dtype: auto` picks here.

Each of SmolLM2's linear shapes (576 → 576, 576 → 192, 576 → 1536, 1536 → 576, and the 576 → 49,152
output layer) is run as `F.linear` on `rows` input rows, in float32 and in bfloat16, the two interleaved
`--repeats` times; the table gives the median time of one pass over a layer's seven linears plus the output
layer, and bfloat16's ratio to float32. 512 rows is a training or prompt batch, 1 row a decoding step.

    python -m benchmarks.precision                  # rows 1 and 512, 2 threads, 5 repeats
    python -m benchmarks.precision --smoke          # tiny, to prove it runs
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.report import conditions, conditions_line, write_results
from mergecompose.core.io import markdown_table
from mergecompose.core.precision import fast_bfloat16, resolve_dtype

# (in, out) of one SmolLM2-135M layer's seven projections (q, k, v, o, gate, up, down), and its output layer.
LAYER = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]
OUTPUT_LAYER = (576, 49152)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 512])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="one repeat, 2 rows, small shapes")
    parser.add_argument("--out", default="benchmarks/results/precision.json")
    return parser


def pass_seconds(shapes: list[tuple[int, int]], rows: int, dtype: torch.dtype) -> float:
    """Seconds of one `F.linear` pass over every shape, on `rows` random rows, in `dtype`."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, size, generator=generator).to(dtype) for size, out in shapes]  # (out, in) each
    inputs = [torch.randn(rows, size, generator=generator).to(dtype) for size, _ in shapes]  # (rows, in) each
    F.linear(inputs[0], weights[0])  # warm-up
    started = time.perf_counter()
    for x, weight in zip(inputs, weights):
        F.linear(x, weight)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = [(16, 32), (32, 64)] if args.smoke else [*LAYER, OUTPUT_LAYER]
    all_rows = [2] if args.smoke else args.rows
    repeats = 1 if args.smoke else args.repeats
    start = conditions(repeats)
    results: dict = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "fast_bfloat16": fast_bfloat16("cpu"),
        "auto": resolve_dtype("auto", "cpu"),
        "rows": {},
    }
    table = []
    for rows in all_rows:
        times: dict[str, list[float]] = {"float32": [], "bfloat16": []}
        for _ in range(repeats):
            for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
                times[name].append(pass_seconds(shapes, rows, dtype))
        medians = {name: statistics.median(values) for name, values in times.items()}
        ratio = medians["bfloat16"] / medians["float32"]
        results["rows"][rows] = {"seconds": medians, "bfloat16_over_float32": ratio}
        table.append([rows, f"{1e3 * medians['float32']:.2f}", f"{1e3 * medians['bfloat16']:.2f}", f"{ratio:.1f}"])
    end = conditions(repeats)
    results["conditions"] = {"start": start, "end": end}
    print(markdown_table(["rows", "float32 ms", "bfloat16 ms", "bfloat16 / float32"], table))
    print(
        f"CPU capability {results['cpu_capability']}, fast bfloat16 kernels: {results['fast_bfloat16']}, "
        f"`dtype: auto` picks {results['auto']}"
    )
    print(conditions_line(start, end))
    write_results(results, args.out)
    return results


if __name__ == "__main__":
    main()
