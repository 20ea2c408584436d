"""What a verification batch costs against one token, by weight type (docs/runtime.md's table).

Exact mode pays off where a batch of r rows costs little more than one token. That ratio depends on the weight
type: llama.cpp's CPU kernels for a batch differ by type, and it repacks some types at load (Q4_0, IQ4_NL, Q4_K
on AVX2/AVX-512; more on ARM) into layouts whose matrix kernels take several rows at once. This requantizes a
model with llama.cpp's quantize API into each type (every matrix in that type, as `llama-quantize --pure`, but
where a matrix's rows do not split into the type's blocks: the table says what each file holds), then times, on
the stock path (a plain context, no early-exit state), llama_decode of one token and of a batch of r tokens with
every row's logits (what a verification batch asks), each after the same prompt and rolled back after; in turns,
the median of the repeats.

    .venv/bin/python tools/batch_costs_by_type.py [MODEL.gguf] [--types F16,Q4_0] [--rows 2,4,8] [--repeats 30]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from specee_edge.default_model import default_model_path
from specee_edge.errors import SpecEEError
from specee_edge.runtime import Context, Model
from specee_edge.runtime.quantize import FTYPES, requantize, weight_type, weight_types
from specee_edge.threads import default_threads

TYPES = ("F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL")
PROMPT = ("The bicycle was invented in the nineteenth century. Its first form had no pedals: riders pushed "
          "themselves along with their feet. Later designs added cranks, chains and pneumatic tyres.")


@dataclass
class TypeCosts:
    weight_type: str
    holds: dict[str, float]     # the share of the matrix weights in each GGML type (fallbacks included)
    one_ms: float               # one token (median)
    rows_ms: dict[int, float]   # r rows with every row's logits (median)

    def ratio(self, rows: int) -> float:
        return self.rows_ms[rows] / self.one_ms


def time_decode(ctx: Context, tokens: list[int], n_keep: int) -> float:
    """Seconds of one llama_decode of `tokens` (every row's logits when several), then the cache rolled back."""
    t0 = time.perf_counter()
    ctx.decode(tokens, output_all=len(tokens) > 1)
    seconds = time.perf_counter() - t0
    ctx.truncate(n_keep)
    return seconds


def measure(path: Path, rows: list[int], repeats: int, threads: int) -> tuple[float, dict[int, float]]:
    """Median ms of one token and of each batch size, timed in turns after the same prompt."""
    model = Model(path)
    ctx = Context(model, n_ctx=512, n_batch=512, n_threads=threads)
    try:
        prompt = model.tokenize(PROMPT)
        ctx.decode(prompt)
        n_keep = ctx.n_past
        batch = model.tokenize(" The bicycle is still the most efficient way to travel", add_special=False)
        if len(batch) < max(rows):
            raise SpecEEError(f"--rows goes up to {len(batch)}")
        sizes = [1, *rows]
        time_decode(ctx, batch[: max(rows)], n_keep)  # warm-up: the first graph of each size is built once
        seconds: dict[int, list[float]] = {r: [] for r in sizes}
        for _ in range(repeats):
            for r in sizes:
                seconds[r].append(time_decode(ctx, batch[:r], n_keep))
        ms = {r: float(np.median(s)) * 1e3 for r, s in seconds.items()}
        return ms[1], {r: ms[r] for r in rows}
    finally:
        ctx.close()
        model.close()


def table(results: list[TypeCosts], rows: list[int]) -> str:
    head = "| weight type | the file holds | 1 token ms | " + " | ".join(f"{r} rows ms (× 1 token)" for r in rows) + " |"
    lines = [head, "|" + "---|" * (3 + len(rows))]
    for res in results:
        holds = ", ".join(f"{name} {share:.0%}" for name, share in res.holds.items())
        cells = " | ".join(f"{res.rows_ms[r]:.1f} ({res.ratio(r):.2f}×)" for r in rows)
        lines.append(f"| {res.weight_type} | {holds} | {res.one_ms:.1f} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[TypeCosts]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="the GGUF to requantize (default: the default model)")
    parser.add_argument("--types", default=",".join(TYPES), help=f"comma list of {', '.join(FTYPES)}")
    parser.add_argument("--rows", default="2,4,8", help="batch sizes, comma list")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("-t", "--threads", type=int, default=None)
    parser.add_argument("--keep", type=Path, default=None, help="keep the requantized files in this folder")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    try:
        types = [weight_type(t) for t in args.types.split(",")]
        rows = sorted({int(r) for r in args.rows.split(",")})
        if rows[0] < 2 or args.repeats < 1:
            raise SpecEEError("--rows are batch sizes of 2 or more, --repeats at least 1")
    except ValueError:
        parser.error("--rows takes integers, e.g. 2,4,8")
    except SpecEEError as e:
        parser.error(str(e))
    source = Path(args.model) if args.model else default_model_path()
    threads = args.threads or default_threads()
    results = []
    with tempfile.TemporaryDirectory(prefix="batch-costs-") as tmp:
        folder = args.keep or Path(tmp)
        try:
            for name in types:
                path = folder / f"{source.stem}.{name}.gguf"
                if not path.exists():
                    requantize(source, path, name)
                one, by_rows = measure(path, rows, args.repeats, threads)
                results.append(TypeCosts(name, weight_types(path), one, by_rows))
        except SpecEEError as e:
            parser.exit(1, f"error: {e}\n")
    print(f"{source.name} requantized, {threads} threads, median of {args.repeats}:")
    print(table(results, rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return results


if __name__ == "__main__":
    main()
