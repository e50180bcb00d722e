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

from finetune.training import checkpoint, core, evaluate, examples, faults
from finetune import methods
from finetune.models import attention
from finetune.process import exit_with
from finetune.training.lifecycle import describe_run, finish_run, rank0_print, resume_or_exit, save_final_trainer
from finetune.models.verify import VerificationError


def main(argv: list[str] | None = None, callbacks: list | None = None) -> None:
    # Config: every problem is reported at once, before anything heavy happens. TrainingArguments is
    # built here, before the model, so that ZeRO-3 loads the weights already partitioned.
    cfg = core.start(argv, "finetune train")
    args = cfg.training
    # Only now the libraries (torch, transformers, peft: seconds): a flag mistake is reported without them.
    import transformers

    from finetune.models.load import WeightsError, load_model
    from finetune.training.hf_trainer import StopPoint

    # Resume: `latest` is the newest complete checkpoint; one saved for another world size or ZeRO stage is refused.
    resume = resume_or_exit(cfg, path="trainer", world_size=args.world_size)

    # Tokenizer and data: the method's examples (finetune.methods), tokenized once per node, cached; bad records
    # stop the run here.
    method = methods.get(cfg.objective.method)
    if "trainer" not in method.paths:
        exit_with(f"method {method.name}: not supported by finetune/train.py")
    tokenizer, train, held_out, stats = examples.datasets_or_exit(cfg, method, args.local_process_index)
    collator = method.collator(cfg, tokenizer)

    # Model (and LoRA).
    try:
        model = load_model(cfg.model, args, task=method.task)
    except WeightsError as e:
        exit_with(str(e))
    attention.enable(model, cfg)
    rank0_print(describe_run(cfg, stats, model))
    core.install_loss(model, cfg)
    core.install_tiling(model, cfg)

    # Trainer: the HF Trainer, data in DistributedSampler order; loss is normalized by the trained tokens of
    # the whole global batch (average_tokens_across_devices), so how the batch is split does not matter.
    callbacks = list(callbacks or [])  # TrainerCallbacks of a caller (the quickstart's progress bar and time bound)
    if cfg.evaluation.early_stopping_patience:
        callbacks.append(transformers.EarlyStoppingCallback(cfg.evaluation.early_stopping_patience,
                                                            cfg.evaluation.early_stopping_threshold))
    if os.environ.get(faults.STOP_VAR):
        callbacks.append(StopPoint())
    trainer = make_trainer(cfg, method, model, tokenizer, train, held_out, collator, resume, callbacks)
    trainer.fingerprint = cfg.fingerprint
    evaluate.guard_trackers(trainer.callback_handler.callbacks)  # a tracker's failure is a warning, not the run's
    trainer.eval_set = evaluate.eval_set(cfg, tokenizer, None if method.own_evaluation or held_out is None
                                         else held_out.dataset)

    # Train.
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)

    # Save: full model (consolidated under ZeRO-3) or adapter, tokenizer, per-step losses; atomically.
    try:
        save_final_trainer(trainer, args.output_dir, cfg)
    except VerificationError as e:
        exit_with(str(e))
    rank0_print(f"saved to {args.output_dir}")
    checkpoint.end_process_group()
    finish_run(cfg)  # the trackers' runs ended; --push_to_hub


def make_trainer(cfg, method, model, tokenizer, train, held_out, collator, resume, callbacks):
    """The Trainer of the run's method (finetune.methods): the Trainer as it is where it computes the method's loss
    (SFT), else MethodTrainer with the method's Session; what else the method needs (DPO's reference) is made here,
    before any update."""
    from finetune.data.images import processor_of
    from finetune.training.hf_trainer import MethodTrainer, Trainer

    # A vision-language model's processor is what its checkpoints and final folder save (tokenizer included).
    common = dict(model=model, args=cfg.training, train_dataset=train.dataset,
                  eval_dataset=held_out.dataset if held_out is not None else None, data_collator=collator,
                  processing_class=processor_of(tokenizer) or tokenizer, callbacks=callbacks)
    if method.trainer_loss:
        return Trainer(**common)
    # The trainer lends the method its accelerator once built (the lambdas run after this function returns).
    session = method.setup(cfg.objective, model, tokenizer, [train, held_out], collator, core.method_context(
        cfg, cfg.training.device, lambda: trainer.accelerator.unwrap_model(trainer.model),
        lambda: trainer.accelerator.autocast(), resumed=resume is not None, step=lambda: trainer.state.global_step))
    trainer = MethodTrainer(method=method, session=session, held_out=held_out, repeat=method.repeats(cfg.objective),
                            **common)
    if described := session.describe():
        rank0_print(described)
    return trainer


if __name__ == "__main__":
    main()
