"""The step loop: schedule -> execute -> sample -> update."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from charioteer.config import CacheConfig, SchedulerConfig
from charioteer.engine.model_runner import ModelRunner
from charioteer.memory.block_manager import BlockManager, batch_capacity, kv_bytes_per_token
from charioteer.model.llama import LlamaModel
from charioteer.model.loader import LoadedModel, load_model
from charioteer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from charioteer.request import Request, RequestStatus
from charioteer.sampling_params import SamplingParams
from charioteer.scheduling import make_scheduler
from charioteer.scheduling.batch import Batch


@dataclass
class EngineArgs:
    model: str | None = None  # see charioteer.model.loader.load_model
    scheduler: str = "sarathi"
    chunk_size: int | str = 256  # or "auto": follow recent requests' P:D (charioteer.tune.adaptive)
    min_chunk_size: int = 16
    max_chunk_size: int = 512
    tune_table: str | None = None  # chunk_size="auto": table saved by `charioteer tune --save-table`
    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None
    tile_size: int | None = None
    token_budget_mode: bool = False
    kv_policy: str = "paged"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 2.0
    max_model_len: int | None = None
    num_layers: int | None = None  # keep only the first N layers (synthetic or real)
    device: str = "cpu"
    seed: int = 0  # synthetic weights
    pipeline_parallel_size: int = 1  # N > 1: layers split into N stage processes (charioteer.pipeline)
    # Pipeline: at most this many requests per micro-batch (the paper's per-micro-batch batch size;
    # max_num_seqs still caps all running requests). None: a micro-batch takes every ready request,
    # so e.g. Orca's first micro-batch may take all of them and leave the next ones empty.
    micro_batch_cap: int | None = None

    def __post_init__(self) -> None:
        # Build the sub-configs now so bad values fail before any model is loaded.
        self.scheduler_config = SchedulerConfig(
            policy=self.scheduler, max_num_seqs=self.max_num_seqs, chunk_size=self.chunk_size,
            min_chunk_size=self.min_chunk_size, max_chunk_size=self.max_chunk_size, tune_table=self.tune_table,
            max_num_batched_tokens=self.max_num_batched_tokens, tile_size=self.tile_size,
            token_budget_mode=self.token_budget_mode,
        )
        self.cache_config = CacheConfig(
            block_size=self.block_size, kv_policy=self.kv_policy, num_blocks=self.num_kv_blocks,
            memory_bytes=int(self.kv_cache_memory_gb * (1 << 30)),
        )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not isinstance(self.pipeline_parallel_size, int) or self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be an integer >= 1, got {self.pipeline_parallel_size!r}")
        if self.micro_batch_cap is not None and self.micro_batch_cap < 1:
            raise ValueError(f"micro_batch_cap must be >= 1, got {self.micro_batch_cap}")


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, loaded: LoadedModel | None = None, **kwargs) -> None:
        self.args = args = args or EngineArgs(**kwargs)
        loaded = loaded or load_model(args.model, num_layers=args.num_layers, seed=args.seed)
        self.model_config = config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(args.max_model_len or config.max_position, config.max_position)

        cache = args.cache_config
        self.kv_token_bytes = kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, 4)
        num_blocks = cache.num_blocks or cache.memory_bytes // (cache.block_size * self.kv_token_bytes)
        self.blocks = BlockManager(num_blocks, cache.block_size, cache.kv_policy, prefer_contiguous=True)
        self.scheduler = make_scheduler(args.scheduler_config, self.blocks)
        # Pipeline parallelism: stage processes hold the weights and KV caches (each its layers'
        # share of the same number of KV blocks); this process keeps scheduling and sampling.
        self.executor = None
        if args.pipeline_parallel_size > 1:
            from charioteer.pipeline.executor import PipelineExecutor

            self.model = None
            self.weight_bytes = sum(t.numel() * 4 for t in loaded.state_dict.values())
            self.executor = PipelineExecutor(
                loaded, args.pipeline_parallel_size, num_blocks * cache.block_size, args.device,
                model_spec=(args.model or loaded.source, args.num_layers, args.seed))
        else:
            self.model = LlamaModel(config, loaded.state_dict, args.device)
            self.weight_bytes = self.model.weight_bytes
        self.runner = ModelRunner(self.model, self.blocks)
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self._streaming: dict[str, int] = {}  # request_id -> length of text already returned
        self.num_steps = 0

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
            "kv_bytes_per_token": self.kv_token_bytes,
            "weight_bytes": weights,
            "max_model_len": self.max_model_len,
            "batch_capacity": batch_capacity(kv_bytes + weights, weights, self.max_model_len, self.kv_token_bytes),
            "max_num_seqs": self.args.max_num_seqs,
            "pipeline_parallel_size": self.args.pipeline_parallel_size,
        }

    @property
    def pipeline_metrics(self):
        """Per-stage busy/idle and per-request bubble times (charioteer.pipeline.metrics); None without a pipeline."""
        return self.executor.metrics if self.executor is not None else None

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
                     request_id: str | None = None) -> Request:
        """Validate a prompt and its parameters and build the Request, without queueing it."""
        params = params or SamplingParams()
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
        eos = self.model_config.eos_token_id
        return Request(request_id, token_ids, params, eos_token_id=eos,
                       prompt=prompt if isinstance(prompt, str) else None)

    def add(self, request: Request, stream: bool = False) -> None:
        self.scheduler.add_request(request)
        self._requests[request.request_id] = request
        if stream:
            self._streaming[request.request_id] = 0

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, stream: bool = False) -> str:
        request = self.make_request(prompt, params, request_id)
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
        self.runner.sampler.forget(request.request_id)

    # ---- the loop -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch. Returns outputs of finished requests, and of streaming ones that advanced.

        With a pipeline: plan micro-batches until N are in flight, then wait for the oldest and
        return the outputs of its requests.
        """
        if self.executor is not None:
            return self._step_pipeline()
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.has_unfinished():
                raise RuntimeError(
                    f"scheduler {self.scheduler.name} planned an empty batch with "
                    f"{self.scheduler.num_requests} requests pending; the KV cache is too small for them"
                )
            return []
        result = self.runner.execute(batch)
        return self._finish_batch(batch, result)

    def _step_pipeline(self) -> list[RequestOutput]:
        from charioteer.pipeline.executor import PipelineError

        executor = self.executor
        try:
            executor.check()
            while executor.num_in_flight < executor.num_stages:
                batch = self._schedule_micro_batch()
                if not batch:
                    break
                executor.submit(batch, *self.runner.prepare(batch))
            if not executor.num_in_flight:
                if self.scheduler.has_unfinished():
                    raise RuntimeError(
                        f"scheduler {self.scheduler.name} planned an empty batch with "
                        f"{self.scheduler.num_requests} requests pending; the KV cache is too small for them"
                    )
                return []
            done = executor.wait_next()
        except PipelineError as exc:
            self._fail_all(str(exc))
            raise
        result = self.runner.process(done.order, done.rows_per_entry, done.logits)
        return self._finish_batch(done.batch, result)

    def _schedule_micro_batch(self) -> Batch:
        """Plan a micro-batch; with micro_batch_cap, show the scheduler at most that many requests
        (ready running ones first, then waiting ones), the rest held back as if in flight."""
        cap = self.args.micro_batch_cap
        sched = self.scheduler
        if cap is None:
            return sched.schedule()
        ready = [r for r in sched.running if not r.in_flight]
        hidden = ready[cap:]
        room = max(0, cap - len(ready))
        held = [sched.waiting.pop() for _ in range(max(0, len(sched.waiting) - room))][::-1]
        for r in hidden:
            r.in_flight = True
        try:
            return sched.schedule()
        finally:
            for r in hidden:
                r.in_flight = False
            sched.waiting.extend(held)

    def _fail_all(self, reason: str) -> None:
        """The pipeline is gone: end every request (in flight or waiting) as aborted."""
        for batch in self.executor.abandon():
            for entry in batch.entries:
                entry.request.in_flight = False
        for request in list(self._requests.values()):
            self.scheduler.finish(request, "abort")
            self._forget(request)

    def _finish_batch(self, batch: Batch, result) -> list[RequestOutput]:
        self.num_steps += 1
        for request_id, (first, logprobs) in result.prompt_logprobs.items():
            known = self._requests[request_id].prompt_logprobs
            if not known:
                known.append(None)  # nothing predicts the first prompt token
            known.extend(logprobs[len(known) - first:])
        for request_id, logprobs in result.logprobs.items():
            self._requests[request_id].output_logprobs.append(logprobs)
        self.scheduler.on_batch_done(batch, result.tokens)
        return self._collect(batch)

    def _collect(self, batch: Batch) -> list[RequestOutput]:
        outputs = []
        for entry in batch.entries:
            request = entry.request
            if not entry.samples or request.request_id not in self._requests:
                continue
            stops = request.params.stop
            # Stop strings need text; a request that just stopped on EOS may also hold one.
            check_stop = bool(stops) and (request.status is RequestStatus.RUNNING or request.finish_reason == "stop")
            if not (check_stop or request.is_finished or request.request_id in self._streaming):
                continue
            text = self.tokenizer.decode(request.output_token_ids) if self.tokenizer else ""
            hits = [i for i in (text.find(s) for s in stops) if i >= 0] if check_stop else []
            if hits:
                text = text[: min(hits)]
                self.scheduler.finish(request, "stop")  # no-op if it already finished
            if request.is_finished or request.request_id in self._streaming:
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
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[CompletionOutput(
                index=0, text=text, token_ids=list(request.output_token_ids),
                finish_reason=request.finish_reason if request.is_finished else None,
                logprobs=list(request.output_logprobs) if params.logprobs is not None else None,
            )],
            finished=request.is_finished,
            prompt_logprobs=list(request.prompt_logprobs) if params.prompt_logprobs is not None else None,
            metrics=RequestMetrics(request.arrival_time, request.scheduled_time, request.first_token_time,
                                   request.finish_time, request.num_preemptions),
            new_text=new_text,
        )
