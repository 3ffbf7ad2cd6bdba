"""The step loop: schedule -> execute -> sample -> update."""
from __future__ import annotations

import dataclasses
import itertools
import time
import weakref
from collections.abc import Callable

import torch

from charioteer.config import EngineArgs
from charioteer.engine.budget_controller import TokenBudgetController
from charioteer.engine.model_runner import ModelRunner
from charioteer.engine.step_record import PipelineTiming, StageTiming, StepObserver, StepRecord, entry_records
from charioteer.engine.structured_output import StructuredOutputCompiler
from charioteer.memory.block_manager import BlockManager, batch_capacity, kv_bytes_per_token
from charioteer.model.llama import LlamaModel
from charioteer.model.loader import LoadedModel, load_model
from charioteer.model.precision import dtype_name, resolve_dtype
from charioteer.request import CompletionOutput, Request, RequestMetrics, RequestOutput, SamplingParams
from charioteer.runtime import available_memory_bytes
from charioteer.scheduling import make_scheduler
from charioteer.scheduling.base import Batch

BUDGET_ALIGN = 16  # the steered budget's step without a --tile-size (the KV block and kernel granularity)


def check_kv_cache_fits(num_blocks: int, block_size: int, kv_token_bytes: int) -> None:
    """Refuse a KV cache larger than the memory the machine has free. Its pages are committed only as they are
    written, so one too large would otherwise start and be killed for memory mid-serving, losing every request."""
    need, free = num_blocks * block_size * kv_token_bytes, available_memory_bytes()
    if free is not None and need > free:
        raise ValueError(f"the KV cache would take {need / (1 << 30):.1f} GiB ({num_blocks} blocks of {block_size} "
                         f"tokens) but only {free / (1 << 30):.1f} GiB of memory is available: lower "
                         f"--kv-cache-memory-gb or --num-kv-blocks")


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, loaded: LoadedModel | None = None, op_hooks=None,
                 **kwargs) -> None:
        """`op_hooks`: a per-operation timer passed to every forward pass (charioteer.bench.batch_timer)."""
        self.args = args = args or EngineArgs(**kwargs)
        loaded = loaded or load_model(args.model, num_layers=args.num_layers, seed=args.seed)
        self.model_config = config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(args.max_model_len or config.max_position, config.max_position)

        self.dtype = resolve_dtype(args.dtype, torch.device(args.device))
        cache = args.cache_config
        self.kv_token_bytes = kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim,
                                                 self.dtype.itemsize)
        num_blocks = cache.num_blocks or cache.memory_bytes // (cache.block_size * self.kv_token_bytes)
        if torch.device(args.device).type == "cpu":
            check_kv_cache_fits(num_blocks, cache.block_size, self.kv_token_bytes)
        self.blocks = BlockManager(num_blocks, cache.block_size, cache.kv_policy, prefer_contiguous=True,
                                   enable_prefix_caching=cache.prefix_caching)
        # Through a weak reference: the scheduler must not keep the engine (its weights, its KV cache)
        # alive in a cycle that only the garbage collector's rare full pass would free.
        holds_stop_string = weakref.WeakMethod(self._holds_stop_string)
        self.scheduler = make_scheduler(args.scheduler_config.for_context(self.max_model_len), self.blocks,
                                        lambda request: holds_stop_string()(request))
        # Pipeline parallelism: stage processes hold the weights and KV caches (each its layers'
        # share of the same number of KV blocks); this process keeps scheduling and sampling.
        self.executor = None
        if args.pipeline_parallel_size > 1:
            from charioteer.pipeline.executor import PipelineExecutor

            self.model = None
            self.weight_bytes = sum(t.numel() * self.dtype.itemsize for t in loaded.state_dict.values())
            self.executor = PipelineExecutor(
                loaded, args.pipeline_parallel_size, num_blocks * cache.block_size, args.device,
                model_spec=(args.model or loaded.source, args.num_layers, args.seed), dtype=self.dtype,
                quantization=args.quantization, batch_invariant=args.batch_invariant,
                full_last_layer=args.full_last_layer)
        else:
            self.model = LlamaModel(config, loaded.state_dict, args.device, dtype=self.dtype,
                                    quantization=args.quantization, batch_invariant=args.batch_invariant,
                                    gguf_blocks=loaded.gguf_blocks, full_last_layer=args.full_last_layer)
            self.weight_bytes = self.model.weight_bytes
        self.runner = ModelRunner(self.model, self.blocks)
        # Grammars for structured outputs, compiled once per distinct constraint (xgrammar).
        self.structured_outputs = StructuredOutputCompiler(self.tokenizer, config.vocab_size, [config.eos_token_id])
        self.op_hooks = op_hooks
        self._observers: list[StepObserver] = []
        self.pipeline_metrics = None  # per-stage busy/idle and per-request bubbles (charioteer.pipeline.metrics)
        if self.executor is not None:
            from charioteer.pipeline.metrics import PipelineMetrics

            self.pipeline_metrics = PipelineMetrics(args.pipeline_parallel_size)
            self.subscribe(self.pipeline_metrics.observe)
        self.budget_controller = self._budget_controller()
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self._streaming: dict[str, int] = {}  # request_id -> length of text already returned
        self._decoded: dict[str, tuple[int, str]] = {}  # request_id -> (output tokens, their text)
        self.num_steps = 0
        self._prefix_cache_seen = (0, 0)  # prefix-cache (queries, hits) at the last step record

    def _budget_controller(self) -> TokenBudgetController | None:
        """With tbt_slo_ms: a controller that reads every step record and steers the scheduler's budget."""
        config = self.scheduler.config
        if config.tbt_slo_ms is None:
            return None
        # Token-budget mode counts decodes in the budget: never fewer than every running decode.
        low = max(config.min_chunk_size, config.max_num_seqs) if config.token_budget_mode else config.min_chunk_size
        controller = TokenBudgetController(config.tbt_slo_ms / 1e3, min(low, config.max_chunk_size),
                                           config.max_chunk_size, includes_decodes=config.token_budget_mode,
                                           # a chunk rides with up to B - 1 decodes (token-budget mode: inside it)
                                           max_decodes=None if config.token_budget_mode else config.max_num_seqs - 1,
                                           align=config.tile_size or BUDGET_ALIGN)
        scheduler = self.scheduler  # not self: the engine's observers must not hold the engine in a cycle
        scheduler.set_token_budget(controller.budget)
        self.subscribe(lambda record: scheduler.set_token_budget(controller.observe(record)))
        return controller

    # ---- reporting ----------------------------------------------------------------------

    def capacity(self) -> dict:
        """KV capacity and the paper's batch capacity B = floor((M_G - M_S) / (L * m_kv))."""
        kv_bytes = self.blocks.capacity_tokens * self.kv_token_bytes
        weights = self.weight_bytes
        return {
            "kv_policy": self.blocks.policy,
            "block_size": self.blocks.block_size,
            "num_blocks": self.blocks.num_blocks,
            "kv_capacity_tokens": self.blocks.capacity_tokens,
            "dtype": dtype_name(self.dtype),
            # fp32 where bf16 runs widened (charioteer.model.precision); the stages' own with a pipeline
            "activation_dtype": dtype_name(self.model.activation_dtype) if self.model is not None else None,
            "quantization": self.args.quantization,
            # which GEMM, attention and row-op paths this CPU runs (llama.Kernels); None with a pipeline
            "kernels": dataclasses.asdict(self.model.kernels) if self.model is not None else None,
            "kv_bytes_per_token": self.kv_token_bytes,
            "weight_bytes": weights,
            "max_model_len": self.max_model_len,
            "batch_capacity": batch_capacity(kv_bytes + weights, weights, self.max_model_len, self.kv_token_bytes),
            "max_num_seqs": self.args.max_num_seqs,
            "pipeline_parallel_size": self.args.pipeline_parallel_size,
        }

    def shutdown(self) -> None:
        """Stop the pipeline stage processes (no-op without a pipeline). The engine cannot step afterwards."""
        if self.executor is not None:
            self.executor.shutdown()

    # ---- requests -----------------------------------------------------------------------

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give a non-empty string or a list of token ids")
            if self.tokenizer is None:
                raise ValueError(f"model {self.model_config.name} has no tokenizer: give prompts as lists of token ids")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty: give a non-empty string or a list of token ids")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        return ids

    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                     request_id: str | None = None, *, prompt_text: str | None = None,
                     arrival_time: float | None = None, priority: int | None = None) -> Request:
        """Validate a prompt and its parameters and build the Request, without queueing it.

        `prompt_text`: the text behind token-id prompts (a chat template's output), for outputs.
        `arrival_time`: when the request reached the server (time.monotonic()), if before now.
        `priority`: replaces params.priority (lower first, under scheduling_policy="priority").
        """
        params = params or SamplingParams()
        if priority is not None:
            params = dataclasses.replace(params, priority=priority)
        params.validate()
        token_ids = self.encode(prompt)
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens and max_tokens is {params.max_tokens}: together {total}, "
                f"over the model's context of {self.max_model_len} tokens; shorten the prompt or lower max_tokens"
            )
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.structured_outputs.matcher(params.structured_outputs)
        eos = self.model_config.eos_token_id
        request = Request(request_id, token_ids, params, eos_token_id=eos,
                          prompt=prompt if isinstance(prompt, str) else prompt_text, grammar=grammar)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self.scheduler.check_request(request)
        return request

    def make_samples(self, request: Request) -> list[Request]:
        """The samples of a request built by make_request: itself (sample 0, which prefills the
        prompt) and, for n or best_of > 1, one request per further sample, `{i}_{request_id}`, that
        starts on sample 0's prompt KV. Add them all; `merge_samples` joins their outputs."""
        params = request.params
        if params.num_samples == 1:
            return [request]
        request.params = params.for_sample(0)
        samples = [request]
        for i in range(1, params.num_samples):
            sample = self.make_request(request.prompt_token_ids, params.for_sample(i), f"{i}_{request.request_id}",
                                       prompt_text=request.prompt, arrival_time=request.arrival_time)
            sample.fork_of = request
            samples.append(sample)
        return samples

    def add(self, request: Request, stream: bool = False) -> None:
        self.scheduler.add_request(request)
        self._requests[request.request_id] = request
        if stream:
            self._streaming[request.request_id] = 0

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, stream: bool = False, priority: int | None = None) -> str:
        request = self.make_request(prompt, params, request_id, priority=priority)
        self.add(request, stream)
        return request.request_id

    def abort(self, request_id: str) -> None:
        request = self.scheduler.abort(request_id)
        if request is not None:
            self._forget(request)

    def has_unfinished_requests(self) -> bool:
        # Micro-batches still in the pipeline count: they must return to free their KV blocks.
        return self.scheduler.has_unfinished() or bool(self.executor and self.executor.num_in_flight)

    def _forget(self, request: Request) -> None:
        self._requests.pop(request.request_id, None)
        self._streaming.pop(request.request_id, None)
        self._decoded.pop(request.request_id, None)
        self.runner.sampler.forget(request.request_id)

    # ---- observers ----------------------------------------------------------------------

    def subscribe(self, observer: StepObserver) -> Callable[[], None]:
        """Call `observer(record)` after every step; returns a function that unsubscribes it."""
        self._observers.append(observer)
        return lambda: self._observers.remove(observer) if observer in self._observers else None

    # ---- the loop -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch. Returns outputs of finished requests, and of streaming ones that advanced.

        With a pipeline: plan micro-batches until N are in flight, then wait for the oldest and
        return the outputs of its requests. Either way, observers get one StepRecord. A decode-only
        plan of several steps (num_scheduler_steps) runs them all, with one StepRecord for each.
        """
        t0, cpu0 = time.monotonic(), time.thread_time()
        if self.executor is not None:
            ran = self._run_pipeline()
        else:
            ran = self._run_local()
        if ran is None:
            return []
        batch, result, schedule_s, timing = ran
        if batch.num_steps > 1:
            return self._finish_steps(batch, result, t0, cpu0, schedule_s)
        execute_s = time.monotonic() - t0 - schedule_s
        outputs, finished = self._finish_batch(batch, result)
        self._publish(batch, finished, t0, cpu0, schedule_s, execute_s, timing)
        return outputs

    def _run_local(self):
        t0 = time.monotonic()
        batch = self.scheduler.schedule()
        if not batch:
            self._check_progress()
            return None
        schedule_s = time.monotonic() - t0
        if batch.num_steps > 1:
            return batch, self.runner.execute_steps(batch, self.op_hooks), schedule_s, None
        return batch, self.runner.execute(batch, self.op_hooks), schedule_s, None

    def _run_pipeline(self):
        from charioteer.pipeline.executor import PipelineError

        executor = self.executor
        t0 = time.monotonic()
        try:
            executor.check()
            while executor.num_in_flight < executor.num_stages:
                batch = self.scheduler.schedule(self.args.micro_batch_cap)
                if not batch:
                    break
                executor.submit(batch, *self.runner.prepare(batch))
            if not executor.num_in_flight:
                self._check_progress()
                return None
            schedule_s = time.monotonic() - t0
            done = executor.wait_next()
        except PipelineError as exc:
            self._fail_all(str(exc))
            raise
        timing = PipelineTiming(done.dispatch, done.returned, tuple(StageTiming(*t) for t in done.stage_times))
        return done.batch, self.runner.process(done.order, done.rows_per_entry, done.logits), schedule_s, timing

    def _check_progress(self) -> None:
        if self.scheduler.has_unfinished():
            raise RuntimeError(
                f"scheduler {self.scheduler.name} planned an empty batch with "
                f"{self.scheduler.num_requests} requests pending; the KV cache is too small for them"
            )

    def _fail_all(self, reason: str) -> None:
        """The pipeline is gone: end every request (in flight or waiting) as aborted."""
        self.scheduler.release(self.executor.abandon())
        for request in list(self._requests.values()):
            self.scheduler.finish(request, "abort")
            self._forget(request)

    def _finish_batch(self, batch: Batch, result) -> tuple[list[RequestOutput], list[str]]:
        self.num_steps += 1
        for request_id, (first, logprobs) in result.prompt_logprobs.items():
            known = self._requests[request_id].prompt_logprobs
            if not known:
                known.append(None)  # nothing predicts the first prompt token
            known.extend(logprobs[len(known) - first:])
        for request_id, logprobs in result.logprobs.items():
            self._requests[request_id].output_logprobs.append(logprobs)
        finished = [r.request_id for r in self.scheduler.on_batch_done(batch, result.tokens)]
        return self._collect(batch), finished

    def _finish_steps(self, batch: Batch, steps, t0: float, cpu0: float, schedule_s: float) -> list[RequestOutput]:
        """A multi-step plan's steps replayed in order: each updates the requests (on_batch_done) and gets its
        own record. The records tile the call's time: each holds its step's loop time and an equal share of
        the planning and of this replay (and of the call's CPU time), so that a record's duration is what its
        token cost."""
        records, step_batch = [], batch
        for k, (result, start, end) in enumerate(steps):
            step_batch = self.scheduler.next_step(step_batch) if k else batch
            self.num_steps += 1
            finished = [r.request_id for r in self.scheduler.on_batch_done(step_batch, result.tokens)]
            if self._observers:
                records.append(self._record(step_batch, finished, start, schedule_s / len(steps), 0.0, 0.0,
                                            end - start, None))
        outputs = self._collect(batch)
        if records:
            share = (time.monotonic() - t0 - sum(r.execute_s for r in records)) / len(records)
            cpu_s = (time.thread_time() - cpu0) / len(records)
            begin = t0
            for k, record in enumerate(records):
                duration = record.execute_s + share
                self._notify(dataclasses.replace(record, start_time=begin, duration_s=duration, cpu_s=cpu_s,
                                                 plan_steps=len(steps), plan_step=k))
                begin += duration
        return outputs

    def _publish(self, batch: Batch, finished: list[str], t0: float, cpu0: float, schedule_s: float,
                 execute_s: float, timing: PipelineTiming | None) -> None:
        if self._observers:
            self._notify(self._record(batch, finished, t0, schedule_s, time.monotonic() - t0,
                                      time.thread_time() - cpu0, execute_s, timing))

    def _record(self, batch: Batch, finished: list[str], t0: float, schedule_s: float, duration_s: float,
                cpu_s: float, execute_s: float, timing: PipelineTiming | None) -> StepRecord:
        blocks, sched = self.blocks, self.scheduler
        return StepRecord(
            index=self.num_steps - 1, entries=entry_records(batch),
            preempted=tuple(r.request_id for r in batch.preempted), finished=tuple(finished),
            start_time=t0, schedule_s=schedule_s, execute_s=execute_s, duration_s=duration_s,
            cpu_s=cpu_s, kv_blocks_used=blocks.num_blocks - blocks.num_free_blocks,
            kv_blocks_total=blocks.num_blocks, num_running=len(sched.running), num_waiting=len(sched.waiting),
            token_budget=sched.token_budget, pipeline=timing, **self._prefix_cache_counts(),
        )

    def _notify(self, record: StepRecord) -> None:
        for observer in list(self._observers):
            observer(record)

    def _prefix_cache_counts(self) -> dict[str, int]:
        """Prefix-cache queries and hits (tokens) since the previous step record."""
        cache = self.blocks.prefix_cache
        if cache is None:
            return {}
        last_queries, last_hits = self._prefix_cache_seen
        self._prefix_cache_seen = cache.queries, cache.hits
        return {"prefix_cache_queries": cache.queries - last_queries, "prefix_cache_hits": cache.hits - last_hits}

    def _text(self, request: Request) -> str:
        """The output decoded once per new token (the stop-string check and _collect share it)."""
        if self.tokenizer is None:
            return ""
        n = request.num_output_tokens
        cached = self._decoded.get(request.request_id)
        if cached is None or cached[0] != n:
            cached = self._decoded[request.request_id] = (n, self.tokenizer.decode(request.output_token_ids))
        return cached[1]

    def _holds_stop_string(self, request: Request) -> bool:
        text = self._text(request)
        return any(stop in text for stop in request.params.stop)

    def _collect(self, batch: Batch) -> list[RequestOutput]:
        """Outputs for the requests of `batch` that finished or stream."""
        outputs = []
        for entry in batch.entries:
            request = entry.request
            streaming = request.request_id in self._streaming
            if not entry.samples or request.request_id not in self._requests:
                continue
            if not (request.is_finished or streaming):
                continue
            text = self._text(request)
            if request.params.stop and request.finish_reason == "stop":
                hits = [i for i in (text.find(s) for s in request.params.stop) if i >= 0]
                text = text[: min(hits)] if hits else text
            outputs.append(self._output(request, text))
            if request.is_finished:
                self._forget(request)
        return outputs

    def _output(self, request: Request, text: str) -> RequestOutput:
        """`text` is the output decoded once by _collect, already cut at a stop string."""
        new_text = ""
        if request.request_id in self._streaming:
            shown = self._streaming[request.request_id]
            # Hold back an incomplete UTF-8 sequence until its last byte arrives.
            visible = text
            if not request.is_finished:
                visible = text.rstrip("\ufffd")
                if request.params.stop:  # hold back what may be the start of a stop string
                    visible = visible[: max(0, len(visible) - max(map(len, request.params.stop)) + 1)]
            new_text = visible[shown:]
            self._streaming[request.request_id] = max(shown, len(visible))
        params = request.params
        prompt_owner = request.fork_of or request  # sample 0 computed the prompt's logprobs for every sample
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[CompletionOutput(
                index=0, text=text, token_ids=list(request.output_token_ids),
                finish_reason=request.finish_reason if request.is_finished else None,
                logprobs=list(request.output_logprobs) if params.logprobs is not None else None,
                cumulative_logprob=sum(lp[t] for lp, t in zip(request.output_logprobs, request.output_token_ids))
                if params.logprobs is not None else None,
            )],
            finished=request.is_finished,
            prompt_logprobs=list(prompt_owner.prompt_logprobs) if prompt_owner.params.prompt_logprobs is not None
            else None,
            metrics=RequestMetrics(request.arrival_time, request.scheduled_time, request.first_token_time,
                                   request.finish_time, request.num_preemptions),
            new_text=new_text,
        )
