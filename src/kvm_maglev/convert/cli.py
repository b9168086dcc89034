"""Convert a research checkpoint into a Hub-ready transformers folder."""

import argparse
import importlib

# architecture -> module exposing add_arguments(parser) and run(args) -> int
_ARCHITECTURES = {
    "kvm": "kvm_maglev.convert.kvm",
    "maglev": "kvm_maglev.convert.maglev",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="architecture", required=True)
    for name, module_name in _ARCHITECTURES.items():
        arch_parser = sub.add_parser(name, help=f"convert a {name} research checkpoint")
        arch_parser.set_defaults(_arch_module=module_name)
        importlib.import_module(module_name).add_arguments(arch_parser)


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(args._arch_module).run(args)
