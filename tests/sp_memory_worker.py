"""One rank of the engine path (scripts/sft.py) that also records its peak resident memory: VmHWM (bench/memory.py's
measure), written to OUT/hwm-RANK every 50 ms while it runs, the last value read before the rank ends.

    deepspeed --num_gpus 2 tests/sp_memory_worker.py OUT -- ENGINE FLAGS      (tests/test_sequence_parallel.py)
"""

import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# DeepSpeed's launcher puts --local_rank=N first: OUT is the word before "--".
_at = sys.argv.index("--")
OUT = Path(sys.argv[_at - 1])
del sys.argv[_at - 1:_at + 1]


def _watch() -> None:
    rank = os.environ.get("RANK", "0")
    while True:
        with open("/proc/self/status") as f:
            kib = next(line for line in f if line.startswith("VmHWM:")).split()[1]
        tmp = OUT / f".hwm-{rank}"
        tmp.write_text(kib)
        os.replace(tmp, OUT / f"hwm-{rank}")
        time.sleep(0.05)


if __name__ == "__main__":
    from finetune.process import run_rank
    from finetune.training.engine import main

    OUT.mkdir(parents=True, exist_ok=True)
    threading.Thread(target=_watch, daemon=True).start()
    run_rank(main, own_process=True)
