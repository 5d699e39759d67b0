"""Engine config: YAML <-> dataclasses, overrides, and the start-up refusals a user can hit."""

from __future__ import annotations

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


def test_compilation_cache_dir_refuses_a_symlink_anywhere_on_the_path(tmp_path):
    from jaxserve.runner.device_setup import private_directory

    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    for directory in (tmp_path / "link", tmp_path / "link" / "xla"):
        with pytest.raises(ValueError, match=r"runner.compilation_cache_dir .*link.* is reached through a symbolic "
                                             r"link.*use the real path"):
            private_directory(str(directory))
    assert not (real / "xla").exists()  # refused before creating anything


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
