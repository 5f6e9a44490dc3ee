"""Text <-> token ids for language models, plus chat prompts and streaming.

`Tokenizer` wraps a `tokenizers.Tokenizer` with what a Hugging Face folder says
about it (BOS/EOS tokens, chat template, generation EOS ids). A chat request's
messages become a prompt string through the folder's Jinja chat template;
generated ids become streamed text through `IncrementalDetokenizer`.
Importable without torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

from mstar.errors import ConfigError, RequestError
from mstar.models.checkpoint import read_json

BEGIN_OF_TEXT = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
# from this length on a text is encoded through the call that lets other threads run: the engine prepares
# inputs this long on a thread of their own (`engine.engine.OFF_LOOP_SIZE`), where that pays
LONG_TEXT_CHARS = 1 << 16
# from this many ids on, the batch decode's work, done without the GIL, outweighs taking the GIL back
LONG_DECODE_TOKENS = 1 << 15
BYTE_TOKENIZER_SPECIALS = (BEGIN_OF_TEXT, END_OF_TEXT, START_HEADER, END_HEADER, EOT)
# byte b has id b; specials follow in the order above
BYTE_TOKENIZER_VOCAB_SIZE = 256 + len(BYTE_TOKENIZER_SPECIALS)
BYTE_TOKENIZER_BOS = 256
BYTE_TOKENIZER_EOS = (257, 260)

LLAMA3_STYLE_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# used when a folder ships no chat template: plain "role: content" lines
FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] + ': ' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


class Tokenizer:
    """A fast tokenizer with its folder's special tokens and chat template."""

    def __init__(self, tokenizer: _HFTokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
                 chat_template: str | None = None, add_bos_token: bool | None = None,
                 eos_token_ids: Iterable[int] = (), bos_token_id: int | None = None) -> None:
        self._tok = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        # the token string wins; the generation config's id is the fallback
        from_token = tokenizer.token_to_id(bos_token) if bos_token else None
        self.bos_token_id: int | None = from_token if from_token is not None else bos_token_id
        if self.bos_token is None and self.bos_token_id is not None:
            self.bos_token = tokenizer.id_to_token(self.bos_token_id)
        eos = list(eos_token_ids)
        eos_id = tokenizer.token_to_id(eos_token) if eos_token else None
        if eos_id is not None:
            eos.append(eos_id)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        if self.eos_token is None and self.eos_token_ids:
            self.eos_token = tokenizer.id_to_token(self.eos_token_ids[0])
        self._compiled: Any = None
        self._bytes_form: tuple[str, frozenset[int]] | None = None  # `_byte_form`, read at its first use
        # the longest token's text in UTF-8 bytes: a text of n characters has at least n / max_token_bytes
        # tokens, known without tokenising it (worked out here, not on the event loop at the first request)
        self.max_token_bytes = max((len(t.encode()) for t in tokenizer.get_vocab(with_added_tokens=True)),
                                   default=1)

    # ------------------------------------------------------------ loading
    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """Read tokenizer.json, tokenizer_config.json, chat_template.jinja and
        generation_config.json from a Hugging Face style folder."""
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise ConfigError(f"{folder}: no tokenizer.json")
        try:
            tok = _HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the tokenizers library raises plain Exception
            raise ConfigError(f"{tok_file}: cannot load: {e}") from None
        cfg = read_optional_json(folder / "tokenizer_config.json")
        gen = read_optional_json(folder / "generation_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():  # over tokenizer_config.json's, as transformers (and so vLLM) reads a folder
            template = jinja_file.read_text()
        gen_eos = gen.get("eos_token_id")
        gen_eos_ids = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        return cls(tok, bos_token=_token_str(cfg.get("bos_token")), eos_token=_token_str(cfg.get("eos_token")),
                   chat_template=template, add_bos_token=cfg.get("add_bos_token"),
                   eos_token_ids=gen_eos_ids, bos_token_id=gen.get("bos_token_id"))

    # ------------------------------------------------------------ encoding
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, exactly one leading
        BOS when the folder asks for one (its post-processor or `add_bos_token`),
        even when `text` already starts with the BOS token (a rendered chat
        template usually does)."""
        if len(text) < LONG_TEXT_CHARS:
            ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        else:  # the batch call releases the GIL while it works: other threads run meanwhile
            ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        bos = self.bos_token_id
        if not add_special_tokens or bos is None:
            return ids
        if self.add_bos_token and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        if len(ids) >= 2 and ids[0] == bos and ids[1] == bos and self.bos_token and text.startswith(self.bos_token):
            ids = ids[1:]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def decode_list(self) -> Callable[[list[int], bool], str]:
        """`decode` for a list of ints, without the copy and keyword (a call
        for every running request's token, on the event loop)."""
        return self._tok.decode

    def decode_batch(self, seqs: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """Several decodes, each as `decode` gives it. The library's batch call
        lets the GIL go, and taking it back from a device worker busy in
        Python costs a switch interval (5 ms by default): for a step's worth of
        short windows, one `decode` each under the GIL is ~10x cheaper then."""
        if sum(len(s) for s in seqs) < LONG_DECODE_TOKENS:
            decode = self._tok.decode
            return [decode(list(s), skip_special_tokens=skip_special_tokens) for s in seqs]
        return self._tok.decode_batch([list(s) for s in seqs], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """Each token's own bytes in the text: a part of a multi-byte
        character stays that part (a byte-level BPE token's bytes, a
        `<0xE2>` byte-fallback piece), so a client that joins a text's
        tokens' bytes gets its UTF-8. A sentencepiece word marker is a space
        (its decoder strips the text's first one; these bytes keep it).
        Added and special tokens, and tokens of a vocabulary of neither
        kind, are their decoded text's UTF-8."""
        kind, added = self._byte_form()
        out: list[bytes | None] = []
        for i in ids:
            piece = None if i in added or not kind else self._tok.id_to_token(i)
            if piece is None:
                out.append(None)  # decoded below, all in one call
            elif kind == "byte_level":
                spelled = all(c in _UNBYTE for c in piece)
                out.append(bytes(_UNBYTE[c] for c in piece) if spelled else piece.encode())
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                out.append(bytes([int(piece[3:5], 16)]))
            else:
                out.append(piece.replace("\u2581", " ").encode())
        rest = [i for i, b in zip(ids, out) if b is None]
        decoded = iter(self.decode_batch([[i] for i in rest], skip_special_tokens=False) if rest else ())
        return [b if b is not None else next(decoded).encode() for b in out]

    def _byte_form(self) -> tuple[str, frozenset[int]]:
        """How the vocabulary spells text ("byte_level"; "word_marked": `▁`
        for a space, bytes as `<0xNN>` pieces where it falls back; "" for
        neither, from its decoder), and the added tokens' ids; read once."""
        if self._bytes_form is None:  # the decoder's own state: the whole tokenizer's JSON takes ~0.5 s to write
            decoder = json.loads(self._tok.decoder.__getstate__()) if self._tok.decoder is not None else {}
            kinds = {d.get("type") for d in (decoder.get("decoders") or [decoder])}
            kind = "byte_level" if "ByteLevel" in kinds else \
                "word_marked" if kinds & {"ByteFallback", "Metaspace"} else ""
            self._bytes_form = (kind, frozenset(self._tok.get_added_tokens_decoder()))
        return self._bytes_form

    # ------------------------------------------------------------ chat
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            media: Collection[str] = (), variables: Mapping[str, Any] | None = None) -> str:
        """The prompt text for a chat. Message content may be a string or a
        list of `{"type": "text", "text": ...}` parts (joined with newlines);
        with `media`, also parts of those types, which the template gets as
        a list of parts (`{"type": "image"}`, say: the template places the
        media's tokens). `variables`: more the template reads (a request's
        `chat_template_kwargs`, such as Qwen's `enable_thinking`)."""
        if not isinstance(messages, list) or not messages:
            raise RequestError("must be a non-empty list", field="messages")
        msgs = [_normalise_message(m, i, media) for i, m in enumerate(messages)]
        template = self._template()
        given = {"messages": msgs, "add_generation_prompt": add_generation_prompt, "bos_token": self.bos_token or "",
                 "eos_token": self.eos_token or "", "tools": None, "documents": None}
        for name in variables or {}:
            if name in given:
                raise RequestError(f"'{name}' is set by the server", field=f"chat_template_kwargs.{name}")
            if name in template.environment.globals or name == "self":  # would hide what templates call
                raise RequestError(f"'{name}' is one of the chat template's own names",
                                   field=f"chat_template_kwargs.{name}")
        try:
            return template.render(**(variables or {}), **given)
        except _TemplateError as e:
            raise RequestError(str(e), field="messages") from None

    def _template(self) -> Any:
        if self._compiled is None:
            self._compiled = _compile_template(self.chat_template or FALLBACK_TEMPLATE)
        return self._compiled


class _TemplateError(Exception):
    """Raised by a chat template's `raise_exception(...)`."""


def _compile_template(source: str) -> Any:
    # jinja2 is imported only when a chat is rendered
    from datetime import datetime

    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise _TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    # the same environment settings as transformers, so templates render identically
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except Exception as e:  # jinja2.TemplateSyntaxError and friends
        raise ConfigError(f"chat template does not compile: {e}") from None


def _normalise_message(m: Any, i: int, media: Collection[str] = ()) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
        raise RequestError("must be an object with a string 'role'", field=where)
    out = dict(m)
    content = m.get("content")
    if content is None:
        out["content"] = ""
    elif isinstance(content, list):
        parts: list[dict[str, str]] = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind in media:
                parts.append({"type": kind})
            elif kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            else:
                raise RequestError("only text parts ({'type': 'text', 'text': ...}) are supported"
                                   + (f", and {', '.join(sorted(media))} parts" if media else ""),
                                   field=f"{where}.content")
        # text alone stays one string, which every template reads
        texts = [p["text"] for p in parts if p["type"] == "text"]
        out["content"] = "\n".join(texts) if len(texts) == len(parts) else parts
    elif not isinstance(content, str):
        raise RequestError("must be a string or a list of text parts", field=f"{where}.content")
    return out


def read_optional_json(file: Path) -> dict[str, Any]:
    """A JSON object from `file`, or {} when the file is absent."""
    data = read_json(file, required=False)
    return data if isinstance(data, dict) else {}


def _token_str(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


# ------------------------------------------------------------------ builtin


def _byte_alphabet() -> list[str]:
    """The printable stand-in character of each byte, as byte-level BPE uses:
    printable Latin-1 bytes stand for themselves, the rest are shifted past 255."""
    keep = (set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1))
            | set(range(ord("®"), ord("ÿ") + 1)))
    chars, shift = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shift))
            shift += 1
    return chars


# byte-level BPE's stand-in characters back to their bytes
_UNBYTE = {ch: b for b, ch in enumerate(_byte_alphabet())}


def builtin_byte_tokenizer(chat_template: str | None = None) -> Tokenizer:
    """A byte-level tokenizer built in code: token b is byte b (no merges),
    then the Llama-3 specials; BOS is added by the post-processor, as Llama 3's
    tokenizer.json does. Chats render Llama-3 style unless `chat_template`
    says otherwise."""
    vocab = {ch: b for b, ch in enumerate(_byte_alphabet())}
    tok = _HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_TOKENIZER_SPECIALS])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BEGIN_OF_TEXT} $A", pair=f"{BEGIN_OF_TEXT} $A {BEGIN_OF_TEXT} $B",
        special_tokens=[(BEGIN_OF_TEXT, BYTE_TOKENIZER_BOS)])
    return Tokenizer(tok, bos_token=BEGIN_OF_TEXT, eos_token=EOT,
                     chat_template=chat_template or LLAMA3_STYLE_TEMPLATE, eos_token_ids=BYTE_TOKENIZER_EOS)


# streaming lives in its own file; re-exported so callers import one module
from mstar.models.detokenizer import IncrementalDetokenizer  # noqa: E402

__all__ = ["IncrementalDetokenizer", "Tokenizer", "builtin_byte_tokenizer"]
