"""Point-to-point messages between the driver (rank 0) and the stages (ranks 1..N).

Every process builds its own gloo process group object from a TCPStore (no global
`init_process_group` state, so several pipelines can live in one driver process, e.g. in tests).
Objects travel pickled in uint8 tensors behind an int64 header; activations travel as tensors.
"""
from __future__ import annotations

import datetime
import os
import pickle

import torch
import torch.distributed as dist

# A stage may wait for work as long as the server is idle; dead peers are noticed by closed
# connections and process checks, not by timeouts (a gloo timeout also breaks the connection).
OP_TIMEOUT = datetime.timedelta(days=30)
CONNECT_TIMEOUT = datetime.timedelta(seconds=120)
PREFIX = "charioteer-pp"

# Tags of the message kinds.
TAG_HEADER, TAG_PAYLOAD, TAG_HIDDEN, TAG_TIMES, TAG_LOGITS, TAG_OBJECT_HEADER, TAG_OBJECT = range(1, 8)

# Header kinds (driver -> stage).
KIND_SHUTDOWN, KIND_FORWARD = 0, 1

# Stage exit codes. A stage whose peer dies fails too; its own code says it was not the cause.
EXIT_OK, EXIT_ERROR, EXIT_PEER_LOST, EXIT_DRIVER_GONE = 0, 1, 2, 3


def is_peer_lost(exc: BaseException) -> bool:
    """Whether a gloo error means the other end of a connection went away."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and "gloo" in text and (
        "Connection reset" in text or "Connection closed" in text or "Socket closed" in text)


def gloo_group(store: dist.Store, rank: int, world_size: int, prefix: str = PREFIX) -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world_size, OP_TIMEOUT)


def env_store() -> tuple[dist.Store, int, int]:
    """The standard rendezvous environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), as torchrun sets it."""
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in os.environ]
    if missing:
        raise ValueError(f"pipeline rendezvous needs the environment variables {', '.join(missing)}")
    store, rank, world_size = next(dist.rendezvous("env://", timeout=CONNECT_TIMEOUT))
    store.set_timeout(CONNECT_TIMEOUT)
    return store, rank, world_size


def to_bytes_tensor(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)


def from_bytes_tensor(t: torch.Tensor):
    return pickle.loads(t.numpy().tobytes())


def send_object(pg, obj, dst: int) -> list:
    """Send a picklable object; returns the pending works (keep them until they complete)."""
    payload = to_bytes_tensor(obj)
    header = torch.tensor([payload.numel()], dtype=torch.int64)
    return [pg.send([header], dst, TAG_OBJECT_HEADER), pg.send([payload], dst, TAG_OBJECT), header, payload]


def recv_object(pg, src: int):
    header = torch.empty(1, dtype=torch.int64)
    pg.recv([header], src, TAG_OBJECT_HEADER).wait()
    payload = torch.empty(int(header[0]), dtype=torch.uint8)
    pg.recv([payload], src, TAG_OBJECT).wait()
    return from_bytes_tensor(payload)


def wait_all(items) -> None:
    for item in items:
        if isinstance(item, dist.Work):
            item.wait()
