"""The run's data, the same on the three paths: the method's training examples (finetune.methods), tokenized once
per node and cached, and the eval examples, from --eval_dataset or held out of --dataset (--eval_split_size, a seeded
split recorded in eval_split.json)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from finetune.process import exit_with
from finetune.training import core
from finetune.training.lifecycle import rank0_print, write_json_atomic

SPLIT_FILE = "eval_split.json"


# ----------------------------------------------------------------------------------------------
# The eval set: a file of its own, or a seeded share of the training data.


def split_indices(n: int, size: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, eval) example indices: a seeded permutation's first k are held out (k = size * n, or size itself)."""
    import torch

    k = round(size * n) if size < 1 else int(size)
    if not 1 <= k < n:
        raise ValueError(f"eval_split_size {size} holds out {k} of {n} examples; it must leave at least one on each side")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[k:]), sorted(order[:k])


def datasets_or_exit(cfg, method, local_rank: int):
    """(tokenizer, training Examples, eval Examples or None, stats): --dataset as `method` (finetune.methods) turns
    records into examples, tokenized once per node and cached, and the eval set of --eval_dataset (tokenized like
    --dataset) or --eval_split_size (held out before packing; the split goes to eval_split.json). A bad record
    stops every rank with its file and line; rank 0 prints the data summary."""
    from finetune.data.prepare import DataError
    from finetune.models.load import WeightsError, load_tokenizer

    data = cfg.data
    try:
        tokenizer = load_tokenizer(cfg.model)
        attach_processor(cfg.model, tokenizer)
    except WeightsError as e:
        exit_with(str(e))

    def prepare(data_cfg, what: str, **kw):
        try:
            return method.prepare(data_cfg, tokenizer, local_rank=local_rank, log=rank0_print, **kw)
        except DataError as e:
            exit_with(f"{what}: {e}")

    if data.eval_split_size:
        unpacked = dataclasses.replace(data, packing=False)
        dataset, stats, key = prepare(unpacked, "data error", seed=cfg.training.seed)
        rank0_print(stats.summary())
        seed = core.data_seed(cfg.training)
        try:
            train_idx, eval_idx = split_indices(len(dataset), data.eval_split_size, seed)
        except ValueError as e:
            exit_with(str(e))
        train, held_out = dataset.select(train_idx), dataset.select(eval_idx)
        if data.packing:
            from finetune.data.packing import pack_dataset

            train, packing = pack_dataset(train, data.max_seq_length)
            stats.packed_rows = packing.rows
        rank0_print(f"eval: {len(eval_idx)} of {len(dataset)} {method.unit} held out (seed {seed}), {len(train_idx)} "
                    f"train; indices in {Path(cfg.training.output_dir) / SPLIT_FILE}")
        if core.rank() == 0:
            Path(cfg.training.output_dir).mkdir(parents=True, exist_ok=True)
            write_json_atomic(Path(cfg.training.output_dir) / SPLIT_FILE, {
                "dataset": str(data.dataset), "eval_split_size": data.eval_split_size, "seed": seed,
                "examples": len(dataset), "eval_indices": eval_idx,
                "note": f"indices of the tokenized {method.unit} of --dataset (records dropped by max_seq_length or "
                        "without trained tokens are not counted)"})
        # Each part's rows are numbered anew: what is cached under a part's key (DPO's reference log-probs) is
        # keyed by the split too.
        split = f"{key}-split{data.eval_split_size}-{seed}" if key else None
        return (tokenizer, method.examples(train, split and f"{split}-train"),
                method.examples(held_out, split and f"{split}-eval"), stats)
    dataset, stats, key = prepare(data, "data error", seed=cfg.training.seed)
    rank0_print(stats.summary())
    if not data.eval_dataset:
        return tokenizer, method.examples(dataset, key), None, stats
    eval_data = dataclasses.replace(data, dataset=data.eval_dataset, dataset_split=data.eval_dataset_split,
                                    packing=False, padding_free=False, dataset_weights=None)
    eval_dataset, eval_stats, eval_key = prepare(eval_data, "eval data error (--eval_dataset)")
    rank0_print(f"eval {eval_stats.summary()}")
    return tokenizer, method.examples(dataset, key), method.examples(eval_dataset, eval_key), stats


def attach_processor(model_cfg, tokenizer) -> None:
    """A vision-language model's processor (its image processor and chat template, around the tokenizer as loaded),
    given to the data pipeline through the tokenizer (finetune.data.vision); --chat_template still wins. A
    vision-language folder without processor files (a multimodal checkpoint saved with its tokenizer alone) trains
    text records on that tokenizer; a record with an image is refused by file and line (formats.base.text_only)."""
    from finetune.data import images
    from finetune.models.load import PROCESSOR_FILES, is_vision, load_processor

    folder = Path(model_cfg.model_name_or_path)
    config = folder / "config.json"
    if not config.is_file() or not is_vision(json.loads(config.read_text())):
        return
    if not any((folder / name).is_file() for name in PROCESSOR_FILES):
        rank0_print(f"{folder} holds no processor files ({' or '.join(PROCESSOR_FILES)}): text records only")
        return
    processor = load_processor(model_cfg.model_name_or_path, trust_remote_code=model_cfg.trust_remote_code)
    processor.tokenizer = tokenizer
    if getattr(model_cfg, "chat_template", None) or not processor.chat_template:
        processor.chat_template = tokenizer.chat_template
    from finetune.models import families

    family = families.find(json.loads(config.read_text()))
    images.attach(tokenizer, processor, packs=family is not None and not family.packing_refusal)


def read_split(output_dir) -> dict | None:
    path = Path(output_dir) / SPLIT_FILE
    return json.loads(path.read_text()) if path.is_file() else None
