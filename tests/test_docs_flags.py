"""Every flag of every ``graphfeed-*`` command is documented, with the default it has.

The convention the documentation keeps (docs/*.md and README.md): a command's flags are
rows of a *flag table*, a Markdown table whose first header cell names the command and
says "flag" (`` | `graphfeed-train` flag | default | meaning | ``; a subcommand's table
may name the subcommand, `` `graphfeed-train --task link` flag `` a use of the command)
and which has a "default" column. A row's first cell lists one or more flags in
backticks (`` `--fanouts` ``, `` `--tls-cert PEM`, `--tls-key PEM` ``); its default
cell holds one default for all of them, or one per flag separated by ", ", written as on
the command line (`` `10,5` ``, `` `4M` ``, `` `auto` ``). A flag that takes no value
is `off` by default; a required one says `required`; a flag without a default value
says `none`, `off`, or in words what it falls back to (`` `--batch-size` ``, "half the
usable CPUs, 2 to 6").

A documented default is read with the flag's own converter (``type=``) and compared with
the parser's default; ``graphfeed-server``'s parser leaves its defaults to
:class:`~sampling_server.config.ServerConfig` (so that a cluster file can fill them in),
so its flags are compared with the config's defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from partitioner.cli import build_parser as partition_parser
from sampling_server.cli import build_parser as server_parser
from sampling_server.config import ServerConfig
from trainer_client.local import build_parser as local_parser
from trainer_client.train import build_parser as train_parser

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMANDS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "graphfeed-partition": partition_parser, "graphfeed-server": server_parser,
    "graphfeed-train": train_parser, "graphfeed-local": local_parser,
}
#: A flag table's first header cell: the command (and maybe a subcommand or a use), then "flag".
TABLE_HEADER = re.compile(r"`(graphfeed-[\w-]+)[^`]*` flags?", re.IGNORECASE)
#: No default value: what a documented default says instead.
NO_VALUE = ("none", "off", "required")
#: A ServerConfig field without a default: the server needs it (from a flag or the cluster file).
MISSING = dataclasses.MISSING


@dataclasses.dataclass(frozen=True)
class Row:
    """One flag's row of a flag table."""

    #: ``path:line`` of the row.
    where: str
    #: The command whose table it is.
    command: str
    #: The default the row documents for this flag, without backticks.
    default: str


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def flag_rows() -> Iterator[tuple[str, Row]]:
    """(flag, its row) for every flag of every flag table of the documentation."""
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        for i, line in enumerate(lines[:-1]):
            header = _cells(line) if line.startswith("|") else []
            if not header or not re.fullmatch(r"\|[\s:|-]+\|", lines[i + 1].strip()) \
                    or not header[0].lower().endswith(("flag", "flags")):
                continue
            command = TABLE_HEADER.fullmatch(header[0])
            assert command, f"{doc.name}:{i + 1}: a flag table names its command: | `graphfeed-...` flag |"
            column = [h.lower() for h in header].index("default")
            for n, row in enumerate(lines[i + 2:], start=i + 3):
                if not row.startswith("|"):
                    break
                cells = _cells(row)
                flags = re.findall(r"`(--?[\w-]+)[^`]*`", cells[0])
                defaults = [d.strip().strip("`").strip() for d in cells[column].split(", ")]
                if len(defaults) != len(flags):
                    defaults = [cells[column].replace("`", "").strip()] * len(flags)
                for flag, default in zip(flags, defaults, strict=True):
                    yield flag, Row(f"{doc.relative_to(REPO)}:{n}", command.group(1), default)


def options(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """Every option of ``parser`` and of its subcommands (positional arguments aside)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from options(sub)
        elif action.option_strings and not isinstance(action, argparse._HelpAction):
            yield action


def default_of(command: str, action: argparse.Action) -> Any:
    """The default a flag has: the parser's, or for the server's flags the config's."""
    if command == "graphfeed-server" and action.default is None:
        config = {f.name: f for f in dataclasses.fields(ServerConfig)}.get(action.dest)
        if config is not None:
            return config.default
    return action.default


def differs(action: argparse.Action, documented: str, default: Any) -> str | None:
    """Why ``documented`` is not ``default`` (None: it is)."""
    if action.nargs == 0:
        return None if documented == "off" else "a flag without a value is documented as `off`"
    if action.required or default is MISSING:
        return None if documented == "required" else "a required flag is documented as `required`"
    try:
        value = action.type(documented) if callable(action.type) else documented
    except (argparse.ArgumentTypeError, TypeError, ValueError):
        value = argparse.SUPPRESS  # words: what the flag falls back to
    if default is None or default is argparse.SUPPRESS or (isinstance(default, list | tuple) and not default):
        words = value is argparse.SUPPRESS or " " in documented or value is None
        return None if documented in NO_VALUE or words else f"the flag has no default value ({default!r})"
    return None if value == default else f"the flag's default is {default!r}"


def documented_flags() -> dict[tuple[str, str], list[Row]]:
    rows: dict[tuple[str, str], list[Row]] = {}
    for flag, row in flag_rows():
        rows.setdefault((row.command, flag), []).append(row)
    return rows


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_is_documented_with_the_default_it_has(command: str) -> None:
    rows = documented_flags()
    problems = []
    for action in options(COMMANDS[command]()):
        default = default_of(command, action)
        for flag in action.option_strings:
            found = rows.get((command, flag))
            if not found:
                problems.append(f"{command} {flag}: in no `{command}` flag table of README.md or docs/*.md "
                                f"(add a row: | `{flag}` | default | meaning |)")
            for row in found or []:
                why = differs(action, row.default, default)
                if why:
                    problems.append(f"{row.where}: {command} {flag}: documented default {row.default!r}, but "
                                    f"{why}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_documented_flag_exists(command: str) -> None:
    known = {flag for action in options(COMMANDS[command]()) for flag in action.option_strings}
    unknown = [f"{row.where}: {command} {flag}" for (cmd, flag), found in documented_flags().items()
               if cmd == command and flag not in known for row in found]
    assert not unknown, "documented, but no such flag:\n" + "\n".join(unknown)


def test_the_checks_catch_a_wrong_default_a_missing_flag_and_a_value_for_a_flag_without_one() -> None:
    parser = argparse.ArgumentParser()
    fanouts = parser.add_argument("--fanouts", type=lambda t: [int(v) for v in t.split(",")], default=[10, 5])
    resume = parser.add_argument("--resume", action="store_true")
    servers = parser.add_argument("--servers", default=None)
    assert differs(fanouts, "10,5", [10, 5]) is None
    assert differs(fanouts, "10,6", [10, 5]) == "the flag's default is [10, 5]"
    assert differs(resume, "off", False) is None and differs(resume, "on", False)
    assert differs(servers, "none", None) is None
    assert differs(servers, "the first server's peers", None) is None  # words: a fallback
    assert differs(servers, "127.0.0.1:50051", None) == "the flag has no default value (None)"
