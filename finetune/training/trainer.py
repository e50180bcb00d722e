"""The HF Trainer path (`finetune train`, finetune/train.py): the entry point that reads config, model, data,
trainer, train, save; the Trainer with narrow overrides (DistributedSampler data order, resumable step checkpoints)
is finetune.training.hf_trainer's.

The stock Trainer deals whole batches of one seeded permutation round-robin over the ranks; the
prepare() loop and the DeepSpeed script use DistributedSampler's order. One order for all three paths
(finetune.data.sampler) is what lets their losses agree step for step.

Checkpoints: the Trainer writes them; we add the completion marker once every rank is done
(finetune.training.checkpoint), and make a resumed DeepSpeed optimizer continue bit for bit.
"""

from __future__ import annotations

import os

from finetune.training import checkpoint, core, evaluate, faults
from finetune import config as C
from finetune.data.prepare import make_collator
from finetune.models import attention
from finetune.process import exit_with
from finetune.training.lifecycle import describe_run, plan_or_exit, rank0_print, resume_or_exit, save_final
from finetune.models.verify import VerificationError


def main(argv: list[str] | None = None, callbacks: list | None = None) -> None:
    # Config: every problem is reported at once, before anything heavy happens. TrainingArguments is
    # built here, before the model, so that ZeRO-3 loads the weights already partitioned.
    core.start_run()  # no rank outlives its launcher; no silent wait
    cfg = C.load_or_exit(argv)
    args = cfg.training
    plan_or_exit(cfg)
    # Only now the libraries (torch, transformers, peft: seconds): a flag mistake is reported without them.
    import transformers

    from finetune.models.load import WeightsError, load_model
    from finetune.training.hf_trainer import StopPoint, Trainer

    # Resume: `latest` is the newest complete checkpoint; one saved for another world size or ZeRO stage is refused.
    resume = resume_or_exit(cfg, path="trainer", world_size=args.world_size)

    # Tokenizer and data: tokenized once per node, cached; bad records stop the run here.
    dpo = cfg.objective.method == "dpo"
    if dpo:  # preference pairs (finetune.training.dpo), evaluated by its own evaluate
        from finetune.training import dpo as preference

        tokenizer, pairs, held_out, stats = preference.pairs_or_exit(cfg, args.local_process_index)
        train_dataset, eval_dataset = pairs.dataset, None
    else:
        tokenizer, train_dataset, eval_dataset, stats = evaluate.datasets_or_exit(cfg, args.local_process_index)

    # Model (and LoRA).
    try:
        model = load_model(cfg.model, args)
    except WeightsError as e:
        exit_with(str(e))
    attention.enable(model, cfg)
    rank0_print(describe_run(cfg, stats, model))
    core.install_loss(model, cfg)

    # Trainer: the HF Trainer, data in DistributedSampler order; loss is normalized by the trained tokens of
    # the whole global batch (average_tokens_across_devices), so how the batch is split does not matter.
    callbacks = list(callbacks or [])  # TrainerCallbacks of a caller (the quickstart's progress bar and time bound)
    if cfg.evaluation.early_stopping_patience:
        callbacks.append(transformers.EarlyStoppingCallback(cfg.evaluation.early_stopping_patience,
                                                            cfg.evaluation.early_stopping_threshold))
    if os.environ.get(faults.STOP_VAR):
        callbacks.append(StopPoint())
    if dpo:
        trainer = preference.make_trainer(cfg, model, tokenizer, pairs, held_out, resume, callbacks)
    else:
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            data_collator=make_collator(cfg, tokenizer),
            processing_class=tokenizer,
            callbacks=callbacks,
        )
    trainer.fingerprint = cfg.fingerprint
    trainer.eval_set = evaluate.eval_set(cfg, tokenizer, eval_dataset)

    # Train.
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)

    # Save: full model (consolidated under ZeRO-3) or adapter, tokenizer, per-step losses; atomically.
    try:
        save_final(trainer, args.output_dir, cfg)
    except VerificationError as e:
        exit_with(str(e))
    rank0_print(f"saved to {args.output_dir}")
    checkpoint.end_process_group()


if __name__ == "__main__":
    main()
