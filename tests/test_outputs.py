"""Tests for jaxserve.outputs: OutputStream's text, stop strings, stop tokens and logprobs (vLLM V1 semantics).

Tokenizers are built on the fly with `tokenizers`: a byte-level BPE (tokens are often several characters, or part
of one) and a character-level WordLevel with a Fuse decoder (one token per character, easy to reason about).
"""

from __future__ import annotations

import math

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

from jaxserve.core.sched_types import Logprobs
from jaxserve.outputs import CompletionOutput, Logprob, OutputStream, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer

pytestmark = pytest.mark.cpu_test

FFFD = "\ufffd"
CORPUS = ["hello world, hello there!", "say hello to the world", "東京の天気は晴れです",
          "emoji 🙂🚀 test", "abc xyz abcabc"] * 20
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return Tokenizer(backend, SPECIAL)


@pytest.fixture(scope="module")
def char() -> Tokenizer:
    chars = sorted({c for text in CORPUS for c in text})
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    return Tokenizer(backend, SPECIAL)


def _ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _run(tok, params, ids, chunk=1, finished_by_token=False, prompt=()):
    """Feed `ids` in chunks until a stop string matches; finish; return (stream, stop, snapshot texts)."""
    stream, stop, texts = OutputStream(tok, params, list(prompt), index=0), None, []
    for start in range(0, len(ids), chunk):
        piece = ids[start:start + chunk]
        last = start + chunk >= len(ids)
        stop = stream.append(piece, None, finished_by_token and last)
        texts.append(stream.completion_output().text)
        if stop is not None:
            break
    if stop is not None:
        stream.finish("stop", stop)
    else:
        stream.finish("stop" if finished_by_token else "length", None)
    return stream, stop, texts


def test_no_stop_text_is_decode_and_finish_reason_length(bpe):
    ids = _ids(bpe, "hello world, hello there!")
    stream, stop, texts = _run(bpe, SamplingParams(), ids)
    out = stream.completion_output()
    assert stop is None and out.text == "hello world, hello there!" and out.token_ids == ids
    assert (out.finish_reason, out.stop_reason, out.index) == ("length", None, 0) and out.finished()
    assert out.logprobs is None and out.cumulative_logprob is None
    assert texts[-1] == out.text and all(out.text.startswith(t) for t in texts)


def test_stop_string_inside_one_token(bpe):
    ids = _ids(bpe, "say hello there")
    hello = next(k for k, i in enumerate(ids) if "ell" in bpe.decode([i]))
    assert bpe.decode([ids[hello]]).strip() == "hello"  # one token holds the whole stop string
    stream, stop, _ = _run(bpe, SamplingParams(stop=["ell"]), ids)
    out = stream.completion_output()
    assert stop == "ell" and out.text == "say h" and (out.finish_reason, out.stop_reason) == ("stop", "ell")
    assert out.token_ids == ids[:hello + 1]  # generation ended with the token holding the stop


def test_stop_string_spanning_tokens_keeps_later_token_ids(char):
    ids = _ids(char, "hello world!")
    for chunk in (1, 3, len(ids)):
        stream, stop, texts = _run(char, SamplingParams(stop="world"), ids, chunk=chunk)
        out = stream.completion_output()
        assert stop == "world" and out.text == "hello "
        assert all(out.text.startswith(t) for t in texts)  # the held-back tail is never retracted
        # Tokens after the match stay as generated (vLLM): they were appended in the same call.
        end_of_chunk_with_d = math.ceil(len("hello world") / chunk) * chunk
        assert out.token_ids == ids[:end_of_chunk_with_d]


def test_stop_string_inside_a_run_cuts_it_there_with_cut_at_stop(char):
    ids = _ids(char, "hello world!")
    stream = OutputStream(char, SamplingParams(stop="wor"), [])
    assert stream.append(ids[:4], None, False, cut_at_stop=True) is None
    assert stream.append(ids[4:], None, False, cut_at_stop=True) == "wor"
    assert stream.token_ids == ids[:len("hello wor")]  # as if appended one token per step
    stream.finish("length")
    assert (stream.finish_reason, stream.stop_reason, stream.text) == ("stop", "wor", "hello ")


def test_stop_string_at_the_very_start(char, bpe):
    for tok in (char, bpe):
        stream, stop, _ = _run(tok, SamplingParams(stop=["hello"]), _ids(tok, "hello world"))
        assert stop == "hello" and stream.completion_output().text == ""


def test_first_completed_stop_string_wins(char):
    ids = _ids(char, "hello world")
    for chunk in (1, len(ids)):
        stream, stop, _ = _run(char, SamplingParams(stop=["world", "lo"]), ids, chunk=chunk)
        assert stop == "lo" and stream.completion_output().text == "hel"
    # "bc" is completed before "abcd": one-by-one and all-at-once agree.
    for chunk in (1, 4):
        stream, stop, _ = _run(char, SamplingParams(stop=["abcd", "bc"]), _ids(char, "abcd"), chunk=chunk)
        assert stop == "bc" and stream.completion_output().text == "a"
    # Completed by the same token: the one listed first (vLLM), whatever the chunking.
    for chunk in (1, 4):
        stream, stop, _ = _run(char, SamplingParams(stop=["bc", "abc"]), _ids(char, "xabc"), chunk=chunk)
        assert stop == "bc" and stream.completion_output().text == "xa"
        stream, stop, _ = _run(char, SamplingParams(stop=["abc", "bc"]), _ids(char, "xabc"), chunk=chunk)
        assert stop == "abc" and stream.completion_output().text == "x"


def test_stop_strings_completed_by_one_token_the_first_listed_wins(bpe):
    """One token " abc" completes both "bc" and "b" (which ends earlier inside it): the first listed wins."""
    ids = _ids(bpe, "xyz abc")
    assert bpe.decode(ids[-1:]) == " abc"  # the whole " abc" is one token of this tokenizer
    stream, stop, _ = _run(bpe, SamplingParams(stop=["bc", "b"]), ids)
    assert stop == "bc" and stream.completion_output().text == "xyz a"
    stream, stop, _ = _run(bpe, SamplingParams(stop=["b", "bc"]), ids)
    assert stop == "b" and stream.completion_output().text == "xyz a"
    stream, stop, _ = _run(bpe, SamplingParams(stop=["bc", "b"], include_stop_str_in_output=True), ids)
    assert stop == "bc" and stream.completion_output().text == "xyz abc"
    stream, stop, _ = _run(bpe, SamplingParams(stop=["b", "bc"], include_stop_str_in_output=True), ids)
    assert stop == "b" and stream.completion_output().text == "xyz ab"


def test_include_stop_str_in_output(char, bpe):
    params = SamplingParams(stop=["wor"], include_stop_str_in_output=True)
    stream, stop, texts = _run(char, params, _ids(char, "hello world!"))
    assert stop == "wor" and stream.completion_output().text == "hello wor"
    assert all("hello wor".startswith(t) for t in texts)
    stream, stop, _ = _run(bpe, SamplingParams(stop=["ell"], include_stop_str_in_output=True),
                           _ids(bpe, "say hello there"))
    assert stop == "ell" and stream.completion_output().text == "say hell"  # cut inside the token


def test_streamed_text_holds_back_a_possible_stop_prefix(char):
    stream = OutputStream(char, SamplingParams(stop=["world"]), [], 0)
    stream.append(_ids(char, "hello wor"), None, False)
    assert stream.text == "hello wor" and stream.completion_output().text == "hello"  # 4 chars held back
    assert stream.append(_ids(char, "ld"), None, False) == "world"
    assert stream.completion_output().text == "hello "


def test_stop_string_wins_over_length_in_the_same_step(char):
    stream = OutputStream(char, SamplingParams(stop=["c"]), [], 0)
    assert stream.append(_ids(char, "abc"), None, False) == "c"
    assert stream.finish("length", None) is None
    out = stream.completion_output()
    assert (out.text, out.finish_reason, out.stop_reason) == ("ab", "stop", "c")


def test_finished_by_stop_token(char):
    bang = char.token_to_id("!")
    ids = _ids(char, "hi there!")
    for include, expected in ((False, "hi there"), (True, "hi there!")):
        params = SamplingParams(stop_token_ids=[bang], include_stop_str_in_output=include)
        stream, stop, _ = _run(char, params, ids, finished_by_token=True)
        out = stream.completion_output()
        assert stop is None and out.text == expected and out.token_ids == ids and out.finish_reason == "stop"


def test_finished_by_eos_with_special_tokens_kept(char):
    ids = [*_ids(char, "abc"), char.eos_token_id]
    for include, expected in ((False, "abc"), (True, "abc</s>")):
        params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
        stream, _, _ = _run(char, params, ids, chunk=2, finished_by_token=True)
        assert stream.completion_output().text == expected


def test_min_tokens_text_is_not_searched_for_stop_strings(char):
    # "ab" comes within the first 2 tokens, so it is never a match; the later check looks only at new text
    # plus len(stop) - 1 characters, not the whole text again.
    stream = OutputStream(char, SamplingParams(stop=["ab"], min_tokens=2), [], 0)
    assert stream.append(_ids(char, "ab"), None, False) is None
    assert stream.append(_ids(char, "c"), None, False) is None
    assert stream.append(_ids(char, "xab"), None, False) == "ab" and stream.text == "abcx"


def test_detokenize_false_keeps_text_empty(char):
    ids = _ids(char, "hello")
    params = SamplingParams(detokenize=False, logprobs=1)
    stream = OutputStream(char, params, [], 0)
    stream.append(ids, [Logprobs(-0.5, 1, [i], [-0.5]) for i in ids], False)
    stream.finish("length")
    out = stream.completion_output()
    assert out.text == "" and out.token_ids == ids
    assert all(entry.decoded_token is None for step in out.logprobs for entry in step.values())


def test_multibyte_characters_are_never_split(bpe):
    text = "Café 中文 晴れ 👩‍💻🙂"
    ids = _ids(bpe, text)
    assert any(FFFD in bpe.decode([i]) for i in ids)  # some tokens are partial characters
    stream, stop, texts = _run(bpe, SamplingParams(), ids)
    assert stream.completion_output().text == text
    assert all(FFFD not in t and text.startswith(t) for t in texts)
    stream, stop, _ = _run(bpe, SamplingParams(stop="文"), ids)  # a stop that is a multi-byte character
    assert stop == "文" and stream.completion_output().text == "Café 中"


def test_flushed_text_can_complete_a_stop_string(bpe):
    first_byte = next(i for i in _ids(bpe, "中") if bpe.decode([i]) == FFFD)
    stream = OutputStream(bpe, SamplingParams(stop=[FFFD]), [], 0)
    assert stream.append([first_byte], None, False) is None and stream.text == ""  # held back
    assert stream.finish("length") == FFFD
    out = stream.completion_output()
    assert (out.text, out.finish_reason, out.stop_reason) == ("", "stop", FFFD)


def test_prompt_gives_context(bpe):
    stream, _, _ = _run(bpe, SamplingParams(), _ids(bpe, " world"), prompt=_ids(bpe, "hello"))
    assert stream.completion_output().text == " world"


def test_logprobs_decoded_tokens_ranks_and_cumulative_sum(char):
    ids = _ids(char, "hi!")
    h, i, bang, eos = ids[0], ids[1], ids[2], char.eos_token_id
    steps = [Logprobs(-0.1, 1, [h, i, bang], [-0.1, -2.5, -3.0]),
             Logprobs(-1.5, 2, [bang, i, h], [-0.5, -1.5, -4.0]),
             Logprobs(-4.25, 7, [eos, h, i], [-0.01, -2.0, -3.0])]
    stream = OutputStream(char, SamplingParams(logprobs=2), [], 0)
    stream.append(ids[:2], steps[:2], False)
    stream.append(ids[2:], steps[2:], False)
    stream.finish("length")
    out = stream.completion_output()
    assert out.cumulative_logprob == pytest.approx(-0.1 - 1.5 - 4.25)
    assert [list(step) for step in out.logprobs] == [[h, i], [i, bang], [bang, eos, h]]  # sampled first
    assert out.logprobs[0][h] == Logprob(-0.1, 1, "h") and out.logprobs[0][i] == Logprob(-2.5, 2, "i")
    assert out.logprobs[1][i] == Logprob(-1.5, 2, "i") and out.logprobs[1][bang] == Logprob(-0.5, 1, "!")
    assert out.logprobs[2][bang].rank == 7 and out.logprobs[2][eos] == Logprob(-0.01, 1, "</s>")
    assert out.text == "hi!"


def test_logprobs_zero_gives_only_the_sampled_token(bpe):
    ids = _ids(bpe, "中文")
    assert FFFD in bpe.decode([ids[0]])
    stream = OutputStream(bpe, SamplingParams(logprobs=0), [], 0)
    stream.append(ids, [Logprobs(-1.0, 3, [5, 6], [-0.2, -0.3]) for _ in ids], False)
    out = stream.completion_output()
    assert [list(step) for step in out.logprobs] == [[t] for t in ids]
    assert [step[t].decoded_token for step, t in zip(out.logprobs, ids)] == [bpe.decode([t]) for t in ids]
    assert out.cumulative_logprob == -1.0 * len(ids)


def test_missing_logprobs_and_misuse_are_errors(char):
    stream = OutputStream(char, SamplingParams(logprobs=1), [], 0)
    with pytest.raises(ValueError, match="logprobs=1 was requested"):
        stream.append([5], None, False)
    with pytest.raises(ValueError, match="needs a Logprobs"):
        stream.append([5, 6], [Logprobs(-1.0, 1, [5], [-1.0]), None], False)
    assert stream.token_ids == [] and stream.logprobs == []  # a rejected append changes nothing
    with pytest.raises(ValueError, match="finish_reason must be one of"):
        stream.finish("eos")
    stream.finish("abort")
    assert stream.finish("length") is None and stream.completion_output().finish_reason == "abort"
    with pytest.raises(RuntimeError, match="after the sequence ended"):
        stream.append([5], [Logprobs(-1.0, 1, [5], [-1.0])], False)
    stopped = OutputStream(char, SamplingParams(stop="a"), [], 0)
    assert stopped.append(_ids(char, "a"), None, False) == "a"
    with pytest.raises(RuntimeError):
        stopped.append(_ids(char, "b"), None, False)


def test_snapshots_are_copies_and_request_output_fields(char):
    stream = OutputStream(char, SamplingParams(), [1], index=3)
    stream.append(_ids(char, "ab"), None, False)
    first = stream.completion_output()
    stream.append(_ids(char, "c"), None, False)
    assert first.token_ids == _ids(char, "ab") and first.finish_reason is None and not first.finished()
    out = RequestOutput("req-1", "p", [1], [stream.completion_output()], finished=False, num_cached_tokens=0)
    assert out.outputs[0].index == 3 and out.prompt_logprobs is None
    assert CompletionOutput(0, "", [], None, None).stop_reason is None


STOP_ALPHABET = "abc x"


def _reference(full: str, stops: list[str]) -> tuple[str, str | None]:
    """Character-by-character: the first stop string completed (the first listed of those completed by the
    same character) ends the text."""
    for end in range(1, len(full) + 1):
        done = [s for s in stops if full[:end].endswith(s)]
        if done:
            stop = done[0]
            return full[:end - len(stop)], stop
    return full, None


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=STOP_ALPHABET, max_size=30),
       stops=st.lists(st.text(alphabet=STOP_ALPHABET, min_size=1, max_size=4), max_size=3),
       chunk=st.integers(1, 6))
def test_stop_strings_match_a_character_level_reference(char, text, stops, chunk):
    stream, stop, texts = _run(char, SamplingParams(stop=stops), _ids(char, text), chunk=chunk)
    final = stream.completion_output().text
    assert (final, stop) == _reference(text, stops)
    assert all(final.startswith(t) for t in texts)
    assert not any(s in final for s in stops)
