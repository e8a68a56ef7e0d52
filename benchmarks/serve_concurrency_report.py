"""The markdown of benchmarks/serve_concurrency.py: the table, the ratios, what the run ran on.

    from serve_concurrency_report import markdown
    pathlib.Path("benchmarks/results/serve_concurrency.md").write_text(markdown(res))   # res: the run's JSON

Run benchmarks/serve_concurrency.py, not this file; it imports this.
"""

from __future__ import annotations


def ran_on(res: dict) -> str:
    """The markdown line saying what the run ran on (a result without the record says so)."""
    m = res.get("machine")
    if m is None:
        return "What it ran on was not recorded (a run before the benchmark recorded it)."
    one = res.get("one_session_decode_tokens_per_s")
    load = ", ".join(f"{x:.2f}" for x in res["load_start"]) + " at the start, " + \
        ", ".join(f"{x:.2f}" for x in res["load_end"]) + " at the end"
    return (f"Ran on: {m['cpu_model']} ({m['cpu_count']} CPUs)" + (f", GPU {m['gpu']}" if m.get("gpu") else "")
            + f", device {m['device']}; one-session decode rate (batched server) "
            + (f"{one:.1f} tokens/s" if one else "not measured (no level of 1 session)")
            + f"; load average (1, 5, 15 min) {load}.")


def table_reps(res: dict) -> str:
    """What the table's medians are over: the repeats, or (--repeats 0) the paired rounds."""
    return f"{res['repeats']} repeats" if res["repeats"] else f"the {res['pairs']} paired rounds"


def markdown(res: dict) -> str:
    shape = res.get("shape") or ("wide" if res.get("wide") else "tiny-mem")
    lines = [f"# Serving concurrency (benchmarks/serve_concurrency.py)", "",
             f"Model: {res['model']['preset']}{'' if shape == 'tiny-mem' else f' with the {shape} backbone'} "
             f"({res['model']['num_layers']} layers, hidden {res['model']['hidden']}), "
             f"vocab {res['model']['vocab_size']}; greedy, {res['max_tokens']} new tokens per request, "
             f"{table_reps(res)} (medians); one thread per server process; "
             + (f"today = {res['base_commit'][:7]}. " if res["base_commit"] else
                "today's server not run. ")
             + (f"against = {res['against']['rev']} ({res['against']['commit'][:7]}). " if res.get("against") else "")
             + f"Same replies on every server: {res['same_replies']}.", "",
             ran_on(res), "",
             "Aggregate tokens/s: every completion token over the wall time of the level (prefill, HTTP and all). "
             "Decode tokens/s (batched servers only): tokens fed through batched forwards over the scheduler's time "
             "in them (its /health counters), i.e. the batch's decode rate without the prefill and turn-end "
             "chunks interleaved with it.", "",
             "| sessions | server | aggregate tokens/s | decode tokens/s | p50 ms/token | p95 ms/token |",
             "|---|---|---|---|---|---|"]
    for n in res["levels"]:
        for name, rows in res["table"].items():
            r = rows[n] if n in rows else rows[str(n)]
            dec = f"{r['decode_tokens_per_s']:.1f}" if r.get("decode_tokens_per_s") else "-"
            lines.append(f"| {n} | {name} | {r['tokens_per_s']:.1f} | {dec} | {r['p50_ms']:.1f} | {r['p95_ms']:.1f} |")
    def row(label: str, key: str) -> str:
        return f"| {label} | " + " | ".join(f"x{v['median']:.2f} [{v['min']:.2f}, {v['max']:.2f}]"
                                            for v in res[key].values()) + " |"
    lines += ["", f"Ratios per repeat (the levels of one repeat run back to back), median [min, max] over "
              f"{table_reps(res)}:", "",
              "| ratio | " + " | ".join(f"{n} sessions" for n in res["levels"]) + " |",
              "|---|" + "---|" * len(res["levels"]),
              row("batched decode tokens/s vs batched at one session", "decode_speedup_vs_one"),
              row("batched aggregate vs batched at one session", "speedup_vs_one"),
              row("batched aggregate vs the fastest server at one session", "speedup_vs_best_one"),
              *([row("batched aggregate vs today's server at the same concurrency", "speedup_vs_today")]
                if res["speedup_vs_today"] else []), ""]

    def paired_row(label: str, values: dict) -> str:
        return f"| {label} | " + " | ".join(f"x{v['median']:.2f} [{v['lo']:.2f}, {v['hi']:.2f}]"
                                            for v in values.values()) + " |"
    ag = res.get("against")
    lines += [f"Paired: the batched server alone, its levels back to back in each of {res['pairs']} rounds (the "
              "ratio to one session within a round); median with a bootstrap 95% interval over rounds"
              + (f"; with --against, {ag['rev']}'s batched server in the same rounds, the order alternating" if ag
                 else "") + ":", "",
              "| ratio | " + " | ".join(f"{n} sessions" for n in res["levels"]) + " |",
              "|---|" + "---|" * len(res["levels"]),
              paired_row("batched decode tokens/s vs one session", res["paired_decode_speedup"]),
              paired_row("batched aggregate tokens/s vs one session", res["paired_speedup"]),
              *([paired_row(f"{ag['rev']}: batched decode tokens/s vs one session", ag["paired_decode_speedup"]),
                 paired_row(f"scaling ratio, this tree over {ag['rev']}", ag["scaling_ratio_over_against"]),
                 paired_row(f"decode tokens/s, this tree over {ag['rev']}", ag["decode_over_against"])] if ag else []),
              ""]
    return "\n".join(lines)
