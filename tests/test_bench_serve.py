"""The server benchmark's parts: the synthetic tokenizer (benchmarks/make_synthetic_tokenizer.py), the requests
`bench throughput` and `bench serve` share (jaxserve/bench/prompts.py), and `bench serve` against a live server
of a tiny dummy-weights model that detokenizes with the synthetic tokenizer: every requested token arrives as
text, and a server without a tokenizer fails the run with a message that says why."""

from __future__ import annotations

import argparse
import importlib.util
import json
import types

import numpy as np
import pytest

from jaxserve.bench import prompts
from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.conftest import HF_FIXTURES, ROOT

FIXTURE = HF_FIXTURES / "llama3_gqa4_tied"  # vocab 256, bos 0, eos 1


@pytest.fixture(scope="module")
def make_tokenizer():
    spec = importlib.util.spec_from_file_location("make_synthetic_tokenizer",
                                                  ROOT / "benchmarks" / "make_synthetic_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_tokenizer_dir(make_tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic-tokenizer")
    assert make_tokenizer.main(["--model-config", str(FIXTURE / "config.json"), "--out", str(out)]) == 0
    return out


def test_synthetic_tokenizer_of_the_8b_vocabulary_round_trips(make_tokenizer, tmp_path):
    out = tmp_path / "llama3-8b"
    assert make_tokenizer.main(["--model-config", str(ROOT / "configs/models/llama3-8b/config.json"),
                                "--out", str(out)]) == 0
    tok = Tokenizer.from_dir(out)
    assert len(tok) == tok.backend.get_vocab_size() == 128256
    assert (tok.bos_token_id, tok.eos_token_id, tok.all_special_ids) == (128000, 128001, [128000, 128001, 128255])
    rng = np.random.default_rng(0)
    special = set(tok.all_special_ids)
    ids = [i for i in rng.integers(0, 128256, 2000).tolist() if i not in special]
    assert tok.encode(tok.decode(ids)) == ids
    with_eos = [*ids[:3], 128001, *ids[3:6]]
    assert tok.encode(tok.decode(with_eos, skip_special_tokens=False)) == with_eos
    # Streaming after a prompt: one non-empty delta per generated token, re-encoding to the same ids.
    detok = IncrementalDetokenizer(tok, ids[:20])
    deltas = [detok.add_tokens([token]) for token in ids[20:60]]
    assert all(delta.startswith(" ") and len(delta) > 1 for delta in deltas)
    assert tok.encode("".join(deltas) + detok.finish()) == ids[20:60]


def test_synthetic_tokenizer_is_deterministic_and_checks_its_ids(make_tokenizer, tmp_path, capsys):
    first, config = make_tokenizer.build(300, bos_id=7, eos_id=9)
    second, _ = make_tokenizer.build(300, bos_id=7, eos_id=9)
    assert first.to_str() == second.to_str()
    # id 298 holds the 297th word: 26 one-letter words, then "aa" + 10 * 26 + 10
    assert [first.id_to_token(i) for i in (0, 7, 9, 299, 298)] == ["a", "<bos>", "<eos>", "<unk>", "kk"]
    assert config["eos_token"] == "<eos>" and set(config["added_tokens_decoder"]) == {"7", "9", "299"}
    assert make_tokenizer.main(["--vocab-size", "2", "--out", str(tmp_path)]) == 2
    assert "--vocab-size must be >= 4" in capsys.readouterr().err


def test_random_requests_are_one_function_of_seed_lengths_and_vocabulary():
    def draw(seed=0, ratio=0.0):
        return prompts.random_requests(seed, 50, 12, 6, ratio, vocab_size=40, special_ids=[0, 1, 39])

    assert draw() == draw() and prompts.fingerprint(draw()) == prompts.fingerprint(draw())
    assert prompts.fingerprint(draw(seed=1)) != prompts.fingerprint(draw())
    ids = [t for r in draw() for t in r.prompt]
    assert {len(r.prompt) for r in draw()} == {12} and {r.output_len for r in draw()} == {6}
    assert not {0, 1, 39} & set(ids) and set(ids) == set(range(2, 39))
    varied = draw(ratio=0.5)
    assert {len(r.prompt) for r in varied} <= set(range(6, 19)) and len({len(r.prompt) for r in varied}) > 3
    with pytest.raises(ValueError, match="--random-range-ratio"):
        draw(ratio=1.0)


def test_read_requests_takes_output_len_or_max_tokens(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt_token_ids": [1, 2], "output_len": 3}\n\n{"prompt": "a b", "max_tokens": 5}\n'
                    '{"prompt": "c"}\n')
    assert prompts.read_requests(path, 9) == [prompts.BenchRequest([1, 2], 3), prompts.BenchRequest("a b", 5),
                                              prompts.BenchRequest("c", 9)]
    path.write_text('{"prompt_token_ids": [1, "x"]}\n')
    with pytest.raises(ValueError, match="requests.jsonl:1: 'prompt' must be a string"):
        prompts.read_requests(path, 9)


@pytest.fixture(scope="module")
def dummy_server(tiny_tokenizer_dir):
    from jaxserve.config import load_config
    from tests.test_server import LiveServer

    config = load_config(ROOT / "configs" / "tiny.yaml", model=str(FIXTURE), load_format="dummy",
                         tokenizer=str(tiny_tokenizer_dir), precompile=False, port=0, access_log=False)
    server = LiveServer(config)
    yield server
    server.stop()


def test_bench_serve_receives_every_requested_token_as_text(dummy_server, tiny_tokenizer_dir, tmp_path):
    from jaxserve.bench import throughput
    from jaxserve.cli import main as jaxserve_main

    output = tmp_path / "serve.json"
    assert jaxserve_main(["bench", "serve", "--base-url", dummy_server.url, "--tokenizer", str(tiny_tokenizer_dir),
                          "--num-prompts", "6", "--random-input-len", "5", "--random-output-len", "7",
                          "--ignore-eos", "--disable-tqdm", "--output-json", str(output)]) == 0
    result = json.loads(output.read_text())
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (6, 0, 42)
    assert result["output_lens"] == [7] * 6 and result["input_lens"] == [5] * 6
    tok = Tokenizer.from_dir(tiny_tokenizer_dir)
    assert [len(tok.encode(text)) for text in result["generated_texts"]] == [7] * 6  # every token came as text
    # `bench throughput` with the same seed and lengths, on an engine with this tokenizer, runs the same requests.
    args = argparse.Namespace(dataset_path=None, seed=0, num_prompts=6, input_len=5, output_len=7,
                              random_range_ratio=0.0)
    engine = types.SimpleNamespace(tokenizer=dummy_server.engine.tokenizer, vocab_size=dummy_server.engine.vocab_size)
    assert prompts.fingerprint(throughput.bench_requests(args, engine)) == result["prompts_fingerprint"]


def test_bench_serve_fails_clearly_when_the_server_streams_no_text(dummy_server, tiny_tokenizer_dir, monkeypatch,
                                                                   capsys):
    from jaxserve.cli import main as jaxserve_main

    dummy_server.wait_idle()
    # As model.skip_tokenizer_init: the server takes token ids and streams token ids only.
    monkeypatch.setattr(dummy_server.engine.input_processor, "tokenizer", None)  # engine.tokenizer reads it
    assert jaxserve_main(["bench", "serve", "--base-url", dummy_server.url, "--tokenizer", str(tiny_tokenizer_dir),
                          "--num-prompts", "2", "--random-input-len", "5", "--random-output-len", "3",
                          "--ignore-eos", "--disable-tqdm"]) == 2
    err = capsys.readouterr().err
    assert "streamed 1 token(s) but no text" in err and "skip_tokenizer_init" in err


def test_a_dummy_model_without_its_tokenizer_says_how_to_make_one(tmp_path):
    from jaxserve.config import load_config
    from jaxserve.engine import Engine

    config_file = tmp_path / "serve.yaml"
    config_file.write_text(f"model:\n  path: {FIXTURE}\n  load_format: dummy\n  tokenizer: tokenizer-not-made-yet\n")
    config = load_config(config_file)
    assert config.model.tokenizer == str(tmp_path / "tokenizer-not-made-yet")  # relative to the config file
    with pytest.raises(FileNotFoundError, match="make_synthetic_tokenizer.py --model-config"):
        Engine(config, progress=False)


def test_serve_vs_offline_table():
    spec = importlib.util.spec_from_file_location("serve_vs_offline", ROOT / "benchmarks" / "serve_vs_offline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    offline = {"num_requests": 4, "elapsed_s": 2.0, "output_tokens_per_s": 100.0, "total_tokens_per_s": 300.0,
               "prompts_fingerprint": "abc", "ttft_ms": None, "tpot_ms": None, "steps": {"itl_ms": None}}
    online = {"completed": 4, "failed": 0, "duration_s": 2.2, "output_throughput": 92.0,
              "total_token_throughput": 270.0, "prompts_fingerprint": "abc", "request_rate": "inf",
              **{f"p{q}_{m}_ms": float(q) for q in (50, 90, 99) for m in ("ttft", "itl", "tpot")}}
    table = module.summarize(offline, online)
    assert "output tok/s 0.920x, total tok/s 0.900x (target >= 0.9x: met); same prompts: yes" in table
    assert "| 50.0 / 90.0 / 99.0 |" in table
    assert "same prompts: NO" in module.summarize(offline, {**online, "prompts_fingerprint": "abd"})
