"""The oracle bounds: every token exits, for free, as early as it could.

Two oracles, along vanilla's outputs (teacher forced, every layer's output captured):
  verified   at the earliest layer whose top-1 (final norm + the full LM head: the logit lens) equals the
             final top-1; an exit still pays one head, as a verified exit does;
  head-free  at the earliest layer (the last one included) where the argmax of the step's candidates
             (the pack's draft head and prompt lookup, as the engine merges them) equals the final top-1,
             with no head at all; a step whose final top-1 is not a candidate runs every layer and the head.
Both are priced by the token costs the run measures (runtime/costs.py), with no draft, check or fill.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from threadpoolctl import threadpool_limits

from specee_edge.draft import LinearDraft
from specee_edge.draft.lookup import lookup_proposals
from specee_edge.runtime import Context, Model
from specee_edge.runtime.costs import TokenCosts
from specee_edge.runtime.weights import TargetWeights, lens_top1, rms_scaled_f16


@dataclass
class OracleDepths:
    verified: np.ndarray   # per vanilla step: the earliest layer whose top-1 equals the final top-1
    head_free: np.ndarray  # ... whose candidates' argmax does (n_layer: none, the step runs every layer and the head)


@dataclass
class Oracle:
    depths: OracleDepths
    costs: TokenCosts
    n_layer: int

    @property
    def speedup(self) -> float:
        """The verified oracle: plain decoding's time over the oracle's."""
        if not len(self.depths.verified):
            return 1.0
        return float(self.costs.plain_ms / np.mean(self.costs.verified_ms(self.depths.verified + 1)))

    @property
    def head_free_speedup(self) -> float:
        if not len(self.depths.head_free):
            return 1.0
        exits = self.depths.head_free < self.n_layer
        ms = np.where(exits, self.costs.head_free_ms(np.minimum(self.depths.head_free + 1, self.n_layer)), self.costs.plain_ms)
        return float(self.costs.plain_ms / np.mean(ms))

    @property
    def avg_exit_layer(self) -> float:
        return float(np.mean(self.depths.verified)) if len(self.depths.verified) else float(self.n_layer - 1)

    @property
    def head_free_avg_exit_layer(self) -> float:
        d = np.minimum(self.depths.head_free, self.n_layer - 1)
        return float(np.mean(d)) if len(d) else float(self.n_layer - 1)

    @property
    def histogram(self) -> list[int]:
        return np.bincount(self.depths.verified, minlength=self.n_layer).tolist()


def oracle_depths(model: Model, weights: TargetWeights, draft: LinearDraft, lookup_max_n: int,
                  prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], *, n_ctx: int, n_threads: int,
                  advance: Callable[[float], None] = lambda n: None) -> OracleDepths:
    """Each decode step's oracle exit layers along `outputs` (steps in order, prompts concatenated).

    `advance` counts steps: half for the capture, half for the lens.
    """
    n_layer = model.info.n_layer
    ctx = Context(model, n_ctx=n_ctx, n_batch=n_ctx, n_threads=n_threads)  # one ubatch: captures hold every row
    ctx.enable_early_exit(1)
    ctx.set_capture_layers(list(range(n_layer)))
    hidden, previous, tokens, lookup = [], [], [], []
    for prompt, output in zip(prompts, outputs):
        if len(output) < 2:
            continue
        ctx.clear()
        sequence = [*prompt, *output[:-1]]
        ctx.decode(sequence, output_all=True)
        # rows from len(prompt) on feed output[j] and predict output[j + 1]: the decode steps
        captured = np.stack([ctx.captured(il) for il in range(n_layer)], axis=1)
        hidden.append(rms_scaled_f16(captured[len(prompt):]))
        previous.append(captured[len(prompt) - 1 : -1, -1])  # the draft's input: h_{s-1} at the last layer
        tokens.extend(output[:-1])
        lookup.extend(lookup_proposals(sequence, len(prompt), len(sequence), lookup_max_n))
        advance((len(output) - 1) / 2)
    ctx.close()
    if not hidden:
        return OracleDepths(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    hidden = np.concatenate(hidden)
    with threadpool_limits(limits=n_threads, user_api="blas"):  # no llama.cpp threads to fight here
        top1 = lens_top1(hidden, weights, lambda rows: advance(rows / n_layer / 2))
        scores = draft.scores(weights.embeddings(np.array(tokens)), np.concatenate(previous))
        candidates = draft.merged_top_k(scores, np.array([-1 if c is None else c for c in lookup]))
        rows = weights.lm_head[candidates]  # [N, k, n_embd]
        cand_logits = np.stack([np.einsum("nd,nkd->nk", weights.final_norm(hidden[:, il].astype(np.float32)), rows)
                                for il in range(n_layer)], axis=1)
    final = top1[:, -1:]
    head_free = np.take_along_axis(candidates, np.argmax(cand_logits, axis=2), axis=1) == final
    return OracleDepths(np.argmax(top1 == final, axis=1),
                        np.where(head_free.any(axis=1), np.argmax(head_free, axis=1), n_layer))
