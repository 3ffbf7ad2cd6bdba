"""Request traces in the formats public LLM-serving traces use, read into per-request
(arrival time, prompt tokens, output tokens).

- CSV with a header row. Columns are found by name, under any of the names below:
  the Azure LLM inference traces (TIMESTAMP, ContextTokens, GeneratedTokens), Vidur
  (arrived_at, num_prefill_tokens, num_decode_tokens) and ours (arrival_s, prompt_len, decode_len).
  Arrival times are seconds from the start (kept as given) or date-times (Azure's
  "2023-11-16 18:15:46.6805900", counted from the earliest request). The arrival column is optional.
- JSONL: one object per line with the same keys.
- ShareGPT-style JSON: a list of {"conversations": [{"from": "human", "value": ...},
  {"from": "gpt", "value": ...}, ...]} (or turns of {"role", "content"}). Each conversation's
  first human turn is a prompt and the reply after it the output; both are counted with the
  model's tokenizer (the default model's, read from its local file: nothing is downloaded).
  Conversations without such a pair are skipped, as public ShareGPT dumps hold many.

A malformed file raises `TraceError`, one message naming the file, the line and the field.
"""
from __future__ import annotations

import csv
import functools
import io
import json
import math
from dataclasses import dataclass
from datetime import datetime

import numpy as np

ARRIVAL_COLUMNS = ("arrival_s", "arrived_at", "arrival_time", "TIMESTAMP", "Time")
PROMPT_COLUMNS = ("prompt_len", "num_prefill_tokens", "ContextTokens", "PromptTokenCount", "prompt_tokens")
OUTPUT_COLUMNS = ("decode_len", "num_decode_tokens", "GeneratedTokens", "CompletionTokenCount", "output_tokens")
_HUMAN, _REPLY = ("human", "user"), ("gpt", "assistant", "chatgpt", "bard", "bing", "model")


class TraceError(ValueError):
    def __init__(self, path: str, line: int | None, message: str) -> None:
        where = f"{path}, line {line}" if line is not None else path
        super().__init__(f"trace {where}: {message}")


@dataclass(frozen=True)
class Trace:
    prompt_len: np.ndarray  # int64, one per request, in file order
    decode_len: np.ndarray  # int64
    arrival_s: np.ndarray | None  # float64 seconds from the start; None: the file has no arrival times
    format: str  # "csv", "jsonl" or "sharegpt"

    def __len__(self) -> int:
        return len(self.prompt_len)


def read_trace(path: str, tokenizer=None) -> Trace:
    """Read a trace file; `tokenizer` (anything with `encode`) counts ShareGPT text, default: the default model's."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except OSError as exc:
        raise TraceError(path, None, f"cannot be read ({exc.strerror})") from exc
    except UnicodeDecodeError as exc:
        raise TraceError(path, None, "is not UTF-8 text") from exc
    head = text.lstrip()
    if not head:
        raise TraceError(path, None, "is empty")
    if head[0] == "[":
        return _read_sharegpt(path, text, tokenizer)
    if head[0] == "{":
        return _read_jsonl(path, text)
    return _read_csv(path, text)


def trace_has_arrivals(path: str) -> bool:
    """Whether a trace file gives arrival times, from its first line (a ShareGPT file never does)."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            first = next((line for line in f if line.strip()), "")
    except (OSError, UnicodeDecodeError):
        return False  # read_trace reports it
    head = first.lstrip()
    if head.startswith("["):
        return False
    if head.startswith("{"):
        try:
            names = list(json.loads(first))
        except (json.JSONDecodeError, TypeError):
            return False
    else:
        names = next(csv.reader([first]), [])
    return _find_column(names, ARRIVAL_COLUMNS) is not None


# ---- rows: CSV and JSONL ----------------------------------------------------------------------


def _find_column(names, aliases: tuple[str, ...]) -> str | None:
    by_lower = {str(n).strip().lower(): n for n in names}
    for alias in aliases:
        if alias.lower() in by_lower:
            return by_lower[alias.lower()]
    return None


class _Columns:
    """Which column holds each field, and the parsed values so far."""

    def __init__(self, path: str, names, line: int) -> None:
        self.path = path
        self.prompt = _find_column(names, PROMPT_COLUMNS)
        self.output = _find_column(names, OUTPUT_COLUMNS)
        self.arrival = _find_column(names, ARRIVAL_COLUMNS)
        for col, aliases, what in ((self.prompt, PROMPT_COLUMNS, "prompt-token"),
                                   (self.output, OUTPUT_COLUMNS, "output-token")):
            if col is None:
                raise TraceError(path, line, f"no {what} field: expected one of {', '.join(aliases)} "
                                             f"(found {', '.join(map(str, names)) or 'none'})")
        self.prompts: list[int] = []
        self.outputs: list[int] = []
        self.arrivals: list[float] = []
        self.dates: bool | None = None  # whether arrivals are date-times

    def add(self, row: dict, line: int) -> None:
        self.prompts.append(self._tokens(row, self.prompt, line))
        self.outputs.append(self._tokens(row, self.output, line))
        if self.arrival is not None:
            self.arrivals.append(self._arrival(row, line))

    def _value(self, row: dict, column: str, line: int):
        value = row.get(column)
        if value is None or (isinstance(value, str) and not value.strip()):
            raise TraceError(self.path, line, f"field {column!r} is missing or empty")
        return value

    def _tokens(self, row: dict, column: str, line: int) -> int:
        value = self._value(row, column, line)
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number) or number != int(number) or isinstance(value, bool):
            raise TraceError(self.path, line, f"field {column!r} must be a whole number of tokens, got {value!r}")
        if number < 1:
            raise TraceError(self.path, line, f"field {column!r} must be >= 1 token, got {value!r}")
        return int(number)

    def _arrival(self, row: dict, line: int) -> float:
        value = self._value(row, self.arrival, line)
        seconds, is_date = _parse_time(value)
        if seconds is None:
            raise TraceError(self.path, line, f"field {self.arrival!r} must be seconds or a date-time "
                                              f"like 2023-11-16 18:15:46.68, got {value!r}")
        if not is_date and seconds < 0:
            raise TraceError(self.path, line, f"field {self.arrival!r} must be >= 0 seconds, got {value!r}")
        if self.dates is None:
            self.dates = is_date
        elif self.dates != is_date:
            raise TraceError(self.path, line, f"field {self.arrival!r} mixes seconds and date-times: got {value!r}")
        return seconds

    def trace(self, fmt: str) -> Trace:
        if not self.prompts:
            raise TraceError(self.path, None, "holds no requests")
        arrival = None
        if self.arrival is not None:
            arrival = np.asarray(self.arrivals, dtype=np.float64)
            if self.dates:
                arrival -= arrival.min()
        return Trace(np.asarray(self.prompts, dtype=np.int64), np.asarray(self.outputs, dtype=np.int64), arrival, fmt)


def _parse_time(value) -> tuple[float | None, bool]:
    """(seconds, whether it was a date-time); (None, False) if it is neither."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (float(value), False) if math.isfinite(value) else (None, False)
    text = str(value).strip()
    try:
        number = float(text)
        return (number, False) if math.isfinite(number) else (None, False)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp(), True
    except ValueError:
        return None, False


def _read_csv(path: str, text: str) -> Trace:
    reader = csv.DictReader(io.StringIO(text, newline=""))
    if not reader.fieldnames:
        raise TraceError(path, 1, "no header row")
    columns = _Columns(path, reader.fieldnames, 1)
    for row in reader:
        if None in row:  # more values than header columns
            raise TraceError(path, reader.line_num, f"{len(reader.fieldnames) + len(row[None])} values for "
                                                    f"{len(reader.fieldnames)} header columns")
        columns.add(row, reader.line_num)
    return columns.trace("csv")


def _read_jsonl(path: str, text: str) -> Trace:
    columns = None
    for line, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise TraceError(path, line, f"not valid JSON ({exc.msg})") from exc
        if not isinstance(row, dict):
            raise TraceError(path, line, "a JSONL trace holds one JSON object per line")
        if columns is None:
            columns = _Columns(path, list(row), line)
        columns.add(row, line)
    return columns.trace("jsonl")


# ---- ShareGPT conversations -----------------------------------------------------------------


def _json_items(path: str, text: str):
    """Yield (line, item) for each element of a top-level JSON list, with the line it starts on."""
    decoder = json.JSONDecoder()
    counted, line = 0, 1

    def line_at(pos: int) -> int:
        nonlocal counted, line
        line += text.count("\n", counted, pos)
        counted = pos
        return line

    def skip_space(pos: int) -> int:
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        return pos

    pos = skip_space(text.index("[") + 1)
    if text.startswith("]", pos):
        return
    while True:
        try:
            item, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            raise TraceError(path, exc.lineno, f"not valid JSON ({exc.msg})") from exc
        yield line_at(pos), item
        pos = skip_space(end)
        if text.startswith("]", pos):
            return
        if not text.startswith(",", pos):
            found = repr(text[pos]) if pos < len(text) else "the end of the file"
            raise TraceError(path, line_at(min(pos, len(text))), f"not valid JSON (expected , or ] but found {found})")
        pos = skip_space(pos + 1)


def _turn(path: str, line: int, index: int, turn) -> tuple[str, str]:
    """(speaker, text) of a conversation turn, in either {"from", "value"} or {"role", "content"} shape."""
    if not isinstance(turn, dict):
        raise TraceError(path, line, f"conversations[{index}] must be an object with 'from' and 'value'")
    speaker = turn.get("from", turn.get("role"))
    key = "value" if "value" in turn else "content"
    text = turn.get(key)
    if not isinstance(speaker, str):
        raise TraceError(path, line, f"conversations[{index}] has no 'from' (or 'role') string")
    if not isinstance(text, str):
        raise TraceError(path, line, f"conversations[{index}].{key} must be a string, got {type(text).__name__}")
    return speaker.lower(), text


def _prompt_and_reply(path: str, line: int, item) -> tuple[str, str] | None:
    if not isinstance(item, dict):
        raise TraceError(path, line, "each element must be an object with a 'conversations' list")
    turns = item.get("conversations", item.get("messages"))
    if not isinstance(turns, list):
        raise TraceError(path, line, "field 'conversations' is missing or not a list")
    pairs = [_turn(path, line, i, t) for i, t in enumerate(turns[:2])]
    if len(pairs) < 2 or pairs[0][0] not in _HUMAN or pairs[1][0] not in _REPLY:
        return None
    if not pairs[0][1].strip() or not pairs[1][1].strip():
        return None
    return pairs[0][1], pairs[1][1]


@functools.lru_cache(maxsize=1)
def default_tokenizer():
    """The default model's tokenizer, read from its local GGUF file (once per process: it takes seconds)."""
    from charioteer.model.loader import default_model_path
    from charioteer.model.tokenizer import TextTokenizer

    return TextTokenizer.from_gguf(default_model_path())


def _read_sharegpt(path: str, text: str, tokenizer) -> Trace:
    if tokenizer is None:
        tokenizer = default_tokenizer()
    prompts, outputs = [], []
    for line, item in _json_items(path, text):
        pair = _prompt_and_reply(path, line, item)
        if pair is None:
            continue
        prompts.append(len(tokenizer.encode(pair[0])))
        outputs.append(max(1, len(tokenizer.encode(pair[1], add_special_tokens=False))))
    if not prompts:
        raise TraceError(path, None, "holds no conversation that starts with a human turn followed by a reply")
    return Trace(np.asarray(prompts, dtype=np.int64), np.asarray(outputs, dtype=np.int64), None, "sharegpt")
