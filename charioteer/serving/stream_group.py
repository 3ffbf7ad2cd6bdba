"""The requests of one API call (one per prompt of a batched completion) read as one stream."""
from __future__ import annotations

import asyncio

from charioteer.serving.async_engine import Delta, RequestStream


class StreamGroup:
    """Deltas of several RequestStreams, as `(index, delta)` in the order the engine made them.

    A task per stream moves its deltas onto one queue. `next()` returns None once the group was
    closed from outside (the client went away), and raises a stream's EngineError.
    """

    def __init__(self, streams: list[RequestStream]) -> None:
        self.streams = streams
        self.num_finished = 0
        self.closed = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pumps = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.streams)

    async def _pump(self, index: int, stream: RequestStream) -> None:
        while True:
            try:
                delta = await stream.next()
            except Exception as exc:  # EngineError: the group fails with it
                self._queue.put_nowait((index, exc))
                return
            self._queue.put_nowait((index, delta))
            if delta is None or delta.finished:
                return

    async def next(self) -> tuple[int, Delta] | None:
        index, item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        if item is None or self.closed:
            return None
        if item.finished:
            self.num_finished += 1
        return index, item

    def close(self) -> None:
        """Release every request of the group (aborting the unfinished ones) and wake `next()`."""
        if self.closed:
            return
        self.closed = True
        for stream in self.streams:
            stream.close()
        for pump in self._pumps:
            pump.cancel()
        self._queue.put_nowait((0, None))
