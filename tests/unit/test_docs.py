"""The documentation says what the code does: its tables are rendered here from
``core.rules``, ``core.transitions``, ``core.errors`` and ``store.schema`` and must appear in
the docs word for word, and the README's test command is what CI runs.

When a rule changes, print the tables to paste into docs/design.md with:
``python tests/unit/test_docs.py``
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from spoolfs.core import errors, rules, transitions
from spoolfs.core.rules import Kind, Scope, State
from spoolfs.store import schema

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DESIGN = ROOT / "docs" / "design.md"
ERRNO = ROOT / "docs" / "errno.md"
CLI = ROOT / "docs" / "cli.md"
METRICS_DOC = ROOT / "docs" / "metrics.md"
DASHBOARD = ROOT / "mount-examples" / "grafana-dashboard.json"
CI = ROOT / ".ci" / "run"
EXAMPLES = ROOT / "mount-examples"
REFUSED = "EPERM"


def label(kind: Kind) -> str:
    """How the docs name where a message sits: its state directory, and in ``ready/`` a name
    with a leading dot (an upload under a staging name, never claimable)."""
    return "`ready/.name`" if kind is Kind.STAGING else f"`{kind.value}/`"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def renames_table() -> str:
    """Every allowed rename of a message (``rules.RENAMES``); an empty cell is refused."""
    scopes = list(Scope)
    rows = [[label(src), label(dst), *(f"**{by_scope[s].value}**" if s in by_scope else REFUSED
                                       for s in scopes)]
            for (src, dst), by_scope in rules.RENAMES.items()]
    return table(["from", "to", *(s.value for s in scopes)], rows)


def kinds_table() -> str:
    """Per kind: what create, link and unlink mean, and whether a rename may replace it."""
    def action(table: dict[Kind, rules.Action], kind: Kind) -> str:
        return table[kind].value if kind in table else REFUSED

    rows = [[label(k), action(rules.CREATES, k), action(rules.LINKS, k),
             action(rules.UNLINKS, k),
             "replaced" if k in rules.REPLACEABLE else "EEXIST",
             "yes" if k in rules.MUTABLE else "no (EPERM)"]
            for k in Kind]
    return table(["where", "create", "link into", "unlink", "rename onto an existing name",
                  "content writable"], rows)


def durable_line() -> str:
    """Which actions are on disk (fsynced) before the call returns."""
    durable = [f"`{a.value}`" for a in rules.Action if a in rules.DURABLE]
    lazy = [f"`{a.value}`" for a in rules.Action if a not in rules.DURABLE]
    return f"Committed with fsync before the call returns: {', '.join(durable)}. " \
           f"Committed without waiting for the disk: {', '.join(lazy)}."


def _sources(row: transitions.Transition) -> str:
    if row.sources == frozenset(Kind):
        return "any"
    return ", ".join("new" if k is None else label(k)
                     for k in [None, *Kind] if k in row.sources)


def _targets(row: transitions.Transition) -> str:
    if row.targets == frozenset(State):
        return "any"
    return ", ".join("deleted" if s is None else f"`{s.value}/`"
                     for s in [*State, None] if s in row.targets)


def effects_table() -> str:
    """Every action (``transitions.TRANSITIONS``): from where, to where, what it changes."""
    rows = [[f"**{row.action.value}**", "daemon" if row.by_daemon else "user", _sources(row),
             _targets(row),
             ", ".join(f"{k} {v}" for k, v in row.effects.changes().items()) or "-"]
            for row in transitions.TRANSITIONS]
    return table(["action", "by", "from", "to", "sets"], rows)


def state_diagram() -> str:
    """The Mermaid state diagram of the same rows (plain moves within a state left out)."""
    edges: dict[tuple[str, str], list[str]] = {}
    for row in transitions.TRANSITIONS:
        if row.action is rules.Action.MOVE:
            continue
        for src in sorted({"[*]" if k is None else rules.state_of(k).value
                           for k in row.sources}, key=lambda x: (x != "[*]", x)):
            for dst in ["[*]" if s is None else s.value for s in [*State, None]
                        if s in row.targets]:
                labels = edges.setdefault((src, dst), [])
                if row.action.value not in labels:
                    labels.append(row.action.value)
    lines = ["```mermaid", "stateDiagram-v2"]
    lines += [f"    {src} --> {dst}: {', '.join(labels)}" for (src, dst), labels in edges.items()]
    return "\n".join([*lines, "```"])


def render() -> str:
    return f"{renames_table()}\n\n{kinds_table()}\n\n{durable_line()}\n\n" \
           f"{effects_table()}\n\n{state_diagram()}"


def test_design_doc_shows_the_rename_table_of_core_rules() -> None:
    assert renames_table() in DESIGN.read_text(), \
        "docs/design.md's rename table differs from rules.RENAMES; " \
        "paste the output of `python tests/unit/test_docs.py`"


def test_design_doc_shows_create_link_unlink_and_durability_of_core_rules() -> None:
    text = DESIGN.read_text()
    assert kinds_table() in text, "docs/design.md's per-kind table differs from core.rules"
    assert durable_line() in text, "docs/design.md's durability line differs from rules.DURABLE"


def test_design_doc_shows_every_transition_and_its_effects() -> None:
    text = DESIGN.read_text()
    assert effects_table() in text, "docs/design.md's effects table differs from " \
        "core.transitions; paste the output of `python tests/unit/test_docs.py`"
    assert state_diagram() in text, "docs/design.md's state diagram differs from " \
        "core.transitions; paste the output of `python tests/unit/test_docs.py`"


def test_design_doc_names_the_schema_version_and_its_migrations() -> None:
    text = DESIGN.read_text()
    assert f"`store/schema.py`, version {schema.VERSION}," in text
    for version in schema.MIGRATIONS:
        assert f"version {version + 1} " in " ".join(text.split()).lower() or \
            f"Version {version + 1} " in text, f"docs/design.md does not say what version " \
            f"{version + 1} added"


def test_cli_doc_is_made_from_the_parsers() -> None:
    from spoolfs.cli import reference

    assert CLI.read_text() == reference.render(), \
        "docs/cli.md differs from the parsers: python -m spoolfs.cli.reference > docs/cli.md"


def readme_paragraph(start: str) -> str:
    """The README paragraph that begins with ``start``, on one line."""
    text = README.read_text()
    i = text.index(start)
    return " ".join(text[i:text.index("\n\n", i)].split())


#: what the README's promise after the tour names as durable when it returns
PROMISED = ("publish", "claim", "finish", "release", "redrive", "forward", "link publish")


def test_readme_says_exactly_what_is_durable_when() -> None:
    para = readme_paragraph("Every transition that returned is on disk")
    for word in PROMISED:
        assert word in para, f"the README's durability paragraph does not name {word!r}"
        assert rules.Action(word) in rules.DURABLE, \
            f"the README promises {word!r} durable, but rules.DURABLE does not commit it so"
    # uploads are committed without fsync: the README must not promise them before publish
    assert {rules.Action.UPLOAD, rules.Action.LINK}.isdisjoint(rules.DURABLE)
    assert "upload still in `partial/` is not durable until it is published" in para, para
    assert "power cut" in para and "never leaves part of a message in `ready/`" in para, para


def spool_errors() -> list[type[errors.SpoolError]]:
    found, todo = [], [errors.SpoolError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return [c for c in found if c.__module__ == errors.__name__]


def errno_name(code: int) -> str:
    # Python names 95 ENOTSUP; Linux documents the FUSE and fallocate answer as EOPNOTSUPP.
    return "EOPNOTSUPP" if code == errno.EOPNOTSUPP else errno.errorcode[code]


def test_errno_doc_names_every_error_class_with_its_errno() -> None:
    text = ERRNO.read_text()
    for cls in spool_errors():
        row = f"| `{cls.__name__}` | {errno_name(cls.errno)} | {os.strerror(cls.errno)} |"
        assert row in text, f"docs/errno.md lacks the row {row!r}"


def test_design_doc_shows_the_schema_of_store_schema() -> None:
    assert f"```sql\n{schema.TABLES.strip()}\n```" in DESIGN.read_text(), \
        "docs/design.md's schema differs from store/schema.py"
    assert f"```sql\n{schema.INDEXES.strip()}\n```" in DESIGN.read_text(), \
        "docs/design.md's lifecycle indexes differ from store/schema.py"


def ci_command() -> str:
    lines = [line for line in CI.read_text().splitlines()
             if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert len(lines) == 1, f".ci/run should run one command, the README's: {lines}"
    return lines[0]


def test_ci_runs_the_readme_test_command_word_for_word() -> None:
    readme_lines = README.read_text().splitlines()
    command = ci_command()
    assert command in readme_lines, f"README.md does not show .ci/run's command: {command}"
    assert command.endswith("python -m pytest -q")
    text = CI.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "\nset -euo pipefail\n" in text
    assert os.access(CI, os.X_OK), ".ci/run must be executable"


def test_readme_set_up_commands_install_the_same_system_packages() -> None:
    apt = re.findall(r"apt-get install -y ([a-z0-9. -]+?) &&", README.read_text())
    assert len(apt) >= 2 and len(set(apt)) == 1, f"the README's set-up commands differ: {apt}"
    assert set(apt[0].split()) >= {"fuse3", "libfuse3-dev", "attr"}


@pytest.mark.parametrize("script", ["producer.sh", "consumer.sh"])
def test_example_scripts_are_executable_bash(script: str) -> None:
    path = EXAMPLES / script
    assert os.access(path, os.X_OK), f"{path} is not executable"
    res = subprocess.run(["bash", "-n", str(path)], check=False, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    res = subprocess.run([str(path), "-h"], check=False, capture_output=True, text=True)
    assert res.returncode == 0 and "Usage:" in res.stderr, res.stderr


def test_docs_name_no_machine_specific_paths() -> None:
    files = [README, CI, *sorted((ROOT / "docs").glob("*.md")),
             *sorted(p for p in EXAMPLES.iterdir() if p.is_file())]
    # One pattern for the checkout, home and virtualenv paths of a build machine.
    machine_paths = re.compile(r"/(?:work|root)/|/tmp/venv")
    for path in files:
        hit = machine_paths.search(path.read_text())
        assert hit is None, f"{path.relative_to(ROOT)} mentions {hit and hit.group()}"


if __name__ == "__main__":
    print(render())


def test_metrics_doc_is_made_from_the_metric_families() -> None:
    from spoolfs.service import metricsdoc

    assert METRICS_DOC.read_text() == metricsdoc.render(), \
        "docs/metrics.md differs: python -m spoolfs.service.metricsdoc > docs/metrics.md"


def test_the_grafana_dashboard_asks_only_for_metrics_that_exist() -> None:
    """Every query names exposed metrics; the questions of an operator each have a panel."""
    from spoolfs.service import metricsdoc

    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    named = {m for e in exprs for m in re.findall(r"\bspoolfs_[a-z0-9_]+", e)}
    assert named <= metricsdoc.exposed_names(), named - metricsdoc.exposed_names()
    assert {"spoolfs_transitions_total", "spoolfs_lease_expiries_total", "spoolfs_retries_total",
            "spoolfs_abandoned_messages_total", "spoolfs_fuse_errors_total",
            "spoolfs_fuse_request_seconds_bucket", "spoolfs_commit_seconds_bucket",
            "spoolfs_messages", "spoolfs_disk_free_bytes"} <= named
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "queue"}
