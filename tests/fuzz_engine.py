"""An engine state fuzzer: random REPL-like action sequences on the default model, checked after every action.

One `Engine` per KV mode (a KV mode is fixed per engine, so switching modes means switching engines;
each keeps its own cache, which the shared conversation then meets again), with the shipped pack and
with a multi-layer pack: the shipped pack has a single predictor, after layer 28 of 30, so its exits
skip only the last layer, where fill rebuilds the exact K/V and mask hides a cell from one layer. The
multi-layer pack puts copies of that predictor on nine layers (MULTI_LAYERS), so tokens also stop
halfway and the KV modes handle many skipped layers. The actions are what a
user of `specee-edge chat` or of the Python API does: chat turns, /regen, /clear, streams closed early,
Ctrl+C inside the consuming loop or inside the engine, early exit on/off, threshold and quality changes (exact
mode: rounds of drafts verified in batches, cut anywhere by stops, limits and interrupts), KV-mode
changes, and prompts that fill or overflow a small context. Batches are smaller than the context, so
long prompts go in several (the review found a prompt's one-token last batch exiting early).

What is checked, and why each check is exact:

* Errors: only the project's own `SpecEEError`s, and only where expected (`ContextFullError` exactly
  when the prompt has at least n_ctx tokens, and then nothing is decoded). Anything else fails the run.
* Stream outcomes: at most max_tokens tokens; a stream closed early or interrupted (in the consuming
  loop, or inside the engine just before or after a decode) reports "interrupted"; a complete one
  reports stop, length (exactly max_tokens) or context (the cache holds n_ctx tokens: exactly one
  token more than the free cells, and always when max_tokens would overrun them).
* Cache bookkeeping, after every action: the engine's cached tokens (`cached_tokens`) equal the tokens of
  the decode calls the engine made and did not truncate (a `CacheRecorder` wraps the context's decode,
  truncate and clear), and their number equals the context's `n_past`.
* Depth, after every action, at every cached position: `cell_depth` is what the KV mode promises for
  that cell's decode: the exit layer in mask mode, complete in fill mode, complete in full mode except
  for the last stopped token until the next decode runs its remaining layers; and the first position
  past the cache holds nothing. Batches never stop; nothing stops with early exit off or a threshold
  above 1; tokens stop only on layers that have a predictor.
* No stale K/V, differentially (the definition tests/test_runtime.py uses: a reused cache gives the
  logits of a fresh one): a `Twin` context per engine replays the engine's live decode calls (the same
  token chunks, the same exits forced at the same layers through a probe callback, so mask, fill and
  full store what the engine's cells should hold) and must get bit-identical logits for every one of
  them. The twin replays only what survives until it catches up, so K/V left behind by truncated decodes
  (a regen, an interrupt, a prompt that shares only a prefix), or a shallow cell taken for complete, would change
  the engine's logits and not the twin's. For its cost, a twin follows a random share of conversations
  (from one empty cache to the next) and catches up at random action boundaries; logits are compared
  through digests recorded at decode time.
* The same against a brand-new context (`deep_check`, every DEEP_EVERY actions and for every engine at
  the end): it replays everything the engine holds, then both decode two more tokens with early exit
  off. A new context shares no dead history with the engine at all (a twin may share some).
* Vanilla greedy: a greedy generation with early exit off whose prompt the engine decoded from position
  0 (an empty cache, or nothing in common with it) went in as one batch and then one token per call; a
  plain `Context` (early exit never enabled) doing the same with argmax must produce the same tokens.
  A prefill split into other chunks takes other matmul kernels and may differ in the last bits, so this
  comparison is made only where the chunking is the same (and prompts are short, for its cost); in the
  conversations a twin follows, every other early-exit-off decode is compared bit for bit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specee_edge.engine import AUTO, GREEDY, Engine, EngineConfig, SamplingParams, TokenRecord
from specee_edge.engine.exit import find_pack
from specee_edge.errors import ContextFullError, SpecEEError
from specee_edge.pack import EXACT_QUALITY, read_pack, write_pack
from specee_edge.exits import ExitKind
from specee_edge.pack.format import LayerExit, Schedule
from specee_edge.runtime import Context, Model

KV_MODES = ("mask", "fill", "full")
PACKS = ("shipped", "multi")
MULTI_LAYERS = (6, 10, 14, 18, 20, 22, 24, 26, 28)  # the multi-layer pack's predictor layers
MULTI_OFFLINE = (10, 18, 24)                         # and its offline schedule
THRESHOLDS = (None, 0.0, 0.3, 0.5, 0.9, 1.01)
# the shipped pack's own thresholds rarely stop in a few tokens; low ones stop often, so they come up more
THRESHOLD_WEIGHTS = (2, 3, 2, 2, 1, 1)
N_CTX = 256
N_BATCH = 64  # below n_ctx: long prompts go in several batches (none of one token: those would be steps)
N_THREADS = 2
MAX_TOKENS = 5
DEEP_EVERY = 400        # actions between deep checks (a new context replays everything)
TWIN_SHARE = 0.25       # share of conversations (between clears) a twin follows
TWIN_SYNC_P = 0.3       # chance that a following twin catches up after an action
FILL_EVERY = 400        # actions without a fill before one is forced
TAIL = 25               # actions named in a failure message
VANILLA_MAX_PROMPT = 32  # longer prompts are left to the twin (a plain re-prefill costs ~3 ms a token)

USER_MESSAGES = (
    "Hi!", "Name a colour.", "Why is the sky blue?", "Tell me about the moon.", "Write a haiku about rain.",
    "What is 2 + 2?", "Say something in French.", "List three fruits.", "Continue.", "Explain recursion briefly.",
    "Who are you?", "Thanks!", "And another one?", "Shorter, please.",
)
SYSTEM_PROMPTS = ("Be brief.", None, "Answer like a pirate.")  # None: the template's own (13 tokens longer)
RAW_PROMPTS = ("Once upon a time", "The capital of France is", "def fib(n):", "1, 2, 3, 4,", "Hi", "The")
STOPS = ((), (), (), (".",), ("\n",), (" the",))
FILLER = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat. "


class FuzzFailure(AssertionError):
    pass


def write_multilayer_pack(model_path: Path, out: Path) -> Path:
    """The shipped pack with one of its predictors copied onto MULTI_LAYERS. Its features (candidate logits,
    probabilities and their change) mean the same after any layer, and verification still stops a token
    only where the exit's top-1 is a candidate, so the copies stop tokens at many depths."""
    pack = read_pack(find_pack(model_path))
    level = pack.levels[0]  # the loosest level: its most eager layer's predictor and threshold
    source, threshold = min(level.thresholds.items(), key=lambda item: (item[1], -item[0]))
    mlp = pack.predictors[source]
    lossy = dataclasses.replace(level, exits={il: LayerExit(ExitKind.VERIFIED, threshold) for il in MULTI_LAYERS},
                                offline=list(MULTI_OFFLINE), max_draft=0.0, draft_stop=0.0)
    # exact mode drafting with the same exits, head-free, in rounds of up to 4 drafts
    exact = dataclasses.replace(lossy, quality=EXACT_QUALITY, max_draft=4.0, speedup=2.0, speedup_sampled=2.0,
                                speedup_low=1.5, speedup_sampled_low=1.5,
                                exits={il: LayerExit(ExitKind.HEAD_FREE, threshold) for il in MULTI_LAYERS})
    multi = dataclasses.replace(
        pack, predictors={il: mlp for il in MULTI_LAYERS}, temperatures={},
        levels=[lossy, exact],
        default_quality=level.quality,
        schedule=Schedule(offline=list(MULTI_OFFLINE), window=pack.schedule.window, offsets=[-2, 0, 2]),
        provenance={"made_by": "tests/fuzz_engine.py", "predictor": f"layer {source} of the shipped pack"})
    return write_pack(out, multi, draft_quant=pack.draft.quant)


def digest(logits: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(logits).tobytes(), digest_size=16).digest()


# --- the cache model --------------------------------------------------------------------------


@dataclass(eq=False)
class Chunk:
    """One decode call on an engine's context, kept while some of its cells are cached."""

    start: int                   # n_past before the call
    tokens: tuple[int, ...]
    exit_layer: int | None       # where the call stopped (None: every layer ran)
    exit_kind: ExitKind          # how: verified (the exit head's logits) or head-free (the candidates')
    candidates: tuple[int, ...]  # the step's candidates (a head-free exit's logits are theirs)
    digest: bytes                # of the logits right after the call
    argmax: int
    action: int                  # the fuzzer action that made the call


@dataclass
class Injection:
    """Ctrl+C inside the engine: KeyboardInterrupt at the `call`-th decode of a stream, before or after it."""

    call: int
    after: bool


class CacheRecorder:
    """What an engine's context must hold, from the calls the engine makes to it.

    Instance attributes shadow Context.decode/truncate/clear, so every call the engine makes goes
    through here. Live chunks start strictly increasing (a decode appends at n_past; a truncate drops
    every chunk that starts at or after its point), so the live chunks are a stack.
    """

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.stack: list[Chunk] = []
        self.length = 0
        self.pending: Chunk | None = None  # full mode: the stopped chunk whose skipped layers run at the next decode
        self.epoch = 0                     # +1 whenever the cache empties
        self.action = -1
        self.injection: Injection | None = None
        self.calls = 0                     # decode calls since begin_stream
        self.made: list[Chunk] = []        # every chunk decoded since begin_stream, truncated or not
        self._decode, self._truncate, self._clear = ctx.decode, ctx.truncate, ctx.clear
        ctx.decode, ctx.truncate, ctx.clear = self.decode, self.truncate, self.clear

    def begin_stream(self, injection: Injection | None) -> None:
        self.calls = 0
        self.made = []
        self.injection = injection

    def _maybe_interrupt(self, after: bool) -> None:
        inj = self.injection
        if inj is not None and inj.call == self.calls and inj.after == after:
            self.injection = None
            raise KeyboardInterrupt

    def decode(self, tokens: Sequence[int], **kwargs) -> int | None:
        self.calls += 1
        self._maybe_interrupt(after=False)
        start = self.ctx.n_past
        if start != self.length:
            raise FuzzFailure(f"decode at n_past {start}, but the recorded cache holds {self.length} tokens")
        exit_layer = self._decode(tokens, **kwargs)
        logits = self.ctx.logits()
        step = self.ctx.step_info()
        chunk = Chunk(start, tuple(int(t) for t in tokens), exit_layer, step.exit_kind, step.candidates,
                      digest(logits), int(np.argmax(logits)), self.action)
        self.stack.append(chunk)
        self.made.append(chunk)
        self.length += len(chunk.tokens)
        self.pending = chunk if exit_layer is not None else None
        self._maybe_interrupt(after=True)
        return exit_layer

    def truncate(self, n_keep: int) -> None:
        self._truncate(n_keep)
        if n_keep >= self.length:
            return
        while self.stack and self.stack[-1].start >= n_keep:
            if self.stack.pop() is self.pending:
                self.pending = None
        self.length = n_keep
        if n_keep == 0:
            self.epoch += 1

    def clear(self) -> None:
        self._clear()
        self.stack.clear()
        self.length = 0
        self.pending = None
        self.epoch += 1

    def tokens(self) -> list[int]:
        out: list[int] = []
        for chunk in self.stack:
            del out[chunk.start:]
            out.extend(chunk.tokens)
        return out[: self.length]

    def expected_depths(self, mode: str, n_layer: int) -> list[int]:
        """Per cached position, the cell depth the KV mode promises (n_layer - 1: complete)."""
        full = n_layer - 1
        depths: list[int] = []
        for chunk in self.stack:
            del depths[chunk.start:]
            if chunk.exit_layer is None or mode == "fill" or (mode == "full" and chunk is not self.pending):
                depths.extend([full] * len(chunk.tokens))
            else:
                depths.append(chunk.exit_layer)
        return depths[: self.length]


# --- references ---------------------------------------------------------------------------------


class Twin:
    """A context with early exit enabled in the engine's KV mode that replays the engine's live decode
    calls, forcing the recorded exits with a probe callback, and compares the logits bit for bit."""

    def __init__(self, model: Model, mode: str, n_cand: int, n_ctx: int = N_CTX):
        self.ctx = Context(model, n_ctx=n_ctx, n_batch=N_BATCH, n_threads=N_THREADS)
        self.ctx.enable_early_exit(n_cand, mode)
        self.n_cand = n_cand
        self.replayed: list[Chunk] = []
        self.epoch = -1
        self.active = False
        self.compared = 0
        self._exit: tuple | None = None

    def follow(self, recorder: CacheRecorder, rng: random.Random, share: float) -> None:
        """A new conversation (the cache emptied): start over, and maybe follow it."""
        if recorder.epoch != self.epoch:
            self.epoch = recorder.epoch
            self.active = rng.random() < share
            self.ctx.clear()
            self.replayed = []

    def _force_exit(self, chunk: Chunk) -> None:
        """The chunk's exit: its layer and kind, with its candidates (a head-free exit's logits are theirs;
        a verified exit's do not depend on them)."""
        exit = (chunk.exit_layer, chunk.exit_kind, chunk.candidates)
        if exit == self._exit:
            return
        if chunk.exit_layer is None:
            self.ctx.set_probe_callback(None)
            self.ctx.set_probe_layers([])
        else:
            self.ctx.set_candidates(list(chunk.candidates) or list(range(self.n_cand)))
            self.ctx.set_probe_layers([chunk.exit_layer])
            self.ctx.set_probe_callback(lambda il, _z, stop=chunk.exit_layer, kind=chunk.exit_kind:
                                        kind if il == stop else ExitKind.NONE)
        self._exit = exit

    def sync(self, recorder: CacheRecorder) -> None:
        """Replay the live chunks not yet replayed; raise FuzzFailure on the first difference."""
        k = 0
        while k < min(len(self.replayed), len(recorder.stack)) and self.replayed[k] is recorder.stack[k]:
            k += 1
        del self.replayed[k:]
        for chunk in recorder.stack[k:]:
            self.ctx.truncate(chunk.start)
            self._force_exit(chunk)
            got = self.ctx.decode(list(chunk.tokens))
            logits = self.ctx.logits()
            if got != chunk.exit_layer or digest(logits) != chunk.digest:
                raise FuzzFailure(
                    f"the decode of {len(chunk.tokens)} token(s) at position {chunk.start} (made by action "
                    f"{chunk.action}, exit layer {chunk.exit_layer}) is not reproduced by a context that replays"
                    f" only the live decodes: exit {got}, argmax {int(np.argmax(logits))} vs {chunk.argmax}, "
                    "logits differ (stale or missing K/V)")
            self.replayed.append(chunk)
            self.compared += 1
        self.ctx.truncate(recorder.length)

    def close(self) -> None:
        self.ctx.close()


class Vanilla:
    """A plain context (early exit never enabled): greedy decoding as stock llama.cpp does it."""

    def __init__(self, model: Model, n_ctx: int = N_CTX):
        self.ctx = Context(model, n_ctx=n_ctx, n_batch=N_BATCH, n_threads=N_THREADS)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        self.ctx.clear()
        self.ctx.decode(prompt)
        out: list[int] = []
        for i in range(n):
            out.append(int(np.argmax(self.ctx.logits())))
            if i < n - 1:
                self.ctx.decode([out[-1]])
        return out

    def close(self) -> None:
        self.ctx.close()


# --- actions -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    """How one generation is asked for and consumed."""

    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    consume: str = "all"          # all | close (after `k` records) | interrupt (Ctrl+C in the loop after `k`) | ctrl_c_inside
    k: int = 0
    injection: Injection | None = None  # ctrl_c_inside: where the engine is interrupted
    via: str = "stream"           # stream | generate (stream_chat | chat for conversation turns)

    def describe(self) -> str:
        s = self.sampling
        how = "greedy" if s.greedy else f"T={s.temperature} seed={s.seed} rp={s.repeat_penalty}"
        extra = {"all": "", "close": f" close@{self.k}", "interrupt": f" ^C@{self.k}",
                 "ctrl_c_inside": f" ^C-in-decode#{self.injection.call}{'+' if self.injection.after else '-'}"
                 if self.injection else ""}[self.consume]
        stop = f" stop={self.stop!r}" if self.stop else ""
        return f"{self.via} max={self.max_tokens} {how}{stop}{extra}"


@dataclass(frozen=True)
class Action:
    kind: str                     # chat regen raw fill overflow clear early_exit threshold quality engine system
    arg: object = None
    turn: Turn | None = None

    def describe(self) -> str:
        arg = "" if self.arg is None and self.kind not in ("threshold", "quality", "system") else f" {self.arg!r}"
        return f"{self.kind}{arg}" + (f" [{self.turn.describe()}]" if self.turn else "")


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish: str = ""
    error: str = ""
    interrupted: bool = False
    exhausted: bool = False

    def describe(self) -> str:
        if self.error:
            return self.error
        return f"{len(self.tokens)} tok {self.finish or '-'}{' (^C)' if self.interrupted else ''}"


@dataclass
class Step:
    index: int
    key: str
    early_exit: bool
    action: Action
    outcome: Outcome | None = None
    kv_len: int = 0

    def describe(self) -> str:
        ee = "ee" if self.early_exit else "off"
        out = self.outcome.describe() if self.outcome else ("-" if self.action.turn else "ok")
        return f"#{self.index} {self.key} {ee}: {self.action.describe()} -> {out}, cache {self.kv_len}"


# --- the fuzzer ------------------------------------------------------------------------------------


@dataclass
class Slot:
    """One engine of the pool, with its recorder and twin."""

    key: str                      # "mode" (shipped pack) or "mode/multi"
    mode: str
    engine: Engine
    recorder: CacheRecorder
    twin: Twin
    threshold: float | None = None


@dataclass
class Report:
    seed: int
    actions: int = 0
    seconds: float = 0.0
    kinds: Counter = field(default_factory=Counter)
    events: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.kinds.items()))
        events = ", ".join(f"{k} {v}" for k, v in sorted(self.events.items()))
        return (f"engine fuzz: {self.actions} actions, seed {self.seed}, {self.seconds:.1f} s\n"
                f"  actions: {kinds}\n  checks/events: {events}")


class EngineFuzzer:
    def __init__(self, model_path: Path, seed: int, multi_pack: Path, n_ctx: int = N_CTX):
        self.seed = seed
        self.rng = random.Random(seed)
        self.slots: dict[str, Slot] = {}
        for pack in PACKS:
            for mode in KV_MODES:
                key = mode if pack == "shipped" else f"{mode}/{pack}"
                engine = Engine(model_path, pack=AUTO if pack == "shipped" else multi_pack,
                                # exact mode drafts at every chance: a run must not depend on what steps cost
                                config=EngineConfig(n_ctx=n_ctx, n_batch=N_BATCH, n_threads=N_THREADS, kv_mode=mode,
                                                    speculation="always"))
                assert engine.policy is not None and engine.kv_mode == mode
                twin = Twin(engine.model, mode, engine.policy.k, n_ctx)
                self.slots[key] = Slot(key, mode, engine, CacheRecorder(engine.ctx), twin)
        first = self.slots[KV_MODES[0]].engine
        self.n_ctx = first.ctx.n_ctx
        self.n_layer = first.n_layer
        self.vanilla = Vanilla(first.model, n_ctx)
        self.filler = first.tokenize(FILLER * 40)[1:]  # no BOS: filler continues other tokens
        self.key = KV_MODES[0]
        self.messages: list[dict[str, str]] = []
        self.system: str | None = SYSTEM_PROMPTS[0]  # short: every fresh conversation prefills it
        self.last_prompt_len = 0
        self.last_kind = ""
        self.since_fill = 0
        self.tail: deque[Step] = deque(maxlen=TAIL)
        self.report = Report(seed)

    @property
    def slot(self) -> Slot:
        return self.slots[self.key]

    def close(self) -> None:
        self.vanilla.close()
        for slot in self.slots.values():
            slot.twin.close()
            slot.engine.close()

    # --- the run -------------------------------------------------------------------------------

    def run(self, n_actions: int) -> Report:
        t0 = time.perf_counter()
        for i in range(n_actions):
            action = self.next_action()
            step = Step(i, self.key, self.slot.engine.early_exit, action)
            self.tail.append(step)
            try:
                self.slot.recorder.action = i
                step.outcome = self.apply(action, i)
                step.kv_len = len(self.slot.engine.cached_tokens)
                self.check_cache(self.slot)
                self.maybe_sync_twin(self.slot)
                if (i + 1) % DEEP_EVERY == 0:
                    self.deep_check(self.slot, i)
            except FuzzFailure as e:
                raise FuzzFailure(self.failure_message(i, str(e))) from None
            except Exception as e:  # noqa: BLE001 - anything else is a finding too (a real Ctrl+C still stops pytest)
                raise FuzzFailure(self.failure_message(i, f"unexpected {type(e).__name__}: {e}")) from e
            self.report.kinds[action.kind] += 1
            self.last_kind = action.kind
            self.since_fill = 0 if action.kind == "fill" else self.since_fill + 1
            self.report.actions = i + 1
        try:
            for slot in self.slots.values():
                slot.recorder.action = n_actions
                self.check_cache(slot)
                self.deep_check(slot, n_actions)
        except FuzzFailure as e:
            raise FuzzFailure(self.failure_message(n_actions, f"final check: {e}")) from None
        self.report.events["twin_compared_decodes"] = sum(s.twin.compared for s in self.slots.values())
        self.report.seconds = time.perf_counter() - t0
        return self.report

    def failure_message(self, index: int, what: str) -> str:
        tail = "\n".join(f"  {s.describe()}{'  <- failed here' if s.index == index else ''}" for s in self.tail)
        return (f"engine fuzz failed at action {index} (seed {self.seed}): {what}\n"
                f"last {len(self.tail)} actions:\n{tail}\n"
                f"replay: SPECEE_FUZZ_SEED={self.seed} SPECEE_FUZZ_ACTIONS={index + 1} pytest tests/test_fuzz.py")

    # --- choosing actions --------------------------------------------------------------------------

    def next_action(self) -> Action:
        rng = self.rng
        # generations are most of the cost, and prompts that break the cached prefix (raw, fill, system,
        # engine) the most of that: those are rarer than turns that extend the conversation
        weights = {"chat": 10, "regen": 7, "raw": 1, "fill": 0.1, "overflow": 3, "clear": 5, "early_exit": 10,
                   "threshold": 10, "quality": 8, "engine": 2, "system": 0.5}
        if self.last_prompt_len > self.n_ctx - 40:
            weights["clear"] = 40  # the REPL says "/clear starts over"; most users do
        kind = rng.choices(list(weights), list(weights.values()))[0]
        # full contexts: a fill costs a prompt of up to n_ctx tokens, so fills are rare but come in streaks
        # (the next ones reuse the filled cache), and at least one streak every FILL_EVERY actions
        if (self.last_kind == "fill" and rng.random() < 0.7) or self.since_fill >= FILL_EVERY:
            kind = "fill"
        if kind == "regen" and not (self.messages and self.messages[-1]["role"] == "assistant"):
            kind = "chat"
        if kind == "fill":
            # `free` cells after the prompt; max_tokens from free (ends by length at the edge) to free + 2
            # and beyond (ends by context once free + 1 tokens are out), mostly consumed to the end
            free = rng.randint(1, 4)
            return Action(kind, free, self.random_turn(chat=False, max_tokens=rng.randint(free, MAX_TOKENS),
                                                       consume=(80, 10, 5, 5)))
        if kind in ("chat", "regen", "raw", "overflow"):
            arg = {"chat": rng.choice(USER_MESSAGES), "raw": rng.choice(RAW_PROMPTS),
                   "overflow": rng.choice(("chat", "tokens")), "regen": None}[kind]
            return Action(kind, arg, self.random_turn(chat=kind in ("chat", "regen")))
        if kind == "early_exit":
            return Action(kind, rng.random() < 0.7)  # mostly on: exits are what changes the cache
        if kind == "threshold":
            return Action(kind, rng.choices(THRESHOLDS, THRESHOLD_WEIGHTS)[0])
        if kind == "quality":  # the pack's default, exact mode, or its loosest lossy level
            return Action(kind, rng.choice((None, EXACT_QUALITY, 0.5)))
        if kind == "engine":
            return Action(kind, rng.choice([key for key in self.slots if key != self.key]))
        if kind == "system":
            return Action(kind, rng.choice(SYSTEM_PROMPTS))
        return Action(kind)

    def random_turn(self, chat: bool, max_tokens: int = 0,
                    consume: tuple[int, int, int, int] = (55, 15, 15, 15)) -> Turn:
        rng = self.rng
        max_tokens = max_tokens or rng.randint(1, MAX_TOKENS)
        if rng.random() < 0.75:
            sampling = GREEDY
        else:
            sampling = SamplingParams(temperature=rng.choice((0.5, 0.8, 1.2)), seed=rng.randrange(2**31),
                                      repeat_penalty=rng.choice((1.0, 1.1)))
        how = rng.choices(("all", "close", "interrupt", "ctrl_c_inside"), consume)[0]
        via = ("stream_chat", "chat") if chat else ("stream", "generate")
        via = via[1] if how in ("all", "ctrl_c_inside") and rng.random() < 0.25 else via[0]
        k = rng.randint(1, max_tokens) if how in ("close", "interrupt") else 0
        # decode call 1 is the prompt; call c > 1 decodes the (c-1)-th generated token
        injection = Injection(rng.randint(1, max_tokens), rng.random() < 0.5) if how == "ctrl_c_inside" else None
        return Turn(max_tokens, sampling, rng.choice(STOPS), how, k, injection, via)

    # --- applying actions ----------------------------------------------------------------------------

    def apply(self, action: Action, index: int) -> Outcome | None:
        slot, kind = self.slot, action.kind
        if kind == "clear":  # /clear
            self.messages.clear()
            slot.engine.reset()
            self.last_prompt_len = 0
        elif kind == "early_exit":  # /early-exit on|off
            slot.engine.set_early_exit(bool(action.arg))
        elif kind == "threshold":  # /set threshold (None: back to the pack's)
            slot.engine.policy.set_threshold(action.arg)
            slot.threshold = action.arg
        elif kind == "quality":  # /set quality (drops a threshold)
            slot.engine.set_quality(action.arg)
            slot.threshold = None
        elif kind == "engine":  # another KV mode: another engine, same conversation
            self.key = str(action.arg)
        elif kind == "system":  # /set system
            self.system = action.arg
        elif kind == "chat":  # a message, as ReplSession.send
            self.messages.append({"role": "user", "content": str(action.arg)})
            outcome = self.reply(action.turn, index)
            if not self.replied(outcome):
                self.messages.pop()
            return outcome
        elif kind == "regen":  # /regen, as ReplSession.cmd_regen
            previous = self.messages.pop()
            outcome = self.reply(action.turn, index)
            if not self.replied(outcome):
                self.messages.append(previous)
            return outcome
        elif kind == "raw":
            return self.generate(slot.engine.tokenize(str(action.arg)), action.turn, index, text=str(action.arg))
        elif kind == "fill":  # a prompt that leaves `arg` free cells, over part of what is cached
            cached = slot.engine.cached_tokens
            keep = max(0, len(cached) - self.rng.randint(0, 16))
            tokens = (cached[:keep] + self.filler)[: self.n_ctx - int(action.arg)]
            return self.generate(tokens, action.turn, index)
        elif kind == "overflow":
            if action.arg == "chat":  # a message too long for the context; the REPL drops it again
                self.messages.append({"role": "user", "content": FILLER * 25})
                outcome = self.reply(action.turn, index)
                if not self.replied(outcome):
                    self.messages.pop()
                return outcome
            extra = self.rng.randint(0, 8)
            return self.generate(self.filler[: self.n_ctx + extra], action.turn, index)
        else:
            raise AssertionError(f"unknown action {kind}")
        return None

    @staticmethod
    def replied(outcome: Outcome) -> bool:
        """ReplSession.reply's answer: a reply joins the conversation unless nothing came of it."""
        return bool(outcome.text) or not (outcome.error or outcome.interrupted)

    def conversation(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        return system + self.messages

    def reply(self, turn: Turn, index: int) -> Outcome:
        engine = self.slot.engine
        messages = self.conversation()
        prompt = engine.tokenize(engine.format_chat(messages))
        self.last_prompt_len = len(prompt)
        outcome = self.generate(prompt, turn, index, messages=messages)
        if outcome.text or not (outcome.error or outcome.interrupted):
            self.messages.append({"role": "assistant", "content": outcome.text})
        return outcome

    def open_stream(self, turn: Turn, prompt: list[int], messages: list[dict] | None,
                    text: str | None) -> Iterator[TokenRecord]:
        engine = self.slot.engine
        kwargs = dict(max_tokens=turn.max_tokens, sampling=turn.sampling, stop=turn.stop)
        if turn.via in ("chat", "generate"):
            out = engine.chat(messages, **kwargs) if turn.via == "chat" else engine.generate(text or prompt, **kwargs)
            return iter([TokenRecord(t) for t in out.tokens[:-1]]
                        + [TokenRecord(out.tokens[-1], out.text)] if out.tokens else [])
        if turn.via == "stream_chat":
            return engine.stream_chat(messages, **kwargs)
        return engine.stream(text or prompt, **kwargs)

    def generate(self, prompt: list[int], turn: Turn, index: int, *, messages: list[dict] | None = None,
                 text: str | None = None) -> Outcome:
        """One generation, consumed as `turn` says, then every check that concerns it."""
        slot = self.slot
        engine, recorder = slot.engine, slot.recorder
        early_exit, threshold = engine.early_exit, slot.threshold
        n_chunks = len(recorder.stack)
        cached_before = engine.cached_tokens
        expect_full = len(prompt) >= self.n_ctx
        outcome = Outcome()
        records: list[TokenRecord] = []
        recorder.begin_stream(turn.injection)
        try:
            stream = self.open_stream(turn, prompt, messages, text)
            try:
                if turn.consume == "close":
                    while len(records) < turn.k:
                        record = next(stream, None)
                        if record is None:
                            outcome.exhausted = True
                            break
                        records.append(record)
                else:
                    for record in stream:
                        records.append(record)
                        if turn.consume == "interrupt" and len(records) == turn.k:
                            raise KeyboardInterrupt
                    outcome.exhausted = True
            finally:
                close = getattr(stream, "close", None)
                if close:
                    close()
        except KeyboardInterrupt:
            outcome.interrupted = True
        except SpecEEError as e:
            outcome.error = f"{type(e).__name__}: {e}"
            if not (expect_full and isinstance(e, ContextFullError)):
                raise FuzzFailure(f"unexpected {outcome.error}") from e
        finally:
            recorder.injection = None
        outcome.tokens = [r.id for r in records]
        outcome.text = "".join(r.text for r in records)
        if expect_full:
            self.check_refused(outcome, cached_before, n_chunks)
            self.report.events["context_full_error"] += 1
            return outcome
        outcome.finish = engine.stats.finish_reason
        self.check_generation(turn, prompt, outcome, records, recorder.made, early_exit, threshold)
        # vanilla-comparable: the prompt went in as one batch from position 0 (then one token per call)
        from_zero = bool(recorder.made) and recorder.made[0].start == 0 and recorder.made[0].tokens == tuple(prompt)
        if (not early_exit and turn.sampling.greedy and turn.sampling.repeat_penalty == 1.0 and from_zero
                and outcome.tokens and len(prompt) <= VANILLA_MAX_PROMPT):
            self.check_vanilla(prompt, outcome.tokens)
        return outcome

    # --- checks ----------------------------------------------------------------------------------------

    def check_refused(self, outcome: Outcome, cached_before: list[int], n_chunks: int) -> None:
        """A prompt of n_ctx tokens or more: ContextFullError before anything is decoded."""
        recorder = self.slot.recorder
        if not outcome.error.startswith("ContextFullError"):
            raise FuzzFailure(f"a prompt of at least n_ctx={self.n_ctx} tokens was not refused: {outcome.describe()}")
        if outcome.tokens or recorder.made or self.slot.engine.cached_tokens != cached_before or len(recorder.stack) != n_chunks:
            raise FuzzFailure("a refused prompt changed the cache or produced tokens")

    def check_generation(self, turn: Turn, prompt: list[int], outcome: Outcome, records: list[TokenRecord],
                         new_chunks: list[Chunk], early_exit: bool, threshold: float | None) -> None:
        engine, ev = self.slot.engine, self.report.events
        n = len(outcome.tokens)
        if n > turn.max_tokens:
            raise FuzzFailure(f"{n} tokens for max_tokens={turn.max_tokens}")
        stopped_early = outcome.interrupted or (turn.consume == "close" and not outcome.exhausted)
        if stopped_early:
            # the engine saw GeneratorExit or KeyboardInterrupt (every stream here has started: it decoded)
            if outcome.finish != "interrupted":
                raise FuzzFailure(f"an interrupted stream finished with {outcome.finish!r}")
            ev["interrupted"] += 1
        else:
            if n == 0:
                raise FuzzFailure("a stream ended without a token")
            if outcome.finish not in ("stop", "length", "context"):
                raise FuzzFailure(f"finish_reason {outcome.finish!r} after a complete stream")
            if outcome.finish == "length" and n != turn.max_tokens:
                raise FuzzFailure(f"finish 'length' after {n} of {turn.max_tokens} tokens")
            free = self.n_ctx - len(prompt)
            if outcome.finish == "context" and (engine.ctx.n_past != self.n_ctx or n != free + 1):
                raise FuzzFailure(f"finish 'context' after {n} tokens with n_past {engine.ctx.n_past}, n_ctx"
                                  f" {self.n_ctx}, {free} free cells after the prompt")
            if outcome.finish != "stop" and free <= turn.max_tokens - 2 and outcome.finish != "context":
                raise FuzzFailure(f"{free} free cells and max_tokens {turn.max_tokens}, but finish {outcome.finish!r}")
            ev[f"finish_{outcome.finish}"] += 1
        for chunk in new_chunks:
            if chunk.exit_layer is None:
                continue
            if len(chunk.tokens) > 1:
                raise FuzzFailure(f"a batch of {len(chunk.tokens)} tokens stopped at layer {chunk.exit_layer}")
            if not early_exit:
                raise FuzzFailure(f"a token stopped at layer {chunk.exit_layer} with early exit off")
            if threshold is not None and threshold > 1.0:
                raise FuzzFailure(f"a token stopped at layer {chunk.exit_layer} with threshold {threshold}")
            if chunk.exit_layer not in self.slot.engine.policy.predictors:
                raise FuzzFailure(f"a token stopped at layer {chunk.exit_layer}, which has no predictor")
            ev[f"exits_{self.slot.mode}"] += 1
            if chunk.exit_layer < self.n_layer - 2:
                ev[f"exits_{self.slot.mode}_skipping_2+_layers"] += 1
        if not early_exit and any(r.probes or r.exit_layer is not None for r in records):
            raise FuzzFailure("probes or exits reported with early exit off")
        ev["exact_rounds"] += len({id(r.round) for r in records if r.round is not None and r.round.drafts})
        ev["generations"] += 1

    def check_vanilla(self, prompt: list[int], tokens: list[int]) -> None:
        """Early exit off, greedy, from an empty cache: stock llama.cpp's argmax chain, token for token."""
        expected = self.vanilla.greedy(prompt, len(tokens))
        if expected != tokens:
            raise FuzzFailure(f"early exit off, greedy: {tokens} but a plain context gives {expected}")
        self.report.events["vanilla_checked"] += 1

    def check_cache(self, slot: Slot) -> None:
        """The engine's cached tokens, the context's length, the recorded decodes and the cell depths agree."""
        engine, recorder = slot.engine, slot.recorder
        n_past = engine.ctx.n_past
        if len(engine.cached_tokens) != n_past or recorder.length != n_past:
            raise FuzzFailure(f"cache lengths disagree: engine {len(engine.cached_tokens)}, context n_past {n_past},"
                              f" recorded {recorder.length}")
        if engine.cached_tokens != recorder.tokens():
            raise FuzzFailure("the engine's cached tokens are not the tokens decoded into the context")
        depths = recorder.expected_depths(slot.mode, self.n_layer)
        for pos, expected in enumerate(depths):
            got = engine.ctx.cell_depth(pos)
            if got != expected:
                raise FuzzFailure(f"{slot.mode}: cell at position {pos} has depth {got}, expected {expected}")
        if n_past < self.n_ctx and engine.ctx.cell_depth(n_past) != -1:
            raise FuzzFailure(f"position {n_past}, past the cache, still has a cell")

    def maybe_sync_twin(self, slot: Slot) -> None:
        slot.twin.follow(slot.recorder, self.rng, TWIN_SHARE)
        if slot.twin.active and self.rng.random() < TWIN_SYNC_P:
            slot.twin.sync(slot.recorder)
            self.report.events["twin_syncs"] += 1

    def deep_check(self, slot: Slot, index: int) -> None:
        """A brand-new context replays everything the engine holds; then both continue two teacher-forced
        tokens with early exit off. Bit-identical logits throughout, or stale K/V is visible."""
        engine, recorder = slot.engine, slot.recorder
        fresh = Twin(engine.model, slot.mode, engine.policy.k, self.n_ctx)
        try:
            fresh.follow(recorder, self.rng, 1.0)
            fresh.sync(recorder)
            length = recorder.length
            n = min(2, self.n_ctx - length)
            if n > 0:
                was = engine.early_exit
                engine.set_early_exit(False)
                recorder.action = index
                try:
                    for token in self.rng.sample(self.filler, n):
                        engine.ctx.decode([token])
                    fresh.sync(recorder)
                finally:
                    engine.ctx.truncate(length)
                    engine.set_early_exit(was)
            self.check_cache(slot)
            self.report.events["deep_checks"] += 1
            self.report.events["deep_compared_decodes"] += fresh.compared
        finally:
            fresh.close()
