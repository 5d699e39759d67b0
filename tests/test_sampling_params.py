"""Tests for jaxserve.sampling_params: vLLM's defaults, normalisation, and every validation rule."""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import pytest

from jaxserve.sampling_params import SamplingParams

pytestmark = pytest.mark.cpu_test

# vLLM's SamplingParams fields that jaxserve supports, in vLLM's order, with vLLM's defaults.
VLLM_DEFAULTS = [("n", 1), ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                 ("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("seed", None),
                 ("stop", None), ("stop_token_ids", None), ("ignore_eos", False), ("max_tokens", 16),
                 ("min_tokens", 0), ("logprobs", None), ("prompt_logprobs", None), ("detokenize", True),
                 ("skip_special_tokens", True), ("spaces_between_special_tokens", True),
                 ("include_stop_str_in_output", False)]


def test_fields_defaults_and_order_match_vllm():
    fields = dataclasses.fields(SamplingParams)
    assert [(f.name, f.default) for f in fields] == VLLM_DEFAULTS
    params = SamplingParams()
    assert params.stop == [] and params.stop_token_ids == []  # None lists are normalised
    assert not params.is_greedy and params.max_tokens == 16
    # Positional arguments land where they do in vLLM.
    assert SamplingParams(2, 0.1, 0.2, 1.1, 0.7, 0.9, 5).top_k == 5


def test_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=[5, 3, 5, np.int64(7)]).stop_token_ids == [5, 3, 7]  # deduped, ints
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=0).seed == 0 and SamplingParams(seed=-5).seed == -5
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(logprobs=True).logprobs == 1
    params = SamplingParams(temperature=1, top_p=np.float32(0.5), max_tokens=None)
    assert type(params.temperature) is float and type(params.top_p) is float and params.max_tokens is None
    assert SamplingParams(min_tokens=100, max_tokens=None).min_tokens == 100


def test_greedy_resets_filters_and_rejects_n_above_one():
    params = SamplingParams(temperature=0.0, top_p=0.5, top_k=10, min_p=0.2)
    assert params.is_greedy and (params.top_p, params.top_k, params.min_p) == (1.0, 0, 0.0)
    with pytest.raises(ValueError, match=r"n must be 1 when using greedy sampling .*got n=2"):
        SamplingParams(temperature=0, n=2)
    assert SamplingParams(temperature=0.5, n=4).n == 4


def test_tiny_temperature_is_clamped_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxserve.sampling_params"):
        params = SamplingParams(temperature=1e-4)
    assert params.temperature == 0.01 and not params.is_greedy
    assert "temperature 0.0001" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxserve.sampling_params"):
        assert SamplingParams(temperature=0.01).temperature == 0.01
    assert caplog.text == ""


INF, NAN = math.inf, math.nan
BAD = [  # (kwargs, substrings the message must contain: the parameter, and the value)
    (dict(n=0), ["n must be at least 1", "got 0"]),
    (dict(n=-3), ["n must be at least 1", "got -3"]),
    (dict(n=1.5), ["n must be an integer", "1.5"]),
    (dict(n=True), ["n must be an integer", "True"]),
    (dict(presence_penalty=2.5), ["presence_penalty must be in [-2, 2]", "2.5"]),
    (dict(presence_penalty=-2.1), ["presence_penalty", "-2.1"]),
    (dict(presence_penalty=NAN), ["presence_penalty", "nan"]),
    (dict(frequency_penalty=-3), ["frequency_penalty must be in [-2, 2]", "-3"]),
    (dict(frequency_penalty="0.5"), ["frequency_penalty must be a number", "'0.5'"]),
    (dict(repetition_penalty=0.0), ["repetition_penalty must be greater than zero", "0.0"]),
    (dict(repetition_penalty=-1.0), ["repetition_penalty", "-1.0"]),
    (dict(repetition_penalty=INF), ["repetition_penalty must be a finite number", "inf"]),
    (dict(repetition_penalty=NAN), ["repetition_penalty must be a finite number", "nan"]),
    (dict(temperature=-1.0), ["temperature must be non-negative, got -1.0"]),
    (dict(temperature=NAN), ["temperature must be a finite number", "nan"]),
    (dict(temperature=INF), ["temperature must be a finite number", "inf"]),
    (dict(temperature=-INF), ["temperature must be a finite number", "-inf"]),
    (dict(temperature=None), ["temperature must be a number", "None"]),
    (dict(top_p=0.0), ["top_p must be in (0, 1], got 0.0"]),
    (dict(top_p=1.5), ["top_p must be in (0, 1], got 1.5"]),
    (dict(top_p=-0.1), ["top_p", "-0.1"]),
    (dict(top_p=NAN), ["top_p", "nan"]),
    (dict(top_k=-2), ["top_k must be 0 or -1 (disabled), or at least 1", "got -2"]),
    (dict(top_k=2.0), ["top_k must be an integer", "2.0"]),
    (dict(top_k=True), ["top_k must be an integer", "True"]),
    (dict(top_k="5"), ["top_k must be an integer", "'5'"]),
    (dict(min_p=-0.1), ["min_p must be in [0, 1]", "-0.1"]),
    (dict(min_p=1.1), ["min_p must be in [0, 1]", "1.1"]),
    (dict(seed=2**63), ["seed must be within the int64 range", str(2**63)]),
    (dict(seed=-(2**63) - 1), ["seed", str(-(2**63) - 1)]),
    (dict(seed=1.5), ["seed must be an integer", "1.5"]),
    (dict(max_tokens=0), ["max_tokens must be at least 1, got 0"]),
    (dict(max_tokens=-1), ["max_tokens must be at least 1, got -1"]),
    (dict(max_tokens=10.0), ["max_tokens must be an integer", "10.0"]),
    (dict(min_tokens=-1), ["min_tokens must be greater than or equal to 0", "-1"]),
    (dict(min_tokens=17), ["min_tokens must be less than or equal to max_tokens=16", "got 17"]),
    (dict(min_tokens=5, max_tokens=4), ["min_tokens", "max_tokens=4", "got 5"]),
    (dict(logprobs=-2), ["logprobs must be non-negative, or -1 for the whole vocabulary", "got -2"]),
    (dict(logprobs=2.5), ["logprobs must be an integer", "2.5"]),
    (dict(prompt_logprobs=-2), ["prompt_logprobs must be non-negative, or -1", "got -2"]),
    (dict(prompt_logprobs=1.0), ["prompt_logprobs must be an integer", "1.0"]),
    (dict(stop=[""]), ["stop strings must be non-empty", "['']"]),
    (dict(stop=""), ["stop strings must be non-empty"]),
    (dict(stop=["ok", ""]), ["stop strings must be non-empty", "['ok', '']"]),
    (dict(stop=[1]), ["stop must be a string or a list of strings", "[1]"]),
    (dict(stop=5), ["stop must be a string or a list of strings", "5"]),
    (dict(stop=["x"], detokenize=False), ["stop strings are only supported when detokenize is True",
                                          "detokenize=False"]),
    (dict(stop_token_ids=[-1]), ["stop_token_ids must be non-negative", "-1"]),
    (dict(stop_token_ids=[1.5]), ["stop_token_ids must be an integer", "1.5"]),
    (dict(stop_token_ids=5), ["stop_token_ids must be a list of integers", "5"]),
    (dict(ignore_eos="yes"), ["ignore_eos must be a bool", "'yes'"]),
    (dict(detokenize=0), ["detokenize must be a bool", "0"]),
    (dict(temperature=0, n=3), ["n must be 1 when using greedy sampling", "n=3"]),
]


@pytest.mark.parametrize("kwargs,expected", BAD, ids=[repr(k) for k, _ in BAD])
def test_bad_values_raise_value_error_naming_parameter_and_value(kwargs, expected):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


@pytest.mark.parametrize("kwargs", [
    dict(top_k=-1), dict(top_k=0), dict(top_k=1), dict(top_p=1.0), dict(top_p=1e-6), dict(min_p=0.0),
    dict(min_p=1.0), dict(presence_penalty=-2.0), dict(frequency_penalty=2.0), dict(repetition_penalty=1e-3),
    dict(temperature=0.0), dict(temperature=5.0), dict(seed=2**63 - 1), dict(seed=-(2**63)), dict(logprobs=0),
    dict(logprobs=-1), dict(prompt_logprobs=0), dict(prompt_logprobs=-1), dict(max_tokens=1), dict(min_tokens=16), dict(stop_token_ids=[0]), dict(detokenize=False),
    dict(stop=["a"], include_stop_str_in_output=True),
])
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_verify_against_engine():
    limits = dict(max_n=8, max_logprobs=20, vocab_size=100)
    SamplingParams(n=8, logprobs=20, stop_token_ids=[0, 99]).verify_against_engine(**limits)
    SamplingParams().verify_against_engine(**limits)
    # As vLLM: -1 is the whole vocabulary, allowed where max_logprobs covers it (or is -1 itself).
    SamplingParams(logprobs=-1, prompt_logprobs=-1).verify_against_engine(**{**limits, "max_logprobs": -1})
    SamplingParams(prompt_logprobs=-1).verify_against_engine(**{**limits, "max_logprobs": 100})
    cases = [(dict(n=9), ["n must be at most 8", "got 9"]),
             (dict(logprobs=21), ["logprobs must be at most 20", "got 21"]),
             (dict(prompt_logprobs=21), ["prompt_logprobs must be at most 20", "got 21"]),
             (dict(prompt_logprobs=-1), ["prompt_logprobs must be at most 20", "got -1 (the whole vocabulary, 100)"]),
             (dict(stop_token_ids=[3, 100]), ["stop_token_ids", "token id 100 is out of vocabulary", "100"])]
    for kwargs, expected in cases:
        with pytest.raises(ValueError) as info:
            SamplingParams(**kwargs).verify_against_engine(**limits)
        assert all(part in str(info.value) for part in expected), str(info.value)


def test_clone_is_deep_and_equal():
    params = SamplingParams(n=2, stop=["a"], stop_token_ids=[3], seed=7)
    copy = params.clone()
    assert copy == params and copy is not params and copy.stop is not params.stop
    copy.stop.append("b")
    assert params.stop == ["a"]


def test_validation_is_idempotent():
    params = SamplingParams(temperature=1e-3, seed=-1, top_k=-1, stop="x", stop_token_ids=[2, 2])
    assert SamplingParams(**dataclasses.asdict(params)) == params
