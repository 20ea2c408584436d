"""Calibration's progress: a bar per stage under a line for the whole run (elapsed, and an estimate of what is left)
on a terminal; elsewhere (a log, a pipe) one line as each stage ends."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn

from specee_edge.calibrate.budget import STAGES, remaining

LABELS = dict(STAGES)


def clock(seconds: float) -> str:
    """h:mm:ss or m:ss."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class RunProgress:
    """`with progress.stage(key, unit, total) as advance:` around each stage; `seconds` holds each finished stage's
    time. `estimates` (budget.estimate's) may be replaced as the run learns more (`refine`)."""

    def __init__(self, console: Console, estimates: Mapping[str, float]):
        self.console = console
        self.estimates = dict(estimates)
        self.seconds: dict[str, float] = {}
        self.started = time.perf_counter()
        self.live = console.is_terminal
        # auto_refresh=False: a refresh thread contends for the GIL with the decode loop
        self.bars = Progress(TextColumn("{task.description:<34}"), BarColumn(), TextColumn("{task.fields[note]}"),
                             console=console, auto_refresh=False, disable=not self.live)
        self.whole = self.bars.add_task("whole run", total=1.0, note="")
        self._current: tuple[str, float, Callable[[], float | None]] | None = None

    def __enter__(self) -> RunProgress:
        self.bars.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bars.__exit__(*exc)

    def refine(self, key: str, seconds: float) -> None:
        """A better estimate of a stage not yet run."""
        self.estimates[key] = seconds

    def left(self) -> float:
        """Estimated seconds left in the whole run."""
        if self._current is None:
            return remaining(self.estimates, self.seconds)
        key, started, fraction = self._current
        return remaining(self.estimates, self.seconds, key, time.perf_counter() - started, fraction())

    def whole_line(self) -> str:
        return f"elapsed {clock(time.perf_counter() - self.started)}, about {clock(self.left())} left"

    @contextmanager
    def stage(self, key: str, unit: str, total: float | None) -> Iterator[Callable[[float], None]]:
        """The stage `key` (one of STAGES): yields advance(n), n units of `total` done."""
        number = [k for k, _ in STAGES].index(key) + 1
        name = f"{number}/{len(STAGES)} {LABELS[key]}" + (f" ({unit})" if unit else "")
        task = self.bars.add_task(name, total=total, note="")
        started = time.perf_counter()

        def fraction() -> float | None:
            done = self.bars.tasks[task].completed
            return min(1.0, done / total) if total else None

        def advance(n: float = 1) -> None:
            self.bars.update(task, advance=n)
            self._refresh(task, started)

        self._current = (key, started, fraction)
        self._refresh(task, started)
        try:
            yield advance
        finally:
            self._current = None
            self.seconds[key] = time.perf_counter() - started
            if total:
                self.bars.update(task, completed=total)
            self._refresh(task, started)
            if not self.live:
                self.console.print(f"calibrate {name}: {clock(self.seconds[key])} (estimated "
                                   f"{clock(self.estimates.get(key, 0.0))}); {self.whole_line()}", highlight=False)

    def _refresh(self, task, started: float) -> None:
        if not self.live:
            return
        done = self.bars.tasks[task]
        count = f"{done.completed:,.0f}/{done.total:,.0f} " if done.total else ""
        self.bars.update(task, note=f"{count}{clock(time.perf_counter() - started)}")
        elapsed = time.perf_counter() - self.started
        left = self.left()
        self.bars.update(self.whole, completed=elapsed / (elapsed + left) if elapsed + left > 0 else 1.0,
                         note=self.whole_line())
        self.bars.refresh()
