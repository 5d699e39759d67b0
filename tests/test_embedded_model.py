"""The embedded default model (jaxserve/assets/tiny-adder) adds numbers, through the HF loader,
our tokenizer and the paged-cache forward."""

from __future__ import annotations

import numpy as np

from jaxserve.tokenizer import Tokenizer
from tests import reference_generate
from tests.conftest import TINY_MODEL
from tools import train_tiny


def test_embedded_model_greedy_accuracy(tiny_model):
    tokenizer = Tokenizer.from_dir(TINY_MODEL)
    held_out = train_tiny.held_out_problems()
    rng = np.random.default_rng(2026)
    problems = [held_out[i] for i in rng.choice(len(held_out), 500, replace=False)]
    prompts = [tokenizer.encode(f"{a}+{b}=") for a, b in problems]
    assert prompts[0][0] == tokenizer.bos_token_id
    result = reference_generate.greedy_generate(
        tiny_model.params, tiny_model.config, prompts, max_new_tokens=6, block_size=4,
        eos_token_ids=tiny_model.generation.eos_token_ids, keep_logits=False,
    )
    answers = [tokenizer.decode(tokens) for tokens in result.tokens]
    ends_with_eos = [tokens[-1] == tokenizer.eos_token_id for tokens in result.tokens]
    correct = [ans == str(a + b) and eos for ans, eos, (a, b) in zip(answers, ends_with_eos, problems)]
    accuracy = float(np.mean(correct))
    assert accuracy >= 0.98, f"accuracy {accuracy:.3f}; wrong: {[p for p, c in zip(problems, correct) if not c][:10]}"


def test_held_out_problems_are_never_trained_on():
    rng = np.random.default_rng(0)
    rows, mask = train_tiny.sample_batch(rng, 20000)
    a = np.array([p[0] for p in train_tiny.held_out_problems()])
    assert 900 < len(a) < 1100
    # Every sampled problem that falls in the held-out set carries zero loss weight.
    held = {(x, y) for x, y in train_tiny.held_out_problems()}
    inv = {v: k for k, v in train_tiny.VOCAB.items()}
    seen = 0
    for row, m in zip(rows, mask):
        text = "".join(inv[t] for t in row if t > 3)
        x, rest = text.split("+")
        y = rest.split("=")[0]
        if (int(x), int(y)) in held:
            seen += 1
            assert m.sum() == 0
    assert seen > 0, "the sample should have drawn some held-out problems"
