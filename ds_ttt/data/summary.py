"""Plain-text summary tables printed at the end of the data scripts."""

from __future__ import annotations


def format_table(rows: list[list], headers: list[str]) -> str:
    cells = [[str(h) for h in headers]] + [[f"{c:,}" if isinstance(c, int) and not isinstance(c, bool) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

    def fmt(r):
        return "| " + " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) + " |"

    return "\n".join([line, fmt(cells[0]), line] + [fmt(r) for r in cells[1:]] + [line])
