"""Fine-tune a Llama-style causal LM with the Hugging Face Trainer.

    python finetune/train.py --model_name_or_path MODEL --dataset data.jsonl --output_dir out
    accelerate launch --multi_gpu --num_processes 2 finetune/train.py --config zero3 ...
    accelerate launch --config_file accelerate_configs/zero3.yaml finetune/train.py --config zero3 ...
    torchrun --nproc_per_node 2 finetune/train.py --config zero2 ...

`--config` picks the parallelism (ddp, zero1, zero2, zero3 = ZeRO-3 with CPU offload, or a DeepSpeed
JSON); it changes memory and speed, never the losses. `finetune train --help` lists every flag.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a file: import the `finetune` package, not this folder's modules as top-level names.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from finetune import checkpoint
from finetune import config as C
from finetune.data import make_collator
from finetune.model import load_model
from finetune.outputs import data_or_exit, describe_run, exit_with, plan_or_exit, rank0_print, resume_or_exit, save_final
from finetune.verify import VerificationError
from finetune.trainer import Trainer


def main(argv: list[str] | None = None, callbacks: list | None = None) -> None:
    # Config: every problem is reported at once, before anything heavy happens. TrainingArguments is
    # built here, before the model, so that ZeRO-3 loads the weights already partitioned.
    cfg = C.load_or_exit(argv)
    args = cfg.training
    plan_or_exit(cfg)

    # Resume: `latest` is the newest complete checkpoint; one saved for another world size or ZeRO stage is refused.
    resume = resume_or_exit(cfg, path="trainer", world_size=args.world_size)

    # Tokenizer and data: tokenized once per node, cached; bad records stop the run here.
    tokenizer, train_dataset, stats = data_or_exit(cfg, args.local_process_index)

    # Model (and LoRA).
    model = load_model(cfg.model, args)
    rank0_print(describe_run(cfg, stats, model))

    # Trainer: the HF Trainer, data in DistributedSampler order; loss is normalized by the trained tokens of
    # the whole global batch (average_tokens_across_devices), so how the batch is split does not matter.
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        data_collator=make_collator(cfg, tokenizer),
        processing_class=tokenizer,
        callbacks=callbacks,  # TrainerCallbacks of a caller (the quickstart's progress bar and time bound)
    )
    if args.process_index == 0:
        C.save_resolved(cfg, args.output_dir)

    # Train.
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)

    # Save: full model (consolidated under ZeRO-3) or adapter, tokenizer, per-step losses; atomically.
    try:
        save_final(trainer, args.output_dir)
    except VerificationError as e:
        exit_with(str(e))
    rank0_print(f"saved to {args.output_dir}")
    checkpoint.end_process_group()


if __name__ == "__main__":
    main()
