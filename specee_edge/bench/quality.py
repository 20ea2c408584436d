"""Quality of SpecEE's outputs: agreement with the full model, exact prefix, held-out perplexity.

Under the bench's grammar (`constrain`: a fresh GrammarConstraint per answer) the full model's greedy token is the
one the Sampler draws under it, the best token the grammar allows, the grammar moved along each answer's own tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.special import log_softmax, softmax

from specee_edge.bootstrap import ratio_interval
from specee_edge.engine import GREEDY, Engine, TokenRecord
from specee_edge.engine.constraint import GrammarConstraint
from specee_edge.exits import ExitKind
from specee_edge.runtime import Context


def full_model_logits(ctx: Context, prompt: Sequence[int], output: Sequence[int]) -> Iterator[np.ndarray]:
    """Teacher forcing: the full model's logits at each decode step of `output` (the steps giving output[1:]).

    One token per decode, as generation runs: a batched pass takes other matmul kernels and by itself
    disagrees with sequential greedy decoding on a few percent of near-tie steps.
    """
    ctx.clear()
    ctx.decode(list(prompt))
    for token in output[:-1]:
        ctx.decode([token])
        yield ctx.logits()


class GreedyUnder:
    """The full model's greedy choices along one answer, as the Sampler makes them under the grammar `constrain`
    makes (None: the argmax): a context manager that closes the grammar."""

    def __init__(self, constrain: Callable[[], GrammarConstraint] | None):
        self.constraint = constrain() if constrain is not None else None

    def pick(self, logits: np.ndarray) -> int:
        """The argmax, else (the grammar refusing it) the best token the grammar allows."""
        token = int(np.argmax(logits))
        if self.constraint is None or self.constraint.allows(token):
            return token
        return int(np.argmax(self.constraint.mask(logits)))

    def allowed(self, logits: np.ndarray) -> np.ndarray:
        """`logits` where the grammar allows the token, -inf elsewhere."""
        return logits if self.constraint is None else self.constraint.mask(logits)

    def took(self, token: int) -> None:
        """The answer took `token`: the grammar moves past it. A token it refuses (a lane that broke the grammar,
        which its `in_grammar` reports) leaves the rest of the answer unconstrained: llama.cpp aborts the process
        on accepting one."""
        if self.constraint is None:
            return
        if self.constraint.allows(token):
            self.constraint.accept(token)
        else:
            self.constraint.close()
            self.constraint = None

    def __enter__(self) -> GreedyUnder:
        return self

    def __exit__(self, *exc) -> None:
        if self.constraint is not None:
            self.constraint.close()


@dataclass
class Agreement:
    agreement: float             # share of decode steps whose token equals the full model's argmax (1.0 without steps)
    candidate_mass: float | None  # at head-free steps: the full model's probability mass on the step's candidates
    head_free_steps: int
    interval: tuple[float, float]  # 95%, bootstrapped over the prompts


def agreement(ctx: Context, prompts: Sequence[Sequence[int]], records: Sequence[Sequence[TokenRecord]],
              advance: Callable[[float], None] = lambda n: None,
              constrain: Callable[[], GrammarConstraint] | None = None) -> Agreement:
    """records: a lane's, one list per prompt (the first from the prompt pass). A head-free step chose among
    its candidates only: what the full model would have given the rest is what sampling there leaves out."""
    matches, steps = [], []  # per prompt
    masses = []
    for prompt, answer in zip(prompts, records):
        output = [r.id for r in answer]
        if len(output) < 2:
            continue
        matches.append(0)
        steps.append(len(output) - 1)
        with GreedyUnder(constrain) as greedy:
            greedy.took(output[0])
            for record, token, logits in zip(answer[1:], output[1:], full_model_logits(ctx, prompt, output)):
                matches[-1] += greedy.pick(logits) == token
                greedy.took(token)
                if record.exit_kind == ExitKind.HEAD_FREE:
                    masses.append(float(softmax(logits.astype(np.float64))[list(record.candidates)].sum()))
        advance(len(output) - 1)
    if not steps:
        return Agreement(1.0, None, 0, (1.0, 1.0))
    return Agreement(sum(matches) / sum(steps), float(np.mean(masses)) if masses else None, len(masses),
                     ratio_interval(np.array(matches), np.array(steps)))


# Batched graphs use other matrix kernels than single-token ones, so exact mode's verification can flip an
# argmax where the full model's top two logits nearly tie; a divergence from vanilla greedy with a wider
# gap than this would be a wrong answer, not arithmetic.
NEAR_TIE = 0.25


def divergence_margins(ctx: Context, prompts: Sequence[Sequence[int]], references: Sequence[Sequence[int]],
                       outputs: Sequence[Sequence[int]],
                       constrain: Callable[[], GrammarConstraint] | None = None) -> list[float]:
    """For each answer that departs from its reference (vanilla greedy), the full model's top-1 minus top-2 logit
    (of the tokens the grammar allows there) at the first position where they differ, decoding the shared prefix
    one token at a time as vanilla did."""
    margins = []
    for prompt, reference, output in zip(prompts, references, outputs):
        d = common_prefix(reference, output)
        if d == min(len(reference), len(output)):
            continue  # equal, or one ends where the other goes on (an EOS near-tie is counted by identical)
        ctx.clear()
        ctx.decode(list(prompt))
        with GreedyUnder(constrain) as greedy:
            for token in reference[:d]:
                ctx.decode([token])
                greedy.took(token)
            allowed = greedy.allowed(ctx.logits()).astype(np.float64)
        top2 = np.sort(allowed[np.isfinite(allowed)])[-2:]  # both answers' tokens are allowed there: two at least
        margins.append(float(top2[1] - top2[0]))
    return margins


def batched_replay(ctx: Context, prompt: Sequence[int], records: Sequence[TokenRecord],
                   constrain: Callable[[], GrammarConstraint] | None = None) -> list[int]:
    """llama.cpp's greedy tokens along an exact-mode answer (records, the first from the prompt), evaluated as its
    rounds evaluated them, on `ctx` (a plain context: early exit off): each token decoded alone where the answer
    decoded it alone, each verification batch as one batch of the same rows, its rejected rows dropped after.
    Batches and single steps run other kernels, so these can differ from decoding every token alone (near-ties
    flip); greedy exact mode must give exactly these, whatever its drafts, probes and rollbacks did."""
    ctx.clear()
    ctx.decode(list(prompt))
    with GreedyUnder(constrain) as greedy:
        tokens = [greedy.pick(ctx.logits())]
        greedy.took(records[0].id)
        i = 1
        while i < len(records):
            round_ = records[i].round
            if round_ is None or not round_.rows:  # one token decoded alone (a plain step, or an exit round's first)
                ctx.decode([records[i - 1].id])
                tokens.append(greedy.pick(ctx.logits()))
                greedy.took(records[i].id)
                i += 1
                continue
            emitted = next((j for j in range(i, len(records)) if records[j].round is not round_), len(records)) - i
            start = ctx.n_past
            ctx.decode(list(round_.rows), output_all=True)
            for row in range(emitted):
                tokens.append(greedy.pick(ctx.logits(row)))
                greedy.took(records[i + row].id)
            ctx.truncate(start + emitted)
            i += emitted
    return tokens


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def exact_prefix(reference: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> float:
    """Mean number of generated tokens before the first divergence from `reference` (vanilla greedy)."""
    return float(np.mean([common_prefix(r, o) for r, o in zip(reference, outputs)]))


def log_softmax_at(logits: np.ndarray, token: int) -> float:
    return float(log_softmax(logits.astype(np.float64))[token])


@dataclass
class Perplexity:
    value: float  # the exit layers' full distributions, divided by their layer's calibrated temperature
    raw: float    # the same without the temperatures


def perplexity(engine: Engine, tokens: Sequence[int], *, early_exit: bool,
               advance: Callable[[float], None] = lambda n: None) -> Perplexity:
    """Teacher forcing through the engine one token at a time, exits on or off: exp(mean NLL of tokens[1:]),
    with and without the pack's temperatures (one pass: the tokens' exits are the same). A head-free exit's
    step holds only its candidates' logits: its layer's full ones are computed for this (Engine.full_logits)."""
    previous = engine.speculative
    engine.set_early_exit(early_exit)
    engine.reset()
    try:
        for _ in engine.stream(tokens[:1], max_tokens=1, sampling=GREEDY):  # the first token, as a prompt
            pass
        nll = raw_nll = 0.0
        for i, token in enumerate(tokens[1:], 1):
            full = engine.full_logits()
            nll -= log_softmax_at(full, token)
            raw_nll -= log_softmax_at(full * np.float32(engine.temperature()), token)
            if i < len(tokens) - 1:
                engine.step(token)  # the token's step, exits as the policy decides
            advance(1)
    finally:
        engine.set_early_exit(previous)
        engine.reset()
    n = max(len(tokens) - 1, 1)
    return Perplexity(float(np.exp(nll / n)), float(np.exp(raw_nll / n)))


REPEAT_NGRAM = 4   # a token inside a 4-gram the answer already said is a repeated one
LOOP_SHARE = 0.5   # an answer at least half repeated loops


def repetition(tokens: Sequence[int], n: int = REPEAT_NGRAM) -> float:
    """The share of an answer's tokens inside an n-gram that already appeared earlier in it: how much of it a
    prompt lookup over the answer could predict (a base model's greedy loops approach 1)."""
    seen: set[tuple[int, ...]] = set()
    repeated = np.zeros(len(tokens), dtype=bool)
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i : i + n])
        if gram in seen:
            repeated[i : i + n] = True
        seen.add(gram)
    return float(repeated.mean()) if len(tokens) else 0.0

