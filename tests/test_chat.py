"""specee-edge chat and generate: the real REPL through a pseudo-terminal, on the default model."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from rich.console import Console

from specee_edge.cli.render import depth_legend, depth_style, exit_setting, footer
from specee_edge.cli.repl import Repl, ReplSettings
from specee_edge.default_model import default_model_path
from specee_edge.engine import GREEDY, Engine, EngineConfig, GenerationStats, SamplingParams
from specee_edge.shipped import shipped_dir
from tests.conftest import LOOSE, STRICT, exiting_quality, write_two_level_pack

CLI = str(Path(sys.executable).with_name("specee-edge"))
PACK = shipped_dir() / "SmolLM2-135M-Instruct.Q4_1.specee.gguf"
FAST = ["--temp", "0", "-t", "1"]
FOOTER = r"\[ prompt [\d.]+ t/s \| generation [\d.]+ t/s \| [^\]\n]+ \]"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\r|\x07")


def test_the_default_models_pack_is_shipped():
    assert PACK.is_file(), f"the shipped pack {PACK.name} is part of the repository"


class Terminal:
    """A command on a pseudo-terminal, like a user at a keyboard (the stdlib's pexpect)."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: its stdin/stdout/stderr and controlling terminal are the pty
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # a shell's background job inherits SIGINT ignored
            os.execve(argv[0], argv, env)
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
        self.raw = b""
        self.pos = 0

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw.decode(errors="replace"))

    def _read(self, timeout: float) -> None:
        if select.select([self.fd], [], [], timeout)[0]:
            try:
                data = os.read(self.fd, 65536)
            except OSError:  # the child has gone
                data = b""
            if not data:
                raise EOFError(self.text[self.pos:])
            self.raw += data

    def expect(self, pattern: str, timeout: float = 30) -> re.Match:
        """Wait for `pattern` after what was matched so far."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while not (match := rx.search(self.text, self.pos)):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{pattern!r} not seen; after the last match: {self.text[self.pos:]!r}")
            self._read(left)
        self.pos = match.end()
        return match

    def prompt(self) -> None:
        self.expect(r">>> ")

    def send(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def line(self, text: str) -> None:
        self.prompt()
        self.send(text + "\r")

    def exit_code(self, timeout: float = 15) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self._read(0.1)
            except EOFError:
                pass
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
        os.kill(self.pid, 9)
        raise AssertionError(f"still running; last output: {self.text[-500:]!r}")


@pytest.fixture(scope="module")
def bare_model(tmp_path_factory) -> str:
    """The default model under a name with no pack: early exit off, and no pack to load (seconds saved)."""
    path = tmp_path_factory.mktemp("bare") / "SmolLM2-135M-Instruct.Q4_1-nopack.gguf"
    path.symlink_to(default_model_path())
    return str(path)


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    # the history file goes to tmp_path; rich lays tables out 160 wide, as on the pty
    return dict(os.environ, TERM="xterm", COLUMNS="160", SPECEE_CACHE=str(tmp_path))


def run_cli(*args: str, env: dict[str, str], stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([CLI, *args], input=stdin, capture_output=True, text=True, env=env, timeout=60)


# --- the REPL on a terminal --------------------------------------------------------------------

def test_repl_session(env, bare_model):
    term = Terminal([CLI, "chat", bare_model, "-n", "12", "-t", "1", "-s", "3"], env)  # llama.cpp's default sampling, seeded
    term.expect(r"specee-edge chat · SmolLM2-135M-Instruct\.Q4_1-nopack\.gguf \(llama, 30 layers")
    term.line("What is the capital of France?")
    answer = term.expect(r"France\?\n(.+)\n" + FOOTER).group(1)
    assert answer.strip()

    term.line("/set temp 0")
    term.expect(r"temp = 0\n")
    term.line("/show info")
    term.expect(r"pack\s+none: exact mode with prompt-lookup drafts, no exits")  # no pack: drafts all the same
    term.expect(r"sampling\s+temp 0, top_k 40")
    term.line("/frobnicate now")
    term.expect(r"error: unknown command /frobnicate \(/help lists them\)\n(?=>>> )")  # one line, then the prompt
    term.line("/clear")
    term.expect(r"conversation cleared")
    term.line("/show info")
    term.expect(r"context\s+4096 tokens, 0 in use")

    # Ctrl+C mid-reply: the reply stops, the conversation goes on
    term.line("/set n_predict 400")
    term.line("Tell me a long story about a dragon.")
    term.expect(r"dragon\.\n\S+\s+\S+")  # the reply is streaming
    term.send("\x03")
    term.expect(r"\[interrupted\]\n" + FOOTER)
    term.line("/stats")
    term.expect(r"finish_reason\s+interrupted")
    term.line("/set n_predict 8")
    term.line("And what is the dragon's name?")
    term.expect(r"name\?\n(?:.+\n)?" + FOOTER)
    term.line("/stats")
    term.expect(r"finish_reason\s+(length|stop)")
    term.line("/exit")
    assert term.exit_code() == 0


def test_repl_multiline_history_and_exits(env, bare_model):
    term = Terminal([CLI, "chat", "-n", "6", *FAST, "-m", bare_model], env)
    term.line('"""Say hello')
    term.expect(r"\.\.\. ")
    term.send('to me."""\r')
    term.expect(FOOTER)
    term.prompt()
    term.send("half a line")
    term.expect("half a line")  # readline has it (the echo comes from readline)
    time.sleep(0.3)  # a signal that lands while readline handles a key waits for the next key (CPython's readline)
    term.send("\x03")  # Ctrl+C on a half-typed line drops the line, not the REPL
    term.prompt()
    term.send("\x1b[A\r")  # arrow up: the last message again
    term.expect(r"Say hello\nto me\.\n(?:.+\n)?" + FOOTER)  # the block came back as one message
    term.prompt()
    time.sleep(0.3)  # as above: the prompt is drawn before readline waits for keys, and a signal then waits for one
    term.send("\x03")  # Ctrl+C at an empty prompt leaves
    assert term.exit_code() == 0
    assert (Path(env["SPECEE_CACHE"]) / "chat_history").is_file()


def test_repl_ctrl_d_and_no_pack_notice(env, bare_model):
    term = Terminal([CLI, "chat", "-m", bare_model, *FAST], env)
    model = re.escape(bare_model)
    term.expect(rf"no pack for {model}: exact mode with prompt-lookup drafts only; `specee-edge calibrate {model}`"
                " adds exit drafts and lossy quality levels")
    term.prompt()
    term.send("\x04")
    assert term.exit_code() == 0


# --- the REPL in-process: conversation bookkeeping ---------------------------------------------

@pytest.fixture(scope="module")
def engine():
    engine = Engine(None, pack=None, config=EngineConfig(n_ctx=1024, n_threads=1))
    yield engine
    engine.close()


def make_repl(engine: Engine, **settings) -> tuple[Repl, io.StringIO]:
    out = io.StringIO()
    console = Console(file=out, width=120)
    settings = {"sampling": SamplingParams(**vars(GREEDY)), "max_tokens": 6, **settings}
    return Repl(engine, ReplSettings(**settings), console, console), out


def interrupt_after(stream_chat, n_tokens: int):
    """stream_chat, but Ctrl+C arrives in the REPL after n_tokens records."""
    def stream(*args, **kwargs):
        inner = stream_chat(*args, **kwargs)
        try:
            for i, record in enumerate(inner):
                if i == n_tokens:
                    raise KeyboardInterrupt
                yield record
        finally:
            inner.close()
    return stream


def test_interrupted_reply_stays_in_the_conversation(engine, monkeypatch):
    engine.reset()
    repl, out = make_repl(engine, max_tokens=50)
    monkeypatch.setattr(engine, "stream_chat", interrupt_after(engine.stream_chat, 3))
    repl.send("Tell me a story.")
    monkeypatch.undo()
    assert [m["role"] for m in repl.messages] == ["user", "assistant"]
    assert repl.messages[1]["content"] and "[interrupted]" in out.getvalue()
    assert engine.ctx.n_past == len(engine.cached_tokens)  # the cache is consistent again
    repl.send("Shorter, please.")
    assert [m["role"] for m in repl.messages] == ["user", "assistant", "user", "assistant"]
    assert repl.last_stats.finish_reason in ("length", "stop")


def test_slash_commands_in_process(engine):
    engine.reset()
    repl, out = make_repl(engine)
    repl.send("Hi")
    assert repl.command("/regen") and [m["role"] for m in repl.messages] == ["user", "assistant"]
    repl.command("/set system You are a pirate.")
    assert repl.conversation()[0] == {"role": "system", "content": "You are a pirate."}
    repl.command("/set seed 7")
    repl.command("/set top_k 5")
    assert (repl.settings.sampling.seed, repl.settings.sampling.top_k) == (7, 5)
    repl.command("/set verbose on")
    assert repl.settings.verbose
    for bad in ("/set top_k many", "/set bogus 1", "/early-exit sideways", "/show nothing"):
        assert repl.command(bad)  # one error line, the REPL goes on
    repl.command("/set threshold 0.5")  # no pack here: refused
    repl.command("/early-exit on")  # no pack here: exact mode with prompt-lookup drafts, no error
    errors = [line for line in out.getvalue().splitlines() if line.startswith("error:")]
    assert len(errors) == 5, errors
    assert repl.command("/clear") and repl.messages == [] and engine.ctx.n_past == 0
    assert not repl.command("/bye")


def test_regen_without_a_reply(engine):
    repl, out = make_repl(engine)
    repl.command("/regen")
    assert "error: no reply to regenerate yet" in out.getvalue()


# --- generate ----------------------------------------------------------------------------------

def test_generate_json(env, bare_model):
    result = run_cli("generate", bare_model, "-p", "What is 2+2?", "-n", "8", *FAST, "--json", env=env)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert isinstance(out["text"], str) and out["text"]
    for key in ("prompt_tok_s", "decode_tok_s", "avg_exit_layer", "exit_rate", "predictor_calls_per_token",
                "verify_fail_rate", "draft_recall_at_k", "finish_reason", "n_prompt", "n_decode", "ms_per_token"):
        assert key in out["stats"], key
    assert out["stats"]["finish_reason"] in ("length", "stop")


def test_generate_plain_text_to_stdout_stats_to_stderr(env, tmp_path, bare_model):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Name a colour.")
    result = run_cli("generate", "-m", bare_model, "-f", str(prompt), "-n", "6", *FAST, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() and "t/s" not in result.stdout and "\x1b" not in result.stdout
    assert re.search(FOOTER, result.stderr)


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_missing_model_is_one_line_and_exit_1(env, command):
    result = run_cli(command, "missing.gguf", "-p" if command == "generate" else "-n", "hi" if command == "generate" else "4",
                     env=env)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == ["error: no such model file: missing.gguf"]
    assert result.stdout == ""


def test_bad_pack(env):
    bad = ["--pack", str(Path(__file__).with_name("conftest.py"))]
    result = run_cli("generate", "-p", "hi", "-n", "2", *FAST, *bad, env=env)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot read pack conftest.py: ")
    result = run_cli("chat", "-n", "2", *FAST, *bad, env=env, stdin="/exit\n")  # the REPL carries on without it
    assert result.returncode == 0, result.stderr
    assert re.search(r"\ncannot read pack conftest\.py: .*; early exit off \(exact mode with prompt-lookup drafts only\)\n",
                     result.stdout)


# --- with the shipped pack: exit statistics ----------------------------------------------------

def test_generate_json_with_the_shipped_pack(env):
    result = run_cli("generate", "-p", "What is the capital of France?", "-n", "24", *FAST, "--json",
                     "--quality", str(exiting_quality()), env=env)  # a level with layers on
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    stats = out["stats"]
    assert out["pack"] == str(PACK) and stats["early_exit"] is True
    assert stats["predictor_calls_per_token"] > 0
    assert 0 <= stats["avg_exit_layer"] <= 29 and 0 <= stats["exit_rate"] <= 1


def test_repl_exit_stats_with_the_shipped_pack(env):
    script = "What is the capital of France?\n/stats\n/show info\n/early-exit off\nWhat is the capital of Spain?\n/exit\n"
    result = run_cli("chat", "-n", "16", *FAST, "--color-exits", env=env, stdin=script)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert re.search(rf"pack {re.escape(PACK.name)}\) · early exit on, quality exact\n", out) and "exit depth: 0-14" in out
    # exact mode's footer: what its controller chose (plain steps, lookup rounds), then the level
    assert re.search(r"\| exact: plain \d+%.*\| quality exact \]", out)
    assert re.search(r"predictor_calls_per_token\s+[\d.]+", out)
    assert re.search(r"pack\s+" + re.escape(str(PACK)), out)
    assert "early exit off ]" in out  # the reply after /early-exit off


# --- rendering --------------------------------------------------------------------------------

def test_footer_and_exit_colours():
    stats = GenerationStats(30, True, n_prompt=10, n_decode=4, prompt_s=0.1, decode_s=0.2, exits=2, exit_layer_sum=80)
    assert footer(stats) == "[ prompt 100.0 t/s | generation 20.0 t/s | avg exit layer 20.0/29 | exit 50% ]"
    assert footer(stats, "quality 0.95, threshold 0.5").endswith("| exit 50% | quality 0.95, threshold 0.5 ]")
    assert footer(GenerationStats(30, False)).endswith("| early exit off ]")
    assert footer(GenerationStats(30, False), "quality 0.95").endswith("| early exit off ]")
    assert depth_style(None, 30) == ""
    assert depth_style(3, 30) == "bold green" and depth_style(28, 30) == "magenta"
    assert depth_legend(30).plain == "exit depth: 0-14 15-19 20-24 25-28 full (29)"


def test_set_threshold_reaches_the_native_predictors(default_model):
    """/set threshold changes the thresholds the C predictors use, not only the Python copy."""
    engine = Engine(default_model.info.path, config=EngineConfig(n_ctx=512, n_threads=2))
    repl, _ = make_repl(engine, max_tokens=24)
    repl.command("/set threshold 1")  # no sigmoid exceeds 1: the predictors run, nothing exits
    repl.send("Tell me about the moon.")
    assert engine.stats.exits == 0 and engine.stats.probes > 0
    repl.command("/set threshold 0")  # every positive verified: exits
    repl.command("/regen")
    assert engine.stats.exits > 0 and engine.stats.probes > 0
    engine.close()


# --- quality levels ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_level_pack(tmp_path_factory) -> Path:
    return write_two_level_pack(tmp_path_factory.mktemp("pack") / "two.specee.gguf")


def test_generate_at_a_quality_level(env, two_level_pack):
    result = run_cli("generate", "-p", "Name a colour.", "-n", "8", *FAST, "--pack", str(two_level_pack),
                     "--quality", str(LOOSE), env=env)
    assert result.returncode == 0, result.stderr
    assert re.search(rf"\| exit \d+% \| quality {LOOSE:g} \]", result.stderr)
    # the loose level keeps few whole answers identical: said in one line, before the reply
    assert re.search(rf"quality {LOOSE:g} keeps \d+% of greedy code answers identical", result.stderr)
    result = run_cli("generate", "-p", "Name a colour.", "-n", "8", *FAST, "--pack", str(two_level_pack),
                     "--quality", "0.95", "--threshold", "0.5", env=env)  # the lowest level at or above 0.95
    assert result.returncode == 0, result.stderr
    assert re.search(rf"\| quality {STRICT:g}, threshold 0.5 \]", result.stderr)
    assert "identical" not in result.stderr  # an explicit threshold is not a measured level: nothing to say


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("quality, message", [
    ("0", "error: a quality is an agreement with the full model, in (0, 1]: got 0"),
    ("best", "error: a quality is exact or an agreement with the full model such as 0.95 (or default), got 'best'"),
    ("1.5", "error: a quality is an agreement with the full model, in (0, 1]: got 1.5"),
])
def test_bad_quality_is_one_line_and_exit_1(env, command, quality, message):
    args = ["-p", "hi"] if command == "generate" else []
    result = run_cli(command, *args, "-n", "2", *FAST, "--quality", quality, env=env, stdin="/exit\n")
    assert result.returncode == 1  # chat too: the level was asked for, so no falling back to early exit off
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), lines
    assert result.stdout == ""


def test_set_quality_in_the_repl(default_model, two_level_pack):
    engine = Engine(default_model.info.path, pack=two_level_pack, config=EngineConfig(n_ctx=512, n_threads=1))
    repl, out = make_repl(engine)
    assert engine.policy.quality == STRICT  # the pack's default
    repl.command(f"/set quality {LOOSE}")
    assert engine.policy.quality == LOOSE and "quality = 0.9" in out.getvalue()
    repl.command("/set threshold 0.5")
    assert exit_setting(engine) == f"quality {LOOSE:g}, threshold 0.5"
    repl.send("Hi")
    assert re.search(rf"\| quality {LOOSE:g}, threshold 0.5 \]", out.getvalue())
    repl.command("/set quality default")  # the default level, and the threshold override is gone
    assert engine.policy.quality == STRICT and engine.policy.threshold is None
    repl.command("/set quality 0.95")  # the lowest level at or above it
    assert engine.policy.quality == STRICT
    repl.command("/show info")
    assert re.search(rf"quality\s+{STRICT:g} \(the pack's default\); the pack offers {LOOSE:g}, {STRICT:g}", out.getvalue())
    for bad in ("/set quality 0.999", "/set quality best", "/set quality"):
        repl.command(bad)
    assert engine.policy.quality == STRICT
    errors = [line for line in out.getvalue().splitlines() if line.startswith("error:")]
    assert len(errors) == 3, errors
    repl.command("/help")
    assert "/set quality exact|Q|default" in out.getvalue()
    engine.close()


def test_set_quality_without_a_pack(engine):
    repl, out = make_repl(engine)
    repl.command("/set quality 0.9")
    assert "error: no pack is loaded" in out.getvalue()
