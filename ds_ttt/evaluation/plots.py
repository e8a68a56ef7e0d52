"""What the reports' plots share: pyplot without a display, the colour of a row's mode, and a bar per row
with its 95% interval.

    from ds_ttt.evaluation.plots import pyplot, mode_color, interval_bars
    plt = pyplot()
    fig, ax = plt.subplots()
    interval_bars(ax, rows, "success", labels, [mode_color(r["mode"]) for r in rows], title="task success")

Used by comparison.py (the teacher-forced baselines report) and agent_report.py (the closed-loop report).
"""

from __future__ import annotations

FROZEN_GREY, TTT_BLUE, SFT_ORANGE = "#bbbbbb", "#1f77b4", "#ff7f0e"


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def mode_color(mode: str, *, frozen: bool | None = None) -> str:
    """Grey for a TTT model with its updates off (`frozen`, default: mode == "frozen"), blue for TTT, orange
    for an ordinary model."""
    if frozen if frozen is not None else mode == "frozen":
        return FROZEN_GREY
    return TTT_BLUE if mode == "ttt" else SFT_ORANGE


def interval_bars(ax, rows: list[dict], key: str, labels: list[str], colors: list[str], *, title: str,
                  unit_range: bool = False) -> None:
    """One bar per row at row[key] (None drawn as 0) with error bars to row[key_lo] and row[key_hi]; a
    percentile interval may sit slightly off its point estimate, so each side is clamped at zero length."""
    vals = [r[key] or 0.0 for r in rows]
    err = [[max(0.0, v - (r[f"{key}_lo"] or 0)) for v, r in zip(vals, rows)],
           [max(0.0, (r[f"{key}_hi"] or 0) - v) for v, r in zip(vals, rows)]]
    ax.bar(range(len(rows)), vals, yerr=err, color=colors, capsize=3)
    ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=30, ha="right")
    if unit_range:
        ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=10)


def save_figure(fig, path, *, title: str) -> None:
    """The figure's overall title, a tight layout, PATH at 110 dpi, and the figure closed."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report_files(report: dict, out_prefix, *, markdown, write_plot) -> dict[str, str]:
    """PREFIX.json (the report), PREFIX.md (`markdown(report)`) and PREFIX.png (`write_plot(report, path)`);
    returns {"json" | "md" | "png": path}."""
    import json
    import pathlib

    out = pathlib.Path(out_prefix)
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = {k: str(out.with_suffix(f".{k}")) for k in ("json", "md", "png")}
    pathlib.Path(paths["json"]).write_text(json.dumps(report, indent=1) + "\n")
    pathlib.Path(paths["md"]).write_text(markdown(report))
    write_plot(report, paths["png"])
    return paths
