"""The server's tokenization machinery: the characters-per-token bound (it must never refuse a prompt that
fits) and the worker pool (results equal the in-process tokenizer's; a dead, hung or garbling worker is
replaced; no worker at all answers at once; nothing is imported from the working directory)."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest
import tokenizers
from tokenizers import models, normalizers, pre_tokenizers

from jaxserve.server.char_bound import max_chars_per_token
from jaxserve.server.tokenizer_pool import TokenizeError, TokenizerPool
from jaxserve.tokenizer import Tokenizer
from tests.conftest import TINY_MODEL
from tests.test_tokenizer import BUILDERS, CORPUS

TEXTS = [*set(CORPUS), " " * 300, "\n\n\t  \t" * 40, "🙂" * 50, "e\u0301" * 60, "x" * 500, "ab " * 200]


def _spec(tok: tokenizers.Tokenizer) -> dict:
    return json.loads(tok.to_str())


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_bound_holds_for_tokenizers_that_keep_every_character(name):
    backend, _ = BUILDERS[name]()
    bound = max_chars_per_token(_spec(backend))
    assert bound is not None
    for text in TEXTS:
        tokens = len(backend.encode(text, add_special_tokens=False).ids)
        assert tokens * bound >= len(text), (name, text[:40], tokens, bound)


def test_bound_of_the_embedded_tokenizer():
    spec = json.loads((TINY_MODEL / "tokenizer.json").read_text())
    assert max_chars_per_token(spec) == 5  # one character per token; "<pad>" / "<unk>" are the longest


def test_no_bound_where_a_stage_can_drop_or_merge_input():
    words = tokenizers.Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()  # a long word is one <unk>; spaces vanish
    assert max_chars_per_token(_spec(words)) is None
    backend, _ = BUILDERS["bpe"]()
    for normalizer in (normalizers.StripAccents(), normalizers.BertNormalizer(), normalizers.Strip(),
                       normalizers.Replace(tokenizers.Regex(" +"), " ")):
        backend.normalizer = normalizer
        assert max_chars_per_token(_spec(backend)) is None, normalizer
    backend.normalizer = normalizers.NFC()  # composes at most 4 characters into one
    plain = max_chars_per_token(_spec(BUILDERS["bpe"]()[0]))
    assert max_chars_per_token(_spec(backend)) == 4 * plain
    wordpiece = tokenizers.Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert max_chars_per_token(_spec(wordpiece)) is None


def test_worker_pool_matches_the_tokenizer_and_replaces_a_dead_worker():
    tokenizer = Tokenizer.from_dir(TINY_MODEL)
    messages = [{"role": "user", "content": "12+34"}]

    async def scenario():
        pool = TokenizerPool(str(TINY_MODEL), max_model_len=32, size=1)
        await pool.start()
        try:
            assert pool.max_prompt_chars == 32 * 5
            encoded = await pool.encode("505+250=", add_special_tokens=True)
            assert encoded.token_ids == tokenizer.encode("505+250=") and encoded.count == 9
            assert (await pool.encode("1" * 40, add_special_tokens=True)).token_ids is None  # 41 >= 32: count only
            chat = await pool.render_chat(messages, add_generation_prompt=True, continue_final_message=False,
                                          chat_template=None, template_kwargs={}, add_special_tokens=False)
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            assert chat.prompt == text and chat.token_ids == tokenizer.encode(text, add_special_tokens=False)
            tools = [{"type": "function", "function": {"name": "add"}}, {"type": "function", "function": {"name": "x"}}]
            listing = ("{{ bos_token }}{% for t in tools %}{{ t['function']['name'] }};{% endfor %}"
                       "{{ messages[0]['content'] }}")
            with_tools = await pool.render_chat(messages, add_generation_prompt=False, continue_final_message=False,
                                                chat_template=listing, template_kwargs={}, add_special_tokens=False,
                                                tools=tools)
            assert with_tools.prompt == "<s>add;x;12+34"
            assert with_tools.prompt == tokenizer.apply_chat_template(messages, tools=tools, chat_template=listing)
            assert await pool.decode([1, 5, 14, 5], skip_special_tokens=True) == "1+1"
            with pytest.raises(TokenizeError) as refused:
                await pool.encode("1+\ud8001", add_special_tokens=True)
            assert refused.value.kind == "value" and "surrogate" in str(refused.value)
            with pytest.raises(TokenizeError) as template:
                await pool.render_chat(messages, add_generation_prompt=True, continue_final_message=False,
                                       chat_template="{{ raise_exception('no') }}", template_kwargs={},
                                       add_special_tokens=False)
            assert template.value.kind == "template"
            worker = next(iter(pool._workers))
            worker.process.kill()
            with pytest.raises(TokenizeError) as dead:
                await pool.encode("1+1=", add_special_tokens=True)
            assert dead.value.kind == "internal"
            assert (await pool.encode("1+1=", add_special_tokens=True)).count == 5  # served by its replacement
            assert worker.process.poll() is not None and worker not in pool._workers
        finally:
            await pool.close()
        assert all(w.process.poll() is not None for w in pool._workers)

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_workers_do_not_import_from_the_servers_working_directory(tmp_path, monkeypatch):
    (tmp_path / "json.py").write_text("import pathlib\npathlib.Path(__file__).with_name('imported').write_text('')\n")
    monkeypatch.chdir(tmp_path)

    async def scenario():
        pool = TokenizerPool(str(TINY_MODEL), max_model_len=32, size=1)
        await pool.start()
        try:
            assert (await pool.encode("1+1=", add_special_tokens=True)).count == 5
        finally:
            await pool.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert not (tmp_path / "imported").exists()


def test_worker_pool_times_out_hung_workers_and_fails_fast_without_workers(monkeypatch):
    """A worker that hangs is killed after timeout_s and replaced; a malformed reply fails its call; while
    no worker runs and none is starting, calls fail at once ("unavailable") until a re-spawn succeeds."""
    from jaxserve.framing import FRAME_HEAD

    async def scenario():
        pool = TokenizerPool(str(TINY_MODEL), max_model_len=32, size=1, timeout_s=1.0)
        await pool.start()
        try:
            hung = next(iter(pool._workers))
            os.kill(hung.process.pid, signal.SIGSTOP)
            with pytest.raises(TokenizeError) as timed_out:
                await pool.encode("1+1=", add_special_tokens=True)
            assert timed_out.value.kind == "timeout" and "server.tokenizer_timeout_s=1 s" in str(timed_out.value)
            assert (await pool.encode("1+1=", add_special_tokens=True)).count == 5  # its replacement
            assert hung.process.poll() is not None

            garbled = next(iter(pool._workers))
            garbled.reader.feed_data(FRAME_HEAD.pack(5, 0) + b"{oops")  # read before the real reply
            with pytest.raises(TokenizeError) as malformed:
                await pool.encode("1+1=", add_special_tokens=True)
            assert malformed.value.kind == "internal" and "malformed reply header" in str(malformed.value)
            assert (await pool.encode("1+1=", add_special_tokens=True)).count == 5

            async def cannot_start():
                raise RuntimeError("no worker today")

            monkeypatch.setattr(pool, "_spawn", cannot_start)
            next(iter(pool._workers)).process.kill()
            with pytest.raises(TokenizeError):
                await pool.encode("1+1=", add_special_tokens=True)  # the call the worker died under
            with pytest.raises(TokenizeError) as unavailable:
                await asyncio.wait_for(pool.encode("1+1=", add_special_tokens=True), 5)
            assert unavailable.value.kind == "unavailable" and not pool.available
            monkeypatch.undo()  # the next retry starts one
            for _ in range(100):
                if pool.available:
                    break
                await asyncio.sleep(0.05)
            assert (await pool.encode("1+1=", add_special_tokens=True)).count == 5
        finally:
            await pool.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
