"""Model numerics against Hugging Face transformers (float32 reference fixtures).

Every fixture: greedy tokens equal HF's for 40 new tokens and logits match at every position,
whether prompts arrive whole or in chunks through the paged cache, with contiguous or shuffled
(non-contiguous) block assignments and with several requests mixed in one batch. The
mixture-of-experts fixtures run one chunked variant: chunking and paging are the attention's
business, which they share with the dense fixtures; their own MLP sees every variant's rows alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import llama
from tests import reference_generate
from tests.conftest import HF_MOE_NAMES, HF_NAMES

ATOL = 1e-4  # float32; measured differences are ~1e-5
NEW_TOKENS = 40
# One program per fixture: the forward traced whole instead of dispatched op by op.
forward_dense = jax.jit(llama.forward_dense, static_argnames=("cfg", "return_hidden"))


def check(fx, result):
    for i, prompt in enumerate(fx.prompts):
        assert result.tokens[i] == fx.generated[i], f"{fx.name} prompt {i}: greedy tokens differ from HF"
        # Our rows cover every position fed to the model: the prompt and all generated tokens but the last.
        ours = result.logits[i]
        ref = fx.logits[i][: len(prompt) + NEW_TOKENS - 1]
        np.testing.assert_allclose(ours, ref, atol=ATOL, rtol=ATOL, err_msg=f"{fx.name} prompt {i}")


def test_whole_prompts_contiguous_blocks(hf_fixture):
    m = hf_fixture.model
    result = reference_generate.greedy_generate(m.params, m.config, hf_fixture.prompts, NEW_TOKENS, block_size=16)
    check(hf_fixture, result)


CHUNKINGS = [(1, 16, 0), (5, 4, 1), (16, 32, 2)]  # (chunk_size, block_size, shuffle seed)
MOE_CHUNKING = (1, 16, 0)  # one decode-width program: the cheapest chunked run of a MoE fixture


@pytest.mark.parametrize("hf_fixture,chunk_size,block_size,seed",
                         [(name, *c) for name in HF_NAMES for c in CHUNKINGS
                          if name not in HF_MOE_NAMES or c == MOE_CHUNKING],
                         indirect=["hf_fixture"])
def test_chunked_prefill_shuffled_blocks(hf_fixture, chunk_size, block_size, seed):
    m = hf_fixture.model
    result = reference_generate.greedy_generate(
        m.params, m.config, hf_fixture.prompts, NEW_TOKENS, block_size=block_size, chunk_size=chunk_size,
        shuffle_seed=seed,
    )
    check(hf_fixture, result)


def test_dense_training_forward_matches_hf(hf_fixture):
    """forward_dense (used to train the embedded model) agrees with HF too."""
    m = hf_fixture.model
    full = [prompt + generated for prompt, generated in zip(hf_fixture.prompts, hf_fixture.generated)]
    width = max(map(len, full))  # one batch, each sequence padded at its end (causal: the padding is never seen)
    padded = jnp.asarray([sequence + [0] * (width - len(sequence)) for sequence in full])
    logits = np.asarray(forward_dense(m.params, m.config, padded))
    for i, sequence in enumerate(full):
        np.testing.assert_allclose(logits[i, : len(sequence)], hf_fixture.logits[i], atol=ATOL, rtol=ATOL)


def test_bfloat16_load_runs_close_to_float32():
    from jaxserve.models import loader
    from tests.conftest import HF_FIXTURES

    fx = loader.load_model(HF_FIXTURES / "llama3_gqa4_tied", dtype="bfloat16")
    assert all(leaf.dtype == jnp.bfloat16 for leaf in __import__("jax").tree.leaves(fx.params))
    ref = loader.load_model(HF_FIXTURES / "llama3_gqa4_tied", dtype="float32")
    prompt = [[5, 6, 7, 8, 9, 10, 11]]
    low = reference_generate.greedy_generate(fx.params, fx.config, prompt, 1).logits[0]
    high = reference_generate.greedy_generate(ref.params, ref.config, prompt, 1).logits[0]
    assert np.isfinite(low).all()
    # bf16 keeps ~3 significant digits; logits here are O(1).
    np.testing.assert_allclose(low, high, atol=0.15)
    assert not np.allclose(low, high, atol=1e-6), "bf16 load did not change precision"
