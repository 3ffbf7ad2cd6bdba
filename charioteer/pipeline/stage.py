"""A pipeline stage: one process holding layers [start, end) of the model and their KV cache.

Started by the engine (`PipelineExecutor`, torch.multiprocessing spawn) or by hand / torchrun:

    MASTER_ADDR=driver-host MASTER_PORT=29500 RANK=1 WORLD_SIZE=3 python -m charioteer.pipeline.stage

Rank 0 is the driver (the engine); stage i is rank i + 1. A stage started by hand receives its
setup (model spec, layer range, KV size, device) from the driver and loads the model itself.

Per micro-batch: receive the plan (a pickled ForwardInput) from the driver; the first stage embeds
the tokens, the others receive hidden states from the previous stage; run the layers; send the
hidden states on, or (last stage) the logits and every stage's timestamps to the driver.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
import traceback
from collections import deque

import torch

from charioteer.pipeline import transport as tp


def _watch_parent(parent_pid: int) -> None:
    """Exit if the driver that spawned this stage is gone: no orphans even if it is SIGKILLed."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(tp.EXIT_DRIVER_GONE)


def _input_to(inp, device: torch.device):
    if device.type == "cpu":
        return inp
    from charioteer.model.llama import PrefillSpan

    def mv(t):
        return None if t is None else t.to(device, non_blocking=True)

    return dataclasses.replace(
        inp, token_ids=mv(inp.token_ids), positions=mv(inp.positions), slot_mapping=mv(inp.slot_mapping),
        prefills=[PrefillSpan(p.offset, p.num_tokens, p.start_pos, mv(p.context_slots), mv(p.mask), p.context_start)
                  for p in inp.prefills],
        decode_slots=mv(inp.decode_slots), logits_rows=mv(inp.logits_rows),
    )


class Stage:
    def __init__(self, rank: int, world_size: int, pg, init: dict, store=None) -> None:
        from charioteer.model.llama import KVCache, LlamaModel

        self.rank, self.world_size, self.pg = rank, world_size, pg
        self.index = rank - 1
        self.num_stages = world_size - 1
        self.is_first, self.is_last = self.index == 0, self.index == self.num_stages - 1
        config = init["config"]
        start, end = init["layer_range"]
        device = init["device"]
        if device.startswith("cuda"):
            count = torch.cuda.device_count()
            local = int(os.environ.get("LOCAL_RANK", self.index))
            device = f"cuda:{local % max(count, 1)}"
            torch.cuda.set_device(device)
        self.device = torch.device(device)
        state_dict, blocks = init.get("state_dict"), init.get("gguf_blocks")
        if state_dict is None:  # started by hand or torchrun: load the model here
            from charioteer.model.loader import load_model

            loaded = load_model(init["model"], num_layers=init["num_layers"], seed=init["seed"])
            state_dict, blocks = loaded.state_dict, loaded.gguf_blocks
        self.model = LlamaModel(config, state_dict, self.device, layer_range=(start, end), dtype=init["dtype"],
                                quantization=init["quantization"], batch_invariant=init.get("batch_invariant", False),
                                gguf_blocks=blocks, full_last_layer=init.get("full_last_layer", False))
        del state_dict, blocks
        self.kv = KVCache(config, init["num_slots"], self.device, dtype=init["dtype"], num_layers=end - start)
        self.hidden_size = config.hidden_size
        # Activations between stages: NCCL when every stage has its own GPU, else gloo (via the host).
        self.dev_pg = None
        if init.get("nccl") and store is not None:
            opts = torch.distributed.ProcessGroupNCCL.Options()
            self.dev_pg = torch.distributed.ProcessGroupNCCL(
                torch.distributed.PrefixStore(tp.PREFIX + "-nccl", store), self.index, self.num_stages, opts)
        self.pending: deque = deque()

    def _link_send(self, t: torch.Tensor, dst_rank: int, tag: int) -> None:
        if self.dev_pg is not None and t.device.type == "cuda":
            self.pending.append((self.dev_pg.send([t], dst_rank - 1, tag), t))
        else:
            t = t.cpu()
            self.pending.append((self.pg.send([t], dst_rank, tag), t))

    def _link_recv(self, shape, dtype, src_rank: int, tag: int) -> torch.Tensor:
        if self.dev_pg is not None:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            self.dev_pg.recv([t], src_rank - 1, tag).wait()
            return t
        t = torch.empty(shape, dtype=dtype)
        self.pg.recv([t], src_rank, tag).wait()
        return t.to(self.device)

    def serve(self) -> None:
        pg = self.pg
        header = torch.empty(3, dtype=torch.int64)
        while True:
            wait_begin = time.time()
            pg.recv([header], 0, tp.TAG_HEADER).wait()
            kind, nbytes, _mb = (int(v) for v in header)
            if kind == tp.KIND_SHUTDOWN:
                break
            payload = torch.empty(nbytes, dtype=torch.uint8)
            pg.recv([payload], 0, tp.TAG_PAYLOAD).wait()
            inp = _input_to(tp.from_bytes_tensor(payload), self.device)
            num_tokens = inp.token_ids.numel()
            if self.is_first:
                times = torch.empty(0, dtype=torch.float64)
                x = None
            else:
                x = self._link_recv((num_tokens, self.hidden_size), self.model.activation_dtype, self.rank - 1,
                                    tp.TAG_HIDDEN)
                times = torch.empty(3 * self.index, dtype=torch.float64)
                pg.recv([times], self.rank - 1, tp.TAG_TIMES).wait()
            start = time.time()
            with torch.inference_mode():
                if x is None:
                    x = self.model.embed_tokens(inp)
                x = self.model.run_layers(x, inp, self.kv, out_rows=inp.logits_rows if self.is_last else None)
                out = self.model.logits(x) if self.is_last and inp.logits_rows.numel() else None
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            end = time.time()
            times = torch.cat([times, torch.tensor([wait_begin, start, end], dtype=torch.float64)])
            if self.is_last:
                self.pending.append((pg.send([times], 0, tp.TAG_TIMES), times))
                if out is not None:
                    out = out.float().cpu().contiguous()
                    self.pending.append((pg.send([out], 0, tp.TAG_LOGITS), out))
            else:
                self._link_send(x.contiguous(), self.rank + 1, tp.TAG_HIDDEN)
                self.pending.append((pg.send([times], self.rank + 1, tp.TAG_TIMES), times))
            while len(self.pending) > 8:  # keep a few sends in flight; their tensors stay referenced
                self.pending.popleft()[0].wait()
        while self.pending:
            self.pending.popleft()[0].wait()


def run(rank: int, world_size: int, store_addr: tuple[str, int] | None, init: dict | None,
        parent_pid: int | None = None) -> None:
    """Process entry: connect, set up, report ready (or the error) to the driver, serve until told to stop."""
    torch.set_num_threads(int(os.environ.get("CHARIOTEER_STAGE_THREADS", "1")))
    if parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    code = tp.EXIT_OK
    try:
        if store_addr is None:
            store, rank, world_size = tp.env_store()
        else:
            store = torch.distributed.TCPStore(store_addr[0], store_addr[1], world_size, False,
                                               timeout=tp.CONNECT_TIMEOUT)
        pg = tp.gloo_group(store, rank, world_size)
        if init is None:
            init = tp.recv_object(pg, 0)
        try:
            stage = Stage(rank, world_size, pg, init, store)
        except Exception as exc:
            tp.wait_all(tp.send_object(pg, {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, 0))
            raise
        tp.wait_all(tp.send_object(pg, {"ok": True, "pid": os.getpid(), "layers": stage.model.layer_range}, 0))
        stage.serve()
    except BaseException as exc:  # noqa: BLE001 - report and exit; the driver notices the closed connection
        print(f"charioteer pipeline stage (rank {rank}) failed:\n{traceback.format_exc()}", file=sys.stderr)
        code = tp.EXIT_PEER_LOST if tp.is_peer_lost(exc) else tp.EXIT_ERROR
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo's destructors may wait on peers that are gone.
    os._exit(code)


def main() -> None:
    """`python -m charioteer.pipeline.stage`: a stage of a pipeline whose driver is rank 0 (env rendezvous)."""
    if int(os.environ.get("RANK", "0")) == 0:
        raise SystemExit("charioteer.pipeline.stage runs ranks >= 1; rank 0 is the driver (the charioteer command)")
    run(0, 0, None, None)


if __name__ == "__main__":
    main()
