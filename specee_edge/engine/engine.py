"""The SpecEE decoding engine: one loaded model, an optional pack, and the per-token loop.

    stream()  yields a TokenRecord per generated token      (mlx-lm's stream_generate)
    generate() returns the text and the stats                (mlx-lm's generate)
    chat()     formats messages with the GGUF's chat template, then generate()

The KV cache is kept between calls: a new prompt that extends the tokens already in the cache (the
next turn of a chat) only decodes what is new.

Exact mode (a pack's exact level, and any model without a pack) emits only the full model's own tokens: each
round is a plain step, or drafts (from prompt lookup, or from a pack's early exits) that the full model checks
in one batch, whichever the controller (controller.py) measured cheapest on this machine.
"""

from __future__ import annotations

import codecs
import dataclasses
import os
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from llama_cpp.llama_chat_format import Jinja2ChatFormatter
from threadpoolctl import threadpool_limits

from specee_edge.chat_templates import NAMED_TEMPLATES, named_template
from specee_edge.default_model import default_model_path
from specee_edge.draft.lookup import DRAFT_MATCH_N, LOOKUP_MAX_N, PromptLookup, lookup_drafts
from specee_edge.engine.constraint import GrammarConstraint
from specee_edge.engine.controller import STREAK_PLAN, Choice, Controller, ExitPrior, Outcome, Plan, PlainStreak
from specee_edge.engine.exit import ExitPolicy, find_pack
from specee_edge.engine.guard import NO_GUARD, ExitGuard, candidate_margin, continues_word
from specee_edge.engine.records import GenerationStats, Round, TokenRecord, TokenSource
from specee_edge.engine.sampling import Sampler, SamplingParams, masks_every_token
from specee_edge.engine.stops import StopMatcher
from specee_edge.errors import ContextFullError, DecodeCancelled, SpecEEError, UnsupportedModelError
from specee_edge.exits import ExitKind
from specee_edge.grammar import Grammar
from specee_edge.pack.format import MAX_DRAFT, ROUND_MAX_DRAFTS
from specee_edge.registry import entry_for_file
from specee_edge.runtime import Context, Model
from specee_edge.runtime.context import StepInfo
from specee_edge.runtime.placement import Placement, first_crossing
from specee_edge.threads import default_threads

# By measurement (docs/bench.md): fill agrees with the full model like `full` and costs about
# what `mask` costs; models whose K/V cannot be rebuilt (fused or scaled projections) get mask.
DEFAULT_KV_MODE = "fill"
FALLBACK_KV_MODE = "mask"

AUTO = "auto"  # pack=AUTO: MODEL.specee.gguf beside the model, else a shipped pack in models/
SPECULATION = ("auto", "always")


@dataclass
class EngineConfig:
    n_ctx: int = 4096
    n_batch: int = 512
    n_threads: int = field(default_factory=default_threads)
    flash_attn: str = "auto"  # llama.cpp's --flash-attn: on, off, or auto (on wherever the device runs it)
    placement: Placement | None = None  # where the layers run (-ngl, -ts, --offload-first); None: the process's
    kv_mode: str | None = None  # None: DEFAULT_KV_MODE where the model allows it, else FALLBACK_KV_MODE
    quality: float | None = None    # the pack's quality level (agreement with the full model); None: its default
    threshold: float | None = None  # one threshold for every layer instead of the level's; above 1 never exits
    early_exit: bool = True  # False: plain decoding, no exits and no drafts (SpecEE off)
    draft_max: int = ROUND_MAX_DRAFTS  # exact mode: the most drafts one round checks (llama.cpp's --draft-max)
    speculation: str = "auto"  # exact mode: "auto", each round as the controller measures cheapest here; "always",
    #                            draft at every chance, as llama.cpp's speculative decoding does
    native: bool = True  # False: the Python exit policy, called per probe (research; slower)
    guard: ExitGuard = NO_GUARD  # a lossy level's exits withheld where a wrong token is likely to cost the answer
    profile: bool = False  # time the in-graph draft (one extra scheduler split per token)


@dataclass
class Generation:
    text: str
    tokens: list[int]
    stats: GenerationStats


def with_costs_of(record: TokenRecord, steps: Sequence[TokenRecord]) -> TokenRecord:
    """`record` with the cost of drafting steps whose tokens were never emitted added to its own."""
    return dataclasses.replace(record, **{name: getattr(record, name) + sum(getattr(step, name) for step in steps)
                                          for name in ("forward_ms", "draft_ms", "predictor_ms", "verify_ms", "probes",
                                                       "verify_failures")})


def row_record(step: TokenRecord | None) -> TokenRecord:
    """A verification row's record before its token is drawn: the full model's (no exit), with the cost of the
    drafting step that proposed the row's draft, if any."""
    return TokenRecord() if step is None else dataclasses.replace(step, exit_layer=None, exit_kind=ExitKind.NONE)


def row_source(drafts: Sequence[int], row: int, token: int) -> TokenSource:
    """What the token drawn at `row` of a verification batch of [last token, *drafts] is: the draft it checks,
    accepted; or in its place, a correction; or after every draft, the bonus."""
    if row < len(drafts) and token == drafts[row]:
        return TokenSource.ACCEPTED
    return TokenSource.BONUS if row == len(drafts) else TokenSource.CORRECTION


def ends_round(source: TokenSource, token: int, is_eog: Callable[[int], bool]) -> bool:
    """Whether a verification emits nothing after this row's token: a correction or the bonus ends it, and so does
    an accepted end of generation (nothing is decoded past one)."""
    return source != TokenSource.ACCEPTED or is_eog(token)


def draft_confidence(logits: np.ndarray, candidates: Sequence[int]) -> float:
    """The softmax share of the best candidate among the step's candidates (1 without candidates): how sure the
    exit is of its draft, at the cost of k logits (a head-free exit has no others)."""
    if not candidates:
        return 1.0
    z = logits[list(candidates)].astype(np.float64)
    z = np.exp(z - z.max())
    return float(1.0 / z.sum())


class Engine:
    def __init__(self, model: str | os.PathLike | Model | None = None, pack: str | os.PathLike | None = AUTO,
                 config: EngineConfig | None = None):
        """model: a GGUF's path (None: the default model), loaded for this engine alone; or a loaded Model that
        several engines share (the bench's lanes: one copy of the offloaded weights on the device, not one per
        engine), which stays open when the engine closes, its placement the one it was loaded with."""
        self.config = config or EngineConfig()
        self._owns_model = not isinstance(model, Model)
        if isinstance(model, Model):
            self.model = model
        else:
            self.model = Model(Path(model) if model is not None else default_model_path(),
                               placement=self.config.placement)
        model_path = self.model.info.path
        self.n_layer = self.model.info.n_layer
        # the end-of-generation tokens, at which exact mode's lookup drafts are cut: found now (a scan of the
        # vocabulary), not on the first round of the first reply
        self._eog = self.model.eog_ids
        self.pack_path = find_pack(model_path) if pack == AUTO else (Path(pack) if pack is not None else None)
        self.policy = (ExitPolicy.load(self.pack_path, model_path, quality=self.config.quality,
                                       threshold=self.config.threshold, native=self.config.native,
                                       eog_tokens=sorted(self._eog))
                       if self.pack_path else None)
        self.ctx = Context(self.model, n_ctx=self.config.n_ctx, n_batch=self.config.n_batch,
                           n_threads=self.config.n_threads, flash_attn=self.config.flash_attn)
        self.kv_mode: str | None = None
        if self.policy:
            self.kv_mode = self._enable_early_exit(self.config.kv_mode)
            self.policy.attach(self.ctx)
            self.ctx.set_timing(self.config.profile)
        self.speculative = self.config.early_exit  # exits and drafts on (a lossy level's exits, exact mode's drafts)
        if self.policy:
            self.policy.set_active(self.early_exit)
        # the tokens whose K/V are in the cache, in order, indexed for prompt lookup: exact mode's drafts match up to
        # DRAFT_MATCH_N tokens, the graph's lookup candidate as the pack was trained (0: none)
        self._history = PromptLookup(DRAFT_MATCH_N)
        self._candidate_n = self.policy.pack.lookup_max_n if self.policy else LOOKUP_MAX_N
        if self.config.speculation not in SPECULATION:
            raise SpecEEError(f"unknown speculation {self.config.speculation!r}: choose {' or '.join(SPECULATION)}")
        if not 1 <= self.config.draft_max <= MAX_DRAFT:
            raise SpecEEError(f"draft_max must be in 1..{MAX_DRAFT}, got {self.config.draft_max}")
        # a split model's drafting steps cost one thing where they exit before the split and another past it: the
        # controller prices each side apart, from llama.cpp's own layer map
        self.controller = Controller(self._exit_prior(), always_draft=self.config.speculation == "always",
                                     split_layer=first_crossing(self.model.layer_devices()))
        # the first cache position whose K/V an early exit left approximate (filled or masked layers), if any:
        # set by _note_exit, forgotten by _truncate
        self._approximate_from: int | None = None
        self._last_step: StepInfo | None = None  # what the last decode did (None: no early exit in it)
        self.stats = GenerationStats(self.n_layer, self.early_exit)
        # what the registry says of a model its GGUF does not: a template where it has none, base models
        entry = entry_for_file(model_path)
        registry_template = named_template(entry.chat_template) if entry and entry.chat_template else None
        self.chat_template = self.model.meta("tokenizer.chat_template") or registry_template
        self.prompting = entry.prompting if entry else "chat"

    def _enable_early_exit(self, kv_mode: str | None) -> str:
        if kv_mode is None:
            try:
                self.ctx.enable_early_exit(self.policy.k, DEFAULT_KV_MODE)
                return DEFAULT_KV_MODE
            except UnsupportedModelError:
                kv_mode = FALLBACK_KV_MODE
        self.ctx.enable_early_exit(self.policy.k, kv_mode)
        return kv_mode

    def _exit_prior(self) -> ExitPrior:
        """What the pack's exact level measured at calibration: the controller's first guess for exit drafts."""
        level = self.policy.level if self.policy else None
        if level is None or not level.exact or not level.acceptance:
            return ExitPrior()
        return ExitPrior(acceptance=level.acceptance, exit_share=max(level.exit_rate, 0.05))

    def placement_note(self) -> str | None:
        """One line where the pack's costs were measured with the layers placed otherwise than here: its levels were
        chosen, and its speed figures predicted, from costs that a split changes (None: the same placement, no pack,
        or a pack that did not record one)."""
        costs = self.policy.pack.provenance.get("costs_ms") if self.policy else None
        measured = costs.get("placement") if isinstance(costs, dict) else None
        here = self.model.placement_text()
        if not measured or measured == here:
            return None
        return (f"the pack was priced with {measured}, not {here}: its levels' speed figures may not hold"
                " (specee-edge calibrate with this placement prices them here)")

    @property
    def early_exit(self) -> bool:
        """A pack's exits are in use (as the answer at a lossy level, as drafts in exact mode)."""
        return self.speculative and self.policy is not None

    @property
    def exact(self) -> bool:
        """Exact mode: only the full model's own tokens are emitted, drafts are checked in batches (a pack's exact
        level; without a pack, drafts come from prompt lookup alone)."""
        return self.speculative and (self.policy is None or self.policy.max_draft > 0)

    @property
    def lookup_max_n(self) -> int:
        """The longest context suffix exact mode's lookup drafts match."""
        return self._history.max_n

    @property
    def cached_tokens(self) -> list[int]:
        """The tokens whose K/V the cache holds, in order (a copy)."""
        return list(self._history.tokens)

    # --- one token -------------------------------------------------------------------------

    def step(self, token: int, exits: bool = True) -> TokenRecord:
        """Decode one token: its record (id and text filled in by the caller that samples the next one);
        the logits for the next token are then in logits(). The path of one token, top to bottom.
        exits=False: this token runs every layer (its graph is the stock one)."""
        t0 = time.perf_counter()
        self._last_step = None
        self._history.extend([token])      # before the decode: an interrupted one is undone by _sync_cache
        if not self.early_exit or self.policy.idle or not exits:
            if self.early_exit and not exits:
                self.policy.begin_full_token()
            self.ctx.decode([token])
            return TokenRecord(forward_ms=(time.perf_counter() - t0) * 1e3)
        lookup = self._history.propose(self._candidate_n) if self._candidate_n else None
        self.policy.begin_token(lookup)    # the layers the schedule checks; the lookup candidate goes first
        self.ctx.decode([token])           # draft -> layers -> probe -> predictor -> verify -> KV, in llama_decode
        t1 = time.perf_counter()
        step = self._last_step = self.policy.end_token()  # exit, candidates; the online schedule learns it
        self._note_exit(step.exit_layer)
        return TokenRecord(exit_layer=step.exit_layer, probes=step.probes, verify_failures=step.verify_failures,
                           exit_kind=step.exit_kind, candidates=step.candidates,
                           source=TokenSource.FULL if step.exit_layer is None else TokenSource.EXIT,
                           draft_ms=step.draft_ms, forward_ms=(t1 - t0) * 1e3,
                           predictor_ms=step.predictor_ms, verify_ms=step.verify_ms)

    def _prefill(self, tokens: list[int], cancel: Callable[[], bool] | None = None) -> int:
        """Make the cache hold `tokens`, decoding only what it lacks; logits for the last one. Returns how
        many of them the cache already held. `cancel` is asked between batches of n_batch tokens.

        Cached cells are reused only up to the first that an early exit left approximate: from there on the
        prompt is decoded again, through every layer, as a fresh request would be. (Reuse still differs from
        a fresh prefill in the last bits: a batch and single-token steps run different kernels.)
        What is decoded is a batch of at least two tokens (one cached token more when only one is new,
        as after /regen): batches never exit early, whereas a single token is a step like any other.
        """
        n_common = 0
        cached = self._history.tokens
        for a, b in zip(cached, tokens):
            if a != b:
                break
            n_common += 1
        if self._approximate_from is not None:
            n_common = min(n_common, self._approximate_from)
        n_common = min(n_common, max(len(tokens) - 2, 0))
        self._truncate(n_common)
        batch = tokens[n_common:]
        if self.early_exit:
            # with probe layers set, the batch's graph leaves its last hidden state where the first
            # draft reads it; a one-token prompt is decoded without them (its first draft reads zeros)
            self.policy.begin_prompt(probes=len(batch) > 1)
        self._history.extend(batch)
        self.ctx.decode(batch, cancel=cancel)
        self._last_step = None
        return n_common

    def _note_exit(self, exit_layer: int | None) -> None:
        """The token just decoded left its cell short of the last layer (full mode runs the skipped layers later):
        from there on the cache is approximate."""
        if (exit_layer is not None and exit_layer < self.n_layer - 1 and self.kv_mode != "full"
                and self._approximate_from is None):
            self._approximate_from = len(self._history) - 1

    def _truncate(self, n_keep: int) -> None:
        """Forget every position from `n_keep` on, in the cache and in the history."""
        if n_keep < self.ctx.n_past:
            self.ctx.truncate(n_keep)
        self._history.truncate(n_keep)
        if self._approximate_from is not None and self._approximate_from >= n_keep:
            self._approximate_from = None

    def temperature(self) -> float:
        """What the last step's logits are divided by: its exit layer's calibrated temperature (1 without an exit)."""
        step = self._last_step
        return self.policy.temperature(step.exit_layer) if step is not None and step.exit_layer is not None else 1.0

    def logits(self) -> np.ndarray:
        """The last token's next-token logits; an early exit's are divided by its layer's calibrated
        temperature, so that their softmax matches the full model's (greedy decoding is unaffected).
        After a head-free exit only the k candidates' logits are finite: sampling draws among them."""
        temperature = self.temperature()
        logits = self.ctx.logits()
        return logits if temperature == 1.0 else logits / np.float32(temperature)

    def _draw(self, draw: Sampler) -> int:
        """The next token from the last step's logits: read in place by llama.cpp's sampler, unless an exit's
        temperature rescales them, or the request's bias or grammar leaves none of a head-free exit's candidates
        (then from the exit layer's full head)."""
        if draw.params.logit_bias and masks_every_token(self.ctx.logits(), draw.params):  # no view without a bias
            return draw(self.full_logits())
        if draw.constraint is not None and self._head_free() and not draw.allows_any(self.ctx.logits()):
            return draw(self.full_logits())
        if self.temperature() != 1.0:
            return draw(self.logits())
        return draw.from_context(self.ctx.handle)

    def _head_free(self) -> bool:
        """The last step exited head-free: only its candidates' logits are finite."""
        return self._last_step is not None and self._last_step.exit_kind == ExitKind.HEAD_FREE

    def full_logits(self) -> np.ndarray:
        """logits(), except after a head-free exit: the exit layer's full-vocabulary logits, computed now
        (the step skipped them; what perplexity needs, not what decoding pays), divided alike."""
        if not self._head_free():
            return self.logits()
        return self.ctx.exit_head_logits() / np.float32(self.temperature())

    # --- generation ------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        """`text`'s tokens, with the BOS the model asks for. A chat template that writes the BOS itself (Gemma's,
        Llama 3's) would get a second one: it is dropped, so a prompt never starts with two."""
        tokens = self.model.tokenize(text, add_special=True, parse_special=True)
        bos = self.model.bos
        if len(tokens) >= 2 and tokens[0] == tokens[1] == bos and self.model.adds_bos:
            del tokens[0]
        return tokens

    def check_prompt(self, tokens: Sequence[int]) -> None:
        """stream()'s checks of a prompt's tokens, which a caller may make before it touches the cache."""
        if not tokens:
            raise SpecEEError("the prompt is empty")
        if len(tokens) >= self.ctx.n_ctx:
            raise ContextFullError(
                f"the prompt ({len(tokens)} tokens) does not fit the context of {self.ctx.n_ctx}"
                " (use a larger -c/--ctx-size or a shorter prompt)"
            )

    def stream(self, prompt: str | Sequence[int], *, max_tokens: int = 256, sampling: SamplingParams | None = None,
               stop: Sequence[str] = (), logprobs: int | None = None, grammar: Grammar | None = None,
               cancel: Callable[[], bool] | None = None) -> Iterator[TokenRecord]:
        """Generate up to max_tokens after `prompt`, one record per token; self.stats follows along.

        logprobs: each record gets its token's log-probability and the `logprobs` most likely tokens'.
        grammar: every emitted token is one the grammar allows (drafts that it refuses are not checked; a lossy
        level's exit whose candidates it refuses all draws from the exit layer's full head).
        cancel: asked between the prompt's batches; when it answers True the stream ends with no token.
        Closing the generator early (or Ctrl+C) leaves the engine consistent and usable. numpy's BLAS
        runs single-threaded meanwhile: its spinning worker threads would fight llama.cpp's OpenMP
        threads for the cores (measured: up to 100x slower tokens on 2 cores).
        """
        sampling = sampling or SamplingParams()
        tokens = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_prompt(tokens)
        if max_tokens < 1:
            raise SpecEEError(f"max_tokens must be at least 1, got {max_tokens}")
        constraint = GrammarConstraint(self.model, grammar) if grammar is not None else None
        draw = Sampler(sampling, self.model.info.n_vocab, tokens, logprobs, constraint)
        self.controller.begin_request()
        try:
            with threadpool_limits(limits=1, user_api="blas"):
                yield from self._stream(tokens, max_tokens, draw, stop, cancel)
        finally:
            self.stats.masked_draws = draw.masked_draws
            draw.close()

    def _stream(self, tokens: list[int], max_tokens: int, draw: Sampler, stop: Sequence[str],
                cancel: Callable[[], bool] | None) -> Iterator[TokenRecord]:
        stats = self.stats = GenerationStats(self.n_layer, self.early_exit, n_prompt=len(tokens), exact=self.exact)
        stops = StopMatcher(stop)
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        history = list(tokens)  # the prompt and the reply so far
        source: Iterator[TokenRecord] | None = None
        n_emitted = 0
        try:
            t0 = time.perf_counter()
            try:
                stats.n_cached = self._prefill(tokens, cancel)
            except DecodeCancelled:
                stats.finish_reason = "interrupted"
                return
            source = self._exact_records(draw, max_tokens) if self.exact else self._plain_records(draw)
            for n in range(max_tokens):
                record = next(source)
                token = record.id
                n_emitted += 1
                if n == 0:
                    stats.prompt_s = time.perf_counter() - t0
                else:
                    stats.add(record)
                    stats.decode_s += time.perf_counter() - t0
                if self.model.is_eog(token):
                    stats.finish_reason = "stop"
                    record.text = stops.flush()
                    yield record
                    return
                history.append(token)
                record.text, stopped = stops.feed(utf8.decode(self.model.token_to_piece(token)))
                if stopped:
                    stats.finish_reason = "stop"
                    yield record
                    return
                if n == max_tokens - 1:
                    break
                if len(history) > self.ctx.n_ctx:  # the cache is full: the token just emitted has no cell to go into
                    stats.finish_reason = "context"
                    record.text += stops.flush()
                    yield record
                    return
                yield record
                t0 = time.perf_counter()
            stats.finish_reason = "length"
            record.text += stops.flush()
            yield record
        except (KeyboardInterrupt, GeneratorExit):
            stats.finish_reason = "interrupted"
            raise
        finally:
            if source is not None:
                source.close()
            if self.exact:
                stats.controller = self.controller.snapshot()
            # the cache keeps the prompt and every emitted token but the last, which was never fed; a round
            # of exact mode may have decoded further, an interrupted decode less
            self._sync_cache(len(tokens) + max(n_emitted - 1, 0))

    def _sync_cache(self, limit: int) -> None:
        """Keep at most `limit` tokens in the cache, and after an interruption only what both the cache and
        the history hold (they may disagree by the decode that was cut short)."""
        self._truncate(min(self.ctx.n_past, len(self._history), limit))

    def _sample(self, record: TokenRecord, draw: Sampler, row: int | None = None) -> TokenRecord:
        """Draw the next token into `record`: from the last step's logits, or from `row` of a verification batch;
        with its log-probabilities when the request asks for them (the model's distribution, never the candidates'
        alone). The one place a token is drawn."""
        t0 = time.perf_counter()
        record.id = self._draw(draw) if row is None else draw.from_context(self.ctx.handle, row)
        record.sample_ms += (time.perf_counter() - t0) * 1e3
        if draw.n_logprobs is not None:
            record.logprobs = draw.logprobs(self.full_logits() if row is None else self.ctx.logits(row), record.id)
        return record

    def _plain_records(self, draw: Sampler) -> Iterator[TokenRecord]:
        """One token a step: drawn from the last step's logits, then decoded (a lossy level's exits are the answer)."""
        record = TokenRecord()  # the first token comes from the prompt's logits
        while True:
            token = self._sample(record, draw).id
            if record.candidates:  # the step had candidates (a graph without them reports none)
                record.draft_hit = token in record.candidates
                lookup = self.policy.lookup  # None, or not used when the step's graph had no draft
                record.lookup_hit = token == lookup if lookup in record.candidates else None
            yield record
            record = self._guarded_step(token) if self.guard.on and self.early_exit else self.step(token)

    def _guarded_step(self, token: int) -> TokenRecord:
        """step(token) under the exit guard (guard.py): exits held for a token that may continue a word; an exit
        whose candidates nearly tie undone, and the token decoded again with exits held."""
        self.policy.hold(self.guard.words and continues_word(self.model.token_to_piece(token)))
        record = self.step(token)
        if (record.exit_layer is None or not self.guard.margin
                or candidate_margin(self.ctx.logits(), record.candidates) >= self.guard.margin):
            return record
        self._truncate(len(self._history) - 1)
        self.policy.hold(True)
        return with_costs_of(self.step(token), [record])

    # --- exact mode ------------------------------------------------------------------------

    def _exact_records(self, draw: Sampler, max_tokens: int) -> Iterator[TokenRecord]:
        """Exact mode: round after round as the controller plans them, where it cannot tell in advance that the coming
        rounds are plain steps (a plain streak); every emitted token is the full model's own."""
        record = self._sample(TokenRecord(), draw)  # from the prompt's logits, the full model's
        yield record
        token, n_emitted = record.id, 1
        greedy = draw.params.greedy
        while True:
            streak = self.controller.plain_streak(self.config.draft_max, self._exit_drafts(), greedy)
            if streak is not None:
                emitted = yield from self._plain_streak(token, draw, max_tokens - n_emitted, streak)
                if emitted:
                    token, n_emitted = emitted[-1], n_emitted + len(emitted)
            for record in self._round(token, draw, max_tokens - n_emitted):  # a streak ends where a round needs a plan
                n_emitted += 1
                yield record
            token = record.id

    def _round(self, token: int, draw: Sampler, budget: int) -> list[TokenRecord]:
        """One round after `token`, the last emitted token (not in the cache yet): a plain step, or drafts checked
        in one batch, whichever the controller prices lowest per emitted token. Returns the records of the tokens
        it emits (at least one; at most `budget` unless the budget is spent), which share their Round."""
        p = self.ctx.n_past
        greedy = draw.params.greedy
        limit = self._round_limit(p, budget)
        lookup = lookup_drafts(self._history, token, limit, self._eog)
        bucket = lookup.bucket
        plan = self.controller.plan(lookup_drafts=len(lookup.tokens), lookup_match=bucket,
                                    exit_drafts=self._exit_drafts(), limit=limit, greedy=greedy)
        if plan.choice == Choice.PLAIN:
            records = [self._plain_round(token, draw, plan, greedy)]
        else:
            records = self._drafting_round(plan, p, token, lookup.tokens, draw)
        self.controller.watch_lookup(plan, lookup.tokens, [r.id for r in records], greedy, bucket)
        return records

    def _plain_streak(self, token: int, draw: Sampler, budget: int,
                      streak: PlainStreak) -> Generator[TokenRecord, None, list[int]]:
        """Rounds that cannot draft profitably (Controller.plain_streak), after `token`, with `budget` tokens left to
        emit: each is lookup's offer, checked against the streak (PlainStreak.keeps), then a plain step and its draw,
        and the offer's shadow round; the plan that would have been made, and the step's time, are told to the
        controller when the streak ends (or the reply does), in order. A round whose offer might pay ends the streak
        undecoded: the round after a streak is planned. Returns the emitted tokens."""
        p = self.ctx.n_past
        greedy = draw.params.greedy
        emitted: list[int] = []
        step_ms: list[float] = []
        offered: list[int | None] = []  # the lookup drafts each round was offered (None: it could check none)
        round_ = Round(Choice.PLAIN, emitted=1)
        try:
            while len(step_ms) < streak.rounds:
                i = len(step_ms)
                limit = self._round_limit(p + i, budget - i)
                lookup = lookup_drafts(self._history, token, limit, self._eog)
                drafts = len(lookup.tokens)
                if drafts and not streak.keeps(drafts, self.controller.acceptance(Choice.LOOKUP, greedy, lookup.bucket)):
                    break  # an offer that might pay: its round is planned
                t0 = time.perf_counter()
                record = self._sample(self.step(token, exits=False), draw)
                step_ms.append((time.perf_counter() - t0) * 1e3)
                offered.append(drafts if limit >= 1 else None)
                token = record.id
                emitted.append(token)
                self.controller.watch_lookup(STREAK_PLAN, lookup.tokens, [token], greedy, lookup.bucket)
                record.round = round_
                yield record
                if step_ms[-1] > streak.ceiling_ms:
                    break
        finally:
            self.controller.end_streak(step_ms, offered, self._exit_drafts() > 0, greedy)
        return emitted

    def _plain_round(self, token: int, draw: Sampler, plan: Plan, greedy: bool) -> TokenRecord:
        """A plain step: `token` through every layer, the next token drawn, and its time told to the controller
        (most rounds are these: no Outcome is built for them)."""
        t0 = time.perf_counter()
        record = self._sample(self.step(token, exits=False), draw)
        ms = (time.perf_counter() - t0) * 1e3
        record.round = Round(Choice.PLAIN, emitted=1, explored=plan.explore)
        record.round.explore_ms = self.controller.observe_plain(plan, ms, greedy)
        return record

    def _drafting_round(self, plan: Plan, p: int, token: int, lookup: list[int], draw: Sampler) -> list[TokenRecord]:
        """A round of `plan`'s drafts (lookup's, or early exits'), checked in one batch; what it cost and accepted
        told to the controller."""
        t0 = time.perf_counter()
        draft_step_ms: list[float] = []
        draft_exit_layers: list[int | None] = []
        ended_full = False
        full_step_ms = None
        if plan.choice == Choice.LOOKUP:
            round_, records = self._verify(plan.choice, p, token, lookup[: plan.drafts], [], draw)
        else:
            round_, records, draft_step_ms, draft_exit_layers, ended_full = self._exit_round(p, token, plan.drafts,
                                                                                             draw)
            if not round_.drafts:  # the first step did not exit: one full-model token, no batch
                full_step_ms = records[0].forward_ms + records[0].sample_ms
        # a batch's price includes drawing its rows, as a plain step's includes drawing its one
        batch_price_ms = round_.batch_ms + sum(r.sample_ms for r in records) if round_.drafts else 0.0
        round_.explored = plan.explore
        round_.explore_ms = self.controller.observe(Outcome(
            plan, emitted=round_.emitted, ms=(time.perf_counter() - t0) * 1e3, drafts=round_.drafts,
            accepted=round_.accepted, batch_ms=batch_price_ms, draft_step_ms=tuple(draft_step_ms),
            draft_exit_layers=tuple(draft_exit_layers), drafting_ended_full=ended_full,
            full_step_ms=full_step_ms, greedy=draw.params.greedy))
        for record in records:
            record.round = round_
        return records

    def _round_limit(self, p: int, budget: int) -> int:
        """The most drafts a round may check: draft_max (with speculation "always", also the pack level's own
        max_draft, the length its calibration measured). Its batch holds m + 1 rows at positions p .. p + m, which
        must fit the context and one llama_decode (a batch split at n_batch would leave its rows' logits
        unreadable), and the round emits up to m + 1 tokens of the `budget`."""
        cap = self.config.draft_max
        if self.controller.always_draft and self.policy is not None:
            cap = min(cap, self.policy.max_draft)
        return min(cap, self.ctx.n_batch - 1, self.ctx.n_ctx - p - 1, budget - 1)

    def _exit_drafts(self) -> int:
        """The most drafts the pack's exits may give a round: the level's max_draft, the length its calibration
        measured; 0 where no layer can be checked (a level with every layer off drafts by lookup only)."""
        return self.policy.max_draft if self.early_exit and not self.policy.idle else 0

    def _exit_round(self, p: int, token: int, limit: int,
                    draw: Sampler) -> tuple[Round, list[TokenRecord], list[float], list[int | None], bool]:
        """Drafts from early exits: `token`, then each draft, is decoded alone with exits on; each step's argmax is
        the next draft (after a head-free exit, the candidates'). Drafting stops at a step that runs every layer,
        at `limit` drafts, at an end of generation, or once the drafts' confidence falls below the level's floor.
        If the first step runs every layer, its logits are the full model's own and the cache below it is exact:
        its token is drawn and nothing is verified. Returns the round, its records, the drafting steps' times and exit
        layers (none then), and whether the last of them ran every layer."""
        drafts: list[int] = []
        steps: list[TokenRecord] = []
        feed = token
        confidence = 1.0  # that every draft so far is accepted, as the drafts' candidates see it
        draft_stop = self.policy.draft_stop
        while True:
            step = self.step(feed)
            steps.append(step)
            if step.exit_layer is None and not drafts:
                return Round(Choice.EXIT, emitted=1), [self._sample(step, draw)], [], [], False
            logits = self.ctx.logits()
            drafts.append(int(np.argmax(logits)))
            if draft_stop:  # the confidence costs a softmax over the candidates: only when a floor asks for it
                confidence *= draft_confidence(logits, step.candidates)
            if (step.exit_layer is None or len(drafts) >= limit or confidence < draft_stop
                    or self.model.is_eog(drafts[-1])):
                break
            feed = drafts[-1]
        # every drafting step is charged, the last too where it ran every layer: the batch recomputes its cell
        draft_step_ms = [s.forward_ms for s in steps]
        ended_full = steps[-1].exit_layer is None
        return (*self._verify(Choice.EXIT, p, token, drafts, steps, draw), draft_step_ms,
                [s.exit_layer for s in steps], ended_full)

    def _verify(self, choice: Choice, p: int, token: int, drafts: list[int], steps: list[TokenRecord],
                draw: Sampler) -> tuple[Round, list[TokenRecord]]:
        """Run [token, draft_1 .. draft_m] through every layer at positions p .. p + m, with logits for each
        row: row i is the full model's distribution after draft_i. Its own token is drawn at each row and the
        draft accepted while they are equal; the first that differs is emitted instead (a correction), and a
        round accepted whole gets one more token from its last row (a bonus). Each emitted token is one draw
        from the full model's distribution, as in plain decoding, so under sampling the output distribution
        is the full model's exactly; the drafts only decide how many rows one batch checks.

        steps: the drafting steps of an exit round, one per draft (none for lookup drafts). A row's record carries
        its draft's step's cost, and an accepted draft's the layer its draft left at (draft_layer); the steps
        past the first rejected draft add their cost to the correction."""
        t0 = time.perf_counter()
        # drafts past the first the grammar refuses cannot be accepted: their rows are not paid for (one stays, as
        # below, so that the batch is a verification)
        drafts = drafts[: max(1, draw.allowed_drafts(drafts))]
        # every draft gets its row, an EOS one too: dropping it could leave a batch of one row, which llama_decode
        # runs as a single-token step that may exit early, not as a verification
        batch = [token, *drafts]
        # the drafted cells are shallow (their skipped layers filled or masked): drop them and recompute
        self._truncate(p)
        # with a draft head, the batch keeps every row's hidden state for the next draft (when its graph has one)
        keeps_draft = self.early_exit and self.policy.begin_verify()
        self._history.extend(batch)  # before the decode: an interrupted one is undone by _sync_cache
        self.ctx.decode(batch, output_all=True)
        self._last_step = None
        t1 = time.perf_counter()
        records: list[TokenRecord] = []
        for row in range(len(batch)):
            step = steps[row] if row < len(steps) else None
            record = self._sample(row_record(step), draw, row)
            records.append(record)
            record.source = row_source(drafts, row, record.id)
            if record.source == TokenSource.ACCEPTED:
                record.draft_layer = step.exit_layer if step is not None else None
            if ends_round(record.source, record.id, self.model.is_eog):
                break
        if len(steps) > len(records):  # drafting steps past the rejection (or an EOS)
            records[-1] = with_costs_of(records[-1], steps[len(records) :])
        # the cache keeps `token` and every emitted token but the last; the next draft reads the hidden
        # state of the row that emitted that one
        n_keep = p + len(records)
        if n_keep < self.ctx.n_past:
            self._truncate(n_keep)
            if keeps_draft:
                self.ctx.draft_from_row(len(records) - 1)
        accepted = sum(r.source == TokenSource.ACCEPTED for r in records)
        return Round(choice, drafts=len(drafts), accepted=accepted, emitted=len(records), batch_ms=(t1 - t0) * 1e3,
                     rows=tuple(batch)), records

    def generate(self, prompt: str | Sequence[int], **kwargs) -> Generation:
        records = list(self.stream(prompt, **kwargs))
        return Generation("".join(r.text for r in records), [r.id for r in records], self.stats)

    # --- chat ------------------------------------------------------------------------------

    def format_chat(self, messages: list[dict], chat_template: str | None = None, tools: list[dict] | None = None) -> str:
        """`messages` through `chat_template`, else the GGUF's template, else its registry entry's; `tools` (OpenAI's
        function tools) rendered by the template where given."""
        template = chat_template or self.chat_template
        if not template:
            raise SpecEEError(f"{self.model.info.path.name} has no chat template: pass --chat-template"
                              f" ({', '.join(NAMED_TEMPLATES)}, a Jinja file or a template)")
        vocab_piece = lambda key: self.model.token_to_piece(int(self.model.meta(key) or 0), special=True).decode(errors="replace")
        formatter = Jinja2ChatFormatter(template, eos_token=vocab_piece("tokenizer.ggml.eos_token_id"),
                                        bos_token=vocab_piece("tokenizer.ggml.bos_token_id"))
        return formatter(messages=messages, **({"tools": tools} if tools else {})).prompt

    def format_prompt(self, text: str) -> str:
        """A prompt as bench and calibration present it: one user turn, or plain text for a base model."""
        if self.prompting == "completion":
            return text + "\n\n"
        return self.format_chat([{"role": "user", "content": text}])

    def prompt_tokens(self, text: str) -> list[int]:
        """format_prompt(text), tokenized: what bench, eval and calibration decode after."""
        return self.tokenize(self.format_prompt(text))

    def stream_chat(self, messages: list[dict], *, chat_template: str | None = None, **kwargs) -> Iterator[TokenRecord]:
        return self.stream(self.format_chat(messages, chat_template), **kwargs)

    def chat(self, messages: list[dict], *, chat_template: str | None = None, **kwargs) -> Generation:
        return self.generate(self.format_chat(messages, chat_template), **kwargs)

    def set_early_exit(self, on: bool) -> None:
        """SpecEE on or off: a pack's exits and exact mode's drafts (without a pack, prompt-lookup drafts), or
        plain decoding."""
        self.speculative = on
        if self.policy:
            self.policy.set_active(on)

    @property
    def guard(self) -> ExitGuard:
        return self.config.guard

    def set_guard(self, guard: ExitGuard) -> None:
        """The exit guard of the lossy levels from the next token on (NO_GUARD: none)."""
        self.config = dataclasses.replace(self.config, guard=guard)
        if self.policy:
            self.policy.hold(False)

    def set_quality(self, quality: float | None) -> None:
        """Use the pack's level for `quality` (None: its default), dropping a threshold override."""
        if self.policy is None:
            raise SpecEEError("no pack is loaded: quality levels come from one (specee-edge calibrate MODEL.gguf)")
        self.policy.set_quality(quality)
        self.controller.exit_prior = self._exit_prior()  # the new level's calibration is the exits' first guess

    def reset(self) -> None:
        """Forget the conversation: clear the KV cache."""
        self.ctx.clear()
        self._history.clear()
        self._approximate_from = None

    def close(self) -> None:
        """Free the native context and model now, and let go of the pack (and the target's memory map its
        draft reads embeddings from), instead of whenever the garbage collector runs."""
        self.ctx.close()
        if self._owns_model:
            self.model.close()
        self.policy = None
        self.speculative = False
