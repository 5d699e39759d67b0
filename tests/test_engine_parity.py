"""HF parity through the full engine (scheduler, paged cache, chunked prefill, mixed batches,
sampler), not only the forward: greedy tokens equal transformers' and logprobs match its logits."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import HF_MOE_NAMES, HF_NAMES


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - (np.log(np.sum(np.exp(x - x.max(-1, keepdims=True)), -1, keepdims=True)) + x.max(-1, keepdims=True))


# The mixture-of-experts fixtures run the overlapped scheduling only: the scheduling modes differ in
# the engine loop, which the dense fixtures cover, not in the model.
@pytest.mark.parametrize("hf_fixture,async_scheduling",
                         [pytest.param(name, mode, id=f"{name}-{'overlap' if mode else 'sync'}")
                          for name in HF_NAMES for mode in (True, False) if name not in HF_MOE_NAMES or mode],
                         indirect=["hf_fixture"])
def test_engine_greedy_matches_hf(hf_fixture, async_scheduling):
    # A 16-token budget spreads the 33-token prompt over steps and mixes it with the others' decodes.
    llm = LLM(model=hf_fixture.path, dtype="float32", skip_tokenizer_init=True, max_model_len=96, block_size=4,
              num_blocks=96, max_num_batched_tokens=16, max_num_seqs=4, token_buckets=[16], request_buckets=[4],
              precompile=False, progress=False, async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in hf_fixture.prompts], params, use_tqdm=False)
    for i, out in enumerate(outputs):
        completion = out.outputs[0]
        assert completion.token_ids == hf_fixture.generated[i], f"{hf_fixture.name} prompt {i}"
        assert completion.text == ""  # no tokenizer: token ids only
        reference = log_softmax(hf_fixture.logits[i])[len(hf_fixture.prompts[i]) - 1:]
        ours = [entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs)]
        expected = [reference[step, token] for step, token in enumerate(completion.token_ids)]
        np.testing.assert_allclose(ours, expected, atol=2e-4)
    assert llm.engine.kv_cache.usage == 0.0
