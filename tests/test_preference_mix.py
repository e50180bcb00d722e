"""Several preference data sets mixed by weight (--dataset a --dataset b --dataset_weights ...), as SFT's are
(finetune.data.mix): the mixed set's composition against the weights, for pairs (DPO, SimPO, ORPO) and unpaired
examples (KTO); a DPO run on a mix trains."""

from __future__ import annotations

import json
import math

import pytest

from finetune.data import mix
from finetune.data import preference as PR
from finetune.data import unpaired as U


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def data_cfg(paths, cache, weights=None):
    from finetune.config import DataConfig

    return DataConfig(dataset=[str(p) for p in paths], dataset_weights=weights, dataset_cache_dir=str(cache),
                      dataset_num_proc=1)


def tok(folder):
    from finetune.config import ModelConfig
    from finetune.models.load import load_tokenizer

    return load_tokenizer(ModelConfig(model_name_or_path=str(folder)))


A = [{"prompt": f"alpha {i}", "chosen": "yes", "rejected": "no"} for i in range(10)]
B = [{"prompt": f"beta {i}", "chosen": "ok", "rejected": "bad"} for i in range(4)]


@pytest.mark.parametrize("weights, want", [(None, (10, 4)), ([0.25, 0.75], (4, 10)), ([3, 1], (11, 3))])
def test_pair_mix_composition(tiny_chatml, tmp_path, weights, want):
    """14 pairs in all; each source's share is its weight: 0.25 x 14 = 3.5 -> 4 (largest remainder, the tie to the
    earlier source) and 10.5 -> 10; 3:1 -> 10.5 -> 11 and 3.5 -> 3. B asked for 10 of its 4 is taken twice whole
    plus 2 more; A asked for fewer than its 10 gives a seeded subset."""
    t = tok(tiny_chatml)
    paths = [write_jsonl(tmp_path / "a.jsonl", A), write_jsonl(tmp_path / "b.jsonl", B)]
    lines = []
    ds, stats, key = PR.prepare_pairs(data_cfg(paths, tmp_path / "cache", weights), t, log=lines.append, seed=7)
    alpha = t("alpha", add_special_tokens=False)["input_ids"][0]
    from_a = sum(alpha in row for row in ds["prompt_ids"])
    got = (from_a, len(ds) - from_a)
    print(f"\npairs, weights {weights}: taken {got} of (10, 4); shares {[round(g / 14, 3) for g in got]}")
    assert got == want and stats.pairs == 14 == sum(want) and key.startswith("mix-")
    if weights:
        assert all(abs(g / 14 - w / sum(weights)) <= 0.5 / 14 + 1e-12 for g, w in zip(got, weights))
        assert f"b.jsonl: {want[1]} of 4 examples" in lines[0]
    # The same seed gives the same rows; another seed another subset of A.
    again, _, _ = PR.prepare_pairs(data_cfg(paths, tmp_path / "cache", weights), t, log=lambda *a: None, seed=7)
    assert again["prompt_ids"] == ds["prompt_ids"]


def test_large_mix_matches_weights():
    """The counts alone, at scale: 3 sources of 1,000, 50,000 and 7 examples at weights 0.5, 0.3, 0.2."""
    sizes, weights = [1000, 50000, 7], [0.5, 0.3, 0.2]
    counts = mix.counts(sizes, weights)
    total = sum(sizes)
    assert sum(counts) == total
    assert all(abs(c - total * w) < 1 for c, w in zip(counts, weights)), counts
    picks = mix.plan(sizes, weights, seed=1)
    assert [len(p) for p in picks] == counts
    # The first and last sources are repeated whole (25,503 of 1,000; 10,201 of 7), the second subsampled.
    assert len(set(picks[0])) == 1000 and len(set(picks[2])) == 7 and len(set(picks[1])) == counts[1]


def test_unpaired_mix_composition(tiny_chatml, tmp_path):
    t = tok(tiny_chatml)
    good = [{"prompt": f"alpha {i}", "completion": "yes", "label": True} for i in range(6)]
    bad = [{"prompt": f"beta {i}", "completion": "no", "label": False} for i in range(6)]
    paths = [write_jsonl(tmp_path / "good.jsonl", good), write_jsonl(tmp_path / "bad.jsonl", bad)]
    ds, stats, _ = U.prepare_unpaired(data_cfg(paths, tmp_path / "cache", [2, 1]), t, log=lambda *a: None)
    print(f"\nunpaired, weights [2, 1]: {sum(ds['label'])} desirable, {len(ds) - sum(ds['label'])} undesirable of 12")
    assert (sum(ds["label"]), len(ds)) == (8, 12) and (stats.desirable, stats.undesirable) == (8, 4)


def test_dpo_on_a_mix_trains(tiny_chatml, tmp_path, isolated, one_thread):
    """DPO on two pair files mixed 0.7 / 0.3: step 1 is log 2 (the policy is its reference), and the margins grow."""
    from finetune.training import trainer

    paths = [write_jsonl(tmp_path / "a.jsonl", A[:6]), write_jsonl(tmp_path / "b.jsonl", B)]
    out = tmp_path / "out"
    trainer.main(["--method", "dpo", "--model_name_or_path", str(tiny_chatml), "--dataset", str(paths[0]),
                  "--dataset", str(paths[1]), "--dataset_weights", "0.7", "0.3", "--output_dir", str(out),
                  "--dataset_cache_dir", str(tmp_path / "cache"), "--per_device_train_batch_size", "4",
                  "--max_steps", "6", "--learning_rate", "0.5", "--optim", "sgd", "--lr_scheduler_type", "constant",
                  "--seed", "3", "--beta", "0.5"])
    logs = [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e]
    print(f"\nDPO on a mix: losses {[round(e['loss'], 4) for e in logs]}, margins "
          f"{[round(e['rewards/margins'], 4) for e in logs]}")
    assert logs[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert logs[-1]["loss"] < logs[0]["loss"] and logs[-1]["rewards/margins"] > 0
