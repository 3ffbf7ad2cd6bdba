"""The real-model executor: carries out a Batch plan on a LlamaModel and samples tokens
(greedy, or temperature / top-k / top-p with per-request seeds)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from charioteer.engine import structured_output
from charioteer.memory.block_manager import BlockManager
from charioteer.model.llama import ForwardInput, KVCache, LlamaModel, PrefillSpan, causal_mask
from charioteer.model import cpu_kernels
from charioteer.request import SamplingParams
from charioteer.scheduling.base import Batch, BatchEntry


def top_logprobs(logprobs: torch.Tensor, k: int, chosen: int) -> dict[int, float]:
    """The chosen token's logprob plus the k most likely ones."""
    result = {chosen: float(logprobs[chosen])}
    if k > 0:
        values, ids = logprobs.topk(k)
        for value, token in zip(values.tolist(), ids.tolist()):
            result.setdefault(token, value)
    return result


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (its first maximum); the CPU kernel splits the rows over threads."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(-1) == 1 and cpu_kernels.available()):
        return cpu_kernels.argmax_rows(logits)
    return logits.argmax(dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token drawn from `probs` [vocab] (non-negative, any positive total) by inverting its CDF
    at one uniform number: a token of probability 0 is never drawn. torch.multinomial draws one
    exponential number per token, 0.9 ms for SmolLM2's 49152 against 0.04 here."""
    cdf = probs.cumsum(0)
    u = torch.rand(1, generator=generator, device=probs.device, dtype=cdf.dtype)
    return min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)), probs.shape[0] - 1)


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams, device) -> torch.Generator | None:
        if params.seed is None:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = torch.Generator(device=device).manual_seed(params.seed)
        return gen

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams],
               grammars: list | None = None) -> list[int]:
        """logits: [N, vocab] float32. Returns one token per row.

        `grammars`: per row, the request's grammar matcher or None. A constrained row's logits are
        masked in place (so its logprobs are the masked distribution's, as in vLLM) and its matcher
        advances with the token; the other rows are not touched.
        """
        constrained = [row for row, g in enumerate(grammars or ()) if g is not None]
        if constrained:
            structured_output.mask_rows(logits, constrained, [grammars[row] for row in constrained])
        tokens = greedy(logits).tolist()
        for row, (request_id, p) in enumerate(zip(request_ids, params)):
            if p.greedy:
                continue
            scores = logits[row] / p.temperature
            if p.top_k > 0 and p.top_k < scores.shape[-1]:
                kth = scores.topk(p.top_k).values[-1]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            probs = scores.softmax(-1)
            if p.top_p < 1.0:
                sorted_probs, order = probs.sort(descending=True)
                # Keep the smallest prefix whose mass reaches top_p (always at least one token).
                drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
                sorted_probs = sorted_probs.masked_fill(drop, 0.0)
                probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
            tokens[row] = draw(probs, self._generator(request_id, p, logits.device))
        for row in constrained:
            structured_output.advance(grammars[row], tokens[row], request_ids[row])
        return tokens


def run_starts(tables: list[list[int]], ends: list[int], block_size: int) -> list[int] | None:
    """Each row's first slot when positions [0, ends[i]) of every row lie in one run of consecutive slots (each
    of the blocks they use follows the one before; blocks past them are ignored), else None. In Python, not
    numpy: at a decode step numpy's reductions cost tens of microseconds each with the caches cold."""
    starts = []
    for table, end in zip(tables, ends):
        used, first = -(-end // block_size), table[0]
        if table[used - 1] - first != used - 1 or table[:used] != list(range(first, first + used)):
            return None
        starts.append(first * block_size)
    return starts


@dataclass
class BatchResult:
    tokens: dict[str, int] = field(default_factory=dict)  # request_id -> sampled token
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)  # for the sampled token
    # request_id -> (first prompt position, logprobs of the prompt tokens from there on)
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: LlamaModel | None, blocks: BlockManager) -> None:
        """`model` None: a pipeline driver, which prepares batches (on the CPU, to send to the
        stages) and samples from the logits they return, but holds no weights or KV cache."""
        self.model = model
        self.blocks = blocks
        self.device = model.device if model is not None else torch.device("cpu")
        self._on_cpu = self.device.type == "cpu"  # tensors made here need no copy
        self.kv = (KVCache(model.config, blocks.num_blocks * blocks.block_size, self.device, dtype=model.dtype)
                   if model is not None else None)
        self.pad_slot = blocks.num_blocks * blocks.block_size  # KVCache's zero slot, here and in every stage
        self.sampler = Sampler()

    def _slots(self, entry: BatchEntry, start: int, end: int) -> torch.Tensor:
        bs = self.blocks.block_size
        table = torch.tensor(self.blocks.block_table(entry.request), dtype=torch.long)
        pos = torch.arange(start, end)
        return table[pos // bs] * bs + pos % bs

    def _contiguous_start(self, entry: BatchEntry, end: int) -> int | None:
        """First slot of positions [0, end) when they are one run of consecutive slots, else None."""
        starts = run_starts([self.blocks.block_table(entry.request)], [end], self.blocks.block_size)
        return None if starts is None else starts[0]

    @staticmethod
    def _wants_prompt_logprobs(entry: BatchEntry) -> bool:
        r = entry.request
        # prompt_logprobs[i] is for prompt position i; skip entries whose positions were all
        # reported already (a recompute after preemption).
        return (
            entry.is_prefill and r.params.prompt_logprobs is not None
            and len(r.prompt_logprobs) < min(entry.end + 1, r.num_prompt_tokens)
        )

    def prepare(self, batch: Batch) -> tuple[ForwardInput, list[BatchEntry], list[list[int]]]:
        """Lay the batch out flat (prefills first, then decodes) and say which logits rows each entry needs.

        Positions and slots are built in numpy, a tensor each at the end: at a decode step every op's
        cost is its call overhead, and numpy's is a fraction of torch's.
        """
        prefill_entries, decodes = batch.prefills, batch.decodes  # each a new list, so taken once
        if not prefill_entries and all(e.samples for e in decodes):
            inp = self._decode_input(decodes, [e.request.token_id_at(e.start) for e in decodes])
            return inp, decodes, [[row] for row in range(len(decodes))]
        token_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        prefills = []
        flat_rows: list[int] = []  # batch rows whose logits are computed
        rows_per_entry: list[list[int]] = []  # for each entry, its rows of the logits tensor
        offset = 0
        for entry in prefill_entries:
            r, start, end = entry.request, entry.start, entry.end
            token_ids += r.token_slice(start, end)
            positions.append(np.arange(start, end))
            context = self._slots(entry, 0, end)
            slots.append(context[start:].numpy())
            mask = None
            if start > 0:
                mask = causal_mask(start, end)
            prefills.append(PrefillSpan(offset, entry.num_tokens, start, context if start > 0 else None, mask,
                                        self._contiguous_start(entry, end) if start > 0 else None))
            if self._wants_prompt_logprobs(entry):
                rows = range(offset, offset + entry.num_tokens)
            else:
                rows = [offset + entry.num_tokens - 1] if entry.samples else []
            rows_per_entry.append(list(range(len(flat_rows), len(flat_rows) + len(rows))))
            flat_rows.extend(rows)
            offset += entry.num_tokens
        decode_slots = lens = decode_runs = None
        if decodes:
            token_ids += [e.request.token_id_at(e.start) for e in decodes]
            context, ends, decode_runs, last_slots = self._decode_contexts(decodes)
            positions.append(ends - 1)  # a decode runs one token, its context's last
            slots.append(last_slots)
            decode_slots, lens = torch.from_numpy(context), torch.from_numpy(ends)
            for entry in decodes:
                rows_per_entry.append([len(flat_rows)] if entry.samples else [])
                if entry.samples:
                    flat_rows.append(offset)
                offset += 1
        dev = self._to_device
        inp = ForwardInput(
            token_ids=dev(torch.from_numpy(np.array(token_ids, dtype=np.int64))),
            positions=dev(torch.from_numpy(positions[0] if len(positions) == 1 else np.concatenate(positions))),
            slot_mapping=dev(torch.from_numpy(slots[0] if len(slots) == 1 else np.concatenate(slots))),
            prefills=[self._span_to_device(p) for p in prefills] if prefills else prefills,
            num_decodes=len(decodes),
            decode_slots=None if decode_slots is None else dev(decode_slots),
            logits_rows=dev(torch.from_numpy(np.array(flat_rows, dtype=np.int64))),
            decode_runs=decode_runs,
            decode_lengths=lens,
        )
        return inp, prefill_entries + decodes, rows_per_entry

    def _decode_input(self, decodes: list[BatchEntry], token_ids: list[int]) -> ForwardInput:
        """A decode-only batch's input (each entry samples): `token_ids`, one per entry, at the entries' positions."""
        context, ends, runs, last_slots = self._decode_contexts(decodes)
        dev = self._to_device
        return ForwardInput(
            token_ids=dev(torch.from_numpy(np.array(token_ids, dtype=np.int64))),
            positions=dev(torch.from_numpy(ends - 1)),  # a decode runs one token, its context's last
            slot_mapping=dev(torch.from_numpy(last_slots)), prefills=[], num_decodes=len(decodes),
            decode_slots=dev(torch.from_numpy(context)),
            logits_rows=dev(torch.from_numpy(np.arange(len(decodes), dtype=np.int64))),
            decode_runs=runs, decode_lengths=torch.from_numpy(ends),
        )

    def _decode_contexts(self, decodes: list[BatchEntry]):
        """Every decode's context slots at once: [D, longest context] padded with the zero slot, the
        context lengths [D] and the slots of the decoded tokens [D] (int64 arrays), and each context's
        (first slot, length) when all are contiguous runs.

        One set of array ops for the whole batch (per-request ones cost more than the model's attention at
        small batches), and as few as the case needs: at a decode step each costs microseconds with the caches
        cold. Whether each context is one run is checked per request in Python (run_starts).
        """
        bs = self.blocks.block_size
        tables = [self.blocks.block_table(e.request) for e in decodes]
        end_list = [e.end for e in decodes]
        ends = np.array(end_list, dtype=np.int64)
        starts = run_starts(tables, end_list, bs)  # one scattered context: the batched gather serves them all
        if starts is not None and len(decodes) == 1:  # one run, as wide as the batch: no padding
            context = np.arange(starts[0], starts[0] + end_list[0], dtype=np.int64)[None, :]
            return context, ends, [(starts[0], end_list[0])], ends + (starts[0] - 1)
        pos = np.arange(max(end_list))
        if starts is None:
            widest = max(len(t) for t in tables)
            table = np.array([t + [t[-1]] * (widest - len(t)) for t in tables], dtype=np.int64)
            context = np.ascontiguousarray(table[:, pos // bs] * bs + pos % bs)  # fancy indexing: other strides
            last_slots = context[np.arange(len(ends)), ends - 1]
        else:  # every context one run of slots
            first = np.array(starts, dtype=np.int64)
            context, last_slots = first[:, None] + pos, first + ends - 1
        context[pos[None, :] >= ends[:, None]] = self.pad_slot
        runs = None if starts is None else list(zip(starts, end_list))
        return context, ends, runs, last_slots

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if self._on_cpu else t.to(self.device)

    def _span_to_device(self, span: PrefillSpan) -> PrefillSpan:
        if span.context_slots is None or self._on_cpu:
            return span
        return PrefillSpan(span.offset, span.num_tokens, span.start_pos, span.context_slots.to(self.device),
                           span.mask.to(self.device), span.context_start)

    def execute(self, batch: Batch, hooks=None) -> BatchResult:
        inp, order, rows_per_entry = self.prepare(batch)
        logits = self.model.forward(inp, self.kv, hooks).float()  # sampling and logprobs in fp32 whatever the dtype
        return self.process(order, rows_per_entry, logits)

    def execute_steps(self, batch: Batch, hooks=None) -> list[tuple[BatchResult, float, float]]:
        """A decode-only plan's `num_steps` steps in one loop (fewer where a request samples a stop token), each
        step's tokens the next one's input (the scheduler took every step's KV slots). Every step's input is
        built before the loop, and the tokens become Python ints after it (inside it only for the stop-token
        check): with a step's weights streamed through the caches, each Python op between two forward passes
        costs microseconds. The requests are not updated here: the engine replays each step's result in order.
        Returns each step's result with its start and end (time.monotonic())."""
        decodes = batch.entries
        ids = [e.request.request_id for e in decodes]
        params = [e.request.params for e in decodes]
        first = [e.request.token_id_at(e.start) for e in decodes]
        inputs = [self._decode_input([e._replace(start=e.start + k) for e in decodes] if k else decodes, first)
                  for k in range(batch.num_steps)]
        greedy_only = all(p.greedy for p in params)
        # a stop token ends the plan after its step, so no step runs a request that has stopped (a stop string
        # is found only by the replay: that request runs to the plan's end, its later tokens dropped)
        stops = [set() if p.ignore_eos else {e.request.eos_token_id, *p.stop_token_ids}
                 for e, p in zip(decodes, params)]
        tokens, steps, times = inputs[0].token_ids, [], [time.monotonic()]
        for inp in inputs:
            inp.token_ids = tokens
            logits = self.model.forward(inp, self.kv, hooks).float()
            tokens = (greedy(logits) if greedy_only
                      else self._to_device(torch.tensor(self.sampler.sample(logits, ids, params))))
            steps.append(tokens)
            times.append(time.monotonic())
            if any(stops) and any(t in stop for t, stop in zip(tokens.tolist(), stops)):
                break
        return [(BatchResult(tokens=dict(zip(ids, t.tolist()))), times[k], times[k + 1]) for k, t in enumerate(steps)]

    def process(self, order: list[BatchEntry], rows_per_entry: list[list[int]], logits: torch.Tensor) -> BatchResult:
        """Sample tokens and gather logprobs from the logits of `prepare`'s rows.

        Entries of requests that finished meanwhile (aborted while their micro-batch was in the
        pipeline) are skipped.
        """
        result = BatchResult()
        sample_rows, sample_ids, sample_params, grammars = [], [], [], []
        for entry, rows in zip(order, rows_per_entry):
            if entry.samples and not entry.request.is_finished:
                sample_rows.append(rows[-1])
                sample_ids.append(entry.request.request_id)
                sample_params.append(entry.request.params)
                grammars.append(entry.request.grammar)
        if sample_rows == list(range(logits.shape[0])):
            sampled = logits  # every row, in order: no 3 MB copy of 16 rows of a 49k vocabulary
        else:
            sampled = logits[sample_rows]
        tokens = self.sampler.sample(sampled, sample_ids, sample_params, grammars) if sample_rows else []
        if sampled is not logits and any(g is not None for g in grammars):
            with torch.inference_mode():  # the model's logits are an inference tensor
                logits[sample_rows] = sampled  # the grammar masks, for the logprobs below
        result.tokens = dict(zip(sample_ids, tokens))
        for entry, rows in zip(order, rows_per_entry):
            r = entry.request
            if r.is_finished:
                continue
            want_prompt = self._wants_prompt_logprobs(entry)
            want_output = entry.samples and r.params.logprobs is not None
            if not (want_prompt or want_output):
                continue
            logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
            if want_prompt:
                k = r.params.prompt_logprobs
                # Row i predicts the token at position start + i + 1.
                result.prompt_logprobs[r.request_id] = (entry.start + 1, [
                    top_logprobs(logprobs[i], k, r.prompt_token_ids[pos + 1])
                    for i, pos in enumerate(range(entry.start, entry.end))
                    if pos + 1 < r.num_prompt_tokens
                ])
            if want_output:
                token = result.tokens[r.request_id]
                result.logprobs[r.request_id] = top_logprobs(logprobs[-1], r.params.logprobs, token)
        return result
