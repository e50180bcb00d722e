"""The finished-rank exit abort, outside finetune: RUNS times, two forked ranks join a gloo group, check their collectives
and end, `shutdown` through the interpreter's shutdown or `end_finished_process` by finetune.process. torch is
imported once and each rank is a fork, so a run costs the rendezvous and the exit, not the import (about 0.5 s a run on
2 loaded cores by end_finished_process, 5-6 s through the shutdown). Prints one JSON line: runs, exits (rank exits,
2 a run), aborts (ranks killed by SIGABRT: "terminate called without an active exception"), failures (other non-zero
exits) and wrong (ranks whose collectives gave a wrong result).

usage: python tests/exit_abort_worker.py shutdown|end_finished_process|destroy_process_group[+kept] RUNS
(destroy_process_group: then through the shutdown; +kept: a reference to the group is kept past it.)
(end_finished_process ends only a launched rank: start this with LOCAL_RANK set.)"""

import datetime
import json
import os
import signal
import sys

import torch
import torch.distributed as dist

from finetune import process
from finetune.testing import free_port

WRONG = 3
KEPT = []


def rank_main(rank: int, port: int, ending: str) -> None:
    # Meant to widen the race window (the main thread keeps the GIL up to 1 s after a gloo worker asks for it).
    # Through the shutdown, 18 of 200 rank exits aborted here (100 runs); its effect alone was not measured.
    sys.setswitchinterval(1.0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    t = torch.ones(1000)
    for _ in range(5):
        dist.all_reduce(t)
    dist.barrier()
    obj = [f"from rank {rank}"]
    # The last collective before the exit, as in the aborts' cores: a broadcast whose work (and its tensors, which
    # have Python objects) a gloo worker thread drops after the main thread's wait() has returned.
    dist.broadcast_object_list(obj, src=0)
    if t[0].item() != 32.0 or obj != ["from rank 0"]:
        os._exit(WRONG)
    if ending.startswith("destroy_process_group"):
        if ending.endswith("+kept"):
            KEPT.append(dist.group.WORLD)  # as a library's engine or state object keeps its group
        dist.destroy_process_group()
    if ending == "end_finished_process":
        process.end_finished_process(0)
        os._exit(WRONG)  # end_finished_process returned: not a launched rank


def main(ending: str, runs: int) -> dict:
    counts = {"runs": runs, "exits": 0, "aborts": 0, "failures": 0, "wrong": 0}
    for _ in range(runs):
        port = free_port()
        pids = []
        for rank in (0, 1):
            pid = os.fork()
            if pid == 0:
                try:
                    rank_main(rank, port, ending)
                except BaseException:  # noqa: BLE001 - a forked rank must never return into the loop
                    import traceback

                    traceback.print_exc()
                    os._exit(1)
                sys.exit(0)  # the child ends through the interpreter's shutdown, as a script's end does
            pids.append(pid)
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            counts["exits"] += 1
            if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGABRT:
                counts["aborts"] += 1
            elif os.waitstatus_to_exitcode(status) == WRONG:
                counts["wrong"] += 1
            elif os.waitstatus_to_exitcode(status) != 0:
                counts["failures"] += 1
    return counts


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))), flush=True)
