"""DeepSpeed's 1F1B TrainSchedule simulated with unequal stage times (pipeline_balance's `schedule`).

    from pipeline_balance.simulate import simulate_train_schedule, uniform_bubble   # benchmarks/ on sys.path
    simulate_train_schedule(fwd_s, bwd_s)["step_s"]   # fwd_s[s][m], bwd_s[s][m]: seconds per stage, micro-batch

Run through `.venv/bin/python benchmarks/pipeline_balance` (the package docstring).
"""

from __future__ import annotations

from dataclasses import dataclass

@dataclass(frozen=True)
class Op:
    kind: str  # "F", "B" (compute), "send_act", "recv_act", "send_grad", "recv_grad"
    micro: int  # for F/B: the micro-batch (forward and backward passes run in micro-batch order)


def train_schedule_ops(num_micro: int, num_stages: int, stage: int) -> list[Op]:
    """Stage `stage`'s instruction stream of deepspeed.runtime.pipe.schedule.TrainSchedule, reduced to
    compute and p2p (loads, tied/dp reductions and the optimizer step are outside the model)."""
    from deepspeed.runtime.pipe import schedule as ds_schedule

    names = {ds_schedule.ForwardPass: "F", ds_schedule.BackwardPass: "B",
             ds_schedule.SendActivation: "send_act", ds_schedule.RecvActivation: "recv_act",
             ds_schedule.SendGrad: "send_grad", ds_schedule.RecvGrad: "recv_grad"}
    ops, counts = [], {"F": 0, "B": 0}
    sched = ds_schedule.TrainSchedule(micro_batches=num_micro, stages=num_stages, stage_id=stage)
    for cmds in sched.steps():
        for cmd in cmds:
            kind = names.get(type(cmd))
            if kind is None:
                continue
            if kind in counts:
                ops.append(Op(kind, counts[kind]))
                counts[kind] += 1
            else:
                ops.append(Op(kind, -1))
    assert counts == {"F": num_micro, "B": num_micro}, counts
    return ops


def simulate_train_schedule(fwd_s, bwd_s, *, cores: float | None = None, background: float = 0.0,
                            blocking_send: bool = True) -> dict:
    """Step time of DeepSpeed's 1F1B TrainSchedule for one or more data-parallel replicas.

    fwd_s[r][s][m], bwd_s[r][s][m]: seconds of the forward / backward of micro-batch m on stage s of
    replica r (a 2-level [s][m] list is one replica). Every rank executes its TrainSchedule stream in
    order; a compute op takes its time; a p2p op waits for its peer (blocking_send: the k-th send and
    the k-th receive of a channel complete together; otherwise a send never waits). `cores`: ranks
    share this many cores with `background` other runnable processes (processor sharing: with n
    computing ranks each runs at min(1, cores/(n + background)), relative to the one process that
    measured the times, which ran at min(1, cores/(1 + background))); None = a dedicated device per rank. The step ends when the slowest rank ends (the engine's loss
    broadcast and the gradient all-reduce synchronise all ranks). Raises on a deadlock.

    Returns step_s, per-rank busy seconds, utilisation = busy / step, and the bubble
    1 - sum(busy) / (ranks x step).
    """
    if fwd_s and fwd_s[0] and not isinstance(fwd_s[0][0], (list, tuple)):
        fwd_s, bwd_s = [fwd_s], [bwd_s]
    num_rep, num_stages, num_micro = len(fwd_s), len(fwd_s[0]), len(fwd_s[0][0])
    ranks = [(r, s) for r in range(num_rep) for s in range(num_stages)]
    progs = {rk: train_schedule_ops(num_micro, num_stages, rk[1]) for rk in ranks}
    pc = dict.fromkeys(ranks, 0)
    remaining: dict = {}  # rank -> seconds of work left in the current compute op
    arrived: dict = {}  # (replica, src, dst, kind) -> [sends arrived, receives arrived]
    my_index: dict = {}  # rank -> (channel, k, side) registered for the current p2p op
    busy = dict.fromkeys(ranks, 0.0)
    finish = dict.fromkeys(ranks, 0.0)
    t = 0.0

    def channel(rk, op):
        r, s = rk
        if op.kind == "send_act":
            return (r, s, s + 1, "act"), 0
        if op.kind == "recv_act":
            return (r, s - 1, s, "act"), 1
        if op.kind == "send_grad":
            return (r, s, s - 1, "grad"), 0
        return (r, s + 1, s, "grad"), 1  # recv_grad

    while True:
        progressed = True
        while progressed:  # start compute ops and complete every p2p op that can complete now
            progressed = False
            for rk in ranks:
                if rk in remaining or pc[rk] >= len(progs[rk]):
                    continue
                op = progs[rk][pc[rk]]
                if op.kind in ("F", "B"):
                    r, s = rk
                    remaining[rk] = (fwd_s if op.kind == "F" else bwd_s)[r][s][op.micro]
                    progressed = True
                    continue
                if rk not in my_index:
                    ch, side = channel(rk, op)
                    cnt = arrived.setdefault(ch, [0, 0])
                    my_index[rk] = (ch, cnt[side], side)
                    cnt[side] += 1
                    progressed = True
                ch, k, side = my_index[rk]
                other = arrived[ch][1 - side]
                done = other > k if (side == 1 or blocking_send) else True
                if done:
                    del my_index[rk]
                    pc[rk] += 1
                    finish[rk] = t
                    progressed = True
        if all(pc[rk] >= len(progs[rk]) for rk in ranks):
            break
        if not remaining:
            stuck = {f"replica {r} stage {s}": progs[(r, s)][pc[(r, s)]].kind for (r, s) in ranks
                     if pc[(r, s)] < len(progs[(r, s)])}
            raise RuntimeError(f"pipeline schedule deadlocked at t={t:.6g}: {stuck}")
        rate = 1.0 if cores is None else (min(1.0, cores / (len(remaining) + background))
                                          / min(1.0, cores / (1.0 + background)))
        dt = min(remaining.values()) / rate
        t += dt
        for rk in list(remaining):
            remaining[rk] -= dt * rate
            busy[rk] += dt * rate  # work done (device-seconds at full speed)
            if remaining[rk] <= 1e-12 * max(1.0, t):
                del remaining[rk]
                pc[rk] += 1
                finish[rk] = t
    step = max(finish.values())
    util = {f"{r}/{s}": (busy[(r, s)] / step if step > 0 else 0.0) for (r, s) in ranks}
    return {"step_s": step, "busy_s": {f"{r}/{s}": busy[(r, s)] for (r, s) in ranks}, "utilisation": util,
            "bubble": 1.0 - sum(busy.values()) / (len(ranks) * step) if step > 0 else 0.0,
            "num_micro": num_micro, "num_stages": num_stages, "num_replicas": num_rep,
            "cores": cores, "background": background, "blocking_send": blocking_send}


def uniform_bubble(num_micro: int, num_stages: int) -> float:
    """The textbook 1F1B/GPipe bubble for equal stages: (S - 1) / (M + S - 1)."""
    return (num_stages - 1) / (num_micro + num_stages - 1)
