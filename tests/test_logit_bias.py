"""One check of a logit bias, made by the library's Sampler and by the server (tests/test_server.py): token ids
of the vocabulary, biases finite or -inf (a ban). Before it a negative id wrapped to the vocabulary's end and
one past it raised a bare IndexError."""

from __future__ import annotations

import math

import numpy as np
import pytest

from specee_edge.engine import Engine, EngineConfig, SamplingParams
from specee_edge.engine.sampling import Sampler
from specee_edge.errors import SpecEEError
from tests.conftest import tiny_model_path

N_VOCAB = 256


@pytest.mark.parametrize("bias, message", [
    ({-1: 2.0}, r"logit_bias names tokens outside the vocabulary \[0, 256\): \[-1\]"),
    ({3: 1.0, N_VOCAB: 1.0}, r"outside the vocabulary \[0, 256\): \[256\]"),
    ({"7": 1.0}, r"outside the vocabulary \[0, 256\): \['7'\]"),  # JSON's keys are strings: ids are ints
    ({True: 1.0}, r"outside the vocabulary \[0, 256\): \[True\]"),
    ({5: math.nan}, r"logit_bias gives token 5 the bias nan: a bias is a finite number, or -inf"),
    ({5: math.inf}, r"logit_bias gives token 5 the bias inf"),
    ({5: "ban"}, r"logit_bias gives token 5 the bias 'ban'"),
])
def test_the_sampler_refuses_a_bias_it_cannot_apply(bias, message):
    for temperature in (0.0, 0.8):  # greedy decoding with a bias goes through the chain too
        with pytest.raises(SpecEEError, match=message):
            Sampler(SamplingParams(temperature=temperature, logit_bias=bias), N_VOCAB)


def test_a_ban_and_finite_biases_are_applied():
    logits = np.zeros(N_VOCAB, np.float32)
    sampler = Sampler(SamplingParams(temperature=0.0, logit_bias={np.int64(9): 3.0, 10: 4.0, 0: -math.inf}), N_VOCAB)
    assert sampler(logits) == 10
    sampler.close()


def test_the_engine_refuses_a_bad_bias_before_it_decodes(tiny_dir):
    engine = Engine(tiny_model_path(tiny_dir, "llama"), pack=None, config=EngineConfig(n_ctx=64, n_threads=1))
    prompt = engine.tokenize("hello world")
    with pytest.raises(SpecEEError, match=r"outside the vocabulary \[0, 256\): \[-3\]"):
        engine.generate(prompt, max_tokens=4, sampling=SamplingParams(logit_bias={-3: -math.inf}))
    assert engine.cached_tokens == [] and engine.ctx.n_past == 0
    assert len(engine.generate(prompt, max_tokens=4, sampling=SamplingParams(seed=1, logit_bias={5: -math.inf})).tokens) == 4
    engine.close()
