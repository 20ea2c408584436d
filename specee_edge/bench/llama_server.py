"""llama.cpp's own llama-server as bench lanes: plain decoding (the bench's baseline), its self-speculation and its
speculation with a draft model.

Each lane is one server on a free loopback port, started with the bench's model, threads, context and batch size.
A prompt is sent as token ids (/completion with a token array: no chat template can differ) with the lane's
sampling and the prompt's seed; the prompt cache is off, so every request decodes its prompt afresh as the other
lanes do. Decode speed is read from the response's `timings`: predicted_ms spans the first token (sampled from
the prompt pass) to the last, so a prompt's decode steps are predicted_n - 1, as the other lanes count them. The
server's time includes its sampling and its per-token bookkeeping, as the Python lanes' includes theirs; at
temperature 0 that is llama.cpp's whole default sampler chain, where the Python lanes take a numpy argmax
(docs/bench.md says what each pays). A speculative lane's server must say, once up, that it set speculative
decoding up (GET /slots): one that did not would decode plainly under the lane's name, and its lane is dropped.
Under the bench's grammar, each request carries its GBNF in llama-server's own `grammar` field: the text every other
lane decodes under; a server that refuses it answers an error, and its lane is dropped.

The binary comes from tools/build_llama_server.py (the runtime's vendored llama.cpp, its flags; cached), or from
--llama-server PATH / SPECEE_LLAMA_SERVER.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specee_edge.bench.report import twin_of
from specee_edge.bench.runner import Stopwatch, one_line, prompt_sampling
from specee_edge.engine.sampling import GREEDY, SamplingParams
from specee_edge.errors import SpecEEError
from specee_edge.grammar import Grammar
from specee_edge.runtime.costs import Timing
from specee_edge.runtime.placement import OFFLOAD_FIRST_KEY, Placement

PLAIN = "llama-server"  # the plain lane's name; a speculative lane is named by its --spec-type, or `draft`
# llama.cpp's self-speculative types (common/speculative.cpp), each a lane behind --spec-type
SPEC_TYPES = ("ngram-mod", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-cache")
# the fastest at their defaults in a 2-core trial: ngram-mod greedy, ngram-map-k sampled (docs/bench.md)
DEFAULT_SPEC_TYPES = ("ngram-mod", "ngram-map-k")
DRAFT = "draft"  # the lane of -md DRAFT (--draft-model)
# llama.cpp's classic speculation with a separate draft model (common/speculative.cpp). The type must be named:
# --spec-type defaults to none, and -md alone selects only the drafts a GGUF announces (MTP, DFlash, EAGLE)
DRAFT_SPEC_TYPE = "draft-simple"
BUILDER = Path(__file__).resolve().parents[2] / "tools" / "build_llama_server.py"  # in a source checkout
ENV_BINARY = "SPECEE_LLAMA_SERVER"
BUILD_MINUTES = "about 30 minutes"  # 40 min measured on a loaded 2-core VM (docs/bench.md)
# what patches/0013 has llama.cpp log where --offload-first took: a llama-server without it ignores the key
OFFLOAD_FIRST_LOGGED = f"{OFFLOAD_FIRST_KEY}: the first repeating layers go to the devices"
START_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 5.0


class LlamaServerError(Exception):
    """A llama-server that could not be built, started or asked; its message is one line."""


def has_terminal() -> bool:
    """Whether someone watches: a build of llama-server takes half an hour, so the bench starts one only where
    stdin and stderr are a terminal (not in CI, not under `make bench`, which reads stdin from /dev/null)."""
    return sys.stdin is not None and sys.stdin.isatty() and sys.stderr.isatty()


def find_binary(explicit: Path | None = None, build: bool = True) -> Path:
    """The llama-server to run: `explicit`, else $SPECEE_LLAMA_SERVER, else the cached build (built first when
    `build`, its progress on this terminal). Raises LlamaServerError with one line on failure, saying how to build
    it ahead or skip its lanes where it is not built."""
    named = explicit or (Path(os.environ[ENV_BINARY]) if os.environ.get(ENV_BINARY) else None)
    if named is not None:
        if not named.is_file() or not os.access(named, os.X_OK):
            raise LlamaServerError(f"no llama-server program at {named}")
        return named
    if not BUILDER.is_file():
        raise LlamaServerError(f"no llama-server: pass --llama-server PATH or set {ENV_BINARY} (building it needs a "
                               "source checkout's tools/build_llama_server.py)")
    found = subprocess.run([sys.executable, str(BUILDER), "--print-path"], capture_output=True, text=True)
    path = Path(found.stdout.strip().splitlines()[-1]) if found.stdout.strip() else None
    if found.returncode != 0 and build:
        print(f"building llama-server from the runtime's llama.cpp: once, cached; {BUILD_MINUTES} on 2 cores "
              "(--no-llama-server skips it and its lanes)", file=sys.stderr, flush=True)
        built = subprocess.run([sys.executable, str(BUILDER)], stdout=subprocess.PIPE, text=True)  # progress on stderr's tty
        path = Path(built.stdout.strip().splitlines()[-1]) if built.returncode == 0 and built.stdout.strip() else None
        if path is None:
            raise LlamaServerError(f"building llama-server failed (exit {built.returncode}): see the log named above")
    if path is None or not path.is_file():
        raise LlamaServerError(f"llama-server is not built ({BUILD_MINUTES} on 2 cores, once: `make llama-server` or "
                               "tools/build_llama_server.py); --no-llama-server skips its lanes")
    return path


def free_port() -> int:
    """A loopback port free now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerSetup:
    """What every lane's server shares: the bench's model, threads, context and batch size, and its split: the
    placement's flags and the devices the bench's own copy of the model put layers on (Model.layer_devices(): where
    a server's log must show weights)."""

    binary: Path
    model: Path
    threads: int
    n_ctx: int
    flash_attn: str = "auto"  # -fa, as the bench's other lanes run
    n_batch: int = 512  # llama-cpp-python's Llama default, which the bench's other lanes use
    placement: Placement = field(default_factory=Placement)  # the bench's split, pinned (-ngl, -ts, --fit off, ...)
    devices: tuple[str, ...] = ()  # the devices other than the CPU that hold the bench's offloaded layers

    @property
    def splits(self) -> bool:
        """Whether the model is split over devices, so that the server's log must show the split."""
        return self.placement.n_gpu_layers > 0 or bool(self.devices)

    def args(self, port: int, extra: Sequence[str]) -> list[str]:
        # --swa-full: a sliding-window model keeps every token's K/V, as the engine's contexts do; -lv 4: llama.cpp
        # logs where it put the layers (offloaded N/M, each device's buffer) at its INFO level, which the server's
        # log shows from verbosity 4 (its default, 3, hides it); once at load, a few lines a request after that
        return [str(self.binary), "-m", str(self.model), "-t", str(self.threads), "-tb", str(self.threads),
                "-c", str(self.n_ctx), "-b", str(self.n_batch), "-ub", str(self.n_batch), "-fa", self.flash_attn,
                *self.placement.llama_server_args(),
                *(["-lv", "4"] if self.splits else []),
                "--swa-full", "-np", "1", "--host", "127.0.0.1", "--port", str(port), *extra]


def placement_not_taken(log: str, setup: ServerSetup) -> str | None:
    """What a server's start-up log says against its having split the model as the bench's other lanes do, in a
    few words; None where it did. llama.cpp logs how many layers it offloaded and each buffer's device; patches/0013
    logs that the first layers went to the devices (--offload-first), which a stock llama-server, built elsewhere
    and given as --llama-server-bin, accepts as an unknown key and ignores."""
    wanted = setup.placement.n_gpu_layers
    if wanted > 0:
        offloaded = re.search(r"offloaded (\d+)/(\d+) layers to GPU", log)
        if offloaded is None:
            return "its log does not say that it offloaded any layer"
        done, most = int(offloaded.group(1)), int(offloaded.group(2))
        if done != min(wanted, most):
            return f"it offloaded {done} of {most} layers, not {min(wanted, most)}"
    missing = [device for device in setup.devices if not re.search(rf"{re.escape(device)}\s+model buffer size", log)]
    if missing:
        return f"it put no weights on {', '.join(missing)}"
    if setup.placement.offload_first and OFFLOAD_FIRST_LOGGED not in log:
        return ("it kept llama.cpp's own order, not --offload-first's (a llama-server without specee-edge's patches "
                "ignores the key)")
    return None


def draft_args(setup: ServerSetup, draft_model: Path) -> list[str]:
    """The draft lane's flags: -md DRAFT with its speculation named (DRAFT_SPEC_TYPE), and the draft pinned as
    ServerSetup pins the target, else llama.cpp would pick for it: as many layers on the GPU as the target's (-ngld;
    its default is automatic) and the bench's threads (-td, -tbd). llama.cpp has no context size of a draft's own:
    the draft's context is the target's -c."""
    return ["-md", str(draft_model), "--spec-type", DRAFT_SPEC_TYPE, "-ngld", str(setup.placement.n_gpu_layers),
            "-td", str(setup.threads), "-tbd", str(setup.threads)]


def speculates(name: str) -> bool:
    """Whether a lane's server must speculate: every lane but plain (and plain's repeat)."""
    return (twin_of(name) or name) != PLAIN


def lane_args(name: str, setup: ServerSetup, draft_model: Path | None = None) -> list[str]:
    """The extra llama-server flags of a lane; a repeat lane's are its twin's."""
    name = twin_of(name) or name
    if name == PLAIN:
        return []
    if name == DRAFT:
        if draft_model is None:
            raise LlamaServerError("the draft lane needs --draft-model")
        return draft_args(setup, draft_model)
    if name not in SPEC_TYPES:
        raise LlamaServerError(f"unknown --spec-type {name!r}: choose from {', '.join(SPEC_TYPES)}")
    return ["--spec-type", name]


def parse_spec_types(spec: str | None) -> list[str]:
    """--spec-type: None the defaults, `all`, `none`, or a comma list of llama.cpp's names."""
    if spec is None:
        return list(DEFAULT_SPEC_TYPES)
    spec = spec.strip().lower()
    if spec in ("all", "none"):
        return list(SPEC_TYPES) if spec == "all" else []
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in SPEC_TYPES]
    if unknown:
        raise SpecEEError(f"unknown --spec-type {', '.join(unknown)}: choose from {', '.join(SPEC_TYPES)}, all or none")
    return names


@dataclass
class Completion:
    tokens: list[int]
    steps: int             # decode steps: predicted_n - 1 (the first token comes from the prompt pass)
    seconds: float         # predicted_ms
    drafted: int = 0       # draft_n
    accepted: int = 0      # draft_n_accepted


def completion(answer: dict) -> Completion:
    """A /completion reply's tokens and timings. A reply without `timings` (its predicted_n and predicted_ms: a
    llama-server of another version, --llama-server-bin) raises LlamaServerError: read as 0 steps in 0 s, it would
    make every speed-up against it 0."""
    timings = answer.get("timings")
    if not isinstance(timings, dict) or "predicted_n" not in timings or "predicted_ms" not in timings:
        raise LlamaServerError("llama-server's reply has no timings (predicted_n, predicted_ms): "
                               "a llama-server of another version?")
    return Completion(tokens=[int(t) for t in answer.get("tokens", [])],
                      steps=max(int(timings["predicted_n"]) - 1, 0), seconds=float(timings["predicted_ms"]) / 1e3,
                      drafted=int(timings.get("draft_n", 0)), accepted=int(timings.get("draft_n_accepted", 0)))


def why_not_speculating(slots: object) -> str | None:
    """What GET /slots says against speculation, in a few words; None where every slot has speculative decoding set
    up (its `speculative`: true). llama-server starts without it where it cannot (a type it did not set up, a
    context that cannot drop a rejected draft's tokens), and then decodes plainly, its timings without draft_n."""
    if not isinstance(slots, list) or not slots or not all(isinstance(slot, dict) for slot in slots):
        return "/slots lists no slots"
    if any("speculative" not in slot for slot in slots):
        return "/slots has no `speculative` field (a llama-server of another version?)"
    plain = [str(slot.get("id", i)) for i, slot in enumerate(slots) if slot["speculative"] is not True]
    return f"/slots reports speculative false for slot {', '.join(plain)}" if plain else None


class LlamaServer:
    """One llama-server process; a context manager that stops it (terminate, then kill) however the block ends.
    speculative: the lane speculates, which the server is asked to confirm once it is up (why_not_speculating): a
    server that would decode plainly instead is a LlamaServerError, never a lane reported as if it drafted."""

    def __init__(self, setup: ServerSetup, extra: Sequence[str] = (), speculative: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
        self.log_path = Path(self.log.name)
        self.keep_log = False  # a server that failed keeps its log, which its error line names
        self.proc = subprocess.Popen(setup.args(self.port, extra), stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        try:
            self._wait_ready()
            self._check_placement(setup)
            if speculative:
                self._check_speculates()
        except BaseException:
            self.stop()
            raise
        self.speculates = speculative

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LlamaServerError(f"llama-server exited ({self.proc.returncode}) while starting: "
                                       f"{self.last_log_line()} (log: {self.log_path})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        self.keep_log = True
        raise LlamaServerError(f"llama-server did not start within {START_TIMEOUT_S:.0f} s (log: {self.log_path})")

    def _check_placement(self, setup: ServerSetup) -> None:
        why = placement_not_taken(self.log_path.read_text(errors="replace"), setup)
        if why is not None:
            self.keep_log = True
            raise LlamaServerError(f"llama-server did not split the model as the other lanes do: {why} "
                                   f"(log: {self.log_path})")

    def _check_speculates(self) -> None:
        why = why_not_speculating(self._get("/slots"))
        if why is not None:
            self.keep_log = True
            raise LlamaServerError(f"llama-server set up no speculative decoding ({why}): the lane would decode "
                                   f"plainly (log: {self.log_path})")

    def _get(self, path: str) -> object:
        """The JSON of a GET; a server that does not answer it is a LlamaServerError."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=START_TIMEOUT_S) as reply:
                return json.load(reply)
        except urllib.error.HTTPError as e:
            self.keep_log = True
            raise LlamaServerError(f"llama-server answered {e.code} to {path}: "
                                   f"{e.read().decode(errors='replace')[:200]}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError) as e:
            raise LlamaServerError(f"llama-server did not answer {path} ({one_line(e)}) "
                                   f"(log: {self.log_path})") from None

    def last_log_line(self) -> str:
        self.keep_log = True
        lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        return lines[-1].strip() if lines else "no output"

    def complete(self, prompt: Sequence[int], n_predict: int, sampling: SamplingParams,
                 grammar: Grammar | None = None) -> Completion:
        """Decode up to n_predict tokens after the prompt's token ids, under `grammar` if any."""
        body = request_body(prompt, n_predict, sampling, grammar)
        request = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
                answer = json.load(reply)
        except urllib.error.HTTPError as e:
            self.keep_log = True
            raise LlamaServerError(f"llama-server answered {e.code}: {e.read().decode(errors='replace')[:200]}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise LlamaServerError(f"llama-server did not answer ({e}); {self.last_log_line()} "
                                   f"(log: {self.log_path})") from None
        return completion(answer)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if not self.keep_log:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def request_body(prompt: Sequence[int], n_predict: int, sampling: SamplingParams,
                 grammar: Grammar | None = None) -> dict:
    """A /completion request: the prompt's token ids, the lane's sampling and seed, the prompt cache off, and the
    run's grammar in llama-server's `grammar` field (GBNF as given: llama-server converts nothing, so it runs the
    very text the other lanes run)."""
    body = {"prompt": list(map(int, prompt)), "n_predict": n_predict, "cache_prompt": False,
            "return_tokens": True, "stream": False, "seed": sampling.seed or 0,
            "temperature": max(sampling.temperature, 0.0), "top_k": sampling.top_k, "top_p": sampling.top_p,
            "min_p": sampling.min_p, "repeat_penalty": sampling.repeat_penalty,
            "repeat_last_n": sampling.repeat_last_n, "frequency_penalty": sampling.frequency_penalty,
            "presence_penalty": sampling.presence_penalty}
    return (body | {"grammar": grammar.text}) if grammar is not None else body


@dataclass
class ServerLane:
    """A llama-server lane: answer() decodes the whole answer in one request, timed by the server's own timings
    (`watch`, the Python lanes' stopwatch, has nothing to time). The prompt's sampling and grammar are the
    bench's."""

    name: str
    server: LlamaServer
    max_tokens: int
    sampling: SamplingParams = field(default_factory=lambda: GREEDY)
    grammar: Grammar | None = None
    timing: Timing = field(default_factory=Timing)
    outputs: list[list[int]] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0

    @property
    def speculates(self) -> bool:
        """Its server confirmed speculative decoding at start (LlamaServer's check)."""
        return self.server.speculates

    def answer(self, prompt: Sequence[int], watch: Stopwatch) -> None:
        self.timing.begin_prompt()
        done = self.server.complete(prompt, self.max_tokens, prompt_sampling(self.sampling, len(self.outputs)),
                                    self.grammar)
        self.outputs.append(done.tokens)
        self.timing.add_span(done.steps, done.seconds)
        self.drafted += done.drafted
        self.accepted += done.accepted
