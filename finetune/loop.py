"""Fine-tune with a plain accelerate loop you can read and change: a launcher-friendly file for
finetune.training.loop.

    accelerate launch --multi_gpu --num_processes 2 finetune/loop.py --config zero2 \
        --model_name_or_path MODEL --dataset data.jsonl --output_dir out

`finetune loop` runs the same code.
"""

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from finetune.compat import check_versions
from finetune.process import run_rank
from finetune.training.loop import main

if __name__ == "__main__":
    check_versions()
    run_rank(main, own_process=True, resume_hint=True)  # ends without the interpreter shutdown once done (finetune.process)
