"""EAGLE-3 speculative decoding (speculative.method eagle3) end to end: greedy outputs are token-identical to
decoding without it on the embedded model (overlap, forced preemption, prefix caching, chunked prompts) with
the trained embedded head's guesses accepted, the target forward's aux states are the residual stream
entering the aux layers, the checkpoint's name variants (midlayer / layers.0, a `model.` prefix, no d2t) load
alike, bad heads are refused at start with a message each, and nothing compiles after start-up."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from jaxserve import SamplingParams
from jaxserve.models import eagle3_head as eagle3
from jaxserve.models import llama, loader, registry
from jaxserve.models.layers import ModelBatch
from tests.conftest import TINY_MODEL
from tests.test_engine import assert_no_leaks, make_llm, problems
from tools import train_tiny

TINY_EAGLE3 = TINY_MODEL.parent / "tiny-adder-eagle3"
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
PROMPTS = ["4567+0=", "1234+1=", "3000+12=", "5050+5050=", "8888+1=", "1001+1000="] + [
    f"{a}+{b}=" for a, b in problems(14, seed=17)]


def eagle3_spec(model=TINY_EAGLE3, k: int = 3) -> dict:
    return {"method": "eagle3", "model": str(model), "num_speculative_tokens": k}


def token_ids(outputs):
    return [c.token_ids for out in outputs for c in out.outputs]


def random_eagle3_head(fixture_path, out, aux_layers=None, seed: int = 0):
    """A random EAGLE-3 head for a Llama checkpoint (one layer of its shape; aux layers: every one of a target
    with fewer than 4, else the default), its draft vocabulary all but the first two ids."""
    hf = json.loads((fixture_path / "config.json").read_text())
    layer = registry.config_from_hf({**hf, "num_hidden_layers": 1}, dtype="float32")
    num_layers = hf["num_hidden_layers"]
    aux = aux_layers or (tuple(range(num_layers)) if num_layers < 4 else eagle3.default_aux_layers(num_layers))
    head = eagle3.Eagle3Config(layer=layer, draft_vocab_size=hf["vocab_size"] - 2,
                               target_hidden_size=hf["hidden_size"], aux_layers=aux)
    params = jax.tree.map(np.asarray, eagle3.init_head(head, jax.random.key(seed), std=0.05))
    eagle3.save_head(params, head, out, d2t=np.full(head.draft_vocab_size, 2))
    return out


@pytest.fixture(scope="module")
def reference():
    return make_llm(precompile=False).generate(PROMPTS, GREEDY, use_tqdm=False)


def test_trained_head_greedy_identical_with_preemption_prefix_caching_and_chunks(reference):
    """The embedded head agrees with the target on most held-out answer tokens (its TRAINING.md): guesses
    made one token behind (overlap), taken from the device right behind a verify step, after a first guess,
    and after chunked prompts are accepted."""
    llm = make_llm(precompile=False, num_blocks=9, max_num_batched_tokens=5, async_scheduling=True,
                   speculative_config=eagle3_spec())
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == token_ids(reference)
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.num_device_guessed > 0
    # The last ones again: their prompts' blocks are still cached.
    assert token_ids(llm.generate(PROMPTS[-2:], GREEDY, use_tqdm=False)) == token_ids(reference[-2:])
    assert llm.engine.kv_cache.stats.hits > 0
    assert 0.4 * scheduler.num_draft_tokens <= scheduler.num_accepted_tokens <= scheduler.num_draft_tokens
    stats = llm.engine.stats()
    assert (stats.spec_draft_tokens, stats.spec_accepted_tokens) == (scheduler.num_draft_tokens,
                                                                     scheduler.num_accepted_tokens)
    assert_no_leaks(llm)


def test_forward_returns_the_residual_stream_entering_the_aux_layers():
    """The paged step's aux states equal the dense causal forward's (tools/train_tiny.target_aux, what the
    embedded head was trained on): layer 0's is the embedding; the logits are those of the step without."""
    model = loader.load_model(TINY_MODEL, dtype="float32")
    cfg, tokens = model.config, np.array([1, 8, 9, 14, 5, 15], np.int32)
    n = len(tokens)
    positions = jnp.arange(n, dtype=jnp.int32)
    batch = ModelBatch(jnp.asarray(tokens), positions, positions + 4, jnp.array([0, n], jnp.int32),
                       jnp.array([n], jnp.int32), jnp.array([[1, 2, 0, 0]], jnp.int32), jnp.array([n - 1], jnp.int32))
    logits, _, aux = llama.forward(model.params, cfg, batch, llama.init_kv_caches(cfg, 4, 4), aux_layers=(0, 1, 2, 3))
    assert aux.shape == (n, 4 * cfg.hidden_size)
    np.testing.assert_array_equal(aux[:, :cfg.hidden_size], model.params["embed"][tokens])
    dense = train_tiny.target_aux(model.params, jnp.asarray(tokens)[None], aux_layers=(1, 2, 3))[0]
    np.testing.assert_allclose(aux[:, cfg.hidden_size:], dense, rtol=1e-5, atol=1e-5)
    plain_logits, _ = llama.forward(model.params, cfg, batch, llama.init_kv_caches(cfg, 4, 4))
    np.testing.assert_array_equal(logits, plain_logits)


def test_checkpoint_name_variants_load_alike(tmp_path):
    """midlayer.* or layers.0.*, with or without a `model.` prefix; no d2t: the identity over the draft ids."""
    head = eagle3.head_config(TINY_EAGLE3, "float32", 4)
    want = eagle3.load_head(TINY_EAGLE3, head, lambda array: array)
    tensors = safetensors.numpy.load_file(TINY_EAGLE3 / "model.safetensors")
    outside = ("lm_head.weight", "d2t", "t2d")  # (names under model. elsewhere)
    renamed = {(name if name in outside else "model." + name.replace("midlayer.", "layers.0.")): array
               for name, array in tensors.items()}
    (tmp_path / "config.json").write_text((TINY_EAGLE3 / "config.json").read_text())
    safetensors.numpy.save_file(renamed, tmp_path / "model.safetensors")
    got = eagle3.load_head(tmp_path, head, lambda array: array)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for ours, theirs in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(ours, theirs)
    assert (want["d2t"] == np.arange(head.draft_vocab_size) + tensors["d2t"]).all()
    assert sorted(set(range(head.layer.vocab_size)) - set(want["d2t"].tolist())) == [0, 1, 3]  # pad, <s>, <unk>
    del renamed["d2t"]
    safetensors.numpy.save_file(renamed, tmp_path / "model.safetensors")
    assert (eagle3.load_head(tmp_path, head, lambda array: array)["d2t"] == np.arange(head.draft_vocab_size)).all()


def _variant(tmp_path, name: str, config=None, tensors=None) -> Path:
    """The embedded head with config.json fields replaced (None: removed) and tensors changed."""
    out = tmp_path / name
    out.mkdir()
    hf = json.loads((TINY_EAGLE3 / "config.json").read_text())
    for key, value in (config or {}).items():
        if value is None:
            hf.pop(key, None)
        else:
            hf[key] = value
    (out / "config.json").write_text(json.dumps(hf))
    weights = safetensors.numpy.load_file(TINY_EAGLE3 / "model.safetensors")
    weights.update(tensors or {})
    safetensors.numpy.save_file(weights, out / "model.safetensors")
    return out


def test_bad_heads_are_refused_at_start(tmp_path):
    d2t = safetensors.numpy.load_file(TINY_EAGLE3 / "model.safetensors")["d2t"]
    cases = [
        (_variant(tmp_path, "narrow", {"hidden_size": 64}),
         "EAGLE-3 head's hidden_size is 64 but the target model's hidden_size is 128"),
        (_variant(tmp_path, "other-target", {"target_hidden_size": 256}),
         "EAGLE-3 head's target_hidden_size is 256 but the target model's hidden_size is 128"),
        (_variant(tmp_path, "deep-aux", {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}),
         r"aux layers \[1, 2, 4\] .* \[4\] are not layers of the target model \(0 .. 3\)"),
        (_variant(tmp_path, "default-aux", {"eagle_aux_hidden_state_layer_ids": None}),
         r"aux layers \[2, 2, 1\] .*name a layer twice; set eagle_aux_hidden_state_layer_ids"),
        (_variant(tmp_path, "wide-draft", {"draft_vocab_size": 20}),
         "draft_vocab_size is 20, larger than the target model's vocabulary"),
        (_variant(tmp_path, "short-d2t", tensors={"d2t": d2t[:5]}),
         r"d2t has shape \[5\], but draft_vocab_size is 13"),
        (_variant(tmp_path, "two-aux", {"eagle_aux_hidden_state_layer_ids": [1, 2]}),
         r"tensor fc.weight has shape \[128, 384\], but .* give \[128, 256\]"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError, match=message):
            make_llm(precompile=False, speculative_config=eagle3_spec(path))


@pytest.mark.usefixtures("no_jit_dispatches")
def test_no_compiles_after_start_up():
    llm = make_llm(speculative_config=eagle3_spec(k=2), max_num_seqs=4, max_num_batched_tokens=16,
                   token_buckets=[16], request_buckets=[4])
    llm.generate(["1+1="], GREEDY, use_tqdm=False)
    with jax.no_tracing():
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_accepted_tokens > 0
    assert_no_leaks(llm)
