"""Packing and padding-free batching: no cross-contamination, BFD properties, label boundaries, three paths agree.

The reference for "no cross-contamination" is each record run on its own (batch of one, no padding): a packed
or flattened batch must give the same logits, per-token losses and gradients (fp32, 1e-5).
"""

from __future__ import annotations

import random
import re
import sys
from types import SimpleNamespace

import pytest
import torch

from finetune.models import attention, tiny
from finetune.config import DataConfig, Preset
from finetune.data.pipeline import prepare_dataset
from finetune.data.prepare import IGNORE_INDEX, make_collator, tokenize_record
from finetune.models.load import load_tokenizer
from finetune.training.lifecycle import describe_run
from finetune.data.packing import PackedCollator, bfd_pack, collator_layout, pack_dataset
from launch import ENGINE, LOOP, TRAIN, losses, run, tiny_job


# ----------------------------------------------------------------------------------------------
# The packer.


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bfd_never_splits_drops_or_overfills(seed):
    rng = random.Random(seed)
    capacity = 256
    lengths = [rng.randint(1, capacity) for _ in range(300)] + [capacity, capacity, 1, 1]
    bins = bfd_pack(lengths, capacity)
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths)))  # every record exactly once: none split, none dropped
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    lower = -(-sum(lengths) // capacity)
    assert len(bins) <= 11 / 9 * lower + 1  # BFD's worst-case bound against the optimum
    assert bfd_pack(lengths, capacity) == bins  # deterministic: every rank packs the same rows


def test_bfd_is_best_fit():
    # 6 goes where it fits tightest (the bin holding 4, space 6), not into the first bin with room.
    assert bfd_pack([7, 4, 6, 3], 10) == [[0, 3], [2, 1]]


def test_packing_efficiency_on_mixed_lengths():
    # Lengths spread over 20x, as in chat data: BFD fills rows almost completely.
    rng = random.Random(0)
    lengths = [int(12 * (256 / 12) ** rng.random()) for _ in range(2000)]
    bins = bfd_pack(lengths, 256)
    assert sum(lengths) / (len(bins) * 256) >= 0.95


# ----------------------------------------------------------------------------------------------
# No cross-contamination: packed == one by one.


@pytest.fixture(scope="module")
def tok_model(tiny_chatml):
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(SimpleNamespace(model_name_or_path=str(tiny_chatml), trust_remote_code=False))
    attention.register()
    models = {impl: AutoModelForCausalLM.from_pretrained(tiny_chatml, dtype=torch.float32, attn_implementation=impl)
              for impl in ("sdpa", "eager", attention.VARLEN)}
    return tok, models


def records(tok, n=7, seed=3, completion_only=True):
    out = []
    for r in tiny.synthetic_records(n, seed=seed):
        ids, labels = tokenize_record(tok, r, "messages", completion_only)
        out.append({"input_ids": ids, "labels": labels})
    return out


def token_losses(logits, labels):
    """Per-position loss of predicting labels[t + 1] from position t (0 where not trained), as the model's loss shifts."""
    shift = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), shift, ignore_index=IGNORE_INDEX, reduction="none")
    return loss, shift != IGNORE_INDEX


def alone(model, rec):
    ids = torch.tensor([rec["input_ids"]])
    return model(input_ids=ids, use_cache=False).logits[0]


@pytest.mark.parametrize("impl", ["sdpa", "eager", attention.VARLEN])
@pytest.mark.parametrize("layout", ["rows", "flat"])
def test_packed_logits_losses_and_gradients_equal_one_by_one(tok_model, impl, layout, one_thread):
    tok, models = tok_model
    model = models[impl]
    recs = records(tok)
    # Two rows of several records each (the second shorter, so "rows" pads it).
    rows = [recs[:4], recs[4:]]
    feats = [{"input_ids": sum((r["input_ids"] for r in row), []), "labels": sum((r["labels"] for r in row), []),
              "seq_lens": [len(r["input_ids"]) for r in row]} for row in rows]
    batch = PackedCollator(tok.pad_token_id, layout=layout)(feats)
    assert "attention_mask" not in batch  # the split comes from position_ids alone

    model.zero_grad()
    out = model(**batch, use_cache=False)
    packed_loss, trained = token_losses(out.logits, batch["labels"])
    n_items = int(trained.sum())
    # The model's own loss is the mean over trained tokens of the batch (the project's normalization).
    torch.testing.assert_close(out.loss, packed_loss.sum() / n_items, rtol=1e-6, atol=1e-6)
    out.loss.backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]

    model.zero_grad()
    ref_total = torch.zeros(())
    ref_items = 0
    flat_offset = 0  # "flat": one row holding every record of the micro-batch
    for r_i, row in enumerate(rows):
        offset = flat_offset if layout == "flat" else 0
        b = 0 if layout == "flat" else r_i
        for rec in row:
            n = len(rec["input_ids"])
            logits_alone = alone(model, rec)
            torch.testing.assert_close(out.logits[b, offset : offset + n], logits_alone, rtol=0, atol=1e-5)
            rec_loss, rec_trained = token_losses(logits_alone[None], torch.tensor([rec["labels"]]))
            # The record's last position predicts nothing in the pack either (the next record's first label is -100).
            torch.testing.assert_close(packed_loss[b, offset : offset + n], rec_loss[0], rtol=0, atol=1e-5)
            ref_total = ref_total + rec_loss.sum()
            ref_items += int(rec_trained.sum())
            offset += n
        flat_offset = offset
    assert ref_items == n_items
    (ref_total / ref_items).backward()
    for p, g in zip(model.parameters(), packed_grads):
        torch.testing.assert_close(g, p.grad, rtol=0, atol=1e-5)


def test_varlen_falls_back_to_sdpa_where_it_must(tok_model, one_thread):
    """A padded batch (attention mask, plain positions) gives sdpa's own logits; a sliding window is never split."""
    tok, models = tok_model
    recs = records(tok, n=2)
    n = max(len(r["input_ids"]) for r in recs)
    ids = torch.tensor([r["input_ids"] + [tok.pad_token_id] * (n - len(r["input_ids"])) for r in recs])
    mask = torch.tensor([[1] * len(r["input_ids"]) + [0] * (n - len(r["input_ids"])) for r in recs])
    a = models["sdpa"](input_ids=ids, attention_mask=mask, use_cache=False).logits
    b = models[attention.VARLEN](input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.equal(a * mask[..., None], b * mask[..., None])
    from transformers import MistralConfig

    # A sliding window is computed now (tests/test_attention.py); attention dropout and bidirectional attention
    # keep transformers' own kernels.
    assert attention.unsupported(MistralConfig(sliding_window=4096)) is None
    assert attention.unsupported(MistralConfig(attention_dropout=0.1)) == "attention dropout"
    assert attention.unsupported(models["sdpa"].config) is None


def test_without_the_reset_records_would_mix(tok_model, one_thread):
    """The check above can fail: plain positions (one causal sequence) give the second record different logits."""
    tok, models = tok_model
    recs = records(tok, n=2)
    ids = torch.tensor([recs[0]["input_ids"] + recs[1]["input_ids"]])
    mixed = models["sdpa"](input_ids=ids, use_cache=False).logits[0, len(recs[0]["input_ids"]):]
    assert (mixed - alone(models["sdpa"], recs[1])).abs().max() > 1e-2


# ----------------------------------------------------------------------------------------------
# Labels, positions, completion-only masking.


@pytest.mark.parametrize("layout", ["rows", "flat"])
@pytest.mark.parametrize("completion_only", [True, False])
def test_labels_never_cross_a_boundary_and_masking_survives(tok_model, layout, completion_only):
    tok, _ = tok_model
    recs = records(tok, n=9, completion_only=completion_only)
    feats = [{"input_ids": sum((r["input_ids"] for r in recs[a:b]), []),
              "labels": sum((r["labels"] for r in recs[a:b]), []),
              "seq_lens": [len(r["input_ids"]) for r in recs[a:b]]} for a, b in ((0, 5), (5, 9))]
    batch = PackedCollator(tok.pad_token_id, layout=layout)(feats)
    labels, positions = batch["labels"].reshape(-1), batch["position_ids"].reshape(-1)
    offset = 0
    for rec in recs:
        n = len(rec["input_ids"])
        if layout == "rows" and rec is recs[5]:
            offset = batch["labels"].shape[1]  # the second row starts after the first row's padding
        assert positions[offset : offset + n].tolist() == list(range(n))  # positions restart at every record
        assert labels[offset] == IGNORE_INDEX  # never predicted from the previous record
        # Inside the record the labels are the record's own (completion-only mask included).
        assert labels[offset + 1 : offset + n].tolist() == rec["labels"][1:]
        offset += n
    # Trained-token count (what every path normalizes by) equals the records' own.
    assert int((batch["labels"][..., 1:] != IGNORE_INDEX).sum()) == sum(
        sum(x != IGNORE_INDEX for x in r["labels"][1:]) for r in recs)
    if completion_only:
        # The system/user text stays untrained: only assistant tokens (and end-of-turn) carry labels.
        trained_ids = set(batch["input_ids"].reshape(-1)[labels != IGNORE_INDEX].tolist())
        assert tok.convert_tokens_to_ids("<|im_start|>") not in trained_ids
    if layout == "rows":
        pad = batch["labels"][1, offset - batch["labels"].shape[1]:]
        assert (pad == IGNORE_INDEX).all()


def test_layout_choice():
    assert collator_layout(False, False, "sdpa") is None
    assert collator_layout(True, False, "sdpa") == "rows"
    assert collator_layout(True, False, "eager") == "rows"
    # Flash kernels (transformers' and a Hub kernel org/repo) take the batch flattened: no padding at all.
    assert collator_layout(True, False, "flash_attention_2") == "flat"
    assert collator_layout(True, False, "kernels-community/flash-attn3") == "flat"
    assert collator_layout(False, True, "sdpa") == "flat"


@pytest.mark.parametrize("packing,padding_free", [(False, False), (True, False), (False, True), (True, True)])
def test_varlen_exactly_where_the_collator_gives_boundaries(packing, padding_free):
    # models.attention cannot import data (independent layers): it states the rule for sdpa itself. Both layouts
    # carry the record boundaries.
    cfg = SimpleNamespace(data=SimpleNamespace(packing=packing, padding_free=padding_free),
                          model=SimpleNamespace(attn_implementation="sdpa"), training=SimpleNamespace())
    assert attention.applies(cfg, SimpleNamespace()) == (collator_layout(packing, padding_free, "sdpa") is not None)


def test_prepare_dataset_packs_and_reports(tiny_chatml, tmp_path, cache_dir):
    data = tiny.write_jsonl(tmp_path / "d.jsonl", tiny.synthetic_records(120, seed=5))
    tok = load_tokenizer(SimpleNamespace(model_name_or_path=str(tiny_chatml), trust_remote_code=False))
    plain_cfg = DataConfig(dataset=str(data), max_seq_length=256, dataset_cache_dir=str(cache_dir))
    packed_cfg = DataConfig(dataset=str(data), max_seq_length=256, dataset_cache_dir=str(cache_dir), packing=True)
    plain, _ = prepare_dataset(plain_cfg, tok, log=lambda *a: None)
    packed, stats = prepare_dataset(packed_cfg, tok, log=lambda *a: None)
    assert len(packed) == stats.packed_rows < len(plain)
    assert sum(len(packed[i]["input_ids"]) for i in range(len(packed))) == stats.tokens
    assert all(len(packed[i]["input_ids"]) <= 256 for i in range(len(packed)))
    m = re.search(r"packing: 120 records into (\d+) rows of 256 tokens .*efficiency (\d+\.\d)%", stats.summary())
    assert m and int(m.group(1)) == len(packed), stats.summary()
    assert float(m.group(2)) >= 90
    cfg = SimpleNamespace(
        data=packed_cfg, launch=SimpleNamespace(config="ddp"), preset=Preset("ddp"),
        training=SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=2, world_size=1, device="cpu"))
    line = describe_run(cfg, stats, torch.nn.Linear(2, 2))
    assert "tokens/step: 8 packed rows x 256 = 2048 slots; about" in line and "packing efficiency" in line
    assert isinstance(make_collator(cfg, tok), PackedCollator)


def test_pack_dataset_keeps_every_token(tok_model):
    tok, _ = tok_model
    recs = records(tok, n=40)
    packed, stats = pack_dataset(recs, 128)
    rows = [packed[i] for i in range(len(packed))]
    assert sorted(tuple(r["input_ids"]) for r in recs) == sorted(
        tuple(row["input_ids"][s : s + n]) for row in rows
        for s, n in zip([0] + list(torch.tensor(row["seq_lens"]).cumsum(0)[:-1].tolist()), row["seq_lens"]))
    assert stats.tokens == sum(len(r["input_ids"]) for r in recs)


# ----------------------------------------------------------------------------------------------
# The three training paths with --packing: same per-step losses. --padding_free: the padded run's losses.

STEPS = 6


@pytest.fixture(scope="module")
def paths_setup(tmp_path_factory):
    return tiny_job(tmp_path_factory.mktemp("packing_paths"), records=96, seed=11)


def _flags(setup, name, *extra):
    root, model, data = setup
    return [
        "--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(root / name),
        "--dataset_cache_dir", str(root / "cache"), "--max_steps", str(STEPS), "--learning_rate", "3e-3",
        "--warmup_steps", "1", "--seed", "7", "--max_seq_length", "192", "--per_device_train_batch_size", "4",
        "--disable_tqdm", "true", *extra,
    ]


def side_by_side(runs: dict[str, list[str]]) -> dict:
    """name -> Result of one-process runs that do not depend on each other, two at a time, one thread each (the
    two cores; the data cache is shared under its lock, as ranks and nodes share it)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        jobs = {name: pool.submit(run, cmd, timeout=300, OMP_NUM_THREADS="1") for name, cmd in runs.items()}
        return {name: job.result() for name, job in jobs.items()}


@pytest.mark.slow
def test_three_paths_agree_with_packing(paths_setup):
    runs = {
        "trainer": [sys.executable, TRAIN, *_flags(paths_setup, "trainer", "--packing")],
        "loop": [sys.executable, LOOP, *_flags(paths_setup, "loop", "--packing")],
        "engine": [sys.executable, ENGINE, *_flags(paths_setup, "engine", "--packing")],
        # The same rows under eager attention and its block-diagonal mask: what the variable-length attention (on
        # CPU the per-record loop) must reproduce.
        "eager": [sys.executable, TRAIN, *_flags(paths_setup, "eager", "--packing", "--attn_implementation", "eager")],
    }
    results = {}
    for name, result in side_by_side(runs).items():
        result.check()
        assert re.search(r"packing: 96 records into \d+ rows of 192 tokens .*efficiency", result.output), result.output[-3000:]
        assert "packed rows x 192" in result.output
        assert ("attention: packed records through one variable-length kernel call per layer (loop;"
                in result.output) == (name != "eager")
        results[name] = losses(paths_setup[0] / name)
    ref = results["trainer"]
    assert len(ref) == STEPS and ref[-1] < ref[0]
    for name, got in results.items():
        for step, (a, b) in enumerate(zip(ref, got), start=1):
            assert abs(a - b) <= 1e-4 * abs(a), f"{name} step {step}: {b} vs trainer {a}"


@pytest.mark.slow
def test_padding_free_matches_padded(paths_setup):
    """Padding-free keeps the padded run's records per step, so its losses are the padded run's."""
    done = side_by_side({"padded": [sys.executable, TRAIN, *_flags(paths_setup, "padded")],
                         "flat": [sys.executable, TRAIN, *_flags(paths_setup, "flat", "--padding_free")]})
    padded, flat = done["padded"].check(), done["flat"].check()
    assert "padding-free" in flat.output and "padding-free" not in padded.output
    a, b = losses(paths_setup[0] / "padded"), losses(paths_setup[0] / "flat")
    assert len(a) == len(b) == STEPS
    for step, (x, y) in enumerate(zip(a, b), start=1):
        assert abs(x - y) <= 1e-4 * abs(x), f"step {step}: padding-free {y} vs padded {x}"
