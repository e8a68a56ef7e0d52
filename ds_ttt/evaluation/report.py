"""Evaluation outputs: results.json, a Markdown summary (summary.md) and PNG plots (matplotlib, Agg).

Plots: `loss_vs_round.png` — action NLL (left) and observation NLL (right) against the round index,
ttt vs frozen (for ttt also the observation NLL after its update); `exact_vs_round.png` — action and
observation exact-match rates against the round index.
"""

from __future__ import annotations

import json
import pathlib


def _fmt(x, digits=3) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _count(c) -> str:
    return f"{c[0]}/{c[1]}" if c and c[1] else "–"


SUMMARY_ROWS = (
    ("action NLL", "action_nll", None),
    ("action token accuracy", "action_token_acc", None),
    ("action exact match", "action_exact", "action_exact_count"),
    ("observation NLL (before its update)", "obs_nll", None),
    ("observation NLL after its update", "obs_nll_after", None),
    ("observation exact match (with end token)", "obs_exact", "obs_exact_count"),
    ("memory fact exact", "memory_fact_exact", "memory_fact_count"),
    ("memory-check action exact match", "memory_action_exact", "memory_action_exact_count"),
    ("memory-check action NLL", "memory_action_nll", None),
    ("recovery action NLL (after a failing command)", "recovery_action_nll", None),
)


def markdown_summary(results: dict, title: str = "Held-out evaluation") -> str:
    modes = results["modes"]
    lines = [f"# {title}", ""]
    exp = results.get("exposure") or {}
    if exp:
        lines += [f"- exposure: **{exp.get('label')}** — {exp.get('detail', '')}"]
    ck = results.get("checkpoint") or {}
    man = results.get("manifest") or {}
    cfg = results.get("config") or {}
    sha = ck.get("sha256") or ck.get("export_sha256")
    lines += [f"- checkpoint: `{ck.get('path')}` ({ck.get('kind')}, step {ck.get('step')}, sha256 {str(sha)[:16]})",
              f"- manifest: `{man.get('path')}` (sha256 {str(man.get('sha256'))[:16]}, split {man.get('split')}, "
              f"{results.get('num_trajectories')} trajectories)",
              f"- config sha256 {str(cfg.get('sha256'))[:16]}, context policy `{cfg.get('context_policy')}` "
              f"(trained: `{cfg.get('context_policy_trained', cfg.get('context_policy'))}`)", ""]
    s = results["summary"]
    lines += ["| metric | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    for label, key, count in SUMMARY_ROWS:
        cells = []
        for m in modes:
            v = _fmt(s[m].get(key))
            if count and s[m].get(count) and s[m][count][1]:
                v += f" ({_count(s[m][count])})"
            cells.append(v)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "## Per round", "",
              "| round | n | " + " | ".join(f"{m} action NLL | {m} obs NLL | {m} act EM | {m} obs EM" for m in modes) + " |",
              "|---|---|" + "---|" * (4 * len(modes))]
    per = {m: {r["round"]: r for r in results["per_round"][m]} for m in modes}
    for rnd in sorted(per[modes[0]]):
        cells = []
        for m in modes:
            r = per[m].get(rnd, {})
            cells += [_fmt(r.get("action_nll")), _fmt(r.get("obs_nll")), _count(r.get("action_exact_count")),
                      _count(r.get("obs_exact_count"))]
        lines.append(f"| {rnd} | {per[modes[0]][rnd]['num_trajectories']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_plots(results: dict, out_dir: str | pathlib.Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out = pathlib.Path(out_dir)
    modes = results["modes"]
    style = {"ttt": dict(color="tab:blue", marker="o"), "frozen": dict(color="tab:gray", marker="s")}
    files = []

    def save(fig, axes, titles, name, *, ylabel=None, ylim=None):
        """Per-round axes (integer rounds, titles, grid, legend), then write OUT/name and close the figure."""
        for ax, title in zip(axes, titles):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel("round")
            if ylabel is not None:
                ax.set_ylabel(ylabel)
            if ylim is not None:
                ax.set_ylim(*ylim)
            ax.set_title(title)
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        files.append(name)

    def series(m, key):
        rows = results["per_round"][m]
        pts = [(r["round"], r[key]) for r in rows if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for m in modes:
        axes[0].plot(*series(m, "action_nll"), label=m, **style.get(m, {}))
        axes[1].plot(*series(m, "obs_nll"), label=f"{m} (before its update)" if m == "ttt" else m, **style.get(m, {}))
        if m == "ttt":
            axes[1].plot(*series(m, "obs_nll_after"), label="ttt (after update)", linestyle="--", color="tab:orange",
                         marker="^")
    save(fig, axes, ("action NLL", "observation NLL"), "loss_vs_round.png", ylabel="NLL (nats/token)")

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for m in modes:
        axes[0].plot(*series(m, "action_exact"), label=m, **style.get(m, {}))
        axes[1].plot(*series(m, "obs_exact"), label=m, **style.get(m, {}))
    save(fig, axes, ("action exact match", "observation exact match (with end token)"), "exact_vs_round.png",
         ylim=(-0.05, 1.05))
    return files


def write_results(results: dict, out_dir: str | pathlib.Path, *, title: str = "Held-out evaluation",
                  plots: bool = True) -> dict[str, str]:
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if plots:
        results["plots"] = write_plots(results, out)
    (out / "results.json").write_text(json.dumps(results, indent=1, sort_keys=False, default=str) + "\n")
    (out / "summary.md").write_text(markdown_summary(results, title))
    return {"results": str(out / "results.json"), "summary": str(out / "summary.md")}
