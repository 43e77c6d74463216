"""`flagos` on the command line: one parser, one subcommand per module of flagos.tools.

Exit codes, for every subcommand: 0 ok, 1 a check failed, 2 usage error (argparse's own).
The aliases FlagOS users know (`flagos-diagnose`, `flagos-device-list`, `flagos-device-top`,
`flagos-model-benchmark`) run one subcommand each.
"""
from __future__ import annotations

import argparse
import sys

from .. import __version__
from . import SUBCOMMANDS, command_module

EXIT_OK, EXIT_USAGE = 0, 2   # 1 (a check failed) is each subcommand's own


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flagos", description="flagos: one PyTorch device for every AI chip.")
    parser.add_argument("--version", action="store_true", help="print the flagos version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = command_module(name)
        doc = (module.__doc__ or name).strip().splitlines()[0]
        command = sub.add_parser(name, help=doc, description=module.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(command)
        command.set_defaults(handler=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        print(f"flagos {__version__}")
        return EXIT_OK
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return args.handler(args)


def _alias(name: str):
    def entry() -> int:
        return main([name, *sys.argv[1:]])
    entry.__name__ = f"{name}_main"
    return entry


diagnose_main = _alias("diagnose")
devices_main = _alias("devices")
top_main = _alias("top")
bench_main = _alias("bench")
