"""Several tokenized data sets mixed by weight (`--dataset a --dataset b --dataset_weights 0.7 0.3`).

The mixed set holds as many examples as the sources together; each source's share of it is its weight (normalized),
counted by largest remainder so the counts sum exactly. A source asked for fewer examples than it has gives a seeded
random subset; one asked for more is repeated whole, plus a seeded subset for the rest. Without weights, every
source is taken whole. The selection depends only on the seed and the sizes; the sampler shuffles the result.
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune.data.prepare import DataStats


@dataclass
class Share:
    name: str
    available: int
    taken: int
    weight: float


def counts(sizes: list[int], weights: list[float] | None) -> list[int]:
    """Examples taken from each source: weight * total, rounded by largest remainder (ties to the earlier source)."""
    total = sum(sizes)
    if weights is None:
        return list(sizes)
    norm = sum(weights)
    exact = [total * w / norm for w in weights]
    taken = [int(x) for x in exact]
    order = sorted(range(len(sizes)), key=lambda i: (-(exact[i] - taken[i]), i))
    for i in order[: total - sum(taken)]:
        taken[i] += 1
    return taken


def select(size: int, take: int, rng) -> list[int]:
    """`take` indices of range(size): whole passes, then a random subset, each in the source's order."""
    import numpy as np

    passes, rest = divmod(take, size)
    tail = np.sort(rng.permutation(size)[:rest])
    return [i for _ in range(passes) for i in range(size)] + tail.tolist()


def plan(sizes: list[int], weights: list[float] | None, seed: int) -> list[list[int]]:
    import numpy as np

    return [select(n, t, np.random.default_rng([seed, i])) for i, (n, t) in enumerate(zip(sizes, counts(sizes, weights)))]


def mix(datasets_: list, stats: list[DataStats], weights: list[float] | None, seed: int, log=print):
    """(mixed Dataset, combined DataStats); prints what was taken from each source."""
    import datasets

    sizes = [len(d) for d in datasets_]
    picks = plan(sizes, weights, seed)
    parts = [d if p == list(range(len(d))) else d.select(p) for d, p in zip(datasets_, picks)]
    mixed = datasets.concatenate_datasets(parts)
    norm = sum(weights) if weights else None
    shares = [Share(s.path, n, len(p), (w / norm) if norm else n / sum(sizes))
              for s, n, p, w in zip(stats, sizes, picks, weights or [None] * len(sizes))]
    log(describe(shares, seed if weights else None))
    for s in stats:  # counted per source: a mixed set's examples are drawn, not tokenized again
        if warning := s.end_warning():
            log(f"{s.path}:{warning}")
    return mixed, combine(stats, picks, datasets_)


def describe(shares: list[Share], seed: int | None) -> str:
    head = f"mix of {len(shares)} data sets" + (f" (by weight, seed {seed})" if seed is not None else " (each whole)")
    lines = [head]
    for s in shares:
        note = f"; {s.taken / s.available:.2f} passes" if s.taken > s.available else ""
        lines.append(f"  {s.name}: {s.taken} of {s.available} examples (weight {s.weight:.3f}{note})")
    return "\n".join(lines)


def combine(stats: list[DataStats], picks: list[list[int]], sources: list) -> DataStats:
    """One DataStats for the mixed set: records and filtering per source, examples and tokens as taken."""
    import numpy as np

    tokens = trained = 0
    for source, pick in zip(sources, picks):
        lengths, trained_rows = row_counts(source)
        idx = np.asarray(pick, dtype=np.int64)
        tokens += int(lengths[idx].sum())
        trained += int(trained_rows[idx].sum())
    formats = sorted({s.format for s in stats})
    return DataStats(
        path=" + ".join(s.path for s in stats), format=formats[0] if len(formats) == 1 else "mixed: " + ", ".join(formats),
        records=sum(s.records for s in stats), truncated=sum(s.truncated for s in stats),
        dropped_long=sum(s.dropped_long for s in stats), dropped_no_labels=sum(s.dropped_no_labels for s in stats),
        examples=sum(len(p) for p in picks), tokens=tokens, trained_tokens=trained, max_seq_length=stats[0].max_seq_length,
        split_records=sum(s.split_records for s in stats), split_examples=sum(s.split_examples for s in stats),
    )


def row_counts(ds):
    """(tokens, trained tokens) of every row, read batch by batch from the Arrow data (never the whole column)."""
    import numpy as np
    import pyarrow.compute as pc

    lengths, trained = [], []
    for batch in ds.data.to_batches(max_chunksize=10_000):
        labels = batch.column(batch.schema.get_field_index("labels"))
        n = pc.list_value_length(labels).to_numpy(zero_copy_only=False).astype(np.int64)
        offsets = labels.offsets.to_numpy()[:-1] - labels.offsets[0].as_py()
        flat = pc.list_flatten(labels).to_numpy(zero_copy_only=False)
        on = (flat != -100).astype(np.int64)
        per_row = np.add.reduceat(on, offsets) if len(on) else np.zeros(len(n), np.int64)
        per_row = np.where(n > 0, per_row, 0)  # reduceat of an empty row reads the next row's first value
        first = np.where(n > 0, on[np.minimum(offsets, max(len(on) - 1, 0))], 0)
        lengths.append(n)
        trained.append(per_row - first)  # position 0 is never predicted
    return np.concatenate(lengths), np.concatenate(trained)


def mix_rows(parts: list[tuple], weights: list[float] | None, seed: int, log, combine_stats):
    """mix() for data sets of another shape than SFT's (preference pairs, unpaired examples): `parts` are
    (Dataset, stats, cache key) per source; the same counts and selection as mix(); `combine_stats(stats, picked
    datasets)` makes the mixed set's stats. Returns (mixed Dataset, stats, a key naming the sources and the mix)."""
    import hashlib

    import datasets

    sizes = [len(d) for d, _, _ in parts]
    picks = plan(sizes, weights, seed)
    picked = [d if p == list(range(len(d))) else d.select(p) for (d, _, _), p in zip(parts, picks)]
    norm = sum(weights) if weights else None
    shares = [Share(s.path, n, len(p), (w / norm) if norm else n / sum(sizes))
              for (_, s, _), n, p, w in zip(parts, sizes, picks, weights or [None] * len(sizes))]
    log(describe(shares, seed if weights else None))
    key = hashlib.sha256(repr(([k for _, _, k in parts], weights, seed)).encode()).hexdigest()[:24]
    return datasets.concatenate_datasets(picked), combine_stats([s for _, s, _ in parts], picked), f"mix-{key}"
