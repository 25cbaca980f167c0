"""docs/cli.md, made from the parsers themselves: every command, its arguments and options, and
every exit status (``python -m spoolfs.cli.reference > docs/cli.md``; a test keeps the two the
same)."""

from __future__ import annotations

import argparse
import importlib
import inspect
from enum import IntEnum

from spoolfs.cli import COMMANDS, exits


def _cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def _arguments(p: argparse.ArgumentParser) -> list[str]:
    rows = []
    for a in p._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        if isinstance(a, argparse._SubParsersAction):
            continue
        name = ", ".join(f"`{o}`" for o in a.option_strings) or f"`{a.metavar or a.dest}`"
        if a.option_strings and a.nargs != 0:
            name += f" {a.metavar or a.dest.upper()}"
        if a.choices and not isinstance(a.choices, dict):
            name += " (" + "|".join(str(c) for c in a.choices) + ")"
        rows.append(f"| {_cell(name)} | {_cell(a.help)} |")
    return ["| argument | meaning |", "|---|---|", *rows] if rows else []


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def _section(title: str, p: argparse.ArgumentParser) -> list[str]:
    out = [f"## {title}", "", "```", p.format_usage().strip(), "```", ""]
    if p.description:
        out += [" ".join(p.description.split()), ""]
    table = _arguments(p)
    if table:
        out += [*table, ""]
    for name, sub in _subparsers(p).items():
        out += [f"### {title} {name}", "", "```", sub.format_usage().strip(), "```", ""]
        if sub.epilog:
            out += [" ".join(sub.epilog.split()), ""]
        out += [*_arguments(sub), ""]
    return out


def _codes(enum: type[IntEnum]) -> list[str]:
    source = inspect.getsource(enum)
    rows = []
    for member in enum:
        line = next(ln for ln in source.splitlines() if ln.strip().startswith(f"{member.name} ="))
        meaning = line.split("#:", 1)[1].strip() if "#:" in line else ""
        rows.append(f"| {member.value} | {member.name} | {meaning} |")
    return [f"### {exits.DESCRIPTIONS[enum.__name__]}", "", "| status | name | meaning |",
            "|---|---|---|", *rows, ""]


def render() -> str:
    out = ["# The command line", "",
           "Made from the commands' own parsers (`python -m spoolfs.cli.reference`); "
           "`spoolfs COMMAND --help` says the same.", "",
           "```", "usage: spoolfs [STORE] MOUNTPOINT [options]",
           "       spoolfs COMMAND [arguments]", "```", "",
           "| command | what it does |", "|---|---|"]
    out += [f"| [`{c}`](#spoolfs-{c}) | {summary} |" for c, (_, summary) in COMMANDS.items()]
    out.append("")
    for command, (module, _) in COMMANDS.items():
        parser = importlib.import_module(module).parser()
        out += _section(f"spoolfs {command}", parser)
    out += ["## Exit status", "", *_codes(exits.Exit), *_codes(exits.Check)]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
