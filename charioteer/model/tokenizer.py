"""Text tokenizer for charioteer.

`TextTokenizer` wraps a `tokenizers.Tokenizer` (the Rust-backed HF library) and adds
what the engine needs around it: BOS/EOS ids, the chat template, and loaders for
GGUF metadata and Hugging Face tokenizer directories.

GGUF files carry no `tokenizer.json`; they carry the raw vocabulary, merges, token
types and the name of a llama.cpp pre-tokenizer (`tokenizer.ggml.pre`).  `from_gguf`
rebuilds an equivalent `tokenizers` pipeline from that metadata.  Only byte-level BPE
(`tokenizer.ggml.model == "gpt2"`) with the pre-tokenizers listed in
`_PRE_TOKENIZERS` is supported; anything else raises `ValueError` rather than
silently producing different token ids than the model was trained with.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

if TYPE_CHECKING:  # pragma: no cover
    import gguf

__all__ = ["TextTokenizer"]

# llama.cpp token types (gguf.TokenType)
_TOKEN_TYPE_NORMAL = 1
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


def _starcoder_style() -> pre_tokenizers.PreTokenizer:
    # Every numeric character becomes its own piece, then the GPT-2 regex split runs on
    # what is left.  This is what SmolLM2's / StarCoder's tokenizer.json declare, and
    # what llama.cpp does for these pre-tokenizer names (a "\p{N}" split followed by
    # the GPT-2 regex).
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def _gpt2_style() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


# tokenizer.ggml.pre value -> pre-tokenizer builder.  Only names whose llama.cpp
# behaviour is one of the two pipelines above are listed.  Note "default" (also what a
# missing tokenizer.ggml.pre means) is NOT GPT-2: llama.cpp then applies its own
# punctuation / 3-digit splits, and the original HF tokenizer is unknown.
_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "gpt-2": _gpt2_style,
    "smollm": _starcoder_style,
    "starcoder": _starcoder_style,
    "refact": _starcoder_style,
    "codeshell": _starcoder_style,
}


# --------------------------------------------------------------------------- GGUF helpers


def _gguf_field_value(field: Any) -> Any:
    """Python value of a `gguf.ReaderField` (scalar, string or array)."""
    if hasattr(field, "contents"):  # gguf >= 0.10
        return field.contents()
    # Older gguf: field.data indexes into field.parts.
    import gguf  # local import: only needed for the enum

    main_type = field.types[0]
    if main_type == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    if main_type == gguf.GGUFValueType.ARRAY:
        sub_type = field.types[1] if len(field.types) > 1 else None
        if sub_type == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    return field.parts[field.data[0]].tolist()[0]


def _gguf_get(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return _gguf_field_value(field)


# ----------------------------------------------------------------------------- jinja


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template rejected the conversation: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # jinja's builtin tojson HTML-escapes <, >, & and ' -- wrong for prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_chat_template(source: str) -> Any:
    from jinja2 import ext, sandbox

    env = sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


# ------------------------------------------------------------------------------ class


class TextTokenizer:
    """Byte-level BPE tokenizer plus the metadata generation needs."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        eos_token_id: int,
        bos_token_id: int | None = None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
        unk_token_id: int | None = None,
        pad_token_id: int | None = None,
    ) -> None:
        self._tok = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        for name, value in (("eos_token_id", eos_token_id), ("bos_token_id", bos_token_id),
                            ("unk_token_id", unk_token_id), ("pad_token_id", pad_token_id)):
            if value is not None and not (0 <= int(value) < self.vocab_size):
                raise ValueError(f"{name}={value} is outside the vocabulary (size {self.vocab_size})")
        self.eos_token_id: int = int(eos_token_id)
        self.bos_token_id: int | None = None if bos_token_id is None else int(bos_token_id)
        self.unk_token_id: int | None = None if unk_token_id is None else int(unk_token_id)
        self.pad_token_id: int | None = None if pad_token_id is None else int(pad_token_id)
        self._add_bos_token = False
        self.add_bos_token = add_bos_token  # property: keeps the post-processor in sync
        self.chat_template: str | None = chat_template
        self._compiled_template: Any = None
        self._compiled_template_source: str | None = None

    # ------------------------------------------------------------------ basic API

    @property
    def add_bos_token(self) -> bool:
        """Whether encode(..., add_special_tokens=True) prepends BOS."""
        return self._add_bos_token

    @add_bos_token.setter
    def add_bos_token(self, value: bool) -> None:
        value = bool(value)
        if value and self.bos_token_id is None:
            raise ValueError("add_bos_token is set but the tokenizer has no BOS token")
        if value != self._detect_add_bos():
            # The post-processor is what adds BOS (so a saved tokenizer.json behaves the
            # same in transformers); rebuild it.
            self._tok.post_processor = _bos_post_processor(self._tok, self.bos_token_id if value else None)
        self._add_bos_token = value

    def _detect_add_bos(self) -> bool:
        if self._tok.post_processor is None or self.bos_token_id is None:
            return False
        return self._tok.encode("", add_special_tokens=True).ids[:1] == [self.bos_token_id]

    @property
    def eos_token(self) -> str:
        return self.token_to_str(self.eos_token_id)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.token_to_str(self.bos_token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`.  Special tokens written in the text (e.g. "<|im_start|>")
        are always recognised (one id each); `add_special_tokens` only controls the
        post-processor, i.e. whether BOS is prepended when `add_bos_token` is set."""
        if not isinstance(text, str):
            raise TypeError(f"encode() expects a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int] | int, skip_special_tokens: bool = True) -> str:
        if isinstance(ids, int):
            ids = [ids]
        elif hasattr(ids, "tolist"):  # torch / numpy
            ids = ids.tolist()
            if isinstance(ids, int):
                ids = [ids]
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_str(self, token_id: int) -> str:
        """Raw vocabulary entry (e.g. 'Ġhello' for byte-level BPE); for debugging."""
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return piece

    def __len__(self) -> int:
        return self.vocab_size

    # ------------------------------------------- the vocabulary, for grammars

    def vocabulary(self) -> list[str]:
        """Every raw vocabulary entry by id ('Ġhello' for byte-level BPE, '<0x0A>' for byte fallback)."""
        return [self._tok.id_to_token(i) or "" for i in range(self.vocab_size)]

    def special_token_ids(self) -> set[int]:
        """Control tokens (<|im_start|>, ...): matched whole in input text, dropped by decode()."""
        return {int(i) for i, added in self._tok.get_added_tokens_decoder().items() if added.special}

    def byte_encoding(self) -> str:
        """How vocabulary entries spell bytes: 'byte_level' (GPT-2's byte-to-unicode map),
        'byte_fallback' ('<0x0A>' entries, SentencePiece style) or 'raw' (as the text itself)."""
        kinds = _component_types(json.loads(self._tok.to_str()).get("decoder"))
        if "ByteLevel" in kinds:
            return "byte_level"
        if "ByteFallback" in kinds:
            return "byte_fallback"
        return "raw"

    def prepends_space(self) -> bool:
        """Whether encoding puts a space before the text (SentencePiece's '▁' prefix, or a
        byte-level pre-tokenizer with add_prefix_space)."""
        spec = json.loads(self._tok.to_str())
        for part in _components(spec.get("pre_tokenizer")) + _components(spec.get("normalizer")):
            kind = part.get("type")
            if kind == "ByteLevel" and part.get("add_prefix_space"):
                return True
            if kind == "Metaspace" and part.get("prepend_scheme", "always") != "never" \
                    and part.get("add_prefix_space", True):
                return True
            if kind == "Prepend" and part.get("prepend") == "\u2581":
                return True
        return False

    def __repr__(self) -> str:
        return (f"TextTokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
                f"eos_token_id={self.eos_token_id}, add_bos_token={self.add_bos_token}, "
                f"chat_template={'yes' if self.chat_template else 'no'})")

    # -------------------------------------------------------------- chat template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> str:
        """Render `messages` with the model's jinja chat template, the way HF
        transformers does (sandboxed, trim_blocks + lstrip_blocks)."""
        if not self.chat_template:
            raise ValueError(
                "this tokenizer has no chat template (no tokenizer.chat_template in the GGUF "
                "metadata / no chat_template in tokenizer_config.json); set "
                "`tokenizer.chat_template` to a jinja template or pass a plain prompt instead"
            )
        if self._compiled_template is None or self._compiled_template_source != self.chat_template:
            self._compiled_template = _compile_chat_template(self.chat_template)
            self._compiled_template_source = self.chat_template
        context: dict[str, Any] = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token,
        }
        if self.unk_token_id is not None:
            context["unk_token"] = self.token_to_str(self.unk_token_id)
        if self.pad_token_id is not None:
            context["pad_token"] = self.token_to_str(self.pad_token_id)
        context.update(template_kwargs)
        context["messages"] = list(messages)
        context["add_generation_prompt"] = add_generation_prompt
        return self._compiled_template.render(**context)

    # ----------------------------------------------------------------------- GGUF

    @classmethod
    def from_gguf(cls, reader: "gguf.GGUFReader | str | os.PathLike[str]") -> "TextTokenizer":
        """Build the tokenizer from GGUF metadata (a `gguf.GGUFReader` or a file path)."""
        if isinstance(reader, (str, os.PathLike)):
            import gguf

            reader = gguf.GGUFReader(os.fspath(reader))

        tok = _bpe_tokenizer(*_gguf_bpe_metadata(reader))
        bos_id = _gguf_get(reader, "tokenizer.ggml.bos_token_id")
        eos_id = _gguf_get(reader, "tokenizer.ggml.eos_token_id")
        if eos_id is None:
            eos_id = _gguf_get(reader, "tokenizer.ggml.eot_token_id")
        if eos_id is None:
            raise ValueError("GGUF tokenizer metadata has no tokenizer.ggml.eos_token_id; the engine "
                             "needs an end-of-sequence token. Add it to the GGUF metadata (gguf-py's "
                             "gguf_set_metadata.py) or load the tokenizer with from_hf_dir()")
        add_bos = bool(_gguf_get(reader, "tokenizer.ggml.add_bos_token", False))
        return cls(
            tok,
            eos_token_id=eos_id,
            bos_token_id=bos_id,
            add_bos_token=add_bos and bos_id is not None,
            chat_template=_gguf_get(reader, "tokenizer.chat_template"),
            unk_token_id=_gguf_get(reader, "tokenizer.ggml.unknown_token_id"),
            pad_token_id=_gguf_get(reader, "tokenizer.ggml.padding_token_id"),
        )

    # ------------------------------------------------------------- HF directory

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> "TextTokenizer":
        """Load from a Hugging Face model/tokenizer directory (tokenizer.json +
        tokenizer_config.json, optionally chat_template.jinja and config.json)."""
        path = os.fspath(path)
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise ValueError(
                f"no tokenizer.json in {path!r}: only 'fast' (tokenizers-library) tokenizers are "
                "supported. Create one with transformers: AutoTokenizer.from_pretrained(dir)"
                ".save_pretrained(dir), or load the model from a GGUF file with TextTokenizer.from_gguf()"
            )
        tok = Tokenizer.from_file(tok_file)
        tcfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        mcfg = _read_json(os.path.join(path, "config.json"))

        eos_id = _hf_token_id(tok, tcfg, "eos_token")
        if eos_id is None:
            eos_id = _hf_config_id(mcfg, "eos_token_id")
        if eos_id is None:
            raise ValueError(f"cannot determine the EOS token for {path!r}: set eos_token in "
                             "tokenizer_config.json or eos_token_id in config.json")
        bos_id = _hf_token_id(tok, tcfg, "bos_token")
        if bos_id is None:
            bos_id = _hf_config_id(mcfg, "bos_token_id")

        # tokenizer.json's post-processor decides whether BOS is added (as in
        # transformers v5).  Without a post-processor, honour tokenizer_config's
        # add_bos_token (older transformers rebuilt the post-processor from it).
        if tok.post_processor is not None:
            add_bos = bos_id is not None and tok.encode("", add_special_tokens=True).ids[:1] == [bos_id]
        else:
            add_bos = bool(tcfg.get("add_bos_token")) and bos_id is not None

        chat_template = _read_chat_template(path, tcfg)
        return cls(
            tok,
            eos_token_id=eos_id,
            bos_token_id=bos_id,
            add_bos_token=add_bos,
            chat_template=chat_template,
            unk_token_id=_hf_token_id(tok, tcfg, "unk_token"),
            pad_token_id=(_hf_token_id(tok, tcfg, "pad_token") if tcfg.get("pad_token")
                          else _hf_config_id(mcfg, "pad_token_id")),
        )

    def save_hf_dir(self, path: str | os.PathLike[str]) -> None:
        """Write tokenizer.json + tokenizer_config.json, loadable by `from_hf_dir`
        and by `transformers.AutoTokenizer.from_pretrained(path)`."""
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        # The post-processor already encodes add_bos_token (see the property).
        self._tok.save(os.path.join(path, "tokenizer.json"), pretty=True)

        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos_token,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "eos_token": self.eos_token,
        }
        if self.bos_token_id is not None:
            config["bos_token"] = self.bos_token
        if self.unk_token_id is not None:
            config["unk_token"] = self.token_to_str(self.unk_token_id)
        if self.pad_token_id is not None:
            config["pad_token"] = self.token_to_str(self.pad_token_id)
        if self.chat_template:
            config["chat_template"] = self.chat_template
        with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, ensure_ascii=False, indent=2)
        # A stale chat_template.jinja would take priority over the config entry.
        stale = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(stale):
            os.remove(stale)


def _components(spec: Any) -> list[dict]:
    """A tokenizer.json pipeline part (decoder, pre-tokenizer, normalizer) flattened: the parts of a
    Sequence, or the part itself."""
    if not isinstance(spec, dict):
        return []
    inner = spec.get("decoders") or spec.get("pretokenizers") or spec.get("normalizers")
    if spec.get("type") == "Sequence" and isinstance(inner, list):
        return [p for sub in inner for p in _components(sub)]
    return [spec]


def _component_types(spec: Any) -> set[str]:
    return {part.get("type") for part in _components(spec)}


def _gguf_bpe_metadata(reader: Any) -> tuple[list[str], list[int], list[str], str]:
    """The GGUF's tokens, token types, merges and pre-tokenizer name, checked to describe a
    byte-level BPE that `_bpe_tokenizer` rebuilds exactly."""
    tok_model = _gguf_get(reader, "tokenizer.ggml.model")
    tokens = _gguf_get(reader, "tokenizer.ggml.tokens")
    if tok_model is None or tokens is None:
        raise ValueError(
            "GGUF file has no tokenizer metadata (tokenizer.ggml.model / tokenizer.ggml.tokens); "
            "it cannot be used for text generation on its own. Re-convert it with a tokenizer "
            "(llama.cpp convert_hf_to_gguf.py) or load the tokenizer from the original "
            "Hugging Face directory with TextTokenizer.from_hf_dir()."
        )
    if tok_model != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer model {tok_model!r}: only byte-level BPE "
            "(tokenizer.ggml.model = 'gpt2') is implemented. Load the tokenizer from the "
            "model's Hugging Face directory with TextTokenizer.from_hf_dir() instead."
        )
    pre_name = _gguf_get(reader, "tokenizer.ggml.pre")
    if pre_name not in _PRE_TOKENIZERS:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre_name!r} (tokenizer.ggml.pre"
            f"{'; missing means llama.cpp default' if pre_name is None else ''}); supported: "
            f"{sorted(_PRE_TOKENIZERS)}. Load the tokenizer from the model's Hugging Face "
            "directory with TextTokenizer.from_hf_dir() instead."
        )
    merges = _gguf_get(reader, "tokenizer.ggml.merges")
    if merges is None:
        raise ValueError("GGUF tokenizer metadata has no tokenizer.ggml.merges, required for BPE; "
                         "re-convert the model with llama.cpp's convert_hf_to_gguf.py")
    token_types = _gguf_get(reader, "tokenizer.ggml.token_type")
    if token_types is None:
        token_types = [_TOKEN_TYPE_NORMAL] * len(tokens)
    if len(token_types) != len(tokens):
        raise ValueError(f"GGUF tokenizer metadata is inconsistent: {len(tokens)} tokens but "
                         f"{len(token_types)} token types")
    return tokens, token_types, merges, pre_name


def _bpe_tokenizer(tokens: list[str], token_types: list[int], merges_raw: list[str], pre_name: str) -> Tokenizer:
    """The `tokenizers` pipeline of a GGUF's byte-level BPE (see `_gguf_bpe_metadata`)."""
    vocab: dict[str, int] = {}
    for i, piece in enumerate(tokens):
        # A duplicated piece can never be produced by BPE; keep the first id.
        vocab.setdefault(piece, i)
    merges: list[tuple[str, str]] = []
    for m in merges_raw:
        parts = m.split(" ")
        if len(parts) != 2:
            raise ValueError(f"malformed BPE merge {m!r} in tokenizer.ggml.merges (expected 'left right')")
        merges.append((parts[0], parts[1]))

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _PRE_TOKENIZERS[pre_name]()
    tok.decoder = decoders.ByteLevel()
    # CONTROL tokens (<|im_start|> ...) are special: matched as one piece in the
    # input and dropped by decode(skip_special_tokens=True).  USER_DEFINED tokens
    # are matched as one piece too but, as in llama.cpp, always rendered on decode.
    added = []
    for i, (piece, ttype) in enumerate(zip(tokens, token_types)):
        if ttype in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED) and vocab.get(piece) == i:
            added.append(AddedToken(piece, special=ttype == _TOKEN_TYPE_CONTROL,
                                    normalized=False, lstrip=False, rstrip=False,
                                    single_word=False))
    if added:
        tok.add_tokens(added)  # all already in the vocab: ids unchanged
    return tok


def _bos_post_processor(tok: Tokenizer, bos_id: int | None) -> processors.PostProcessor:
    if bos_id is None:
        return processors.TemplateProcessing(single="$A", pair="$A $B:1", special_tokens=[])
    piece = tok.id_to_token(bos_id)
    return processors.TemplateProcessing(
        single=f"{piece} $A", pair=f"{piece} $A {piece} $B:1", special_tokens=[(piece, bos_id)])


def _read_json(file: str) -> dict[str, Any]:
    if not os.path.isfile(file):
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {file!r}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _hf_token_id(tok: Tokenizer, tcfg: Mapping[str, Any], key: str) -> int | None:
    """The id of tokenizer_config.json's token `key` (e.g. "eos_token"), None when it names none."""
    value = tcfg.get(key)
    if isinstance(value, Mapping):  # serialized AddedToken
        value = value.get("content")
    if isinstance(value, str):
        tid = tok.token_to_id(value)
        if tid is None:
            raise ValueError(f"tokenizer_config.json {key}={value!r} is not in the vocabulary")
        return tid
    return None


def _hf_config_id(mcfg: Mapping[str, Any], key: str) -> int | None:
    """config.json's token id `key` (e.g. "eos_token_id"), None when it has none."""
    value = mcfg.get(key)
    if isinstance(value, list):  # e.g. eos_token_id: [2, 0]; first is the main one
        value = value[0] if value else None
    return value if isinstance(value, int) else None


def _read_chat_template(path: str, tcfg: Mapping[str, Any]) -> str | None:
    # Newer transformers save the template as chat_template.jinja; it takes priority.
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None
