"""Token-level view of the memory test: where does a readback go wrong?

    .venv/bin/python benchmarks/readback_inspect.py --checkpoint runs/main/run [--worlds 3] [--mode ttt]

For the first N memory-test worlds (the same worlds as evals/memory_test.py), prints the keys, then
for each readback round (`cat vault/<name>.key`) and the final summary action, every scored token
as `label`, or `label≠prediction` where the greedy prediction (teacher forcing on the real history)
differs. Use it to see which tokens the fast weights miss: the first token of a key, tokens that
repeat inside a key, or the end of the key.
"""

from __future__ import annotations

import argparse
import pathlib

import torch

from ds_ttt.data.token_kind import TokenKind


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="training run / checkpoint directory, or an export")
    ap.add_argument("--worlds", type=int, default=3)
    ap.add_argument("--mode", choices=("ttt", "frozen"), default="ttt")
    args = ap.parse_args()
    from ds_ttt.data.render import render_trajectory
    from ds_ttt.evaluation.memory import memory_worlds
    from ds_ttt.loading import load_for_inference

    loaded = load_for_inference(args.checkpoint)
    model, tok = loaded.model, loaded.tokenizer
    print(f"checkpoint {args.checkpoint}: context policy {model.ttt.context_policy}, mode {args.mode}")
    for world in memory_worlds(args.worlds):
        r = render_trajectory(world, tok)
        with torch.no_grad():
            out = model.trajectory_loss(torch.tensor([r.input_ids]), torch.tensor([r.kinds]), torch.tensor([r.rounds]),
                                        create_graph=False, update=args.mode == "ttt", record=True)
        by_round = {e.round: e for e in out.records[0]}
        print(f"\n== world seed {world['meta']['seed']}: keys {world['meta']['values']}")
        rounds = [(rb["round"], TokenKind.OBSERVATION) for rb in world["meta"]["readbacks"]]
        rounds.append((world["meta"]["memory_checks"][0]["round"], TokenKind.ACTION))
        for rnd, kind in rounds:
            ev = by_round[rnd]
            kinds, labels, preds = ev.label_kinds.tolist(), ev.labels.tolist(), ev.argmax.tolist()
            cells = []
            for i, (k, lab, pred) in enumerate(zip(kinds, labels, preds)):
                closes_obs = kind == TokenKind.OBSERVATION and i > 0 and kinds[i - 1] == TokenKind.OBSERVATION and k != TokenKind.OBSERVATION
                if k == kind or closes_obs:
                    cell = repr(tok.decode([lab]))
                    cells.append(cell if lab == pred else f"{cell}≠{tok.decode([pred])!r}")
            what = "readback (observation + closing token)" if kind == TokenKind.OBSERVATION else "summary action"
            wrong = sum("≠" in c for c in cells)
            print(f"  round {rnd} {what}: {wrong} of {len(cells)} tokens wrong")
            print("   ", " ".join(cells))


if __name__ == "__main__":
    main()
