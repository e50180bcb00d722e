"""Packing and padding-free batching without cross-contamination (docs/packing.md).

Packing happens BEFORE sampling: the best-fit-decreasing packer turns tokenized records into rows of at
most `max_seq_length` tokens, and the rows are the data set's items. The DistributedSampler order of
finetune/data/sampler.py then shuffles and deals rows exactly as it deals records, so every path (Trainer,
accelerate loop, DeepSpeed script), every rank count and a resumed run see the same rows in the same order,
and every rank gets the same token budget per micro-batch. Packing after sampling would instead make the
number of rows per rank depend on which records it drew.

Records are kept apart by `position_ids` that restart at 0 at every record boundary and NO attention mask:
transformers derives the per-record causal mask from such position ids (masking_utils'
`find_packed_sequence_indices` for sdpa/eager). The collator also states the boundaries on the host, under the names
transformers' flash-attention kwargs and TRL's collator use (`cu_seq_lens_q/k`, int32 over the batch flattened
row after row; `max_length_q/k`, Python ints): flash kernels (transformers' own and Hub kernels, any batch size) and
finetune.models.attention's variable-length attention then split the batch without reading device values.
The first label of each record is set to -100, so no record is trained to predict its first token from
the previous record's last one. tests/test_packing.py proves logits, per-token losses and gradients equal
those of the records run one by one.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from finetune.constants import IGNORE_INDEX

# Flash kernels take the batch flattened into one sequence; given the boundaries, a padded row would only cost them its
# padding. The micro-batch is flattened for them (layout "flat": no padding at all), as for a Hub kernel (`org/repo`,
# which goes through transformers' flash path too).
FLAT_ONLY_ATTENTION = ("flash_attention_2", "flash_attention_3", "flash_attention_4")


def boundaries(segment_lengths: Sequence[int]) -> dict[str, Any]:
    """The boundary fields of a batch whose flattened tokens are these segments, in order: `cu_seq_lens_q/k`
    (int32, [segments + 1]), `max_length_q/k` (the longest, a Python int) and `seq_bounds`, the same offsets as a
    tuple of ints, which no device move touches (the per-record loop of finetune.models.attention reads it instead
    of the tensor, on the host)."""
    import itertools

    import torch

    bounds = tuple(itertools.accumulate(segment_lengths, initial=0))
    cu = torch.tensor(bounds, dtype=torch.int32)
    longest = max(segment_lengths, default=0)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest,
            "seq_bounds": bounds}


def to_device(batch: dict[str, Any], device, non_blocking: bool = False) -> dict[str, Any]:
    """A batch on `device`: its tensors moved, its host values (max lengths, bounds) kept as they are."""
    return {k: v.to(device, non_blocking=non_blocking) if hasattr(v, "to") else v for k, v in batch.items()}


def bfd_pack(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: indices of `lengths` grouped into bins of total length <= capacity.

    Longest record first, each into the open bin it fills most tightly, or a new bin. Deterministic (ties go to
    the lower index / the older bin), never splits or drops a record. Records longer than `capacity` get a bin
    of their own (tokenization already truncated or dropped them, so this does not happen in training).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    # Open bins as (space left, bin number), kept sorted: bisect finds the tightest fit in O(log n).
    free: list[tuple[int, int]] = []
    for i in order:
        n = lengths[i]
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            space, b = free.pop(at)
        else:
            space, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if space - n > 0:
            bisect.insort(free, (space - n, b))
    return bins


@dataclass
class PackingStats:
    records: int
    rows: int
    tokens: int
    capacity: int

    @property
    def efficiency(self) -> float:
        """Real tokens over the slots of full rows (rows x max_seq_length)."""
        return self.tokens / max(self.rows * self.capacity, 1)

    def summary(self) -> str:
        return (f"packing: {self.records} records into {self.rows} rows of {self.capacity} tokens (best-fit decreasing); "
                f"efficiency {100 * self.efficiency:.1f}% ({self.tokens} real tokens / {self.rows * self.capacity} slots)")


class PackedDataset:
    """Rows of packed records over a tokenized data set; a row is built when it is read (no copy of the data)."""

    def __init__(self, examples, bins: list[list[int]], capacity: int):
        self.examples, self.bins, self.capacity = examples, bins, capacity

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, i: int) -> dict[str, list]:
        ids: list[int] = []
        labels: list[int] = []
        lens: list[int] = []
        texts: list[str] = []
        images: list = []
        for j in self.bins[i]:
            e = self.examples[j]
            ids += e["input_ids"]
            labels += e["labels"]
            lens.append(len(e["input_ids"]))
            if "images" in e:  # image records (finetune.data.images.PackedVisionCollator): each record's text and images
                texts.append(e["text"])
                images.append(e["images"])
        row = {"input_ids": ids, "labels": labels, "seq_lens": lens}
        return dict(row, texts=texts, images=images) if texts else row


def pack_dataset(examples, capacity: int) -> tuple[PackedDataset, PackingStats]:
    if hasattr(examples, "column_names"):  # a datasets.Dataset: lengths from the Arrow offsets, batch by batch
        import pyarrow.compute as pc

        lengths = [n for batch in examples.with_format("arrow").iter(batch_size=10_000)
                   for n in pc.list_value_length(batch["input_ids"]).to_pylist()]
    else:
        lengths = [len(e["input_ids"]) for e in examples]
    bins = bfd_pack(lengths, capacity)
    stats = PackingStats(records=len(lengths), rows=len(bins), tokens=sum(lengths), capacity=capacity)
    return PackedDataset(examples, bins, capacity), stats


class PackedCollator:
    """Batches of records or packed rows with position_ids restarting at every record, and no attention mask.

    layout "rows": [batch, longest row] (sdpa/eager split each row by its position ids; the tail padding is a
    segment of its own, with labels -100). layout "flat": the whole micro-batch as ONE row without any padding
    (padding-free batching, and packing for flash kernels). Either way the batch carries its record boundaries
    (`boundaries`) over the tokens flattened row after row, the padding of a row a segment of its own.
    """

    def __init__(self, pad_token_id: int, layout: str = "rows", pad_to_multiple_of: int | None = None):
        if layout not in ("rows", "flat"):
            raise ValueError(f"layout must be 'rows' or 'flat', got {layout!r}")
        self.pad_token_id, self.layout, self.pad_to_multiple_of = pad_token_id, layout, pad_to_multiple_of

    def __call__(self, features: Iterable[dict[str, Any]]) -> dict[str, Any]:
        import torch

        rows, lens_of = [], []
        for f in features:
            ids = torch.as_tensor(f["input_ids"], dtype=torch.long)
            labels = torch.as_tensor(f["labels"], dtype=torch.long).clone()
            lens = list(f.get("seq_lens") or [len(ids)])
            if sum(lens) != len(ids):
                raise ValueError(f"seq_lens {lens} do not add up to the row length {len(ids)}")
            starts = torch.as_tensor([0] + lens[:-1]).cumsum(0)
            # Each record's first token is never a target: shifting would predict it from the previous record.
            labels[starts] = IGNORE_INDEX
            positions = torch.cat([torch.arange(n) for n in lens])
            rows.append((ids, labels, positions))
            lens_of.append(lens)
        if self.layout == "flat":
            ids, labels, positions = (torch.cat(parts).unsqueeze(0) for parts in zip(*rows))
            return {"input_ids": ids, "labels": labels, "position_ids": positions,
                    **boundaries([n for f in lens_of for n in f])}
        length = max(len(r[0]) for r in rows)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        ids = torch.full((len(rows), length), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
        # Tail padding restarts at 0 too: it is a segment of its own that no record attends to.
        positions = torch.arange(length).repeat(len(rows), 1)
        for i, (r_ids, r_labels, r_pos) in enumerate(rows):
            n = len(r_ids)
            ids[i, :n], labels[i, :n], positions[i, :n] = r_ids, r_labels, r_pos
            positions[i, n:] -= n
        segments = [m for r_lens in lens_of for m in (*r_lens, length - sum(r_lens)) if m]
        return {"input_ids": ids, "labels": labels, "position_ids": positions, **boundaries(segments)}


def collator_layout(packing: bool, padding_free: bool, attn_implementation: str | None) -> str | None:
    """None: the padded collator. Otherwise the PackedCollator layout this configuration needs."""
    if not (packing or padding_free):
        return None
    name = attn_implementation or ""
    if padding_free or name in FLAT_ONLY_ATTENTION or "/" in name:
        return "flat"
    return "rows"
