"""Tokenizer: a Hugging Face fast tokenizer plus a safe chat-template renderer.

Contracts:

* Text that users send never becomes a control token. ``encode`` tokenizes the
  string ``"<|im_end|>"`` as plain text; ``apply_chat_template`` keeps the
  template's own markers as special ids while every string that came from the
  request (message contents, names, tool call arguments, tool results, tool
  schemas) is tokenized as plain text.
* Chat templates run in jinja2's ``ImmutableSandboxedEnvironment``; any error a
  template raises (including sandbox violations) surfaces as ``ValueError``.
* Decoding never applies ``clean_up_tokenization_spaces``: it would rewrite
  user-visible text (``" ."`` -> ``"."``) and make decoding non-additive, which
  the incremental detokenizer relies on.
"""

from __future__ import annotations

import bisect
import copy
import hashlib
import json
import os
import re
import secrets
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.meta
import jinja2.sandbox
import tokenizers
import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.request import Segment, SegmentKind

# The segment kind of each chat role (engine.request.Segment); other roles are "user".
_SEGMENT_KINDS: dict[str, SegmentKind] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "function": "tool",
    "ipython": "tool",
}

# Tool-call formats (the names of vLLM's parsers; mistral_v11 is Mistral's
# ``[TOOL_CALLS]name[ARGS]{...}`` format from tokenizer v11 on).
ToolCallFormat = Literal["hermes", "llama3_json", "mistral", "mistral_v11"]

# Extra variables a request may pass to the chat template (``chat_template_kwargs``).
# Everything else is refused: variables such as ``messages``, ``tools``,
# ``add_generation_prompt`` or ``bos_token`` are set by the renderer and must not
# be overridden by a client.
SAFE_TEMPLATE_KWARGS: frozenset[str] = frozenset(
    {"enable_thinking", "thinking", "reasoning_effort"}
)

# Variables the renderer itself provides; never settable through template_kwargs.
_RESERVED_TEMPLATE_VARS: frozenset[str] = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "bos_token",
        "eos_token",
        "pad_token",
        "unk_token",
        "raise_exception",
        "strftime_now",
    }
)

# System prompt used when ``tools`` are given and the chat template does not
# reference ``tools`` (e.g. SmolLM2's plain ChatML). It asks for Hermes-style
# tool calls, which the server's tool-call parser recognises. ``{tools}`` is
# replaced by one JSON schema per line.
DEFAULT_TOOL_SYSTEM_PROMPT: str = (
    "You are a function calling AI model. You are provided with function signatures "
    "within <tools></tools> XML tags. You may call one or more functions to assist with "
    "the user query. Don't make assumptions about what values to plug into functions.\n"
    "<tools>\n{tools}\n</tools>\n"
    "For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags as follows:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)

# The per-character map GPT-2 byte-level BPE uses to turn bytes into printable
# characters; inverted to recover a token's raw bytes.
_BYTE_FALLBACK_RE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _gpt2_unicode_to_byte() -> dict[str, int]:
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping: dict[str, int] = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping


def default_cache_dir() -> Path:
    """The tokenizer cache root, computed when called (never at import)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fuel-serve" / "tokenizers"


def _gguf_cache_key(gguf_path: Path) -> str:
    """Key of a GGUF file's converted tokenizer: path, size, mtime and library version."""
    st = gguf_path.stat()
    raw = f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def _load_gguf_tokenizer(gguf_path: Path, cache_dir: Path | None) -> PreTrainedTokenizerBase:
    """Convert the GGUF's tokenizer once, then load the cached fast tokenizer."""
    root = cache_dir if cache_dir is not None else default_cache_dir()
    target = root / _gguf_cache_key(gguf_path)
    if (target / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(target), local_files_only=True)
        except Exception:
            # A corrupt or incompatible cache entry: rebuild it below.
            shutil.rmtree(target, ignore_errors=True)
    hf = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    try:
        root.mkdir(parents=True, exist_ok=True)
        # Write to a private directory then rename, so that concurrent starts
        # never see a half-written entry.
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
        hf.save_pretrained(str(tmp))
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process won the race; its entry is equivalent.
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass  # An unwritable cache only costs start-up time.
    return hf


def _extra_eos_ids(model_dir: Path) -> set[int]:
    """``eos_token_id`` from generation_config.json (int or list), if present."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return set()
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Chat templates expect ``tojson`` to emit raw JSON, not HTML-escaped JSON
    # as jinja2's builtin filter does.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@dataclass
class _Escaper:
    """Replaces special-token strings inside request data by unique markers.

    After rendering, the markers are found in the text and their original
    strings are tokenized as plain text, so that a user cannot inject control
    tokens while the template's own markers stay special.
    """

    specials: list[str]  # longest first, so that the alternation prefers long matches
    nonce: str

    def __post_init__(self) -> None:
        self.pattern: re.Pattern[str] = re.compile(rf"\x00{self.nonce}:(\d+)\x00")
        self._specials_re: re.Pattern[str] | None = (
            re.compile("|".join(re.escape(s) for s in self.specials)) if self.specials else None
        )
        self._index = {s: i for i, s in enumerate(self.specials)}

    def escape_str(self, text: str) -> str:
        if self._specials_re is None:
            return text
        return self._specials_re.sub(
            lambda m: f"\x00{self.nonce}:{self._index[m.group(0)]}\x00", text
        )

    def escape(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.escape_str(value)
        if isinstance(value, dict):
            return {self.escape(k): self.escape(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.escape(v) for v in value]
        return value

    def unescape(self, text: str) -> str:
        return self.pattern.sub(lambda m: self.specials[int(m.group(1))], text)


class _StrictSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """A sandbox where touching an unsafe attribute raises at once.

    jinja2's default returns an undefined value that only fails when used, so
    ``{{ f.__globals__ }}`` would render as "" and a probing template would go
    unnoticed; we want such templates rejected.
    """

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


def _content_text(content: Any) -> Any:
    """Join a list of ``{"type": "text", "text": ...}`` parts into one string."""
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                texts.append(part)
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"unsupported message content part type: {kind!r}")
        return "".join(texts)
    return content


class Tokenizer:
    """A fast tokenizer with safe encoding and chat-template rendering.

    Build with :meth:`load`. ``vocab_size`` is ``len(tokenizer)`` (base vocab
    plus added tokens); the model's embedding may have more rows.
    """

    def __init__(self, hf: PreTrainedTokenizerBase, extra_eos_ids: Iterable[int] = ()) -> None:
        self._hf = hf
        backend: tokenizers.Tokenizer = hf.backend_tokenizer
        self._backend = backend
        # Whether special-token strings in the input are parsed is a flag on
        # the backend; it is set for every encode under this lock. (A second
        # backend copy would avoid the lock but costs ~1.5 s at start-up.)
        self._encode_lock = threading.Lock()
        decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder else None
        self._is_byte_level = _decoder_has(decoder, "ByteLevel")
        self._has_byte_fallback = _decoder_has(decoder, "ByteFallback")
        added = backend.get_added_tokens_decoder().values()
        self._special_strings: list[str] = sorted(
            {t.content for t in added if t.special} | set(hf.all_special_tokens),
            key=len,
            reverse=True,
        )
        eos: set[int] = set(extra_eos_ids)
        if hf.eos_token_id is not None:
            eos.add(int(hf.eos_token_id))
        self._eos_ids = frozenset(eos)
        self._token_bytes_cache: dict[int, bytes] = {}
        self._template_cache: dict[str, jinja2.Template] = {}
        self._uses_tools_cache: dict[str, bool] = {}
        self._unicode_to_byte = _gpt2_unicode_to_byte() if self._is_byte_level else {}
        template = hf.chat_template
        if isinstance(template, dict):
            template = template.get("default") or next(iter(template.values()), None)
        self._chat_template: str | None = template if isinstance(template, str) else None

    # ------------------------------------------------------------------ loading

    @classmethod
    def load(
        cls,
        model_path: Path | str,
        tokenizer_path: str | None = None,
        cache_dir: Path | None = None,
    ) -> Tokenizer:
        """Load from a GGUF file or a Hugging Face directory (local files only).

        ``tokenizer_path`` (an HF directory) overrides where the tokenizer comes
        from. A GGUF tokenizer is converted once and cached under ``cache_dir``
        (default :func:`default_cache_dir`), keyed by the file's path, size and
        mtime. Raises ``ValueError`` if nothing loadable is found.
        """
        model_path = Path(model_path)
        source = Path(tokenizer_path) if tokenizer_path is not None else model_path
        if source.is_file() and source.suffix == ".gguf":
            hf = _load_gguf_tokenizer(source, cache_dir)
            extra = _extra_eos_ids(source.parent)
        elif source.is_dir():
            files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
            if not any((source / f).exists() for f in files):
                raise ValueError(
                    f"no tokenizer in {source} (no tokenizer.json or tokenizer_config.json); "
                    "pass --tokenizer"
                )
            try:
                hf = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
            except Exception as e:  # transformers raises several types, often multi-line
                raise ValueError(f"cannot load the tokenizer in {source}: {e}") from e
            extra = _extra_eos_ids(source) | (
                _extra_eos_ids(model_path) if model_path.is_dir() else set()
            )
        else:
            raise ValueError(f"no tokenizer found at {source} (expected a .gguf file or a dir)")
        if not getattr(hf, "is_fast", False):
            raise ValueError(f"tokenizer at {source} is not a fast tokenizer")
        return cls(hf, extra)

    # --------------------------------------------------------------- properties

    @property
    def vocab_size(self) -> int:
        return len(self._hf)

    def __len__(self) -> int:
        return len(self._hf)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokenizer's eos plus extra eos ids from generation_config.json."""
        return self._eos_ids

    @property
    def eos_token_id(self) -> int | None:
        value = self._hf.eos_token_id
        return int(value) if value is not None else None

    @property
    def bos_token_id(self) -> int | None:
        value = self._hf.bos_token_id
        return int(value) if value is not None else None

    @property
    def all_special_ids(self) -> list[int]:
        return [int(i) for i in self._hf.all_special_ids]

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def tool_call_format(self) -> ToolCallFormat | None:
        """The tool-call format a prompt rendered with ``tools`` asks the model for.

        ``hermes`` when the template does not read ``tools``: the renderer then
        puts :data:`DEFAULT_TOOL_SYSTEM_PROMPT` (``<tool_call>`` blocks) in the
        system message. For a template that renders tools itself, the format
        its text names: ``mistral_v11`` (``[TOOL_CALLS]name[ARGS]{...}``),
        ``mistral`` (``[TOOL_CALLS][{...}]``), ``llama3_json``
        (``<|python_tag|>`` / ``ipython``) or ``hermes`` (``<tool_call>``);
        None when it names none of them, or there is no template.
        """
        source = self._chat_template
        if source is None:
            return None
        try:
            renders_tools = self._template_uses_tools(source)
        except ValueError:  # an invalid template: chat requests fail anyway
            return None
        if not renders_tools:
            return "hermes"
        if "[TOOL_CALLS]" in source:
            return "mistral_v11" if "[ARGS]" in source else "mistral"
        if "<|python_tag|>" in source or "ipython" in source:
            return "llama3_json"
        if "<tool_call>" in source:
            return "hermes"
        return None

    def override_chat_template(self, template: str) -> None:
        """Use ``template`` (Jinja text) instead of the model's own (``--chat-template``)."""
        self._chat_template = template

    @property
    def hf_tokenizer(self) -> PreTrainedTokenizerBase:
        """The wrapped transformers tokenizer (read-only use, e.g. for grammars)."""
        return self._hf

    # ------------------------------------------------------- encode and decode

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Tokenize user text; special-token strings in it stay plain text.

        ``add_special_tokens`` adds what the tokenizer's post-processor adds
        (e.g. a BOS), as ids, not by parsing text.
        """
        with self._encode_lock:
            self._backend.encode_special_tokens = True
            try:
                return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)
            finally:
                # Leave the shared backend as transformers expects it.
                self._backend.encode_special_tokens = False

    def _encode_template_text(self, text: str) -> list[int]:
        """Tokenize trusted template text: special-token strings become special ids."""
        with self._encode_lock:
            self._backend.encode_special_tokens = False
            return list(self._backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Decode ids to text (no tokenization-space clean-up)."""
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary strings of ``ids`` (e.g. ``"Ġhello"`` for byte-level BPE)."""
        out: list[str] = []
        for i in ids:
            token = self._backend.id_to_token(int(i))
            if token is None:
                raise ValueError(f"token id {i} is out of range")
            out.append(token)
        return out

    def token_bytes(self, token_id: int) -> list[int]:
        """The raw bytes one token stands for (OpenAI's logprobs ``bytes`` field).

        Byte-level BPE pieces are mapped back through the GPT-2 byte table,
        SentencePiece ``<0xNN>`` byte-fallback pieces give that byte, ``▁``
        gives a space; special tokens give the UTF-8 of their text.
        """
        return list(self._raw_bytes(token_id))

    def token_to_text(self, token_id: int) -> str:
        """The text one token shows as (OpenAI's logprobs ``token`` field).

        A token whose bytes are not valid UTF-8 on their own (part of a
        multi-byte character) is rendered as ``"bytes:\\xNN\\xNN"``, one
        ``\\xNN`` per byte, as OpenAI does.
        """
        raw = self._raw_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _raw_bytes(self, token_id: int) -> bytes:
        cached = self._token_bytes_cache.get(token_id)
        if cached is not None:
            return cached
        piece = self.convert_ids_to_tokens([token_id])[0]
        raw: bytes
        if piece in self._special_strings:
            raw = piece.encode("utf-8")
        elif self._has_byte_fallback and (m := _BYTE_FALLBACK_RE.match(piece)):
            raw = bytes([int(m.group(1), 16)])
        elif self._is_byte_level and all(c in self._unicode_to_byte for c in piece):
            raw = bytes(self._unicode_to_byte[c] for c in piece)
        else:
            raw = piece.replace("▁", " ").encode("utf-8")
        self._token_bytes_cache[token_id] = raw
        return raw

    # ------------------------------------------------------------ chat template

    def _compile(self, source: str) -> jinja2.Template:
        template = self._template_cache.get(source)
        if template is None:
            env = self._environment()
            try:
                template = env.from_string(source)
            except jinja2.TemplateError as exc:
                raise ValueError(f"invalid chat template: {exc}") from exc
            self._template_cache[source] = template
        return template

    @staticmethod
    def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
        # trim_blocks/lstrip_blocks match how transformers renders templates,
        # which template authors write against.
        env = _StrictSandbox(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        return env

    def _template_uses_tools(self, source: str) -> bool:
        """Whether the template reads the ``tools`` variable (else we render tools)."""
        cached = self._uses_tools_cache.get(source)
        if cached is None:
            try:
                ast = self._environment().parse(source)
            except jinja2.TemplateError as exc:
                raise ValueError(f"invalid chat template: {exc}") from exc
            cached = "tools" in jinja2.meta.find_undeclared_variables(ast)
            self._uses_tools_cache[source] = cached
        return cached

    def _render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None,
        chat_template: str | None,
        template_kwargs: dict[str, Any] | None,
        escaper: _Escaper,
        continue_final_message: bool = False,
        prepared: bool = False,
    ) -> str:
        """The rendered, still escaped, text. ``prepared``: ``messages`` come from
        ``_prepare_messages`` with this ``escaper`` (copied, joined and escaped once
        for many renders of their prefixes)."""
        source = chat_template if chat_template is not None else self._chat_template
        if source is None:
            raise ValueError("this model has no chat template; pass one (--chat-template)")
        extra = dict(template_kwargs or {})
        bad = sorted(
            k for k in extra if k in _RESERVED_TEMPLATE_VARS or k not in SAFE_TEMPLATE_KWARGS
        )
        if bad:
            raise ValueError(
                f"chat_template_kwargs may not set {bad}; allowed: {sorted(SAFE_TEMPLATE_KWARGS)}"
            )
        msgs = messages if prepared else self._prepare_messages(messages, escaper)
        esc_tools = escaper.escape(tools) if tools else None
        if not self._template_uses_tools(source):
            msgs = _to_hermes(msgs, esc_tools)
            esc_tools = None
        template = self._compile(source)
        hf = self._hf
        variables: dict[str, Any] = {
            "messages": msgs,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": hf.bos_token or "",
            "eos_token": hf.eos_token or "",
            "pad_token": hf.pad_token or "",
            "unk_token": hf.unk_token or "",
            **extra,
        }
        if esc_tools is not None:
            variables["tools"] = esc_tools
        try:
            text = template.render(**variables)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template error: {exc}") from exc
        except (TypeError, KeyError, IndexError, AttributeError, ValueError) as exc:
            raise ValueError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        if continue_final_message:
            # msgs[-1]["content"] is escaped like the rendered text, so it is found as is.
            text = _cut_after_final_message(text, msgs[-1].get("content"))
        return text

    @staticmethod
    def _prepare_messages(messages: list[dict[str, Any]], escaper: _Escaper) -> list[Any]:
        """Private copies of ``messages`` with text-part content joined and escaped."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of objects")
        msgs = [dict(m) for m in copy.deepcopy(messages)]
        for m in msgs:
            if "content" in m:
                m["content"] = _content_text(m["content"])
        escaped: list[Any] = escaper.escape(msgs)
        return escaped

    def _new_escaper(self, messages: Any, tools: Any) -> _Escaper:
        blob = repr(messages) + repr(tools)
        while True:
            # Digits only, so that case-changing filters leave markers intact.
            nonce = f"{secrets.randbelow(10**16):016d}"
            if nonce not in blob:
                return _Escaper(self._special_strings, nonce)

    def _render_fresh(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None,
        chat_template: str | None,
        template_kwargs: dict[str, Any] | None,
        continue_final_message: bool,
    ) -> tuple[str, _Escaper]:
        """The rendered, still escaped, text under a new escaper, and that escaper
        (the public render methods' common first step)."""
        escaper = self._new_escaper(messages, tools)
        text = self._render(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_template=chat_template,
            template_kwargs=template_kwargs,
            escaper=escaper,
            continue_final_message=continue_final_message,
        )
        return text, escaper

    def render_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The rendered prompt text (for debugging and ``echo``); see apply_chat_template."""
        text, escaper = self._render_fresh(
            messages,
            add_generation_prompt,
            tools,
            chat_template,
            template_kwargs,
            continue_final_message,
        )
        return escaper.unescape(text)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Render ``messages`` with the chat template and tokenize the result.

        ``content`` may be a string or a list of text parts. Special-token
        strings produced by the template become special ids; the same strings
        inside request data become plain-text tokens. ``chat_template``
        overrides the model's template; ``template_kwargs`` keys must be in
        :data:`SAFE_TEMPLATE_KWARGS`. When ``tools`` are given and the template
        does not reference ``tools``, :data:`DEFAULT_TOOL_SYSTEM_PROMPT` is put
        in the system message, and assistant ``tool_calls`` / ``tool`` messages
        are rendered Hermes-style. ``continue_final_message`` (vLLM's and
        transformers' meaning) cuts the rendered text right after the final
        message's content, so the model continues that message instead of
        starting a new turn; callers pass ``add_generation_prompt=False`` with it.
        Raises ``ValueError`` on any template error.
        """
        text, escaper = self._render_fresh(
            messages,
            add_generation_prompt,
            tools,
            chat_template,
            template_kwargs,
            continue_final_message,
        )
        return self._tokenize_rendered(text, escaper)[0]

    def apply_chat_template_segments(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> tuple[list[int], tuple[Segment, ...]]:
        """``apply_chat_template``'s token ids (the same ids) and each message's span.

        Segment ``k`` covers the tokens message ``k`` added to the rendered prompt:
        the characters from the end of the conversation rendered up to message
        ``k - 1`` to the end of the conversation rendered up to message ``k``
        (each without a generation prompt), found as the longest common prefix
        of that render with the full one, so a template whose last message
        renders differently (a merged tool turn still open, a cut final message)
        still splits where the renders agree. Message 0's span starts at token 0
        (it takes the template's preamble: BOS, a default system prompt). Tokens
        after the last message (the generation prompt) belong to no segment.
        Segments are in order, disjoint and non-empty (a message that rendered
        no token has none). Character boundaries map to tokens by the
        tokenizer's offsets: a token belongs to the span its first character
        is in. When a prefix of the conversation cannot be rendered on its own
        (a template that refuses it), no segments are returned. Costs one
        template render per message (O(n^2) characters for n messages), kept
        off the event loop by the caller.
        """
        text, escaper = self._render_fresh(
            messages,
            add_generation_prompt,
            tools,
            chat_template,
            template_kwargs,
            continue_final_message,
        )
        ids, starts = self._tokenize_rendered(text, escaper)
        bounds = self._message_bounds(
            messages, text, tools, chat_template, template_kwargs, escaper
        )
        if bounds is None:
            return ids, ()
        segments: list[Segment] = []
        begin = 0
        for turn, end_char in enumerate(bounds):
            # The first token starting at or after the boundary opens the next span.
            end = bisect.bisect_left(starts, end_char)
            if end > begin:
                role = messages[turn].get("role")
                kind = _SEGMENT_KINDS.get(role if isinstance(role, str) else "", "user")
                segments.append(Segment(begin, end, kind, turn))
                begin = end
        return ids, tuple(segments)

    def _message_bounds(
        self,
        messages: list[dict[str, Any]],
        text: str,
        tools: list[dict[str, Any]] | None,
        chat_template: str | None,
        template_kwargs: dict[str, Any] | None,
        escaper: _Escaper,
    ) -> list[int] | None:
        """Character offset in ``text`` where each message's rendering ends (None: unknown)."""
        bounds: list[int] = []
        last = 0
        prepared = self._prepare_messages(messages, escaper)  # once, not per prefix
        for k in range(1, len(messages) + 1):
            try:
                part = self._render(
                    prepared[:k],
                    add_generation_prompt=False,
                    tools=tools,
                    chat_template=chat_template,
                    template_kwargs=template_kwargs,
                    escaper=escaper,
                    prepared=True,
                )
            except ValueError:
                return None
            last = max(last, _common_prefix_len(part, text))
            bounds.append(last)
        return bounds

    def _tokenize_rendered(self, text: str, escaper: _Escaper) -> tuple[list[int], list[int]]:
        """Token ids of rendered (escaped) template text, and each token's first character.

        Text between markers is template text (plus ordinary user text, which
        has no special-token strings left in it); each marker is a special
        string the user typed and is tokenized as plain text. Splitting at the
        markers mirrors how the tokenizer splits at added tokens anyway. The
        offsets are into ``text`` (markers included) and never decrease.
        """
        ids: list[int] = []
        starts: list[int] = []

        def add(piece: str, at: int, special: bool) -> None:
            with self._encode_lock:
                self._backend.encode_special_tokens = special
                try:
                    enc = self._backend.encode(piece, add_special_tokens=False)
                finally:
                    self._backend.encode_special_tokens = False
            ids.extend(enc.ids)
            starts.extend(at + a for a, _ in enc.offsets)

        pos = 0
        for m in escaper.pattern.finditer(text):
            if m.start() > pos:
                add(text[pos : m.start()], pos, False)
            # The marker's tokens all start where the marker does.
            n_before = len(ids)
            add(escaper.specials[int(m.group(1))], m.start(), True)
            starts[n_before:] = [m.start()] * (len(ids) - n_before)
            pos = m.end()
        if pos < len(text):
            add(text[pos:], pos, False)
        return ids, starts


def _common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (C-speed comparisons)."""
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; a[:hi+1] != b[:hi+1] or hi is max
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _cut_after_final_message(text: str, content: Any) -> str:
    """``text`` up to the end of the last occurrence of the final message's content.

    The rule transformers applies for ``continue_final_message``: templates may
    strip a message's surrounding whitespace, so the stripped content is looked
    up, and the cut keeps the trailing whitespace only where the template kept it.
    """
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message needs a final message with text content")
    stripped = content.strip()
    at = text.rfind(stripped)
    if at < 0:
        raise ValueError(
            "continue_final_message: the final message's content does not appear in the "
            "rendered chat template, so it cannot be continued"
        )
    kept = content.lstrip()
    if text.startswith(kept, at):
        return text[: at + len(kept)]
    return text[: at + len(stripped)]


def _decoder_has(decoder: Any, kind: str) -> bool:
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == kind:
        return True
    return any(_decoder_has(d, kind) for d in decoder.get("decoders", []) or [])


def _arguments_json(arguments: Any) -> Any:
    """Tool call arguments as an object when they are a JSON string."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _to_hermes(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """Rewrite tool traffic for templates without tool support (plain ChatML).

    Assistant ``tool_calls`` become ``<tool_call>{json}</tool_call>`` lines in
    the content; consecutive ``tool`` messages become one ``user`` turn of
    ``<tool_response>`` blocks; ``tools`` go into the system prompt.
    """
    dumps: Callable[[Any], str] = lambda v: json.dumps(v, ensure_ascii=False)  # noqa: E731
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            parts = [m["content"]] if isinstance(m.get("content"), str) and m["content"] else []
            for call in m["tool_calls"]:
                fn = call.get("function", call) if isinstance(call, dict) else {}
                payload = {
                    "name": fn.get("name"),
                    "arguments": _arguments_json(fn.get("arguments")),
                }
                parts.append(f"<tool_call>\n{dumps(payload)}\n</tool_call>")
            out.append(
                {**{k: v for k, v in m.items() if k != "tool_calls"}, "content": "\n".join(parts)}
            )
        elif role == "tool":
            content = m.get("content")
            block = f"<tool_response>\n{content if content is not None else ''}\n</tool_response>"
            if out and out[-1].get("_fuel_tool_turn"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_fuel_tool_turn": True})
        else:
            if m.get("content") is None:
                m = {**m, "content": ""}
            out.append(m)
    for m in out:
        m.pop("_fuel_tool_turn", None)
    if tools:
        schemas = "\n".join(dumps(t) for t in tools)
        prompt = DEFAULT_TOOL_SYSTEM_PROMPT.format(tools=schemas)
        if out and out[0].get("role") == "system":
            existing = out[0].get("content") or ""
            out[0] = {**out[0], "content": f"{existing}\n\n{prompt}" if existing else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
