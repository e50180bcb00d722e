"""SFT (--method sft, the default): the next-token loss over the records' trained tokens (finetune.data.prepare's
loss masks), normalized by the trained tokens of the whole global batch (the Trainer's average_tokens_across_devices).
The model computes the loss (transformers' or the chunked one of --loss_chunk_size); the HF Trainer path uses the
Trainer's own compute_loss, the loop and the DeepSpeed engine path call Session.loss.
"""

from __future__ import annotations

import contextlib

from finetune.methods.base import Method, Session


class SFTSession(Session):
    def loss(self, model, batch: dict, n_items, *, autocast=contextlib.nullcontext):
        return model(**batch, num_items_in_batch=n_items).loss  # the token-loss sum / n_items


class SFT(Method):
    name = "sft"
    title = "SFT"
    summary = "next-token loss on the records' completions"
    trainer_loss = True

    def prepare(self, data, tokenizer, *, local_rank: int, log, seed: int = 42):
        from finetune.data.pipeline import prepare_dataset

        dataset, stats = prepare_dataset(data, tokenizer, local_rank=local_rank, log=log, seed=seed)
        return dataset, stats, None

    def collator(self, cfg, tokenizer):
        from finetune.data.prepare import make_collator

        return make_collator(cfg, tokenizer)

    def count(self, batches: list[dict]):
        """The trained tokens: labels shift by one, so a row's first label is never a target (a sequence-parallel
        slice carries its targets already shifted, `shift_labels`)."""
        from finetune.data.prepare import IGNORE_INDEX

        return sum((b["shift_labels"] if "shift_labels" in b else b["labels"][..., 1:]).ne(IGNORE_INDEX).sum()
                   for b in batches)

    def setup(self, options, model, tokenizer, examples, collator, context) -> Session:
        return SFTSession()
