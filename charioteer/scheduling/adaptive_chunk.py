"""Adaptive chunk size: follow the P:D of recent requests online (`chunk_size="auto"`).

The paper fixes C by hand for a known P:D and leaves choosing it online as future work. Here the
scheduler keeps the prompt and output lengths of the last `window` (8) finished requests, and
re-picks C after every batch from those and from the requests still running: with a timing table from `charioteer tune --save-table`, the C of best
predicted throughput (`recommend_chunk_size`); without one, the balanced C = (P/D)(B-1), moved
so that C + (B-1) lands on a multiple of the tile when one is set. Changing C between batches
never changes outputs: a chunk boundary is exact wherever it falls.

Running requests make the estimate follow a shift in P:D before the new requests finish. Their
prompt lengths are known. Their output lengths are not, but a request that has already produced
k tokens will produce at least k: it counts as max(k, the finished requests' mean). That only
raises the estimate on evidence, so short-output phases are not disturbed.
"""
from __future__ import annotations

import json
from collections import deque

from charioteer.scheduling.chunk_size import TimingTable, recommend_chunk_size


class AdaptiveChunkSize:
    def __init__(self, batch_size: int, min_chunk: int, max_chunk: int, tile_size: int | None = None,
                 table: TimingTable | None = None, window: int = 8) -> None:
        if not 1 <= min_chunk <= max_chunk:
            raise ValueError(f"adaptive chunk size needs 1 <= min_chunk_size <= max_chunk_size, got {min_chunk}, {max_chunk}")
        if table is not None and table.batch_size != batch_size:
            raise ValueError(f"the tune table was measured at batch size {table.batch_size} but max_num_seqs is "
                             f"{batch_size}: run `charioteer tune --batch-size {batch_size} --save-table ...` again")
        self.batch_size = batch_size
        self.min_chunk, self.max_chunk = min_chunk, max_chunk
        self.tile_size = tile_size
        self.table = table
        self.prompt_lens: deque[int] = deque(maxlen=window)
        self.output_lens: deque[int] = deque(maxlen=window)
        self.chunk_size = max_chunk  # until a request finishes, favour prefill efficiency
        self.history: list[tuple[int, int]] = []  # (requests observed, chunk size) at each change

    @classmethod
    def from_table_file(cls, path: str, **kwargs) -> "AdaptiveChunkSize":
        with open(path) as f:
            return cls(table=TimingTable(**json.load(f)), **kwargs)

    def observe(self, prompt_len: int, output_len: int) -> None:
        """A request finished: remember its lengths (the estimate moves on the next `update`)."""
        if output_len < 1:
            return
        self.prompt_lens.append(prompt_len)
        self.output_lens.append(output_len)

    def update(self, running: list[tuple[int, int]] = ()) -> None:
        """Re-pick C from the finished requests and the running ones, as (prompt length, outputs so far)."""
        if not self.output_lens:
            return  # no output length seen yet
        finished_d = sum(self.output_lens) / len(self.output_lens)
        prompts = [*self.prompt_lens, *(p for p, _ in running)]
        outputs = [*self.output_lens, *(max(k, finished_d) for _, k in running)]
        chunk = self._choose(sum(prompts) / len(prompts), sum(outputs) / len(outputs))
        if chunk != self.chunk_size:
            self.chunk_size = chunk
            self.history.append((len(self.history), chunk))

    def _choose(self, prompt_len: float, decode_len: float) -> int:
        if self.table is not None:
            return recommend_chunk_size(self.table, prompt_len, decode_len, self.min_chunk, self.max_chunk).chunk_size
        decodes = self.batch_size - 1
        chunk = round(prompt_len / decode_len * decodes)
        if self.tile_size:
            rows = max(self.tile_size, round((chunk + decodes) / self.tile_size) * self.tile_size)
            chunk = rows - decodes
        return min(max(chunk, self.min_chunk), self.max_chunk)
