"""docs/metrics.md, made from the metric families the daemon exposes (``python -m
spoolfs.service.metricsdoc > docs/metrics.md``; a test keeps the two the same, and one checks
that the Grafana dashboard in mount-examples/ asks only for metrics listed here)."""

from __future__ import annotations

from typing import Any

from spoolfs.service import status

#: what a family of each type is called in the exposition
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
             "gauge": ("",)}

_EMPTY = {"time": "", "store": "", "queues": {},
          "disk": {"free_bytes": 0, "total_bytes": 0, "free_inodes": 0, "total_inodes": 0}}


def described() -> list[tuple[str, str, tuple[str, ...], str]]:
    """(name as exposed, type, labels, help) of every family, in exposition order."""
    out = []
    for f in status.families(_EMPTY):
        labels: tuple[str, ...] = getattr(f, "_labelnames", ())
        out.append((f.name + _SUFFIXES[f.type][0] if f.type == "counter" else f.name, f.type,
                    labels, f.documentation))
    return out


def exposed_names() -> set[str]:
    """Every sample name the exposition may hold (``x_total``, ``x_bucket``, ...)."""
    return {f.name + suffix for f in status.families(_EMPTY) for suffix in _SUFFIXES[f.type]}


def _cell(text: Any) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def render() -> str:
    lines = [
        "# Metrics",
        "",
        "What `MOUNT/.spool/metrics` and `--metrics-listen HOST:PORT` (`/metrics`) expose, in",
        "the Prometheus text format. Gauges come from the status snapshot (every daemon of a",
        "store shows the same); counters and histograms count what this daemon did since it",
        "started. Histograms have `_bucket`, `_sum` and `_count` samples, in seconds. A",
        "dashboard over them: `mount-examples/grafana-dashboard.json`.",
        "",
        "This file is made from the daemon's own metric families",
        "(`python -m spoolfs.service.metricsdoc > docs/metrics.md`).",
        "",
        "| metric | type | labels | meaning |",
        "|---|---|---|---|",
    ]
    for name, kind, labels, doc in described():
        shown = ", ".join(f"`{label}`" for label in labels) or "–"
        lines.append(f"| `{name}` | {kind} | {shown} | {_cell(doc)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
