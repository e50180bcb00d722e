"""A batch's share for one rank of a sequence-parallel group (--sequence_parallel_size N, docs/sequence-parallel.md).

Every rank of a group collates the same records; each keeps 1/N of the row's tokens, contiguous, rank r the r-th
slice. The labels are shifted BEFORE the split (`shift_labels`: the target of position t is token t + 1 of the whole
row, so the last token of a slice is trained on the first token of the next one), the row is padded to a multiple of N
(pad tokens without a target), and each slice keeps its position ids in the whole row, so rotary embeddings see the
record's real positions. What the attention needs of the whole row stays whole: the record boundaries of a packed row
(`cu_seq_lens_q/k`, `max_length_q/k`, `seq_bounds`, with the padding a segment of its own), since DeepSpeed's Ulysses
attention gathers the whole row (for a share of the heads) before it attends. The trained tokens of the N slices add
up to the row's, each counted once, so the token-mean loss over the global batch is the unsplit run's.
"""

from __future__ import annotations

from typing import Any

from finetune.constants import IGNORE_INDEX, TRAINED_ROWS

BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_bounds")


def split_batch(batch: dict[str, Any], rank: int, size: int) -> dict[str, Any]:
    """This rank's slice of a collated batch ([rows, length] tensors) for a sequence-parallel group of `size`."""
    import torch

    ids, labels = batch["input_ids"], batch["labels"]
    rows, length = ids.shape
    padded = -(-length // size) * size
    pad = padded - length
    packed = "seq_bounds" in batch
    if packed and rows != 1:
        raise ValueError(f"a packed batch of {rows} rows: sequence parallelism splits one row per micro-batch")
    shift = torch.nn.functional.pad(labels, (0, 1 + pad), value=IGNORE_INDEX)[:, 1:]
    positions = batch.get("position_ids")
    if positions is None:  # padded records (right-padded): positions 0.. as the model would make them
        positions = torch.arange(length).expand(rows, length)
    # The padding: tokens of no record, without targets; in a packed row a segment of its own (positions from 0).
    tail = torch.arange(pad).expand(rows, pad) + (0 if packed else length)
    positions = torch.cat([positions, tail.to(positions.dtype)], dim=1)
    ids = torch.nn.functional.pad(ids, (0, pad), value=0)
    piece = padded // size
    cut = slice(rank * piece, (rank + 1) * piece)
    out = {"input_ids": ids[:, cut].contiguous(), "position_ids": positions[:, cut].contiguous()}
    mine = shift[:, cut].contiguous()
    # `labels` only makes the model compute its loss; `shift_labels` (already shifted) are its targets.
    out["labels"], out["shift_labels"] = mine, mine
    if TRAINED_ROWS in batch:  # the chunked loss' trained positions, of this slice's shifted labels
        out[TRAINED_ROWS] = (mine.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)
    if packed:
        from finetune.data.packing import boundaries

        bounds = list(batch["seq_bounds"])
        segments = [b - a for a, b in zip(bounds[:-1], bounds[1:])] + ([pad] if pad else [])
        out.update(boundaries(segments))
    # A prepared (4-D) mask, one value expanded: transformers then builds none for the slice (Ulysses' attention
    # drops any mask and attends causally over the whole row, or by its record boundaries).
    out["attention_mask"] = torch.ones((), dtype=torch.bool).expand(rows, 1, piece, piece)
    return out


class SequenceParallelCollator:
    """A collator whose batches are this rank's slices (split_batch); picklable for DataLoader workers."""

    def __init__(self, collator, rank: int, size: int):
        self.collator, self.rank, self.size = collator, rank, size

    def __call__(self, features) -> dict[str, Any]:
        return split_batch(self.collator(features), self.rank, self.size)
