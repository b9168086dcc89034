"""`kvm-maglev` command line: one subcommand per task; each lives in its own module."""

import argparse
import contextlib
import importlib
import importlib.metadata
import signal
import sys
from collections.abc import Iterator, Sequence

# subcommand -> module exposing add_arguments(parser) and run(args) -> int
_SUBCOMMANDS = {
    "convert": "kvm_maglev.convert.cli",
    "bench": "kvm_maglev.benchmarks.cli",
    "demo": "kvm_maglev.demo",
    "push": "kvm_maglev.hub",
    "quantize": "kvm_maglev.convert.quantize",
}


def version() -> str:
    """The installed distribution's version (what pip installed), else the package's own."""
    try:
        return importlib.metadata.version("kvm_maglev")
    except importlib.metadata.PackageNotFoundError:
        from kvm_maglev import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvm-maglev", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in _SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub_parser = sub.add_parser(name, help=module.__doc__.strip().splitlines()[0])
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(_run=module.run)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM as an exception, so the cleanup that Ctrl-C runs (temporary folders removed) runs for it too."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """Within the block SIGTERM raises Terminated; the previous handler comes back after."""
    try:
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _push_converted(args: argparse.Namespace) -> int:
    """`convert --push-to-hub ORG/NAME`: publish the folder just written (not after a dry run)."""
    if args.dry_run or not getattr(args, "push_to_hub", None):
        return 0
    from huggingface_hub.errors import HfHubHTTPError

    from kvm_maglev import hub

    try:
        hub.push_after_convert(args, args.out)
    except (ValueError, HfHubHTTPError) as error:
        print(f"error: {args.out} was written, but pushing it to {args.push_to_hub} failed: {str(error).strip()}",
              file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == ["--version"]:  # answered before the subcommands (and torch) are imported
        print(f"kvm-maglev {version()}")
        return 0
    args = build_parser().parse_args(argv)
    try:
        with _terminate_as_interrupt():
            status = int(args._run(args) or 0)
            if status == 0 and args.command == "convert":
                status = _push_converted(args)
            return status
    except KeyboardInterrupt as interrupt:  # Ctrl-C or SIGTERM: cleaned up on the way out, one line, no traceback
        signum = signal.SIGTERM if isinstance(interrupt, Terminated) else signal.SIGINT
        print(f"error: kvm-maglev {args.command} stopped by {signum.name}; its temporary files were removed",
              file=sys.stderr)
        return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
