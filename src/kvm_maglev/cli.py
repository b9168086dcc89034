"""`kvm-maglev` command line: one subcommand per task; each lives in its own module."""

import argparse
import importlib
import sys
from typing import Optional, Sequence

# subcommand -> module exposing add_arguments(parser) and run(args) -> int
_SUBCOMMANDS = {
    "convert": "kvm_maglev.convert.cli",
    "bench": "kvm_maglev.benchmarks.cli",
    "demo": "kvm_maglev.demo",
    "push": "kvm_maglev.hub",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvm-maglev", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in _SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub_parser = sub.add_parser(name, help=module.__doc__.strip().splitlines()[0])
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(_run=module.run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
