"""Record an engine's step records to a file, and read them back.

    from charioteer.engine.trace import TraceRecorder
    llm = LLM(...)
    with TraceRecorder(llm, "out.json"):
        llm.generate(prompts)

The file holds one `StepRecord.to_dict()` JSON object per line (JSON lines); `charioteer view
out.json` turns it into a self-contained HTML page. `load_trace` also reads a JSON array of them.
"""
from __future__ import annotations

import json
from typing import IO

from charioteer.engine.step_record import EntryRecord, PipelineTiming, StageTiming, StepRecord

_DERIVED = ("kind", "num_prefill_tokens", "num_decode_tokens")  # to_dict adds these; not fields


class TraceRecorder:
    """Subscribes to an engine (an `LLM` or an `LLMEngine`) and keeps every step record.

    With `path` (a file name or an open text file) each record is written as a JSON line as it
    arrives and not kept in memory; without it they collect in `records`. `close()` (or leaving
    the `with` block) unsubscribes and closes a file this recorder opened.
    """

    def __init__(self, engine, path: str | IO[str] | None = None) -> None:
        engine = getattr(engine, "engine", engine)  # LLM -> its LLMEngine
        self.records: list[StepRecord] = []
        self.count = 0
        self._owns_file = isinstance(path, str)
        self._file: IO[str] | None = open(path, "w", encoding="utf-8") if isinstance(path, str) else path
        self._unsubscribe = engine.subscribe(self._observe)

    def _observe(self, record: StepRecord) -> None:
        self.count += 1
        if self._file is None:
            self.records.append(record)
        else:
            self._file.write(json.dumps(record.to_dict(), separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._unsubscribe()
        if self._file is not None:
            self._file.flush()
            if self._owns_file:
                self._file.close()

    def __enter__(self) -> "TraceRecorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def record_from_dict(d: dict) -> StepRecord:
    """The StepRecord that `to_dict()` gave `d` (raises ValueError if `d` is not one)."""
    try:
        fields = {k: v for k, v in d.items() if k not in _DERIVED}
        fields["entries"] = tuple(EntryRecord(**e) for e in d["entries"])
        fields["preempted"] = tuple(d["preempted"])
        fields["finished"] = tuple(d["finished"])
        pipe = d.get("pipeline")
        if pipe is not None:
            fields["pipeline"] = PipelineTiming(pipe["dispatch"], pipe["returned"],
                                                tuple(StageTiming(**s) for s in pipe["stages"]))
        return StepRecord(**fields)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a step record ({type(exc).__name__}: {exc})") from None


def load_trace(path: str) -> list[StepRecord]:
    """The step records in a trace file: JSON lines, or one JSON array."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        items = json.loads(text)
    else:
        items = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    items.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}: line {n} is not JSON: {exc.msg}") from None
    if not isinstance(items, list) or not all(isinstance(d, dict) for d in items):
        raise ValueError(f"{path}: expected JSON lines or an array of step records")
    return [record_from_dict(d) for d in items]
