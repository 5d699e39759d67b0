"""An instance with a prefill or decode role refuses at start what disaggregation does not support yet,
naming each setting: no prefix caching, data / expert / multi-process parallelism, a sharded KV cache, and
a speculative proposer with a KV cache of its own (the draft model's, an EAGLE head's), whose KV would be
missing for every transferred prompt. n-gram speculation needs no KV and is accepted."""

from __future__ import annotations

import dataclasses
import types

import pytest

from jaxserve.config import ParallelConfig, SpeculativeConfig, load_config
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.pd.engine import refuse_unsupported
from tests.conftest import ROOT

TINY = ROOT / "configs" / "tiny.yaml"
ENGINE = types.SimpleNamespace(kv_cache=KVCacheManager.__new__(KVCacheManager))


def _config(**changes):
    config = load_config(TINY)
    return dataclasses.replace(config, server=dataclasses.replace(config.server, pd_role="decode"), **changes)


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3"])
def test_a_proposer_with_its_own_kv_is_refused(method):
    config = _config(speculative=SpeculativeConfig(method=method, model="head", num_speculative_tokens=2))
    with pytest.raises(ValueError, match=rf"server.pd_role=decode is not supported with speculative.method: "
                                         rf"{method} .*ngram speculation works"):
        refuse_unsupported(config, ENGINE)


def test_ngram_speculation_and_plain_decoding_are_accepted():
    refuse_unsupported(_config(), ENGINE)
    refuse_unsupported(_config(speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3)), ENGINE)


def test_every_unsupported_setting_is_named():
    config = _config(cache=dataclasses.replace(load_config(TINY).cache, enable_prefix_caching=False),
                     parallel=dataclasses.replace(ParallelConfig(), data=2))
    with pytest.raises(ValueError) as refused:
        refuse_unsupported(config, types.SimpleNamespace(kv_cache=object()))
    message = str(refused.value)
    for reason in ("cache.enable_prefix_caching: false", "parallel.data, parallel.expert", "a sharded KV cache"):
        assert reason in message
    assert "run colocated (pd_role: null)" in message
