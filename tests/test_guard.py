"""Exit guards (engine/guard.py): what they withhold, on the default model at a level whose exits fire."""

from __future__ import annotations

import math

import numpy as np
import pytest

from specee_edge.engine import GREEDY, Engine, EngineConfig
from specee_edge.engine.guard import NO_GUARD, ExitGuard, candidate_margin, continues_word, parse_guard
from specee_edge.errors import SpecEEError
from tests.conftest import CHAT_PROMPT, LOOSE, write_two_level_pack

STEPS = 48


def test_guards_are_spelt_as_the_cli_takes_them():
    assert parse_guard("words") == ExitGuard(words=True)
    assert parse_guard("margin2") == ExitGuard(margin=2.0)
    assert parse_guard("words+margin1.5") == ExitGuard(True, 1.5)
    assert parse_guard("none") == parse_guard("") == NO_GUARD and not NO_GUARD.on
    assert ExitGuard(True, 1.5).name == "words+margin1.5" and parse_guard(ExitGuard(True, 1.5).name).on
    for bad in ("digits", "margin0", "margin", "margin-1"):
        with pytest.raises(SpecEEError, match="exit guard"):
            parse_guard(bad)


def test_a_word_continues_after_letters_digits_and_underscores():
    assert continues_word(b"num") and continues_word(b" x1") and continues_word(b"_") and continues_word(b"12")
    assert not any(continues_word(piece) for piece in (b"(", b" ", b"x.", b""))


def test_the_margin_is_between_the_two_best_candidates():
    logits = np.full(10, -np.inf, dtype=np.float32)
    logits[[2, 5, 7]] = [3.0, 1.0, 2.5]
    assert candidate_margin(logits, (5, 2, 7)) == pytest.approx(0.5)
    assert math.isinf(candidate_margin(logits, (2,)))


def guarded_run(engine: Engine, guard: ExitGuard) -> list[tuple[int, int | None, float, str]]:
    """(token, exit layer, the exit's candidate margin, the previous token's text) per generated token."""
    engine.set_guard(guard)
    engine.reset()
    rows, previous = [], b""
    for record in engine.stream(CHAT_PROMPT, max_tokens=STEPS, sampling=GREEDY):
        # at each yield the context still holds the logits of the step that gave this record's token
        margin = candidate_margin(engine.ctx.logits(), record.candidates) if record.exit_layer is not None else 0.0
        rows.append((record.id, record.exit_layer, margin, previous))
        previous = engine.model.token_to_piece(record.id)
    return rows


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    pack = write_two_level_pack(tmp_path_factory.mktemp("guard") / "two.specee.gguf")
    engine = Engine(pack=pack, config=EngineConfig(n_ctx=512, n_threads=2, quality=LOOSE))
    yield engine
    engine.close()


def test_guards_withhold_the_exits_they_name(engine):
    """At a loose level tokens exit after word pieces and at small margins; `words` withholds the first, `margin`
    the second (those tokens run every layer), and switching the guard off gives the level's own exits back."""
    free = guarded_run(engine, NO_GUARD)
    exited = [r for r in free if r[1] is not None]
    assert any(continues_word(prev) for *_, prev in exited), "no exit after a word piece: the test shows nothing"
    margin = float(np.median([r[2] for r in exited]))
    assert not any(continues_word(prev) for _, layer, _, prev in guarded_run(engine, ExitGuard(words=True))
                   if layer is not None)
    assert all(m >= margin for _, layer, m, _ in guarded_run(engine, ExitGuard(margin=margin)) if layer is not None)
    assert guarded_run(engine, NO_GUARD) == free
