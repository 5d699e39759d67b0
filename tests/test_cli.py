"""`jaxserve generate` end to end on the embedded model: the --output file (logprobs included), an --output
that cannot be written refused before the engine is built, a prompts file's cache_salt honoured."""

from __future__ import annotations

import json

import pytest
import yaml

from jaxserve.cli import main
from jaxserve.llm import LLM
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    """configs/tiny.yaml, one request at a time (so a later request can hit an earlier one's prefix), no
    precompile."""
    data = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    data["scheduler"]["max_num_seqs"] = 1
    data["runner"]["precompile"] = False
    path = tmp_path_factory.mktemp("cli") / "tiny-serial.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_generate_writes_logprobs_to_the_output_file(config, tmp_path):
    out = tmp_path / "results.jsonl"
    assert main(["generate", "--config", config, "--prompt", "12+34=", "--prompt", "7+8=", "--temperature", "0",
                 "--logprobs", "2", "--output", str(out), "--quiet"]) == 0
    results = read_lines(out)
    assert [r["outputs"][0]["text"] for r in results] == ["46", "15"]
    for result in results:
        completion = result["outputs"][0]
        assert len(completion["logprobs"]) == len(completion["token_ids"]) == 3  # two digits and </s>
        total = 0.0
        for token, position in zip(completion["token_ids"], completion["logprobs"]):
            assert len(position) == 2 and position[str(token)]["rank"] == 1  # greedy: the top token
            assert all(entry["logprob"] <= 0 for entry in position.values())
            total += position[str(token)]["logprob"]
        assert completion["cumulative_logprob"] == pytest.approx(total, abs=1e-4)
    assert main(["generate", "--config", config, "--prompt", "12+34=", "--output", str(out), "--quiet"]) == 0
    assert "logprobs" not in read_lines(out)[0]["outputs"][0]  # not requested: not written


@pytest.mark.parametrize("where,message", [("dir", "is a directory"), ("missing/out.jsonl", "does not exist")])
def test_unwritable_output_fails_before_the_engine_is_built(config, tmp_path, monkeypatch, capsys, where, message):
    (tmp_path / "dir").mkdir()

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was built before --output was checked")

    monkeypatch.setattr(LLM, "__init__", no_engine)
    assert main(["generate", "--config", config, "--prompt", "1+1=", "--output", str(tmp_path / where)]) == 2
    assert message in capsys.readouterr().err


def test_prompts_file_cache_salt_is_honoured(config, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "123+456=", "cache_salt": "a"}, {"prompt": "123+456=", "cache_salt": "a"},
             {"prompt": "123+456=", "cache_salt": "b"}, {"prompt": "123+456="}]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "results.jsonl"
    assert main(["generate", "--config", config, "--prompts-file", str(prompts), "--temperature", "0",
                 "--output", str(out), "--quiet", "--num-gpu-blocks-override", "64"]) == 0
    results = read_lines(out)
    # "<s>123+456=" is 9 tokens: the same salt shares its 2 full blocks of 4; another salt, or none, shares nothing
    assert [r["num_cached_tokens"] for r in results] == [0, 8, 0, 0]
    assert {r["outputs"][0]["text"] for r in results} == {"579"}
    prompts.write_text(json.dumps({"prompt": "1+1=", "cache-salt": "a"}) + "\n")
    assert main(["generate", "--config", config, "--prompts-file", str(prompts)]) == 2
    assert "unknown key(s) ['cache-salt']" in capsys.readouterr().err


def test_train_tiny_points_at_the_tool(capsys):
    assert main(["train-tiny"]) == 2
    assert "python tools/train_tiny.py" in capsys.readouterr().err


def test_generate_takes_engine_flags_and_vllm_names(config, monkeypatch, capsys):
    class Built(Exception):
        pass

    def record(self, config, **kwargs):
        raise Built(config)

    monkeypatch.setattr(LLM, "__init__", record)
    with pytest.raises(Built) as built:
        main(["generate", "--config", config, "--prompt", "1+1=", "--tensor-parallel-size", "2", "--max-num-seqs", "3",
              "--gpu-memory-utilization", "0.5", "--model-seed", "5", "--seed", "9"])
    (engine_config,) = built.value.args
    assert (engine_config.parallel.model, engine_config.scheduler.max_num_seqs) == (2, 3)
    assert (engine_config.cache.gpu_memory_utilization, engine_config.model.seed) == (0.5, 5)  # --seed: sampling
    for flag, message in ((["--trust-remote-code"], "trust_remote_code=True is refused"),
                          (["--quantization", "awq"], "model.quantization='awq' is not supported"),
                          (["--max-num-seqs", "8.5"], "max_num_seqs must be an integer, got 8.5")):
        assert main(["generate", "--config", config, "--prompt", "1+1=", *flag]) == 2  # before the engine is built
        assert message in capsys.readouterr().err
