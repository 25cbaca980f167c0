"""``GET /`` of ``--metrics-listen``: the status snapshot as a small page for people.

One HTML document with its style inline: no script, no framework, nothing fetched from
elsewhere. It refreshes itself every few seconds and fits a phone's width. Every name in it
(queues, consumer views) is the users' data, escaped.
"""

from __future__ import annotations

from html import escape
from typing import Any

REFRESH_S = 5

_STYLE = """
body{font:15px/1.4 system-ui,sans-serif;margin:0;padding:12px;background:#f6f7f9;color:#1d232b}
h1{font-size:20px;margin:0 0 4px}
.meta{color:#5b6673;font-size:13px;margin-bottom:12px}
section{background:#fff;border:1px solid #dde2e8;border-radius:8px;padding:10px 12px;
margin-bottom:12px}
h2{font-size:17px;margin:0 0 8px;word-break:break-all}
table{border-collapse:collapse;width:100%;font-variant-numeric:tabular-nums}
table+table{margin-top:10px}
th,td{text-align:right;padding:3px 6px;border-bottom:1px solid #eef1f4;white-space:nowrap}
th:first-child,td:first-child{text-align:left;white-space:normal;overflow-wrap:anywhere}
th{font-weight:600;color:#5b6673;font-size:13px}
.bad{color:#b42318;font-weight:600}
.quiet{color:#5b6673}
.disk{font-size:14px}
"""


def _age(s: float | None) -> str:
    if s is None:
        return "–"
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.1f} {unit}"
    return f"{s:.0f} s"


def _size(n: int) -> str:
    for unit, k in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n} B"


def _queue(name: str, q: dict[str, Any]) -> str:
    rows = "".join(
        f"<tr><td>{escape(state)}/</td><td>{v['count']:,}</td><td>{_size(v['bytes'])}</td>"
        f"<td>{_age(v['oldest_age_s'])}</td></tr>" for state, v in q["states"].items())
    out = [f'<section class="queue"><h2>{escape(name)}</h2>',
           "<table><tr><th>state</th><th>messages</th><th>bytes</th><th>oldest</th></tr>",
           rows, "</table>"]
    if q["consumers"]:
        out.append("<table><tr><th>view</th><th>claims</th><th>oldest</th>"
                   "<th>lease ends</th><th>active</th></tr>")
        for c, info in q["consumers"].items():
            nxt = info["next_lease_end_s"]
            lease = "–" if nxt is None else (f"in {_age(nxt)}" if nxt >= 0
                                             else '<span class="bad">overdue</span>')
            out.append(f"<tr><td>{escape(c or '(working/)')}</td><td>{info['in_flight']:,}"
                       f"</td><td>{_age(info['oldest_claim_age_s'])}</td><td>{lease}</td>"
                       f"<td>{_age(info.get('last_activity_age_s'))}</td></tr>")
        out.append("</table>")
    abandoned = q["abandoned"]
    cls = "bad" if abandoned else "quiet"
    out.append(f'<p class="{cls}">error/: {abandoned:,} abandoned, '
               f"{q['waiting_retry']:,} waiting for a retry</p></section>")
    return "".join(out)


def render(snap: dict[str, Any]) -> bytes:
    d = snap["disk"]
    pct = 100 * d["free_bytes"] // max(d["total_bytes"], 1)
    queues = "".join(_queue(name, q) for name, q in snap["queues"].items()) or \
        '<section><p class="quiet">No queues yet: mkdir MOUNT/NAME makes one.</p></section>'
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width,initial-scale=1">
<meta http-equiv="refresh" content="{REFRESH_S}">
<title>spoolfs: {escape(snap['store'])}</title>
<style>{_STYLE}</style></head>
<body><h1>spoolfs</h1>
<div class="meta">{escape(snap['store'])} · {escape(snap['time'])} · refreshes every
{REFRESH_S} s</div>
{queues}
<section class="disk">disk: {_size(d['free_bytes'])} free of {_size(d['total_bytes'])}
({pct}%), {d['free_inodes']:,} inodes free</section>
</body></html>
""".encode()
