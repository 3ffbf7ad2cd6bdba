"""Structured outputs with xgrammar: each distinct constraint (a JSON schema, regex, choice list,
EBNF grammar or any JSON object) compiles once into a grammar, every constrained request gets a
matcher over it, and the sampler masks the request's logits with the matcher's token bitmask.

xgrammar is imported on first use: it costs seconds, and most engines never see a constraint.
"""
from __future__ import annotations

import collections
import json
import os
import re
import threading
from typing import Any

import torch

from charioteer.model.tokenizer import TextTokenizer
from charioteer.request import StructuredOutputsParams

_XGRAMMAR_VOCAB_TYPES = {"byte_level": "BYTE_LEVEL", "byte_fallback": "BYTE_FALLBACK", "raw": "RAW"}
# JSON may hold at most this much whitespace between two of its tokens (vLLM sets no bound): enough
# for pretty-printing 7 levels deep, and it makes the grammar itself end a small model's run of
# newlines, which would otherwise go on until max_tokens.
MAX_JSON_WHITESPACE = 32
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest is the message.
_CPP_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")


class StructuredOutputCompiler:
    """Compiles constraints for one engine's tokenizer, caching the grammars by the constraint's
    text (at most `max_cached`, least recently used dropped first). Thread-safe: the server compiles
    on worker threads so that the engine thread, whose compile then hits the cache, never waits."""

    def __init__(self, tokenizer: TextTokenizer | None, vocab_size: int, stop_token_ids: list[int],
                 max_cached: int = 256) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's: the width of its logits
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.max_cached = max_cached
        self.hits = self.misses = 0
        self._compiler = None
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams):
        """The xgrammar CompiledGrammar of `spec`; ValueError naming the problem if it does not compile."""
        key = spec.key()
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return grammar
            self.misses += 1
        grammar = self._compile(spec)
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, spec: StructuredOutputsParams):
        """A fresh xgrammar GrammarMatcher for one request."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(spec))

    def _xgrammar_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
                # Our LRU is the cache (keyed by the constraint text); xgrammar's would be a second copy.
                self._compiler = xgr.GrammarCompiler(info, max_threads=min(4, os.cpu_count() or 1),
                                                     cache_enabled=False)
            return self._compiler

    def _compile(self, spec: StructuredOutputsParams):
        if self.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer, and this model has none")
        compiler = self._xgrammar_compiler()
        kind = spec.kind
        try:
            if kind in ("json", "json_object"):
                return _compile_json(compiler, spec)
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            message = _CPP_PREFIX.sub("", str(exc)).strip() or type(exc).__name__
            raise ValueError(f"the {_KIND_NAMES[kind]} does not compile: {message}") from None


def _compile_json(compiler, spec: StructuredOutputsParams):
    whitespace = {"any_whitespace": not spec.disable_any_whitespace}
    if not spec.disable_any_whitespace:
        whitespace["max_whitespace_cnt"] = MAX_JSON_WHITESPACE
    if spec.kind == "json_object":  # an object, as OpenAI's json_object means (xgrammar's builtin is any value)
        return compiler.compile_json_schema('{"type": "object"}', strict_mode=False, **whitespace)
    schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
    return compiler.compile_json_schema(schema, **whitespace)


_KIND_NAMES = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regex",
               "choice": "choice list", "grammar": "grammar"}


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are the choices (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def tokenizer_info(tokenizer: TextTokenizer, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's view of the vocabulary: every entry as the model may emit it.

    Special tokens other than the stop tokens are given as empty strings, which xgrammar never
    allows: decode() drops them, so text like '<|im_start|>' inside a JSON string would vanish.
    Ids past the tokenizer's vocabulary (a padded lm_head) are empty, hence never allowed, too.
    """
    import xgrammar as xgr

    pieces = tokenizer.vocabulary()[:vocab_size]
    pieces += [""] * (vocab_size - len(pieces))
    for token in tokenizer.special_token_ids() - set(stop_token_ids):
        if token < vocab_size:
            pieces[token] = ""
    vocab_type = getattr(xgr.VocabType, _XGRAMMAR_VOCAB_TYPES[tokenizer.byte_encoding()])
    return xgr.TokenizerInfo(pieces, vocab_type, vocab_size=vocab_size, stop_token_ids=stop_token_ids,
                             add_prefix_space=tokenizer.prepends_space())


def mask_rows(logits: torch.Tensor, rows: list[int], matchers: list) -> None:
    """Set, in place, every token that row's matcher forbids next to -inf, in each of `rows` of
    `logits` (float32); the other rows are not touched."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    for row, matcher in zip(rows, matchers):
        matcher.fill_next_token_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)


def advance(matcher, token: int, request_id: str) -> None:
    """Feed a sampled token to the request's matcher (its mask allowed it, so it must accept it)."""
    if not matcher.accept_token(token):
        raise RuntimeError(f"request {request_id}: the grammar refused token {token}, which its mask allowed")
