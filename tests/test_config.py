"""Engine config: YAML <-> dataclasses, overrides, and the start-up refusals a user can hit."""

from __future__ import annotations

import os
import stat

import pytest

from jaxserve import LLM
from jaxserve.config import EngineConfig, load_config
from jaxserve.core.buckets import BucketLadders
from tests.conftest import ROOT


def test_tiny_yaml_loads_and_round_trips():
    config = load_config(ROOT / "configs" / "tiny.yaml")
    assert config.cache.block_size == 4 and config.runner.request_buckets == (4, 16, 64)
    assert EngineConfig.from_dict(config.to_dict()) == config


def test_unknown_keys_are_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("scheduler:\n  max_num_seq: 8\n")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['max_num_seq'\] in section 'scheduler'"):
        load_config(bad)
    bad.write_text("schedular:\n  max_num_seqs: 8\n")
    with pytest.raises(ValueError, match="unknown section"):
        load_config(bad)
    with pytest.raises(ValueError, match="unknown engine option 'max_num_seq'"):
        EngineConfig().with_overrides(max_num_seq=8)


@pytest.mark.parametrize("overrides,match", [
    ({"block_size": 3}, "power of two"), ({"policy": "lifo"}, "policy"), ({"attention_backend": "cuda"}, "attention"),
    ({"dtype": "int8"}, "dtype"), ({"num_blocks": 1}, "num_blocks"),
])
def test_bad_values_name_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig().with_overrides(**overrides)


def test_flat_overrides_route_to_sections():
    config = EngineConfig().with_overrides(model="/x", max_num_seqs=3, block_size=8, precompile=False)
    assert (config.model.path, config.scheduler.max_num_seqs, config.cache.block_size, config.runner.precompile) == \
        ("/x", 3, 8, False)


def test_refuses_a_kv_cache_that_cannot_hold_one_max_length_request():
    with pytest.raises(ValueError, match="max_model_len=32 needs 9"):
        LLM(config=load_config(ROOT / "configs" / "tiny.yaml"), num_blocks=8, progress=False)


def test_max_model_len_above_the_model_is_refused():
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(config=load_config(ROOT / "configs" / "tiny.yaml"), max_model_len=64, progress=False)


def test_compilation_cache_dir_is_private(tmp_path):
    import jax

    previous = jax.config.jax_compilation_cache_dir
    cache_dir = tmp_path / "xla"
    try:
        LLM(config=load_config(ROOT / "configs" / "tiny.yaml"), compilation_cache_dir=str(cache_dir),
            precompile=False, progress=False)
        assert stat.S_IMODE(cache_dir.stat().st_mode) == 0o700
        assert jax.config.jax_compilation_cache_dir == str(cache_dir)
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)


def test_compilation_cache_dir_creates_missing_directories_private(tmp_path):
    from jaxserve.runner.device_setup import private_directory

    path = private_directory(str(tmp_path / "a" / "b"))
    assert path == tmp_path / "a" / "b"
    for created in (tmp_path / "a", path):
        assert stat.S_IMODE(created.stat().st_mode) == 0o700
    (path / "entry").write_text("x")
    assert private_directory(str(path)) == path  # an existing private directory is used as it is
    path.chmod(0o755)  # readable by others, writable only by the owner: accepted, mode untouched
    assert private_directory(str(path)) == path and stat.S_IMODE(path.stat().st_mode) == 0o755


def test_compilation_cache_dir_follows_a_symlink_only_root_or_this_user_controls(tmp_path):
    """A link of this user's in a private directory (as a root-owned /home -> /data/home) is followed
    to the real path."""
    from jaxserve.runner.device_setup import private_directory

    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    assert private_directory(str(tmp_path / "link")) == real
    assert private_directory(str(tmp_path / "link" / "xla")) == real / "xla"
    assert stat.S_IMODE((real / "xla").stat().st_mode) == 0o700


def test_compilation_cache_dir_refuses_a_symlink_another_user_could_re_point(tmp_path, monkeypatch):
    from jaxserve.runner import device_setup

    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    shared = tmp_path / "shared"  # anyone may replace the link in it
    shared.mkdir()
    shared.chmod(0o777)
    (shared / "link").symlink_to(real)
    for directory in (shared / "link", shared / "link" / "xla"):
        with pytest.raises(ValueError, match=r"runner.compilation_cache_dir .*link.* is reached through a symbolic "
                                             r"link.*re-point: the directory it sits in.*is writable by group or "
                                             r"others without the sticky bit.*set runner.compilation_cache_dir"):
            device_setup.private_directory(str(directory))
    assert not (real / "xla").exists()  # refused before creating anything
    # a link another user owns, even in a sticky directory (as /tmp)
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    (sticky / "link").symlink_to(real)
    if os.geteuid() == 0:  # root's links are trusted: give this one to another user
        os.lchown(sticky / "link", 4242, -1)
    else:  # this process is someone else
        monkeypatch.setattr(device_setup.os, "getuid", lambda: (sticky / "link").lstat().st_uid + 1)
    owner = (sticky / "link").lstat().st_uid
    with pytest.raises(ValueError, match=rf"symbolic link.*re-point: it is owned by uid {owner}, neither root nor "
                                         r"this user.*use the real path"):
        device_setup.private_directory(str(sticky / "link" / "xla"))


def test_compilation_cache_dir_refuses_a_path_under_a_directory_others_control(tmp_path):
    from jaxserve.runner.device_setup import private_directory

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    (shared / "mine").mkdir(mode=0o700)
    with pytest.raises(ValueError, match=rf"lies under '{shared}', which is writable by group or others without "
                                         r"the sticky bit.*set runner.compilation_cache_dir"):
        private_directory(str(shared / "mine"))
    shared.chmod(0o1777)  # sticky, as /tmp: others cannot replace what this user made in it
    assert private_directory(str(shared / "mine")) == shared / "mine"


def test_compilation_cache_dir_refuses_a_directory_others_can_write(tmp_path):
    from jaxserve.runner.device_setup import private_directory

    for mode in (0o770, 0o707, 0o1777):
        shared = tmp_path / f"shared{mode:o}"
        shared.mkdir()
        shared.chmod(mode)
        with pytest.raises(ValueError, match=rf"{shared}' is writable by group or others.*chmod 700"):
            private_directory(str(shared))


def test_compilation_cache_dir_refuses_another_users_directory(tmp_path, monkeypatch):
    from jaxserve.runner import device_setup

    owned = tmp_path / "theirs"
    owned.mkdir(mode=0o700)
    owner = owned.stat().st_uid
    monkeypatch.setattr(device_setup.os, "getuid", lambda: owner + 1)  # this process is someone else
    with pytest.raises(ValueError, match=rf"theirs' is owned by uid {owner}, not by this user \(uid {owner + 1}\); "
                                         r"set runner.compilation_cache_dir to a directory of your own"):
        device_setup.private_directory(str(owned))


def test_compilation_cache_dir_refuses_a_file(tmp_path):
    from jaxserve.runner.device_setup import private_directory

    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        private_directory(str(tmp_path / "file"))
    with pytest.raises(ValueError, match="cannot create"):
        private_directory(str(tmp_path / "file" / "xla"))


def test_bucket_ladders_and_plan():
    ladders = BucketLadders.build(256, 64, token_buckets=None, request_buckets=None)
    assert ladders.token_buckets == (16, 32, 64, 128, 256)
    assert ladders.request_buckets == (1, 2, 4, 8, 16, 32, 64)
    assert ladders.pad_tokens(17) == 32 and ladders.pad_requests(5) == 8
    plan = ladders.precompile_plan()
    assert (16, 16) in plan and (16, 32) not in plan  # 17+ requests need 17+ tokens
    # pure decode steps (T == R real): one pair per request rung, each also a plan pair
    assert ladders.decode_plan() == [(16, 1), (16, 2), (16, 4), (16, 8), (16, 16), (32, 32), (64, 64)]
    assert set(ladders.decode_plan()) <= set(plan)
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        ladders.pad_tokens(257)
    with pytest.raises(ValueError, match="below max_num_batched_tokens"):
        BucketLadders.build(256, 64, token_buckets=[16, 128])


# ---- vLLM's engine-argument names and type checks -----------------------------------------------------------
def test_vllm_names_map_onto_the_config():
    config = EngineConfig().with_overrides(
        tensor_parallel_size=2, data_parallel_size=3, gpu_memory_utilization=0.5, num_gpu_blocks_override=64,
        max_num_batched_tokens=512, max_model_len=1024, seed=7, max_num_seqs=8, enable_prefix_caching=False,
        block_size=32, dtype="bfloat16", tokenizer="/tok", served_model_name="m", scheduling_policy="priority")
    assert (config.parallel.model, config.parallel.data) == (2, 3)
    assert (config.cache.gpu_memory_utilization, config.cache.num_blocks, config.cache.block_size) == (0.5, 64, 32)
    assert config.cache.memory_fraction is None  # vLLM's share of the whole device, not jaxserve's of the free memory
    assert not config.cache.enable_prefix_caching
    assert (config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs, config.scheduler.policy) == \
        (512, 8, "priority")
    assert (config.model.max_model_len, config.model.seed, config.model.dtype, config.model.tokenizer) == \
        (1024, 7, "bfloat16", "/tok")
    assert config.server.served_model_name == "m"
    assert EngineConfig().with_overrides(**{"parallel.model": 2, "model": "/m"}).parallel.model == 2


def test_unsupported_vllm_names_accept_their_defaults_only():
    defaults = EngineConfig().with_overrides(kv_cache_dtype="auto", quantization=None, speculative_config=None,
                                             enable_expert_parallel=False, pipeline_parallel_size=1,
                                             trust_remote_code=False)
    assert defaults == EngineConfig().with_overrides(kv_cache_dtype=None)
    assert defaults == EngineConfig()
    for overrides in ({"pipeline_parallel_size": 2},):
        (name, value), = overrides.items()
        with pytest.raises(ValueError, match=rf"^{name}=.* is not supported yet.*leave {name} at "):
            EngineConfig().with_overrides(**overrides)
    with pytest.raises(ValueError, match="trust_remote_code=True is refused: jaxserve never runs code from a checkpoint"):
        EngineConfig().with_overrides(trust_remote_code=True)


def test_quantization_is_model_quantization():
    assert EngineConfig().with_overrides(quantization="fp8").model.quantization == "fp8"
    assert EngineConfig().with_overrides(**{"model.quantization": None}) == EngineConfig()
    with pytest.raises(ValueError, match=r"model.quantization='awq' is not supported; use fp8"):
        EngineConfig().with_overrides(quantization="awq")


def test_speculative_section_and_vllm_speculative_config():
    assert not EngineConfig().speculative.enabled
    config = EngineConfig().with_overrides(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                               "prompt_lookup_max": 4})
    spec = config.speculative
    assert spec.enabled and spec.num_speculative_tokens == 3 and spec.lookup_range == (4, 4)
    assert EngineConfig().with_overrides(speculative_config={"method": "ngram", "num_speculative_tokens": 1}
                                         ).speculative.lookup_range == (5, 5)
    # Field overrides refine the mapping; a bound resolved from the other is not frozen into the config.
    refined = config.with_overrides(speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                                    prompt_lookup_min=2, prompt_lookup_max=3)
    assert (refined.speculative.num_speculative_tokens, refined.speculative.lookup_range) == (2, (2, 3))
    assert config.with_overrides(prompt_lookup_min=2).speculative.lookup_range == (2, 4)
    assert EngineConfig().with_overrides(speculative_config=None) == EngineConfig()
    draft = EngineConfig().with_overrides(speculative_config={"model": "/draft", "num_speculative_tokens": 2}).speculative
    assert (draft.method, draft.model, draft.uses_model, draft.draft_tensor_parallel_size) == (
        "draft_model", "/draft", True, None)
    fp8_draft = EngineConfig().with_overrides(speculative_config={"model": "/draft", "num_speculative_tokens": 2,
                                                                  "quantization": "fp8"})
    assert fp8_draft.speculative.quantization == "fp8" and fp8_draft.model.quantization is None
    assert EngineConfig.from_dict({"speculative": {"method": "ngram", "num_speculative_tokens": 2}}) == \
        EngineConfig().with_overrides(**{"speculative.method": "ngram", "num_speculative_tokens": 2})
    for value, message in [
        ({"method": "medusa", "num_speculative_tokens": 2}, r"speculative.method='medusa' is not supported yet"),
        ({"method": "eagle3", "num_speculative_tokens": 2}, "'eagle3' needs speculative.model"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "'draft_model' needs speculative.model"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "'eagle' needs speculative.model: the directory of the "
                                                           "EAGLE head"),
        ({"model": "/draft"}, r"num_speculative_tokens must be an integer >= 1 with method draft_model, got None"),
        ({"model": "/draft", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
        ({"model": "/draft", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 0},
         "draft_tensor_parallel_size must be >= 1"),
        ({"model": "/draft", "num_speculative_tokens": 2, "prompt_lookup_max": 2}, "are for method ngram"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "/draft"},
         "speculative.model is for method draft_model, eagle or eagle3"),
        ({"method": "ngram"}, r"num_speculative_tokens must be an integer >= 1 with method ngram, got None"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         r"prompt_lookup_min \(4\) and prompt_lookup_max \(2\) must satisfy"),
        ({"method": "ngrams", "num_speculative_tokens": 2}, "speculative.method must be ngram, draft_model, eagle or"),
        ({"num_speculative_tokens": 2}, "num_speculative_tokens is set but speculative.method is not"),
        ({"quantization": "fp8"}, "quantization is set but speculative.method is not"),
        ({"method": "ngram", "num_speculative_tokens": 2, "quantization": "fp8"},
         "speculative.quantization is for method draft_model"),
        ({"model": "/draft", "num_speculative_tokens": 2, "quantization": "int8"},
         r"speculative.quantization='int8' is not supported; use fp8"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
         "draft_tensor_parallel_size is for method draft_model, eagle or eagle3"),
        ({"method": "ngram", "num_speculative_tokens": 2, "acceptance": 0.5},
         r"unknown or unsupported key\(s\) \['acceptance'\]"),
        ("ngram", r"speculative_config must be a mapping or null"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineConfig().with_overrides(speculative_config=value)


def test_enable_expert_parallel_turns_data_parallel_ranks_into_expert_shards():
    config = EngineConfig().with_overrides(enable_expert_parallel=True, data_parallel_size=4, tensor_parallel_size=2)
    assert (config.parallel.expert, config.parallel.data, config.parallel.model) == (4, 1, 2)
    assert EngineConfig().with_overrides(enable_expert_parallel=False, data_parallel_size=4).parallel.data == 4
    explicit = EngineConfig().with_overrides(**{"parallel.expert": 2}, data_parallel_size=2, enable_expert_parallel=True)
    assert (explicit.parallel.expert, explicit.parallel.data) == (2, 2)
    with pytest.raises(ValueError, match=r"enable_expert_parallel=True with data_parallel_size=1.*set parallel.expert"):
        EngineConfig().with_overrides(enable_expert_parallel=True)
    with pytest.raises(ValueError, match="parallel.expert_dispatch must be one of"):
        EngineConfig().with_overrides(expert_dispatch="ring")


@pytest.mark.parametrize("overrides,message", [
    ({"max_num_seqs": "8"}, r"max_num_seqs must be an integer, got '8' \(str\)"),
    ({"max_num_seqs": True}, r"max_num_seqs must be an integer, got True \(bool\)"),  # a bool is not an int
    ({"block_size": 16.0}, r"block_size must be an integer, got 16.0 \(float\)"),
    ({"enable_prefix_caching": "yes"}, r"enable_prefix_caching must be a boolean \(true or false\), got 'yes'"),
    ({"precompile": 1}, "precompile must be a boolean"),
    ({"gpu_memory_utilization": "0.9"}, r"gpu_memory_utilization must be a number or null"),
    ({"tensor_parallel_size": 2.0}, r"tensor_parallel_size \(jaxserve's parallel.model\) must be an integer"),
    ({"max_model_len": "1024"}, "max_model_len must be an integer or null"),
    ({"token_buckets": [16, "64"]}, "token_buckets must be a list of integers or null"),
    ({"api_key": 5}, "api_key must be a string or a list of strings or null"),
    ({"trust_remote_code": "no"}, "trust_remote_code must be a boolean"),
    ({"model": 5}, "model must be a string or"),
    ({"cache.num_blocks": "x"}, "cache.num_blocks must be an integer or null"),
])
def test_wrong_types_name_the_option_and_the_type(overrides, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        EngineConfig().with_overrides(**overrides)


def test_memory_fraction_and_gpu_memory_utilization_exclude_each_other():
    assert EngineConfig().cache.kv_memory_fraction == 0.9  # jaxserve's default when neither is set
    assert EngineConfig().with_overrides(memory_fraction=0.5).cache.kv_memory_fraction == 0.5
    with pytest.raises(ValueError, match="memory_fraction .* and cache.gpu_memory_utilization .* set only one"):
        EngineConfig().with_overrides(memory_fraction=0.5, gpu_memory_utilization=0.9)
    with pytest.raises(ValueError, match=r"cache.gpu_memory_utilization must be in \(0, 1\], got 1.5"):
        EngineConfig().with_overrides(gpu_memory_utilization=1.5)


def test_ints_are_accepted_as_floats_and_lists_as_tuples():
    config = EngineConfig().with_overrides(gpu_memory_utilization=1, drain_timeout_s=5, token_buckets=[16, 64])
    assert config.cache.gpu_memory_utilization == 1.0 and isinstance(config.cache.gpu_memory_utilization, float)
    assert isinstance(config.server.drain_timeout_s, float) and config.runner.token_buckets == (16, 64)
    assert hash(config) == hash(EngineConfig().with_overrides(gpu_memory_utilization=1.0, drain_timeout_s=5.0,
                                                              token_buckets=(16, 64)))


def _field_cases():
    from jaxserve.config import SECTIONS
    from jaxserve.config_types import field_types

    return [(section, name) for section, cls in SECTIONS.items() for name in field_types(cls)]


@pytest.mark.parametrize("section,name", _field_cases())
def test_every_field_is_type_checked(section, name, tmp_path):
    from jaxserve.config import SECTIONS

    with pytest.raises(ValueError, match=rf"^{section}\.{name} must be "):
        SECTIONS[section](**{name: object()})
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"{section}:\n  {name}: {{a: 1}}\n")  # a mapping: no field takes one
    with pytest.raises(ValueError, match=rf"^{section}\.{name} must be .*got \{{'a': 1\}} \(dict\)"):
        load_config(bad)


def test_yaml_values_are_type_checked(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("scheduler:\n  max_num_seqs: '8'\n")
    with pytest.raises(ValueError, match="scheduler.max_num_seqs must be an integer, got '8'"):
        load_config(path)
    path.write_text("cache:\n  enable_prefix_caching: 1\n  memory_fraction: 1\n")
    with pytest.raises(ValueError, match="cache.enable_prefix_caching must be a boolean"):
        load_config(path)
    path.write_text("cache:\n  memory_fraction: 1\n")
    assert load_config(path).cache.memory_fraction == 1.0


def test_command_line_flags_take_vllm_names():
    import argparse

    from jaxserve import config_flags

    parser = argparse.ArgumentParser()
    flags = config_flags.add_config_flags(parser, reserved={"--config"}, repeatable={"server.api_key"})
    names = {flag.flag for flag in flags}
    assert {"--tensor-parallel-size", "--gpu-memory-utilization", "--num-gpu-blocks-override", "--kv-cache-dtype",
            "--trust-remote-code", "--max-num-seqs", "--model", "--parallel-model", "--served-model-name"} <= names

    def parse(*argv):
        args = vars(parser.parse_args(argv))
        return EngineConfig().with_overrides(**config_flags.overrides(args, flags))

    config = parse("--tensor-parallel-size", "2", "--enable-prefix-caching", "--gpu-memory-utilization", "0.5",
                   "--num-gpu-blocks-override", "64", "--tokenizer", "null", "--served-model-name", "true",
                   "--api-key", "a", "--api-key", "b", "--trust-remote-code", "false", "--kv-cache-dtype", "auto")
    assert (config.parallel.model, config.cache.enable_prefix_caching, config.cache.gpu_memory_utilization) == \
        (2, True, 0.5)
    assert config.cache.num_blocks == 64 and config.model.tokenizer is None
    assert config.server.served_model_name == "true" and config.server.api_key == ("a", "b")  # strings stay text
    assert parse("--enable-prefix-caching", "false").cache.enable_prefix_caching is False
    with pytest.raises(ValueError, match="trust_remote_code=True is refused"):
        parse("--trust-remote-code")  # bare, as in vLLM: true
    assert parse("--kv-cache-dtype", "fp8").cache.kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="cache.kv_cache_dtype='fp8_e5m2' is not supported; choose one of"):
        parse("--kv-cache-dtype", "fp8_e5m2")
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(jaxserve's parallel.model\) must be an integer"):
        parse("--tensor-parallel-size", "two")
    spec = parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                 "--prompt-lookup-max", "2").speculative
    assert (spec.method, spec.num_speculative_tokens, spec.lookup_range) == ("ngram", 3, (2, 2))
