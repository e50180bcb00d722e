"""Fine-tune with the HF Trainer: a launcher-friendly file for finetune.training.trainer.

    python finetune/train.py --model_name_or_path MODEL --dataset data.jsonl --output_dir out
    accelerate launch --multi_gpu --num_processes 2 finetune/train.py --config zero3 ...
    torchrun --nproc_per_node 2 finetune/train.py --config zero2 ...

`finetune train` runs the same code; `finetune train --help` lists every flag.
"""

import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a file: import the `finetune` package, not this folder's modules as top-level names.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from finetune.compat import check_versions
from finetune.process import run_rank
from finetune.training.trainer import main

if __name__ == "__main__":
    check_versions()
    run_rank(main, own_process=True, resume_hint=True)  # ends without the interpreter shutdown once done (finetune.process)
