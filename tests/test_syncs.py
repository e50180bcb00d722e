"""No host-device sync in a training step that does not log: counted per step on CPU (finetune.testing.SyncCounter)
on the three paths, for SFT (padded and packed) and DPO.

A GPU runs ahead of the host only while the host never waits for it; every `.item()`, `bool(tensor)`, `nonzero()` ...
on a device tensor drains the queue. On a CPU every tensor is on the host, so the counter finds the calls a GPU
would wait for by where they are made: calls of the finetune package (the data loader's collators, which run on
host tensors, excluded). transformers' own calls are reported beside them (`others`), not held to 0 here.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from finetune.testing import REPO, SyncCounter, env, tiny_job

STEPS, EVERY = 8, 4  # steps 4 and 8 log; the last also saves and verifies the final model
QUIET = [s for s in range(1, STEPS) if s % EVERY]  # the steps that must wait for no device
PAIRS = [{"prompt": "copy: red cat", "chosen": "red cat", "rejected": "cat red"},
         {"prompt": [{"role": "user", "content": "capital of France?"}], "chosen": "Paris", "rejected": "It is Lyon."}]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root, model, data = tiny_job(tmp_path_factory.mktemp("syncs"))
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(PAIRS[i % 2]) + "\n" for i in range(40)))
    return root, model, data, pairs


def counted(job, path: str, name: str, *flags: str, pairs: bool = False) -> dict:
    """The path's per-step sync counts ({step: {ours, others, where}}) in a process of its own."""
    root, model, data, pair_data = job
    out = root / f"{name}.json"
    argv = ["--model_name_or_path", str(model), "--dataset", str(pair_data if pairs else data),
            "--output_dir", str(root / name), "--dataset_cache_dir", str(root / "cache"), "--max_steps", str(STEPS),
            "--logging_steps", str(EVERY), "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
            "--max_seq_length", "128", "--disable_tqdm", "true", *flags]
    proc = subprocess.run([sys.executable, "-m", "finetune.testing", "count-syncs", path, str(out), *argv], cwd=REPO,
                          env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["steps"] == STEPS, got
    return {int(k): v for k, v in got["syncs"].items()}


def quiet_syncs(syncs: dict) -> dict:
    """The project's syncs in steps that do not log, by step (empty when there are none)."""
    return {s: [w for w in syncs[s]["where"] if " at finetune/" in w] for s in QUIET if syncs.get(s, {}).get("ours")}


def test_the_counter_sees_a_sync_made_in_the_package_and_not_one_avoided():
    """The counter can fail: the chunked loss finds its rows on the device without the collator's indices."""
    from finetune.data.prepare import trained_rows
    from finetune.training.loss import _trained_rows

    labels = torch.tensor([[-100, 5, 6, -100], [7, -100, 8, 9]])
    hidden, rows = torch.randn(2, 4, 3), trained_rows(labels)  # the collator's, on the host
    with SyncCounter() as c:
        c.begin()
        found = _trained_rows(hidden, labels, None)
        c.begin()
        given = _trained_rows(hidden, labels, None, rows)
        c.begin()
        bool(labels.sum() > 0)  # made here, in tests/: not the package's
    assert [x["what"] for x in c.ours(1)] == ["nonzero"] and c.ours(2) == [] and c.ours(3) == []
    assert c.summary()[3]["others"] == 1
    for a, b in zip(found, given):
        assert torch.equal(a, b)


def test_trainer_sft_steps_wait_for_no_device(job):
    """The default path and method: no sync of ours in a step that does not log; the logging steps do sync."""
    syncs = counted(job, "trainer", "trainer-sft")
    assert quiet_syncs(syncs) == {}, syncs
    assert syncs[EVERY]["ours"] > 0  # the logging step reads the token count (hf_trainer's _read_tokens)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["loop", "engine"])
def test_hand_written_paths_sft_steps_wait_for_no_device(job, path):
    syncs = counted(job, path, f"{path}-sft")
    assert quiet_syncs(syncs) == {}, syncs
    assert syncs[EVERY]["ours"] > 0  # the loss and grad norm read when the step logs (core.LogWindow)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["trainer", "loop"])  # DPO's paths (scripts/sft.py refuses it)
def test_dpo_steps_wait_for_no_device(job, path):
    syncs = counted(job, path, f"{path}-dpo", "--method", "dpo", pairs=True)
    assert quiet_syncs(syncs) == {}, syncs


@pytest.mark.slow
@pytest.mark.parametrize("path", ["trainer", "loop", "engine"])
def test_packed_sft_steps_wait_for_no_device(job, path):
    """Packed rows: the records' boundaries come from the collator too (finetune.models.attention)."""
    syncs = counted(job, path, f"{path}-packed", "--packing", "true")
    assert quiet_syncs(syncs) == {}, syncs


def test_workers_collate_the_batches_the_step_would(job, tmp_path):
    """The GPU default: batches (packed rows, their TRAINED_ROWS) collated ahead of the step in 2 persistent loader
    workers, pinned where CUDA is, are the batches collated in the step's own process, in the same order, over two
    epochs."""
    from finetune import config as C
    from finetune.constants import TRAINED_ROWS
    from finetune.data.pipeline import prepare_dataset
    from finetune.data.prepare import make_collator
    from finetune.data.sampler import distributed_dataloader
    from finetune.models.load import load_tokenizer

    root, model, data, _ = job
    cfg = C.parse(["--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(tmp_path / "o"),
                   "--dataset_cache_dir", str(root / "cache"), "--packing", "true", "--max_seq_length", "128"])
    tokenizer = load_tokenizer(cfg.model)
    dataset, stats = prepare_dataset(cfg.data, tokenizer, log=lambda *a: None)
    assert stats.packed_rows == len(dataset) > 4  # packed once, before training: rows are bins of records

    def epochs(**kw) -> list[dict]:
        loader = distributed_dataloader(dataset, make_collator(cfg, tokenizer), world=1, batch_size=2, shuffle=True,
                                        seed=3, **kw)
        out = []
        for epoch in range(2):
            loader.batch_sampler.set_epoch(epoch)
            out += list(loader)
        return out

    here = epochs()
    ahead = epochs(num_workers=2, persistent_workers=True, pin_memory=torch.cuda.is_available())
    assert len(here) == len(ahead) == 2 * -(-len(dataset) // 2)
    assert TRAINED_ROWS in here[0] and "position_ids" in here[0]
    for a, b in zip(here, ahead):
        # The collator's host values (max lengths, record bounds) are ints and tuples beside the tensors.
        assert a.keys() == b.keys() and all(
            torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def test_the_counter_leaves_torch_as_it_was():
    """Counting changes nothing after it: a 0-d tensor is no sequence (torch.tensor of 0-d tensors, which
    transformers' Qwen2.5-VL get_rope_index builds, raised "len() of a 0-d tensor" in later tests of the same process
    when the counter patched torch.Tensor.__getitem__ and set it back), and torch.Tensor keeps no attribute of ours."""
    before = dict(vars(torch.Tensor))
    deltas = [torch.tensor(3) - 1, torch.tensor(5) - 1]
    with SyncCounter() as c:
        torch.arange(4)[torch.tensor([True, False, True, False])]
    assert [x["what"] for x in c.calls[0]] == ["__getitem__"]
    assert torch.tensor(deltas).tolist() == [2, 4]
    assert dict(vars(torch.Tensor)) == before
