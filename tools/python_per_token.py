"""The Python a decode step runs, counted: bytecodes and Python calls per emitted token, by lane.

Timing the Python around a step is at the mercy of the machine: it runs cold after each decode, and on a shared
VM two runs of the same code differ by more than most changes to it. Counting the bytecodes the interpreter
executes per token does not move from run to run (only with the rounds the controller chose), so a change to
the per-token path can be judged by this count, then by the bench's `other`.

Lanes: `bare` (the runtime's Context, a token at a time with the engines' draw, nothing else: the bench's bare
lane), `off` (the engine's stream with SpecEE off: records, the token's text, stop strings, statistics) and
`exact` (exact mode: lookup, the controller's plan, rounds). Greedy, every lane on the same prompts; the
prompt's pass and each answer's first token are not counted.

    .venv/bin/python tools/python_per_token.py [MODEL.gguf] [--pack PACK|none] [-n 64] [-p 6] [--top 12] [-t 2]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

from specee_edge.bench.run import pick_prompts
from specee_edge.data.prompts import bench_prompts
from specee_edge.default_model import default_model_path
from specee_edge.engine import GREEDY, Engine, EngineConfig
from specee_edge.engine.sampling import Sampler


@dataclass
class Count:
    """Bytecodes by the function that ran them, and Python calls, over `tokens` tokens."""

    bytecodes: Counter = field(default_factory=Counter)
    calls: int = 0
    tokens: int = 0

    def per_token(self, value: float) -> float:
        return value / self.tokens if self.tokens else 0.0


def counted(count: Count, step: Callable[[], object]) -> object:
    """step()'s result, every bytecode it ran (in Python frames it entered) added to `count`."""
    def trace_opcodes(frame, event, arg):
        if event == "opcode":
            count.bytecodes[frame.f_code.co_qualname] += 1
        return trace_opcodes

    def enter(frame, event, arg):
        count.calls += 1
        frame.f_trace_opcodes = True
        return trace_opcodes

    sys.settrace(enter)
    try:
        return step()
    finally:
        sys.settrace(None)


def engine_steps(engine: Engine, prompt: list[int], tokens: int) -> Iterator[Callable[[], object]]:
    """One callable per decode step of the engine's stream after the first token (None past the end)."""
    stream = engine.stream(prompt, max_tokens=tokens, sampling=GREEDY)
    try:
        next(stream)
        while True:
            yield lambda: next(stream, None)
    finally:
        stream.close()


def bare_steps(engine: Engine, prompt: list[int], tokens: int) -> Iterator[Callable[[], object]]:
    """The bare lane's steps: Context.decode and the draw, until an end of generation."""
    ctx = engine.ctx
    ctx.decode(prompt)
    draw = Sampler(GREEDY, ctx.n_vocab, prompt)
    token = [draw.from_context(ctx.handle)]

    def step() -> int | None:
        if engine.model.is_eog(token[0]):
            return None
        ctx.decode([token[0]])
        token[0] = draw.from_context(ctx.handle)
        return token[0]

    try:
        for _ in range(tokens - 1):
            yield step
    finally:
        draw.close()


def count_lane(engine: Engine, prompts: list[list[int]], tokens: int, bare: bool) -> Count:
    count = Count()
    for prompt in prompts:
        engine.reset()
        steps = (bare_steps if bare else engine_steps)(engine, prompt, tokens)
        for step in steps:
            if counted(count, step) is None:
                break
            count.tokens += 1
        steps.close()
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="model GGUF (default: the default model)")
    parser.add_argument("--pack", default="none", help="exact mode's pack: a path, auto (beside the model), or none")
    parser.add_argument("-n", "--tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("-p", "--prompts", type=int, default=6, help="bench prompts (Spec-Bench's, in turns)")
    parser.add_argument("--top", type=int, default=12, help="functions listed per lane")
    parser.add_argument("-t", "--threads", type=int, default=2)
    args = parser.parse_args()
    model = args.model or str(default_model_path())
    engine = Engine(model, pack=None if args.pack == "none" else args.pack,
                    config=EngineConfig(n_ctx=2048, n_threads=args.threads))
    try:
        prompts = [engine.prompt_tokens(p.text) for p in pick_prompts(bench_prompts("spec-bench"), args.prompts)]
        lanes: dict[str, Count] = {"bare": count_lane(engine, prompts, args.tokens, bare=True)}
        engine.set_early_exit(False)
        lanes["off"] = count_lane(engine, prompts, args.tokens, bare=False)
        engine.set_early_exit(True)
        lanes["exact"] = count_lane(engine, prompts, args.tokens, bare=False)
    finally:
        engine.close()
    console = Console()
    table = Table(title="Python per emitted token")
    for column in ("lane", "tokens", "bytecodes", "Python calls"):
        table.add_column(column, justify="left" if column == "lane" else "right")
    for name, count in lanes.items():
        table.add_row(name, str(count.tokens), f"{count.per_token(sum(count.bytecodes.values())):.0f}",
                      f"{count.per_token(count.calls):.1f}")
    console.print(table)
    for name, count in lanes.items():
        top = Table(title=f"{name}: bytecodes per token by function")
        top.add_column("function")
        top.add_column("bytecodes", justify="right")
        for function, n in count.bytecodes.most_common(args.top):
            top.add_row(function, f"{count.per_token(n):.1f}")
        console.print(top)


if __name__ == "__main__":
    main()
