"""The chat REPL: read a message (readline history, \"\"\" blocks), stream the reply, slash commands.

Ctrl+C during a reply stops it and keeps the partial reply in the conversation; Ctrl+C at an empty
prompt, Ctrl+D, /exit or /bye leave.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from specee_edge.cli.render import TokenPrinter, depth_legend, engine_info, exit_setting, footer, level_warning, stats_table
from specee_edge.engine import Engine, GenerationStats, SamplingParams
from specee_edge.errors import ContextFullError, SpecEEError
from specee_edge.grammar import Grammar
from specee_edge.pack import parse_quality, quality_name

try:  # arrow-key editing and history; absent on some platforms (the REPL works without it)
    import readline
except ImportError:  # pragma: no cover
    readline = None  # type: ignore[assignment]

PROMPT = ">>> "
CONTINUATION = "... "
BLOCK = '"""'
HISTORY_LENGTH = 1000

HELP: tuple[tuple[str, str], ...] = (
    ("/help", "this list (also /?)"),
    ("/exit, /bye", "leave (also Ctrl+D, or Ctrl+C at an empty prompt)"),
    ("/clear", "forget the conversation (history and KV cache)"),
    ("/regen", "answer the last message again"),
    ("/set temp|top_k|top_p|min_p N", "sampling"),
    ("/set repeat_penalty|seed|n_predict N", "seed -1: random; n_predict -1: until the context is full"),
    ("/set system TEXT", "the system prompt (no TEXT: the template's default)"),
    ("/set quality exact|Q|default", "the pack's quality level: exact (drafts verified: the model's own replies) or an agreement such as 0.95"),
    ("/set threshold N", "exit threshold of every predictor layer (0..1), instead of the level's"),
    ("/set verbose on|off", "the /stats table after every reply"),
    ("/early-exit on|off", "speculative early exit and exact mode's drafts (off: plain decoding)"),
    ("/stats", "detail of the last reply"),
    ("/show info", "model, pack, schedule and settings"),
    ('"""', "starts and ends a multi-line message"),
    ("//text", "sends /text as a message"),
)

SAMPLING_KEYS: dict[str, tuple[str, Callable[[str], float | int]]] = {
    "temp": ("temperature", float),
    "temperature": ("temperature", float),
    "top_k": ("top_k", int),
    "top_p": ("top_p", float),
    "min_p": ("min_p", float),
    "repeat_penalty": ("repeat_penalty", float),
}


@dataclass
class ReplSettings:
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 512         # -1: until EOS or the context is full
    system: str | None = None     # None: the chat template's default
    chat_template: str | None = None
    verbose: bool = False
    color_exits: bool = False
    grammar: Grammar | None = None  # --grammar, --grammar-file, -j: every reply follows it


def parse_switch(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("on", "true", "1", "yes"):
        return True
    if lowered in ("off", "false", "0", "no"):
        return False
    raise SpecEEError(f"expected on or off, got {value!r}")


class Repl:
    def __init__(self, engine: Engine, settings: ReplSettings, console: Console, err_console: Console,
                 history_file: Path | None = None):
        self.engine = engine
        self.settings = settings
        self.console = console
        self.err_console = err_console
        self.history_file = history_file
        self.messages: list[dict[str, str]] = []  # the conversation, without the system prompt
        self.last_stats: GenerationStats | None = None

    # --- the loop ----------------------------------------------------------------------------

    def run(self) -> None:
        with self._history():
            while True:
                text = self.read_message()
                if text is None:
                    return
                if not text.strip():
                    continue
                if text.startswith("/") and not text.startswith("//"):
                    if not self.command(text):
                        return
                    continue
                self.send(text[1:] if text.startswith("//") else text)  # "//" sends a message that starts with "/"

    @contextlib.contextmanager
    def _history(self):
        if not _uses_readline() or self.history_file is None:
            yield
            return
        readline.set_history_length(HISTORY_LENGTH)
        with contextlib.suppress(OSError):
            readline.read_history_file(self.history_file)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                self.history_file.parent.mkdir(parents=True, exist_ok=True)
                readline.write_history_file(self.history_file)

    def read_message(self) -> str | None:
        """One message: a line, or a \"\"\" block. None: leave (Ctrl+D, or Ctrl+C on an empty line)."""
        while True:
            try:
                line = input(PROMPT)
            except EOFError:
                self.console.print()
                return None
            except KeyboardInterrupt:
                self.console.print()
                if _uses_readline() and readline.get_line_buffer().strip():
                    continue  # Ctrl+C drops a half-typed line, as in a shell
                return None
            if line.lstrip().startswith(BLOCK):
                first = _history_length() - 1
                block = self._read_block(line.lstrip()[len(BLOCK):])
                if block is None:
                    continue
                _fold_history(first, block)
                return block
            return line

    def _read_block(self, first: str) -> str | None:
        """The lines up to one that ends with \"\"\" (Ctrl+C abandons the block; Ctrl+D ends it)."""
        lines: list[str] = []
        line = first
        while True:
            stripped = line.rstrip()
            if stripped.endswith(BLOCK):
                lines.append(stripped[: -len(BLOCK)])
                break
            lines.append(line)
            try:
                line = input(CONTINUATION)
            except EOFError:
                self.console.print()
                break
            except KeyboardInterrupt:
                self.console.print()
                return None
        return "\n".join(lines).strip("\n") or None

    # --- replies -----------------------------------------------------------------------------

    def conversation(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.settings.system}] if self.settings.system is not None else []
        return system + self.messages

    def send(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})
        if not self.reply():
            self.messages.pop()  # unanswered: the message leaves the conversation

    def reply(self) -> bool:
        """Stream the answer to the conversation; it joins the conversation, even when interrupted.

        False: nothing was generated (an error, or Ctrl+C before the first token).
        """
        s = self.settings
        max_tokens = s.max_tokens if s.max_tokens >= 0 else self.engine.ctx.n_ctx
        printer = TokenPrinter(self.console, self.engine.n_layer, s.color_exits)
        pieces: list[str] = []
        interrupted, error = False, None
        try:
            stream = self.engine.stream_chat(self.conversation(), chat_template=s.chat_template,
                                             max_tokens=max_tokens, sampling=s.sampling, grammar=s.grammar)
            try:
                for record in stream:
                    pieces.append(record.text)
                    printer(record)
            finally:
                stream.close()
        except KeyboardInterrupt:
            interrupted = True
        except SpecEEError as e:
            error = e
        text = "".join(pieces)
        if text and not text.endswith("\n"):
            self.console.print()
        if error is not None:
            hint = "; /clear starts over" if isinstance(error, ContextFullError) and len(self.messages) > 1 else ""
            self.error(f"{error}{hint}")
        if not text:
            if interrupted:
                self.console.print("[interrupted before the reply began]", style="dim", markup=False, highlight=False)
            if error is not None or interrupted:
                return False
        self.messages.append({"role": "assistant", "content": text})
        self._after_reply(interrupted)
        return True

    def _after_reply(self, interrupted: bool) -> None:
        stats = self.last_stats = self.engine.stats
        if interrupted:
            self.console.print("[interrupted]", style="dim", markup=False, highlight=False)
        elif stats.finish_reason == "context":
            self.error("the context is full: /clear to start over (or a larger -c/--ctx-size)")
        self.console.print(footer(stats, exit_setting(self.engine)), style="dim", highlight=False, soft_wrap=True)
        if self.settings.verbose:
            self.console.print(stats_table(stats))

    def error(self, message: str) -> None:
        self.err_console.print(Text.assemble(("error:", "red"), f" {message}"), highlight=False, soft_wrap=True)

    # --- slash commands ----------------------------------------------------------------------

    def command(self, line: str) -> bool:
        """Run a slash command; False means leave."""
        name, _, arg = line.strip().partition(" ")
        name = name.lower()
        if name in ("/exit", "/bye", "/quit"):
            return False
        handler = {
            "/help": self.cmd_help, "/?": self.cmd_help, "/clear": self.cmd_clear, "/regen": self.cmd_regen,
            "/set": self.cmd_set, "/early-exit": self.cmd_early_exit, "/stats": self.cmd_stats,
            "/show": self.cmd_show,
        }.get(name)
        if handler is None:
            self.error(f"unknown command {name} (/help lists them)")
            return True
        try:
            handler(arg.strip())
        except SpecEEError as e:
            self.error(str(e))
        return True

    def cmd_help(self, _: str) -> None:
        table = Table(show_header=False, box=None, padding=(0, 2, 0, 2))
        table.add_column(no_wrap=True)
        table.add_column()
        for usage, text in HELP:
            table.add_row(usage, text)
        self.console.print(table, highlight=False, markup=False)

    def cmd_clear(self, _: str) -> None:
        self.messages.clear()
        self.engine.reset()
        self.console.print("conversation cleared", style="dim")

    def cmd_regen(self, _: str) -> None:
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise SpecEEError("no reply to regenerate yet")
        previous = self.messages.pop()
        if not self.reply():
            self.messages.append(previous)

    def cmd_set(self, arg: str) -> None:
        key, _, value = arg.partition(" ")
        key, value = key.lower(), value.strip()
        if key == "system":
            self.settings.system = value or None
            self.console.print(f"system prompt {'set' if value else 'reset to the template default'}", style="dim")
            return
        if not value:
            raise SpecEEError("usage: /set temp|top_k|top_p|min_p|repeat_penalty|seed|n_predict|system|quality|threshold|verbose VALUE")
        if key == "quality":
            self.engine.set_quality(parse_quality(value))
            quality = self.engine.policy.quality  # the level in use: the lowest at or above the value
            self.console.print(f"quality = {quality_name(quality)}" if quality is not None else "the pack has no quality levels: "
                               "its own thresholds again", style="dim", highlight=False)
            if warning := level_warning(self.engine):
                self.console.print(warning, style="yellow", highlight=False, markup=False)
            return
        if key == "verbose":
            self.settings.verbose = parse_switch(value)
        elif key == "threshold":
            self.set_threshold(_number(value, float))
        elif key == "seed":
            seed = _number(value, int)
            self.settings.sampling.seed = None if seed < 0 else seed
        elif key in ("n_predict", "num_predict"):
            self.settings.max_tokens = _number(value, int)
        elif key in SAMPLING_KEYS:
            attr, kind = SAMPLING_KEYS[key]
            setattr(self.settings.sampling, attr, _number(value, kind))
        else:
            raise SpecEEError(f"unknown setting {key!r} (/help lists them)")
        self.console.print(f"{key} = {value}", style="dim", highlight=False)

    def set_threshold(self, value: float) -> None:
        policy = self.engine.policy
        if policy is None:
            raise SpecEEError("no pack is loaded, so there are no thresholds to set")
        if not 0.0 <= value <= 1.0:
            raise SpecEEError(f"the threshold is a probability: 0..1, got {value:g}")
        policy.set_threshold(value)  # into the native predictors too

    def cmd_early_exit(self, arg: str) -> None:
        if not arg:
            self.console.print(f"early exit is {'on' if self.engine.early_exit else 'off'}")
            return
        self.engine.set_early_exit(parse_switch(arg))
        self.console.print(f"early exit {'on' if self.engine.early_exit else 'off'}", style="dim")

    def cmd_stats(self, _: str) -> None:
        if self.last_stats is None:
            raise SpecEEError("no reply yet")
        self.console.print(stats_table(self.last_stats))

    def cmd_show(self, arg: str) -> None:
        if arg not in ("", "info"):
            raise SpecEEError(f"unknown /show {arg!r}: try /show info")
        s = self.settings
        self.console.print(engine_info(self.engine, s.sampling, s.max_tokens, s.system))
        if s.color_exits:
            self.console.print(depth_legend(self.engine.n_layer))


def _uses_readline() -> bool:
    """input() edits with readline only on a terminal."""
    return readline is not None and sys.stdin.isatty() and sys.stdout.isatty()


def _history_length() -> int:
    return readline.get_current_history_length() if _uses_readline() else 0


def _fold_history(first: int, text: str) -> None:
    """A \"\"\" block's lines, history entries from `first` on, become one entry: the message itself."""
    if not _uses_readline():
        return
    for pos in range(readline.get_current_history_length() - 1, first - 1, -1):
        readline.remove_history_item(pos)
    readline.add_history(text)


def _number(value: str, kind: Callable[[str], float | int]) -> float | int:
    try:
        return kind(value)
    except ValueError:
        raise SpecEEError(f"not a {'whole ' if kind is int else ''}number: {value!r}") from None
