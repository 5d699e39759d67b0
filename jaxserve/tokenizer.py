"""Tokenizer, chat templates and streaming detokenization (host-only; no JAX).

Data flow::

    model dir ──► Tokenizer.from_dir
                   ├─ tokenizer.json         → tokenizers.Tokenizer (encode/decode; the only source of ids)
                   ├─ tokenizer_config.json  → special tokens, added_tokens_decoder, chat_template
                   └─ chat_template.jinja, additional_chat_templates/*.jinja → chat templates (override the config's)

    request messages ──► Tokenizer.apply_chat_template ──► prompt str ──► Tokenizer.encode ──► prompt ids
    generated ids ──► IncrementalDetokenizer.add_tokens (per step) ──► text deltas ──► finish() ──► last delta

Chat templates are rendered the way transformers (v5) renders them: the same sandboxed Jinja environment,
filters and globals, the same message normalisation, and special-token strings in the context. Templates are
untrusted code, hence ImmutableSandboxedEnvironment; all template failures surface as ChatTemplateError.

Design decision: ``template_kwargs`` may not use a name the renderer sets itself (``messages``, which is
positional-only so that it can arrive there, and the special-token names such as ``bos_token``): that raises
ValueError naming the key rather than being ignored with a warning, so request-supplied kwargs can never
silently change what the template sees. (transformers lets kwargs override special tokens.)

tokenizer.json's post-processor alone decides what encode(add_special_tokens=True) adds; tokenizer_config's
add_bos_token/add_eos_token are exposed but, as in transformers v5, not applied. generation_config.json
(generation eos ids) is not read here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
import tokenizers

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "Tokenizer"]

logger = logging.getLogger(__name__)

# transformers' named special tokens; these strings are always in the chat template context when set.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_CORE_TEMPLATE_NAMES = ("messages", "tools", "documents", "add_generation_prompt")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_BYTE_TOKEN_RE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
_REPLACEMENT = "\ufffd"


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render, or called raise_exception(message)."""


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string, an AddedToken dict with "content", or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"special token must be a string or a dict with 'content', got {value!r}")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the tokenizer_config.json facts that transformers layers on top of it."""

    def __init__(self, backend: tokenizers.Tokenizer, config: Mapping[str, Any] | None = None, *,
                 chat_template: str | Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
                 copy: bool = True, source: str = "<in-memory tokenizer>"):
        """`config` is a tokenizer_config.json dict; `chat_template` overrides config["chat_template"].
        `backend` is copied before config tokens missing from it are added, unless copy=False."""
        config = dict(config or {})
        self.source = source
        # Named special tokens: the standard seven, extra_special_tokens given as a dict, other "*_token" strings.
        special: dict[str, str] = {}
        for key, value in config.items():
            if key in SPECIAL_TOKEN_NAMES or (key.endswith("_token") and (
                    isinstance(value, str) or isinstance(value, Mapping) and isinstance(value.get("content"), str))):
                if (content := _token_content(value)) is not None:
                    special[key] = content
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
        if isinstance(extra, Mapping):
            special.update({k: c for k, v in extra.items() if (c := _token_content(v)) is not None})
            extra = []
        self.special_tokens_map: dict[str, str] = special
        self.extra_special_tokens: list[str] = [c for v in extra if (c := _token_content(v)) is not None]

        # Bring the backend in line with the config, as transformers does on load.
        added = {t.content for t in backend.get_added_tokens_decoder().values()}
        to_add = []
        for id_str, spec in sorted((config.get("added_tokens_decoder") or {}).items(), key=lambda kv: int(kv[0])):
            if spec["content"] not in added:
                to_add.append(tokenizers.AddedToken(spec["content"], single_word=spec.get("single_word", False),
                                                    lstrip=spec.get("lstrip", False), rstrip=spec.get("rstrip", False),
                                                    normalized=spec.get("normalized", not spec.get("special", False)),
                                                    special=spec.get("special", False)))
        for content in [*special.values(), *self.extra_special_tokens]:
            if content not in added and all(t.content != content for t in to_add):
                to_add.append(tokenizers.AddedToken(content, special=True, normalized=False))
        if to_add and copy:
            backend = tokenizers.Tokenizer.from_str(backend.to_str())
        for tok in to_add:
            (backend.add_special_tokens if tok.special else backend.add_tokens)([tok])
        self._backend = backend

        self._added_decoder = backend.get_added_tokens_decoder()
        self._skipped_ids = frozenset(i for i, t in self._added_decoder.items() if t.special)
        vocab = backend.get_vocab(with_added_tokens=True)
        self._vocab_size = max(backend.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
        decoder_state = backend.decoder.__getstate__() if backend.decoder is not None else b""
        self._byte_fallback_ids = (frozenset(i for t, i in vocab.items() if _BYTE_TOKEN_RE.match(t))
                                   if b'"ByteFallback"' in decoder_state else frozenset())

        if chat_template is None:
            chat_template = config.get("chat_template")
        if isinstance(chat_template, Sequence) and not isinstance(chat_template, str):
            chat_template = {t["name"]: t["template"] for t in chat_template}
        self.chat_template: str | dict[str, str] | None = (
            dict(chat_template) if isinstance(chat_template, Mapping) else chat_template)

        # add_bos_token/add_eos_token: as in transformers v5, tokenizer.json's post-processor decides what encode()
        # adds; the config flags are kept for callers and a disagreement is logged.
        self.add_bos_token: bool | None = config.get("add_bos_token")
        self.add_eos_token: bool | None = config.get("add_eos_token")
        probe = self.encode("a")
        for flag, tid, adds in ((self.add_bos_token, self.bos_token_id, probe[:1]),
                                (self.add_eos_token, self.eos_token_id, probe[-1:])):
            if flag is not None and tid is not None and bool(flag) != (adds == [tid]):
                logger.warning("%s: tokenizer_config.json add_*_token=%s disagrees with tokenizer.json's "
                               "post-processor; following tokenizer.json (as transformers v5)", source, flag)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json (required), tokenizer_config.json and chat template files from a model dir."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {tok_file} (jaxserve needs a fast tokenizer.json)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises a bare Exception
            raise ValueError(f"{tok_file} is not a valid tokenizers file: {e}") from e
        cfg_file = path / "tokenizer_config.json"
        config = _read_json(cfg_file) if cfg_file.is_file() else {}
        if not isinstance(config, dict):
            raise ValueError(f"{cfg_file} must hold a JSON object")
        # As transformers: template files, if any, replace the config's template(s) entirely.
        templates: dict[str, str] = {}
        if (path / "chat_template.jinja").is_file():
            templates["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
        extra_dir = path / "additional_chat_templates"
        if extra_dir.is_dir():
            for f in sorted(extra_dir.glob("*.jinja")):
                templates[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
        chat_template = (templates["default"] if list(templates) == ["default"] else templates) or None
        return cls(backend, config, chat_template=chat_template, copy=False, source=str(path))

    # ---- vocabulary -----------------------------------------------------------------------------------------
    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of ids including added tokens (max id + 1 if ids have holes)."""
        return self._vocab_size

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self._backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of named and extra special tokens plus every added token flagged special (what decode skips)."""
        ids = {self._backend.token_to_id(t) for t in [*self.special_tokens_map.values(), *self.extra_special_tokens]}
        return sorted((ids - {None}) | self._skipped_ids)

    @property
    def added_tokens(self) -> dict[str, int]:
        return {t.content: i for i, t in sorted(self._added_decoder.items())}

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self._vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer(source={self.source!r}, vocab_size={self._vocab_size})"

    # ---- chat templates ---------------------------------------------------------------------------------------
    def get_chat_template(self, chat_template: str | None = None, tools: Any = None) -> str:
        """Pick the template source as transformers does: a name among the model's templates, else a literal."""
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None:
                return own.get(chat_template, chat_template)
            if tools is not None and "tool_use" in own:
                return own["tool_use"]
            if "default" in own:
                return own["default"]
            raise ValueError(f"{self.source} has several chat templates and none named 'default'; pass "
                             f"chat_template= one of {sorted(own)} or a template string")
        if chat_template is not None:
            return chat_template
        if own is None:
            raise ValueError(f"{self.source} has no chat template (none in tokenizer_config.json and no "
                             "chat_template.jinja); pass one with apply_chat_template(..., chat_template=...)")
        return own

    def apply_chat_template(self, messages: Sequence[Any], /, add_generation_prompt: bool = False,
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            documents: Sequence[Mapping[str, Any]] | None = None,
                            chat_template: str | None = None, *, continue_final_message: bool = False,
                            **template_kwargs: Any) -> str:
        """Render `messages` to a prompt string (transformers' apply_chat_template(..., tokenize=False)).

        `template_kwargs` are extra template variables; names the renderer sets (`messages`, the special-token
        names) raise ValueError. `chat_template` is a template name (for models with several) or source."""
        reserved = {*_CORE_TEMPLATE_NAMES, *SPECIAL_TOKEN_NAMES, *self.special_tokens_map}
        for key in template_kwargs:
            if key in reserved:
                raise ValueError(f"chat template kwarg {key!r} is reserved: it is set by the tokenizer, not callers")
        source = self.get_chat_template(chat_template, tools)
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise ValueError("tools must be JSON-schema dicts")
        if documents is not None and not all(isinstance(d, Mapping) for d in documents):
            raise TypeError("documents must be a list of dicts with 'title' and 'text' keys")
        chat = _alias_reasoning_fields(_plain([_message_dict(m) for m in messages]))
        tag = "CONTINUE_FINAL_MESSAGE_TAG "
        final = None
        if continue_final_message:
            final = chat[-1].get("content")
            if isinstance(final, str):
                chat[-1]["content"] = final + tag
            elif isinstance(final, list) and (blocks := [b for b in final if isinstance(b, dict) and "text" in b]):
                final = blocks[-1]["text"]
                blocks[-1]["text"] = final + tag
            else:
                raise ValueError("continue_final_message is set but the final message has no text to continue")
        context = {**self.special_tokens_map, **_plain(template_kwargs)}
        rendered = _render(source, messages=chat, tools=_plain(tools), documents=_plain(documents),
                           add_generation_prompt=add_generation_prompt, **context)
        if final is not None:
            if final.strip() not in rendered or tag.strip() not in rendered:
                raise ValueError("continue_final_message is set but the template dropped the final message")
            at = rendered.rindex(tag.strip())
            rendered = rendered[:at] if rendered[at:at + len(tag)] == tag else rendered[:at].rstrip()
        return rendered


# ---- chat template environment (same as transformers' _compile_jinja_template) ---------------------------------
def _raise_exception(message: Any) -> None:
    raise ChatTemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict` for templates without exposing the dict type (no attribute/type hackery)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace() refusing underscore-prefixed attributes."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja's, so namespace(self=...) works
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


class _GenerationTag(jinja2.ext.Extension):
    """transformers' {% generation %}...{% endgeneration %} (marks assistant text for training masks): the body
    is rendered as is, inside a call block as transformers does (so its variable scoping matches)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


@lru_cache(maxsize=1)
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_TemplateNamespace)
    return env


@lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:  # not cached: lru_cache does not store exceptions
        raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from e


def _render(source: str, **context: Any) -> str:
    template = _compile(source)
    try:
        return template.render(**context)
    except ChatTemplateError:
        raise
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"chat template attempted an unsafe operation: {e}") from e
    except Exception as e:
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e


def _message_dict(message: Any) -> dict:
    """transformers' _normalize_chat_messages: objects to dicts, keys whose value is None dropped."""
    if dataclasses.is_dataclass(message) and not isinstance(message, type):
        message = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
    elif callable(getattr(message, "model_dump", None)):
        message = message.model_dump()
    if not isinstance(message, Mapping):
        raise TypeError(f"chat messages must be dicts, got {message!r}")
    return {k: v for k, v in message.items() if v is not None}


def _plain(value: Any) -> Any:
    """Rebuild template inputs from plain JSON types (transformers' _plain_template_data): rich objects could
    expose methods the sandbox does not know are dangerous, so they become "<TypeName>" placeholders."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base, convert in ((str, str.__str__), (int, int.__int__), (float, float.__float__)):
        if isinstance(value, base):  # subclasses (enums, ...) can carry extra methods: strip to the base type
            return convert(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if (np := sys.modules.get("numpy")) is not None and isinstance(value, np.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning_fields(chat: list[dict]) -> list[dict]:
    out = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        out.append({"thinking": reasoning, **message, "reasoning_content": reasoning} if reasoning is not None
                   else message)
    return out


# ---- streaming detokenization ------------------------------------------------------------------------------------
class IncrementalDetokenizer:
    """Turn a stream of generated ids into text deltas, with O(1) work per token.

    Windowed decode (as vLLM's detokenize_incrementally): keep `prefix` = ids[prefix_offset:read_offset] whose
    text was already emitted, decode prefix + newer ids and emit the part of the text past decode(prefix). Both
    decodes start at the same token, so decoder quirks at a sequence start (sentencepiece's stripped leading
    space) cancel out. Text is held back while:
      * it ends in U+FFFD: the last token(s) may be an incomplete UTF-8 sequence;
      * (ByteFallback decoders) the ids end in a run of <0xNN> byte tokens: tokenizers decodes a whole run at
        once and turns *every* byte of an invalid run into U+FFFD, so later bytes could change earlier text.
    (The second costs latency only for characters spelled in byte tokens, until the next non-byte token.)
    Invariants: every emitted text is a prefix of the final text; without prompt ids, the deltas joined with
    finish() equal tokenizer.decode(generated_ids, skip_special_tokens) exactly. With prompt ids, the last few
    prompt tokens serve as context, so the text is what the generation adds to the prompt's text (e.g. a
    leading space that decode(generated_ids) alone would strip); a character begun by the prompt's last bytes
    and completed by generated ones is emitted with the generation. Work per token is bounded by the window
    (ids since the last emission plus the previous emission's), i.e. O(1) except while text is held back.
    """

    CONTEXT_TOKENS = 5  # prompt tokens kept as left context, as vLLM

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._byte_ids = tokenizer._byte_fallback_ids
        self._buf: list[int] = []  # ids[prefix_offset:]; offsets below are relative to it
        self._read = 0  # read_offset: text of _buf[:_read] is accounted for
        self._run_start: int | None = None  # start of a trailing run of byte-fallback tokens, if any
        self._prefix_text: str | None = ""  # cached decode(_buf[:_read])
        self._finished = False
        if prompt_ids:
            prompt, tr = list(prompt_ids), self._transparent
            start = max(0, len(prompt) - self.CONTEXT_TOKENS)
            # The context needs a token that decodes to text (it absorbs sentencepiece's first-token strip) ...
            while start > 0 and all(tr(t) for t in prompt[start:start + self.CONTEXT_TOKENS]):
                start -= self.CONTEXT_TOKENS
            start = max(start, 0)
            # ... and must not start inside a run of byte-fallback tokens (decoded as a whole).
            bytes_or_tr = lambda t: t in self._byte_ids or tr(t)  # noqa: E731
            while self._byte_ids and start > 0 and bytes_or_tr(prompt[start]) and bytes_or_tr(prompt[start - 1]):
                start -= 1
            self._extend(prompt[start:])
            self._read, self._prefix_text = len(self._buf), None

    def _transparent(self, token_id: int) -> bool:
        """Ids that decode drops entirely: skipped special tokens and unknown ids."""
        if self.skip_special_tokens and token_id in self.tokenizer._skipped_ids:
            return True
        return self.tokenizer.id_to_token(token_id) is None

    def _extend(self, ids: list[int]) -> None:
        for token_id in ids:
            if token_id in self._byte_ids:
                if self._run_start is None:
                    self._run_start = len(self._buf)
            elif self._byte_ids and self._run_start is not None and not self._transparent(token_id):
                self._run_start = None
            self._buf.append(token_id)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _step(self, end: int, final: bool) -> str:
        if end <= self._read:
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._buf[:self._read])
        prefix_text, new_text = self._prefix_text, self._decode(self._buf[:end])
        if new_text.startswith(prefix_text):
            delta = new_text[len(prefix_text):]
        else:  # only if the prompt context ends inside a character that the generation completes
            delta = new_text[len(os.path.commonprefix([prefix_text, new_text])):]
        if not final and (not delta or new_text.endswith(_REPLACEMENT)):
            return ""
        # Advance: prefix_offset <- read_offset, read_offset <- end; drop ids left of the new window.
        drop = self._read
        self._buf = self._buf[drop:]
        self._read = end - drop
        if self._run_start is not None:
            self._run_start -= drop
        self._prefix_text = None
        return delta

    def add_tokens(self, ids: Sequence[int]) -> str:
        """Feed newly generated ids; return the text they complete (possibly "")."""
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.add_tokens called after finish()")
        self._extend(list(ids))
        end = len(self._buf) if self._run_start is None else max(self._run_start, self._read)
        return self._step(end, final=False)

    def finish(self) -> str:
        """Flush held-back text (incomplete characters decode to U+FFFD, as in decode())."""
        if self._finished:
            return ""
        self._finished = True
        return self._step(len(self._buf), final=True)
