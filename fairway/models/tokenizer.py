"""The model's tokenizer and chat template, rebuilt from GGUF metadata.

A GGUF carries no tokenizer.json, only llama.cpp-style metadata (tokens, merges, token types, special
ids, chat template). We rebuild the same `tokenizers.Tokenizer` that transformers builds for the file
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)` is our reference), and cache it as JSON because
reading the GGUF header alone takes seconds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from fairway.cache_dir import cache_dir

# Bump when the build below changes, so stale cached tokenizers are rebuilt rather than reused.
_BUILD_VERSION = 1

# llama.cpp token types (gguf.TokenType); only these two become added tokens.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

logger = logging.getLogger(__name__)

_SURROGATE = re.compile("[\ud800-\udfff]")

# Tokens that end an assistant turn in ChatML-style templates, besides the declared eos.
_END_OF_TURN_TOKENS = ("<|im_end|>",)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-character table that byte-level BPE vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


_BYTE_TO_CHAR = _bytes_to_unicode()
_ALPHABET = frozenset(_BYTE_TO_CHAR.values())
# str.translate table mapping each alphabet character back to the byte it spells (as a latin-1 char).
_CHAR_TO_BYTE = {ord(char): chr(byte) for byte, char in _BYTE_TO_CHAR.items()}


def _spelled_bytes(token: str) -> bytes:
    """The raw bytes a byte-level token stands for.

    Mirrors the ByteLevel decoder in `tokenizers`: a token written wholly in the byte alphabet maps
    char-by-char to bytes; any other token (an added token using other characters) is its UTF-8.
    """
    if set(token) <= _ALPHABET:
        return token.translate(_CHAR_TO_BYTE).encode("latin-1")
    return token.encode("utf-8")


@dataclass(frozen=True)
class _GGUFTokenizerMetadata:
    """The tokenizer-related GGUF keys we use."""

    model: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_token_id: int | None
    eos_token_id: int | None
    chat_template: str | None

    @classmethod
    def read(cls, path: Path) -> _GGUFTokenizerMetadata:
        import gguf  # imported lazily: only a cache miss needs it

        fields = gguf.GGUFReader(path).fields

        def get(key: str, default: Any = None) -> Any:
            field = fields.get(key)
            return default if field is None else field.contents()

        return cls(
            model=get("tokenizer.ggml.model", ""),
            tokens=get("tokenizer.ggml.tokens", []),
            token_types=get("tokenizer.ggml.token_type", []),
            merges=get("tokenizer.ggml.merges", []),
            bos_token_id=get("tokenizer.ggml.bos_token_id"),
            eos_token_id=get("tokenizer.ggml.eos_token_id"),
            chat_template=get("tokenizer.chat_template"),
        )


def _build_backend(meta: _GGUFTokenizerMetadata) -> HFTokenizer:
    """Byte-level BPE exactly as transformers builds it for a `gpt2` GGUF vocabulary."""
    if meta.model != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {meta.model!r}: only byte-level BPE ('gpt2') is supported")
    # Tokens outside the byte alphabet (raw-text special tokens in some files) are respelled into it.
    vocab = {
        token if set(token) <= _ALPHABET else "".join(_BYTE_TO_CHAR[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(meta.tokens)
    }
    merges = [tuple(merge.split(" ", 1)) for merge in meta.merges]
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    # Plain GPT-2 regex split, as transformers uses for pre='smollm' (it has no custom split for it).
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(_added_tokens(meta, _TOKEN_TYPE_CONTROL))
    backend.add_tokens(_added_tokens(meta, _TOKEN_TYPE_USER_DEFINED))
    return backend


def _added_tokens(meta: _GGUFTokenizerMetadata, token_type: int) -> list[AddedToken]:
    """Tokens of one type, to be matched whole in text rather than cut up by BPE.

    A control token spelled outside the byte alphabet is a llama.cpp mislabel that transformers skips;
    we skip it too so encodings agree.
    """
    special = token_type == _TOKEN_TYPE_CONTROL
    return [
        AddedToken(token, normalized=False, special=special)
        for token, kind in zip(meta.tokens, meta.token_types, strict=False)
        if kind == token_type and (not special or set(token) <= _ALPHABET)
    ]


def _cache_path(path: Path) -> Path:
    """Cache file keyed by the model file's identity (path, size, mtime) and our build version."""
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{_BUILD_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "tokenizers" / f"{path.stem}-{digest}.json"


def _write_atomically(path: Path, text: str) -> None:
    """Replace `path` in one step so concurrent loaders never read a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _raise_exception(message: str) -> None:
    """Lets a chat template reject a conversation, as HF templates expect."""
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """HF's tojson: unlike jinja's built-in it does not HTML-escape, which templates rely on."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment HF renders them in (templates are untrusted code)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


class Tokenizer:
    """Encode/decode text and render chat prompts for one model."""

    def __init__(self, backend: HFTokenizer, *, bos_token_id: int | None, eos_token_id: int | None,
                 chat_template: str | None) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        added = backend.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, tok in added.items() if tok.special)
        stops = {eos_token_id} if eos_token_id is not None else set()
        stops.update(i for t in _END_OF_TURN_TOKENS if (i := backend.token_to_id(t)) is not None)
        self.stop_token_ids: frozenset[int] = frozenset(stops)
        self._token_bytes: dict[int, bytes] = {}

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Load from a GGUF file, via the JSON cache when this exact file was built before."""
        path = Path(path)
        cached = _cache_path(path)
        if cached.is_file():
            try:
                return cls._from_cache_text(cached.read_text(encoding="utf-8"))
            except Exception:  # tokenizers raises bare Exception on bad JSON
                pass  # corrupt or stale cache: rebuild and overwrite it below
        meta = _GGUFTokenizerMetadata.read(path)
        tokenizer = cls(_build_backend(meta), bos_token_id=meta.bos_token_id, eos_token_id=meta.eos_token_id,
                        chat_template=meta.chat_template)
        try:
            _write_atomically(cached, tokenizer._to_cache_text())
        except OSError as exc:  # a read-only or full cache only costs speed next time
            logger.warning("could not cache tokenizer at %s: %s", cached, exc)
        return tokenizer

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        """A Hugging Face model folder: tokenizer.json plus tokenizer_config.json (template, bos, eos)."""
        path = Path(path)
        backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}

        def token_id(key: str) -> int | None:
            tok = config.get(key)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            return backend.token_to_id(tok) if tok else None

        return cls(backend, bos_token_id=token_id("bos_token"), eos_token_id=token_id("eos_token"),
                   chat_template=config.get("chat_template"))

    def _to_cache_text(self) -> str:
        # The backend is embedded as a JSON string so loading can hand it straight to from_str.
        return json.dumps({
            "version": _BUILD_VERSION,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "chat_template": self.chat_template,
            "backend": self._backend.to_str(),
        })

    @classmethod
    def _from_cache_text(cls, text: str) -> Tokenizer:
        data = json.loads(text)
        if data["version"] != _BUILD_VERSION:
            raise ValueError("stale tokenizer cache")
        return cls(HFTokenizer.from_str(data["backend"]), bos_token_id=data["bos_token_id"],
                   eos_token_id=data["eos_token_id"], chat_template=data["chat_template"])

    def backend_json(self) -> str:
        """The tokenizers library's JSON of this tokenizer (what llguidance builds its own from)."""
        return self._backend.to_str()

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids for `text`, no BOS; special tokens written in the text become their ids."""
        try:
            return self._backend.encode(text, add_special_tokens=False).ids
        except TypeError:
            # Lone surrogates (which json.loads happily produces from "\\ud800") are not encodable
            # text; replace them as a UTF-8 decoder would rather than fail the request.
            return self._backend.encode(_SURROGATE.sub("\ufffd", text), add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token contributes to decoded text (may be part of a UTF-8 character).

        decode() is exactly the lossy UTF-8 decoding of these bytes concatenated, which is what lets
        the incremental detokenizer work on bytes.
        """
        cached = self._token_bytes.get(token_id)
        if cached is None:
            token = self._backend.id_to_token(token_id)
            if token is None:
                raise ValueError(f"token id {token_id} is outside the vocabulary")
            cached = self._token_bytes[token_id] = _spelled_bytes(token)
        return cached

    def _token_string(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._backend.id_to_token(token_id)

    @cached_property
    def _template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ValueError("this model has no chat template (tokenizer.chat_template is missing)")
        return _compile_template(self.chat_template)

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders tools itself (HF templates take a `tools` variable)."""
        return bool(self.chat_template) and "tools" in self.chat_template

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """Render the conversation as the prompt text the model was trained on (with tools, in
        OpenAI's form, for a template that renders them)."""
        # Like HF, drop None-valued keys: OpenAI clients send content=None, which templates would print.
        clean = [{k: v for k, v in message.items() if v is not None} for message in messages]
        extra = {"tools": tools} if tools else {}
        return self._template.render(
            messages=clean,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_string(self.bos_token_id) or "",
            eos_token=self._token_string(self.eos_token_id) or "",
            **extra,
        )

    def chat_prompt_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Prompt token ids for a conversation (the template writes any BOS itself)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt))
