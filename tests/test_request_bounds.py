"""The library's bounds on request fields that size an allocation or reach llama.cpp as 32-bit integers
(tests/test_server.py has the server's): refused with one line, never wrapped. Before them,
repeat_last_n = 2**26 made the penalty sampler allocate 256 MiB, 2**31 - 1 about 8 GiB, and 2**40 reached
llama.cpp as 0 (penalties off); logprobs took any number of alternatives per token."""

from __future__ import annotations

import pytest

from specee_edge.engine import Engine, EngineConfig, SamplingParams
from specee_edge.engine.sampling import MAX_REPEAT_LAST_N, MAX_SEED, Sampler
from specee_edge.engine.stops import MAX_STOP_CHARS, MAX_STOPS, StopMatcher
from specee_edge.errors import SpecEEError
from tests.conftest import tiny_model_path

N_VOCAB = 256


@pytest.mark.parametrize("fields, message", [
    ({"repeat_last_n": 2**26}, rf"repeat_last_n must be an integer in \[0, {MAX_REPEAT_LAST_N}\], got 67108864"),
    ({"repeat_last_n": 2**31 - 1}, "repeat_last_n must be an integer"),
    ({"repeat_last_n": 2**40}, "repeat_last_n must be an integer"),  # wrapped to 0 before
    ({"repeat_last_n": -1}, "repeat_last_n must be an integer"),
    ({"repeat_last_n": 64.0}, "repeat_last_n must be an integer"),
    ({"top_k": 2**32 + 40}, r"top_k must be an integer in \[0, 2147483647\]"),  # wrapped to 40 before
    ({"seed": 2**32}, rf"seed must be an integer in \[0, {MAX_SEED}\]"),  # wrapped to 0 before
    ({"seed": 2**32 - 1}, "seed must be an integer"),  # llama.cpp's "random seed"
    ({"seed": True}, "seed must be an integer"),
])
def test_sampling_fields_out_of_bounds_are_refused(fields, message):
    with pytest.raises(SpecEEError, match=message):
        SamplingParams(repeat_penalty=1.1, **fields)


def test_the_sampler_checks_fields_set_after_construction():
    params = SamplingParams(repeat_penalty=1.1)
    params.repeat_last_n = 2**40
    with pytest.raises(SpecEEError, match="repeat_last_n must be an integer"):
        Sampler(params, N_VOCAB)


def test_the_bounds_themselves_are_accepted():
    for params in (SamplingParams(repeat_penalty=1.1, repeat_last_n=MAX_REPEAT_LAST_N, top_k=2**31 - 1, seed=MAX_SEED),
                   SamplingParams(repeat_last_n=0, top_k=0, seed=0)):
        Sampler(params, N_VOCAB, n_logprobs=8).close()


@pytest.mark.parametrize("n", [N_VOCAB + 1, 2**40, -1, True])
def test_logprobs_alternatives_are_bounded_by_the_vocabulary(n):
    with pytest.raises(SpecEEError, match=rf"logprobs must be an integer in \[0, {N_VOCAB}\]"):
        Sampler(SamplingParams(), N_VOCAB, n_logprobs=n)
    Sampler(SamplingParams(), N_VOCAB, n_logprobs=N_VOCAB).close()  # the whole distribution


def test_stop_strings_are_bounded():
    StopMatcher(["x" * MAX_STOP_CHARS] * MAX_STOPS)
    for stops in (["x"] * (MAX_STOPS + 1), ["x" * (MAX_STOP_CHARS + 1)]):
        with pytest.raises(SpecEEError, match=f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters"):
            StopMatcher(stops)


def test_the_engine_refuses_them_before_it_decodes(tiny_dir):
    engine = Engine(tiny_model_path(tiny_dir, "llama"), pack=None, config=EngineConfig(n_ctx=64, n_threads=1))
    prompt = engine.tokenize("hello world")
    with pytest.raises(SpecEEError, match="logprobs must be an integer"):
        engine.generate(prompt, max_tokens=4, logprobs=10**9)
    with pytest.raises(SpecEEError, match="at most 64 stop strings"):
        engine.generate(prompt, max_tokens=4, stop=[str(i) for i in range(100)])
    assert engine.cached_tokens == [] and engine.ctx.n_past == 0
    # Seeded: an unseeded draw ends the reply at the tiny model's end-of-generation token now and then.
    records = list(engine.stream(prompt, max_tokens=4, logprobs=N_VOCAB, sampling=SamplingParams(seed=1)))
    assert len(records) == 4 and all(len(r.logprobs.top) == N_VOCAB for r in records)
    engine.close()
