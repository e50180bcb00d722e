"""The engine path's launcher: fine-tune under DeepSpeed's own launcher, driving the engine directly
(finetune.training.engine). The file keeps its name, so `deepspeed scripts/sft.py` lines stay as they were.

    deepspeed --num_gpus 2 scripts/sft.py --deepspeed ds_configs/zero2.json \
        --model_name_or_path MODEL --dataset data.jsonl --output_dir out
    deepspeed --hostfile hosts scripts/sft.py --config zero3 ...      # several nodes

`finetune engine` runs the same code (the engine path; `finetune sft` is its former name).
"""

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from finetune.compat import check_versions
from finetune.process import run_rank
from finetune.training.engine import main

if __name__ == "__main__":
    check_versions()
    run_rank(main, own_process=True, resume_hint=True)  # ends without the interpreter shutdown once done (finetune.process)
