"""Driver side of the pipeline: start or join the stages, send micro-batches, receive logits.

The driver (rank 0) owns the scheduler, the KV block tables and the sampler. For each
micro-batch it sends the plan (a pickled ForwardInput with token ids, positions and slot
mappings) to every stage; hidden states flow stage to stage; the last stage returns the logits
of the rows to sample, with every stage's timestamps (see metrics.py). Up to N micro-batches are
in flight; requests in one are skipped by later plans (the scheduler's in_flight rule).

Blocking receives run in one helper thread; the caller waits on it in short slices and checks in
between that every stage process is alive, so a dead stage is noticed within about a second,
never by a hang.
"""
from __future__ import annotations

import os
import signal
import sys
import time
import types
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from charioteer.parallel import split_layers
from charioteer.pipeline import transport as tp

POLL_S = 0.25


class PipelineError(RuntimeError):
    """A pipeline stage died or could not start; the pipeline is shut down."""


def use_env_rendezvous() -> bool:
    """True when launched by torchrun (or by hand) with RANK and WORLD_SIZE set: stages join, not spawned."""
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


@dataclass
class InFlight:
    index: int
    batch: object
    order: list
    rows_per_entry: list
    num_rows: int
    dispatch: float
    future: Future
    sends: list


@dataclass
class Done:
    batch: object
    order: list
    rows_per_entry: list
    logits: torch.Tensor
    dispatch: float  # time.time() when the plan was sent
    returned: float  # time.time() when the logits arrived
    stage_times: list[tuple[float, float, float]]  # (wait_begin, start, end) per stage


@contextmanager
def _without_main_module():
    """Spawned stages need nothing from the caller's __main__; hide it so a script without an
    `if __name__ == "__main__":` guard is not re-run (and does not re-spawn) in every stage."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _send_shutdown(pg, num_stages: int) -> None:
    header = torch.tensor([tp.KIND_SHUTDOWN, 0, -1], dtype=torch.int64)
    works = [pg.send([header], s + 1, tp.TAG_HEADER) for s in range(num_stages)]
    for w in works:
        w.wait()


def _cleanup(procs: list, pool: ThreadPoolExecutor, link: dict) -> None:
    """Stop the stages: a shutdown message while the pipeline is healthy (stages started by hand
    or torchrun exit cleanly), then terminate and reap what is still running."""
    if link.get("pg") is not None and link.get("healthy"):
        link["healthy"] = False
        try:
            _send_shutdown(link["pg"], link["num_stages"])
            for p in procs:
                p.join(5)
        except Exception:  # noqa: BLE001 - terminated below
            pass
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(2)
    pool.shutdown(wait=False, cancel_futures=True)


class PipelineExecutor:
    def __init__(self, loaded, num_stages: int, num_slots: int, device: str = "cpu",
                 model_spec: tuple[str | None, int | None, int] = (None, None, 0),
                 dtype: torch.dtype = torch.float32, quantization: str | None = None,
                 batch_invariant: bool = False, full_last_layer: bool = False) -> None:
        """`loaded`: the driver's LoadedModel (its weights are shared with spawned stages).
        `model_spec` = (model, num_layers, seed): what stages started by hand load themselves.
        `dtype`, `quantization`: every stage's number formats (charioteer.model.precision);
        `batch_invariant`: every stage runs the batch-invariant kernels (charioteer.model.invariant);
        `full_last_layer`: the last stage runs every row through its last layer (LlamaModel)."""
        config = loaded.config
        self.num_stages = num_stages
        self.layer_ranges = split_layers(config.num_layers, num_stages)
        self.vocab_size = config.vocab_size
        self.procs: list = []
        self.error: str | None = None
        self._in_flight: deque[InFlight] = deque()
        self._count = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="charioteer-pp-recv")
        self._link: dict = {"pg": None, "healthy": False, "num_stages": num_stages}
        self._finalizer = weakref.finalize(self, _cleanup, self.procs, self._pool, self._link)
        world_size = num_stages + 1
        cuda = torch.device(device).type == "cuda"
        base = dict(config=config, num_slots=num_slots, device=device, model=model_spec[0],
                    num_layers=model_spec[1], seed=model_spec[2], dtype=dtype, quantization=quantization,
                    batch_invariant=batch_invariant, full_last_layer=full_last_layer)
        self.env_mode = use_env_rendezvous()
        try:
            if self.env_mode:
                store, rank, world = tp.env_store()
                if rank != 0 or world != world_size:
                    raise ValueError(f"pipeline_parallel_size {num_stages} needs WORLD_SIZE {world_size} with the "
                                     f"engine as RANK 0; got RANK {rank}, WORLD_SIZE {world}")
                self.pg = self._wait(self._pool.submit(tp.gloo_group, store, 0, world_size), "connecting to the stages")
                nccl = cuda and torch.distributed.is_nccl_available()
                for s, layers in enumerate(self.layer_ranges):
                    tp.wait_all(tp.send_object(self.pg, dict(base, layer_range=layers, nccl=nccl), s + 1))
            else:
                import torch.multiprocessing as mp

                from charioteer.model.llama import stage_weight_names
                from charioteer.pipeline import stage

                # Port 0: the OS picks a free port; stages learn it as an argument.
                store = torch.distributed.TCPStore("127.0.0.1", 0, world_size, True, timeout=tp.CONNECT_TIMEOUT,
                                                   wait_for_workers=False)
                nccl = cuda and torch.distributed.is_nccl_available() and torch.cuda.device_count() >= num_stages
                ctx = mp.get_context("spawn")
                for s, layers in enumerate(self.layer_ranges):
                    names = stage_weight_names(config, layers)
                    weights = {k: loaded.state_dict[k] for k in names}
                    blocks = {k: loaded.gguf_blocks[k] for k in names  # the file's bytes, where they run
                              if k in loaded.gguf_blocks and quantization == "gguf"}
                    init = dict(base, layer_range=layers, nccl=nccl, state_dict=weights, gguf_blocks=blocks)
                    p = ctx.Process(target=stage.run, args=(s + 1, world_size, ("127.0.0.1", store.port), init, os.getpid()),
                                    name=f"charioteer-stage-{s}", daemon=True)
                    with _without_main_module():
                        p.start()
                    self.procs.append(p)
                self.pg = self._wait(self._pool.submit(tp.gloo_group, store, 0, world_size), "connecting to the stages")
            self.store = store
            for s in range(num_stages):
                ready = self._wait(self._pool.submit(tp.recv_object, self.pg, s + 1), f"starting stage {s}")
                if not ready.get("ok"):
                    raise PipelineError(f"pipeline stage {s} could not start: {ready.get('error')}")
            self._link.update(pg=self.pg, healthy=True)
        except BaseException:
            self._finalizer()
            raise

    # ---- liveness ---------------------------------------------------------------------------

    def _dead(self) -> list[tuple[int, object]]:
        """The dead stages, the likely cause first: stages that only lost a peer come last."""
        dead = [(s, p) for s, p in enumerate(self.procs) if not p.is_alive()]
        return sorted(dead, key=lambda sp: sp[1].exitcode == tp.EXIT_PEER_LOST)

    @staticmethod
    def _describe(dead) -> str | None:
        if not dead:
            return None
        s, p = dead[0]
        reason = f"pipeline stage {s} (pid {p.pid}) died with exit code {p.exitcode}"
        if p.exitcode is not None and -p.exitcode in signal.valid_signals():
            reason += f" ({signal.Signals(-p.exitcode).name})"
        followers = [f"stage {t} (exit code {q.exitcode})" for t, q in dead[1:]]
        return reason + (f"; then {', '.join(followers)}" if followers else "")

    def _dead_stage(self) -> str | None:
        return self._describe(self._dead())

    def _which_died(self, patience_s: float = 2.0) -> str | None:
        """After a connection error: name the stage that died (its exit may take a moment to show,
        and a stage that only lost its peer may show first)."""
        deadline = time.monotonic() + (patience_s if self.procs else 0.0)
        while True:
            dead = self._dead()
            cause_known = dead and dead[0][1].exitcode != tp.EXIT_PEER_LOST
            if cause_known or time.monotonic() >= deadline:
                return self._describe(dead)
            time.sleep(0.05)

    def _wait(self, future: Future, what: str):
        """Wait for a receive running in the helper thread, checking the stages in between."""
        while True:
            try:
                return future.result(timeout=POLL_S)
            except FutureTimeout:
                dead = self._dead_stage()
                if dead:
                    self._fail(f"{dead} while {what}")
            except PipelineError:
                raise
            except Exception as exc:  # gloo: connection closed by a dead peer
                dead = self._which_died()
                self._fail(f"{dead or 'a pipeline stage failed'} while {what} ({type(exc).__name__}: {exc})")

    def _fail(self, reason: str):
        self.error = reason
        self.shutdown(graceful=False)
        raise PipelineError(reason)

    def check(self) -> None:
        if self.error is not None:
            raise PipelineError(f"the pipeline is down: {self.error}")

    # ---- micro-batches ----------------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def abandon(self) -> list:
        """After a failure: forget the micro-batches in flight; returns their batches."""
        batches = [f.batch for f in self._in_flight]
        self._in_flight.clear()
        return batches

    def submit(self, batch, inp, order, rows_per_entry) -> None:
        """Send a micro-batch's plan to every stage and queue the receive of its logits."""
        self.check()
        dead = self._dead_stage()
        if dead:
            self._fail(dead)
        index = self._count
        self._count += 1
        payload = tp.to_bytes_tensor(inp)
        header = torch.tensor([tp.KIND_FORWARD, payload.numel(), index], dtype=torch.int64)
        dispatch = time.time()
        sends: list = [header, payload]
        try:
            for s in range(self.num_stages):
                sends.append(self.pg.send([header], s + 1, tp.TAG_HEADER))
                sends.append(self.pg.send([payload], s + 1, tp.TAG_PAYLOAD))
        except Exception as exc:
            self._fail(f"{self._which_died() or 'a pipeline stage failed'} while sending a micro-batch ({exc})")
        num_rows = int(inp.logits_rows.numel())
        future = self._pool.submit(self._receive, num_rows)
        self._in_flight.append(InFlight(index, batch, order, rows_per_entry, num_rows, dispatch, future, sends))

    def _receive(self, num_rows: int):
        last = self.num_stages
        times = torch.empty(3 * self.num_stages, dtype=torch.float64)
        self.pg.recv([times], last, tp.TAG_TIMES).wait()
        logits = torch.empty(num_rows, self.vocab_size)
        if num_rows:
            self.pg.recv([logits], last, tp.TAG_LOGITS).wait()
        return times, logits, time.time()

    def wait_next(self) -> Done:
        """Wait for the oldest micro-batch in flight; returns it with its stages' timings."""
        self.check()
        mb = self._in_flight[0]
        times, logits, returned = self._wait(mb.future, f"running micro-batch {mb.index}")
        self._in_flight.popleft()
        tp.wait_all(mb.sends)  # every stage has its plan by now
        stage_times = [tuple(row) for row in times.view(self.num_stages, 3).tolist()]
        return Done(mb.batch, mb.order, mb.rows_per_entry, logits, mb.dispatch, returned, stage_times)

    # ---- shutdown ---------------------------------------------------------------------------

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every stage (a shutdown message, then terminate what is left) and drop the in-flight work."""
        if graceful and self.error is None and self._link["healthy"]:
            try:
                while self._in_flight:  # let the pipeline drain so no stage is mid-send
                    self.wait_next()
            except PipelineError:
                pass
        if not graceful or self.error is not None:
            self._link["healthy"] = False
        if self.error is None:
            self.error = "shut down"
        self._finalizer()
