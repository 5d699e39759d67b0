"""The compiled step updates the KV cache in place and copies no weight or cache per step."""

from __future__ import annotations

import re

import jax
import numpy as np

from jaxserve.models import llama
from jaxserve.models.layers import ModelBatch

# `%name = f32[8,2,16]{2,1,0} opcode(...` (scalars have no layout): the shape's dims and the opcode
INSTRUCTION = re.compile(r"= [a-z0-9]+\[([0-9,]*)\](?:\{[^}]*\})? ([a-z][a-z0-9-]*)\(")


def test_step_donates_caches_and_copies_no_weights(hf_fixture):
    cfg, params = hf_fixture.model.config, hf_fixture.model.params
    caches = llama.init_kv_caches(cfg, num_blocks=9, block_size=4)
    tokens, reqs, max_blocks = 8, 2, 4
    batch = ModelBatch(*(np.zeros(shape, np.int32) for shape in
                         [(tokens,), (tokens,), (tokens,), (reqs + 1,), (reqs,), (reqs, max_blocks), (reqs,)]))
    step = jax.jit(llama.forward, static_argnames=("cfg", "attention_backend"), donate_argnames=("kv_caches",))
    hlo = step.lower(params, cfg, batch, caches).compile().as_text()

    header = hlo.splitlines()[0]
    aliased = {int(p) for p in re.findall(r"\((\d+), \{\}, (?:may|must)-alias\)", header)}
    first_cache = len(jax.tree.leaves(params)) + len(batch)
    assert aliased == set(range(first_cache, first_cache + cfg.num_layers)), header[:300]

    big_shapes = {tuple(x.shape) for x in jax.tree.leaves(params) + caches if np.prod(x.shape) >= 64}
    instructions = []  # (shape, opcode, line) of every array-valued instruction
    for line in hlo.splitlines():
        match = INSTRUCTION.search(line)
        if match:
            instructions.append((tuple(int(d) for d in match.group(1).split(",") if d), match.group(2), line))
    # The parser reads this HLO: every weight and cache is a parameter of its shape, and no copy escapes it.
    assert big_shapes <= {shape for shape, opcode, _ in instructions if opcode == "parameter"}
    assert sum(" copy(" in line for line in hlo.splitlines()) == sum(op == "copy" for _, op, _ in instructions)
    for shape, opcode, line in instructions:
        if opcode == "copy":
            assert shape not in big_shapes, f"a weight- or cache-shaped copy in the step: {line.strip()[:200]}"
