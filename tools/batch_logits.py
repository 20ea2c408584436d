"""How far a verification batch's logits are from decoding one token at a time, on the stock path.

Exact mode verifies drafts in batches; llama.cpp's batched kernels do not reproduce single-token decoding to
the last bit. This decodes the full model's own greedy answers to a few prompts twice, one token at a time
and in batches of 4 rows (plain contexts, no early-exit state), and reports the largest logit difference per
position and how far that moves the sampling distribution at temperature 0.8 (total variation): about the
chance, per token, that a seeded draw differs.

    .venv/bin/python tools/batch_logits.py MODEL.gguf [--tokens 64] [-t 2]
"""

from __future__ import annotations

import argparse

import numpy as np

from specee_edge.engine import GREEDY, Engine, EngineConfig
from specee_edge.runtime import Context

PROMPTS = ("The history of the bicycle", "Write a Python function that sorts a list",
           "Once upon a time, in a small village", "Explain photosynthesis to a child")
ROWS = 4
TEMPERATURE = 0.8


def distribution(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) / TEMPERATURE
    p = np.exp(z - z.max())
    return p / p.sum()


def compare(engine: Engine, prompt: list[int], answer: list[int], threads: int) -> list[tuple[float, float]]:
    """(largest |logit difference|, total variation) at each answer position both decodes cover."""
    single, batched = (Context(engine.model, n_ctx=1024, n_threads=threads) for _ in range(2))
    try:
        single.decode(prompt)
        batched.decode(prompt)
        one = []
        for token in answer[:-1]:
            single.decode([token])
            one.append(single.logits().copy())
        rows = []
        for i in range(0, len(answer) - 1, ROWS):
            chunk = answer[i : i + ROWS]
            if len(chunk) < 2:  # a one-row decode is a single-token step, not a batch
                break
            batched.decode(chunk, output_all=True)
            rows += [batched.logits(r).copy() for r in range(len(chunk))]
        return [(float(np.abs(a - b).max()), 0.5 * float(np.abs(distribution(a) - distribution(b)).sum()))
                for a, b in zip(one, rows)]
    finally:
        single.close()
        batched.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("-t", "--threads", type=int, default=2)
    args = parser.parse_args()
    engine = Engine(args.model, config=EngineConfig(n_ctx=1024, n_threads=args.threads))
    found = []
    for text in PROMPTS:
        prompt = engine.prompt_tokens(text)
        engine.reset()
        found += compare(engine, prompt, engine.generate(prompt, max_tokens=args.tokens, sampling=GREEDY).tokens,
                         args.threads)
    engine.close()
    diff, tv = np.array(found).T
    print(f"{len(diff)} positions: largest logit difference median {np.median(diff):.4f}, 90th percentile "
          f"{np.percentile(diff, 90):.4f}, max {diff.max():.4f}; bit-identical rows {np.mean(diff == 0):.2f}; "
          f"total variation at T={TEMPERATURE} mean {tv.mean():.5f}, max {tv.max():.5f}")


if __name__ == "__main__":
    main()
