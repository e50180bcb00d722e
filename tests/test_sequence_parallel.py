"""--sequence_parallel_size N (DeepSpeed Ulysses on the engine path, docs/sequence-parallel.md).

Fast: a batch's slices put back together are the unsplit batch (tokens, positions, the targets shifted before the
split, trained positions, a packed row's boundaries), their trained tokens add up to the row's; the refusals.
Processes: `deepspeed --num_gpus 2 scripts/sft.py --sequence_parallel_size 2` (each record split over the two
ranks) against one process without it (the Trainer path), per-step losses within 1e-4, on ~1.5k-token records,
padded and packed; and (full matrix) on 16k-token records, with each rank's peak memory against the unsplit run's.
Resume: a split run with rank 1 killed after a checkpoint, resumed, gives the uninterrupted split run's losses.
"""

from __future__ import annotations

import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from finetune.config.preset import Preset
from finetune.config.training import DataConfig, sequence_parallel_problems
from finetune.constants import IGNORE_INDEX, TRAINED_ROWS
from finetune.data.packing import PackedCollator
from finetune.data.prepare import Collator, WithTrainedRows
from finetune.data.sequence import split_batch
from finetune.methods.sft import SFT
from finetune.models import tiny
from finetune.training import sequence_parallel
from launch import BIN, LOOP, REPO, free_port, launcher, matrix, losses, run, unexpected_warnings
from test_bad_inputs import assert_clear, assert_no_debris, cli, train_args  # noqa: F401

ENGINE = REPO / "scripts" / "sft.py"


# ----------------------------------------------------------------------------------------------
# Fast: the split.


def _records(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(1, 50, (n,), generator=g).tolist()
        labels = [IGNORE_INDEX if i < n // 3 else t for i, t in enumerate(ids)]  # a prompt without loss
        out.append({"input_ids": ids, "labels": labels})
    return out


def _glue(parts: list[dict], key: str) -> torch.Tensor:
    return torch.cat([p[key] for p in parts], dim=1)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("packed", [False, True])
def test_slices_put_together_are_the_batch(size, packed):
    if packed:
        row = {"input_ids": [], "labels": [], "seq_lens": []}
        for r in _records([7, 12, 4]):
            row["input_ids"] += r["input_ids"]
            row["labels"] += r["labels"]
            row["seq_lens"].append(len(r["input_ids"]))
        batch = WithTrainedRows(PackedCollator(0))([row])
    else:
        batch = WithTrainedRows(Collator(0))(_records([23]))
    length = batch["input_ids"].shape[1]
    padded = -(-length // size) * size
    parts = [split_batch(batch, r, size) for r in range(size)]
    assert all(p["input_ids"].shape == (1, padded // size) for p in parts)
    assert torch.equal(_glue(parts, "input_ids")[:, :length], batch["input_ids"])
    # Targets: the unsplit row's, shifted before the split (a slice's last token predicts the next slice's first).
    shifted = torch.nn.functional.pad(batch["labels"], (0, padded - length + 1), value=IGNORE_INDEX)[:, 1:]
    assert torch.equal(_glue(parts, "shift_labels"), shifted)
    positions = batch["position_ids"] if packed else torch.arange(length)[None]
    assert torch.equal(_glue(parts, "position_ids")[:, :length], positions)
    # Each trained token in exactly one slice; SFT's count over the slices is the row's.
    assert sum(len(p[TRAINED_ROWS]) for p in parts) == len(batch[TRAINED_ROWS])
    assert sum(int(SFT().count([p])) for p in parts) == int(SFT().count([batch])) > 0
    for p in parts:
        assert torch.equal(p["shift_labels"].reshape(-1)[p[TRAINED_ROWS]].ne(IGNORE_INDEX),
                           torch.ones(len(p[TRAINED_ROWS]), dtype=torch.bool))
    if packed:  # the whole row's boundaries, the padding a segment of its own
        tail = (padded,) if padded > length else ()
        assert parts[0]["seq_bounds"] == tuple(batch["seq_bounds"]) + tail
        assert parts[0]["cu_seq_lens_q"].tolist() == list(parts[0]["seq_bounds"])
        assert all(p["seq_bounds"] == parts[0]["seq_bounds"] for p in parts)


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_sequence_parallel_groups_are_dealt_one_batch(groups):
    """The loop's batch order with copies=N, dealt round-robin over groups x N ranks as accelerate deals it: the N
    ranks of group g get the same batches, those rank g of `groups` processes gets without copies."""
    from finetune.data.sampler import DistributedBatchOrder

    size = 2
    order = DistributedBatchOrder(37, groups, 3, seed=5, copies=size)
    plain = DistributedBatchOrder(37, groups, 3, seed=5)
    for epoch in (0, 1):
        order.set_epoch(epoch)
        plain.set_epoch(epoch)
        stream, reference = list(order), list(plain)
        assert len(stream) == len(order) == size * len(plain)
        for rank in range(groups * size):
            got = [b for k, b in enumerate(stream) if k % (groups * size) == rank]
            assert got == [b for k, b in enumerate(reference) if k % groups == rank // size]


def test_config_refusals():
    data = DataConfig()
    assert sequence_parallel_problems(1, data, {"per_device_train_batch_size": 8}, Preset.named("ddp")) == []
    assert sequence_parallel_problems(2, data, {"per_device_train_batch_size": 1}, Preset.named("zero3")) == []
    [fsdp] = sequence_parallel_problems(2, data, {"per_device_train_batch_size": 1}, Preset.named("fsdp2"))
    assert "not supported with --config fsdp2" in fsdp and "--config zero3" in fsdp
    [batch] = sequence_parallel_problems(2, data, {"per_device_train_batch_size": 4}, Preset.named("zero2"))
    assert "needs --per_device_train_batch_size 1" in batch and "--gradient_accumulation_steps" in batch
    assert "at least 1" in sequence_parallel_problems(0, data, {}, None)[0]


def test_model_and_world_refusals():
    from transformers import LlamaConfig

    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=2)
    config._attn_implementation = "sdpa"
    assert sequence_parallel.model_problems(config, 2) == []
    assert sequence_parallel.model_problems(config, 4) == []  # 2 key/value heads, each replicated to 2 ranks
    assert "4 attention heads do not split over 3 ranks" in sequence_parallel.model_problems(config, 3)[0]
    config._attn_implementation = "eager"
    assert "--attn_implementation sdpa" in sequence_parallel.model_problems(config, 2)[0]
    assert sequence_parallel.groups_or_exit(2, 4, 3) == (2, 1, 1)
    with pytest.raises(SystemExit) as e:
        sequence_parallel.groups_or_exit(3, 4, 0)
    assert e.value.code == 2


def test_a_checkpoint_resumes_only_with_its_split(tmp_path):
    """A checkpoint's data position counts micro-batches of its run's groups of N ranks: another N (or none) is
    refused by name with the fix; a checkpoint without sequence parallelism resumes as before."""
    from finetune.training import checkpoint

    def saved(name: str, split: int):
        folder = checkpoint.folder_for(tmp_path / name, 3)
        folder.mkdir(parents=True)
        (folder / "mp_rank_00_model_states.pt").write_bytes(b"x" * 10)
        checkpoint.mark_complete(folder, path="engine", world_size=4, zero_stage=2, global_step=3,
                                 sequence_parallel=split)
        return folder

    split, plain = saved("split", 2), saved("plain", 1)
    assert "sequence_parallel" not in checkpoint.read_meta(plain)  # the marker as before the flag existed
    kw = dict(path="engine", world_size=4, zero_stage=2)
    assert checkpoint.resolve("latest", tmp_path / "split", sequence_parallel=2, **kw) == split
    assert checkpoint.resolve("latest", tmp_path / "plain", **kw) == plain
    for folder, saved_n, this in ((split, 2, 1), (split, 2, 4), (plain, 1, 2)):
        with pytest.raises(checkpoint.ResumeError) as e:
            checkpoint.resolve("latest", folder.parent, sequence_parallel=this, **kw)
        assert str(e.value) == (
            f"{folder} was saved by a run with --sequence_parallel_size {saved_n}, this run has {this}: its data "
            f"position counts micro-batches of groups of {saved_n} ranks, so the resumed run would train other records "
            f"than the run it continues. Resume with --sequence_parallel_size {saved_n}, or start a new run without "
            "--resume_from_checkpoint")


def test_trainer_path_refuses_it(tiny_chatml, tmp_path, monkeypatch, capfd, isolated, one_thread):
    data = tiny.write_jsonl(tmp_path / "data.jsonl", tiny.synthetic_records(8))
    code, err = cli(train_args(tiny_chatml, data, tmp_path / "out", "--sequence_parallel_size", "2"), tmp_path,
                    monkeypatch, capfd)
    assert_clear(code, err, "sequence_parallel_size: needs --per_device_train_batch_size 1 (one record")
    code, err = cli(train_args(tiny_chatml, data, tmp_path / "out", "--sequence_parallel_size", "2",
                               "--per_device_train_batch_size", "1"), tmp_path, monkeypatch, capfd)
    assert_clear(code, err, "sequence_parallel_size: finetune/train.py does not split records", "scripts/sft.py")
    assert "Loading weights" not in err
    assert_no_debris(tmp_path)


# ----------------------------------------------------------------------------------------------
# Processes: 2 ranks splitting every record against one process.


def _job(root: Path, words: int, records: int, **model) -> tuple[Path, Path]:
    """A tiny Llama and chat records of about `words` words each (copy and reverse tasks: ~3 tokens a word)."""
    path = tiny.build(root / "model", style="chatml", **model)
    pool = tiny.synthetic_records(records * 3, seed=5, min_words=words, max_words=words)
    long = [r for r in pool if not r["messages"][1]["content"].startswith("count")][:records]
    return path, tiny.write_jsonl(root / "data.jsonl", long)


def _flags(root: Path, model: Path, data: Path, out: str, steps: int, length: int, *extra: str) -> list[str]:
    return ["--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(root / out),
            "--dataset_cache_dir", str(root / "cache"), "--max_steps", str(steps), "--learning_rate", "2e-3",
            "--warmup_steps", "1", "--seed", "1234", "--max_seq_length", str(length), "--disable_tqdm", "true",
            "--per_device_train_batch_size", "1", *extra]


def _sp_command(flags: list[str], script: Path = ENGINE, pre: list[str] = (), path: str = "engine") -> list[str]:
    if path == "loop":
        return [*launcher("accelerate", 2, script=LOOP), *flags, "--sequence_parallel_size", "2"]
    return [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), str(script), *pre,
            *flags, "--sequence_parallel_size", "2"]


def _sp_run(flags: list[str], script: Path = ENGINE, pre: list[str] = (), timeout: float = 600,
            path: str = "engine") -> str:
    cmd = _sp_command(flags, script, pre, path)
    result = run(cmd, timeout=timeout, MALLOC_MMAP_THRESHOLD_="131072").check()
    assert "x 1 data-parallel groups of 2 processes (sequence parallel: each record split over 2)" in result.output
    assert not unexpected_warnings(result.output), unexpected_warnings(result.output)
    return result.output


def _samples_per_step(out: Path) -> float:
    last = json.loads((out / "trainer_state.json").read_text())["log_history"][-1]
    return last["train_samples_per_second"] / last["train_steps_per_second"]


def _assert_same(ref: list[float], got: list[float], steps: int) -> float:
    assert len(ref) == len(got) == steps, (ref, got)
    worst = 0.0
    for step, (a, b) in enumerate(zip(ref, got), start=1):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: split {b} vs one process {a}"
        worst = max(worst, abs(a - b) / abs(a))
    return worst


@pytest.mark.slow
# CI: the engine with packed rows on ZeRO-3 with offload and gradient checkpointing (the record boundaries through
# the exchange, the recompute's exchanges), the loop with padded records on ZeRO-2 (sdpa's causal path); both paths
# with both under FINETUNE_FULL_MATRIX=1.
@pytest.mark.parametrize("case", matrix(
    ["engine-records-zero2", "engine-packed-zero3", "loop-records-zero2", "loop-packed-zero3"],
    ["engine-packed-zero3", "loop-records-zero2"]))
def test_split_records_train_as_one_process(case, tmp_path):
    """~1.5k-token records (1.2k-1.9k), 4 steps of 2 records (packed: rows of up to 4k tokens holding 2-3 records):
    the loss of every step with each record split over 2 ranks equals one process's within 1e-4."""
    steps = 4
    model, data = _job(tmp_path, words=600, records=16)
    path, layout, preset = case.split("-")
    packed = layout == "packed"
    extra = ["--gradient_accumulation_steps", "2", *(["--packing", "true"] if packed else [])]
    split_only = ["--gradient_checkpointing", "true"] if packed else []
    length = 4096 if packed else 2048
    ref = [sys.executable, str(REPO / "finetune" / "train.py"), "--config", "ddp",
           *_flags(tmp_path, model, data, "one", steps, length, *extra)]
    run(ref, timeout=300).check()
    output = _sp_run(_flags(tmp_path, model, data, "split", steps, length, "--config", preset, *extra, *split_only),
                     path=path)
    if packed:
        assert "attention: packed records through one variable-length kernel call per layer" in output
    worst = _assert_same(losses(tmp_path / "one"), losses(tmp_path / "split"), steps)
    print(f"{case}: worst relative difference {worst:.2e}")
    # A step is 2 records however many ranks split them (1 per device x 2 accumulation x 2 ranks / 2 per record).
    assert _samples_per_step(tmp_path / "split") == pytest.approx(_samples_per_step(tmp_path / "one"), rel=0.02)
    assert _samples_per_step(tmp_path / "one") == pytest.approx(2, rel=0.02)
    assert losses(tmp_path / "split")[-1] < losses(tmp_path / "split")[0]


@pytest.mark.slow
@pytest.mark.full_matrix  # several minutes; CI's cover of the mechanism: the ~1.5k-token runs above
def test_16k_records_split_with_their_memory(tmp_path):
    """16k-token records on a model whose activations dominate its memory at that length (8 layers, hidden 64,
    MLP 2048: ~0.6 GB of saved activations per layer unsplit, 1.4M parameters): per-step losses with each record
    split over 2 ranks equal one process's within 1e-4, and each rank's peak RSS (VmHWM) is at most 0.6x the
    one-process run's."""
    steps, length = 2, 16384
    model, data = _job(tmp_path, words=5600, records=2, hidden=64, layers=8)
    _widen_mlp(model, 2048)
    worker = REPO / "tests" / "sp_memory_worker.py"
    flags = ["--config", "zero2", "--gradient_accumulation_steps", "1"]
    one = run([sys.executable, str(worker), str(tmp_path / "hwm-one"), "--",
               *_flags(tmp_path, model, data, "one", steps, length, *flags)], timeout=900,
              MALLOC_MMAP_THRESHOLD_="131072").check()
    assert "batch: 1 per device x 1 accumulation x 1 processes" in one.output
    _sp_run(_flags(tmp_path, model, data, "split", steps, length, *flags), script=worker,
            pre=[str(tmp_path / "hwm-split"), "--"], timeout=900)
    worst = _assert_same(losses(tmp_path / "one"), losses(tmp_path / "split"), steps)
    unsplit = int((tmp_path / "hwm-one" / "hwm-0").read_text()) / 2**20
    ranks = [int((tmp_path / "hwm-split" / f"hwm-{r}").read_text()) / 2**20 for r in range(2)]
    # The plan of the split run: each rank's total (a slice's activations, the all-to-all buffers, the process).
    from finetune.plan import planner

    plan = planner.make_plan(["--model_name_or_path", str(model), "--max_seq_length", str(length),
                              "--per_device_train_batch_size", "1", "--config", "zero2", "--devices_per_node", "2",
                              "--accelerator", "cpu", "--host_memory", "24GB", "--sequence_parallel_size", "2"])
    planned = plan["per_device_total"] / 2**30
    print(f"16k: worst relative difference {worst:.2e}; peak RSS one process {unsplit:.2f} GiB, split ranks "
          f"{ranks[0]:.2f} / {ranks[1]:.2f} GiB ({max(ranks) / unsplit:.2f}x); planned per rank {planned:.2f} GiB")
    assert max(ranks) <= 0.6 * unsplit, (ranks, unsplit)
    assert abs(planned - max(ranks)) <= 0.1 * max(ranks), (planned, ranks)


@pytest.mark.slow
# CI: the loop (its batch order deals each batch to the N ranks of a group: `copies`); the engine (DistributedSampler
# over the groups) with FINETUNE_FULL_MATRIX=1.
@pytest.mark.parametrize("path", matrix(["loop", "engine"], ["loop"]))
def test_kill_one_rank_then_resume_gives_the_same_losses(path, tmp_path):
    """A split run on ZeRO-2, rank 1 killed (kill -9) after step 4, resumed with `--resume_from_checkpoint latest`
    from checkpoint-3: every step's loss equals the uninterrupted split run's within 1e-6. 10 records of 2 per step:
    the resume is mid-epoch (steps 4-5) and step 6 is in the second epoch. Every step trains other records (copy
    and reverse tasks of 40 random words), so the same losses are the same records in the same order."""
    from finetune.testing import run_and_kill_rank
    from finetune.training import checkpoint

    steps, save = 6, 3
    model, data = _job(tmp_path, words=40, records=10)
    flags = ["--config", "zero2", "--gradient_accumulation_steps", "2", "--save_steps", str(save),
             "--resume_from_checkpoint", "latest"]
    out = tmp_path / "killed"
    cmd = _sp_command(_flags(tmp_path, model, data, "killed", steps, 512, *flags), path=path)
    # The uninterrupted run and the killed one side by side (each its own port and folder; most of a 2-rank job on
    # 2 cores is start-up and waiting).
    with ThreadPoolExecutor(2) as pool:
        full = pool.submit(_sp_run, _flags(tmp_path, model, data, "full", steps, 512, *flags), path=path)
        killed = run_and_kill_rank(cmd, out / f"checkpoint-{save}" / checkpoint.MARKER, rank=1, timeout=600,
                                   stop_at=(save + 1, 0.0), MALLOC_MMAP_THRESHOLD_="131072")
        full.result()
    assert killed.returncode != 0 and not killed.survivors, killed.output[-3000:]
    assert not (out / "config.json").exists()  # no final model: the run was cut off
    output = _sp_run(_flags(tmp_path, model, data, "killed", steps, 512, *flags), path=path)
    assert f"resume: from {out / f'checkpoint-{save}'}" in output, output[-3000:]
    expected, got = losses(tmp_path / "full"), losses(out)
    assert len(expected) == len(got) == steps, (expected, got)
    assert len(set(expected)) == steps and expected[-1] < expected[0], expected  # it trains, on other records each step
    diff = max(abs(a - b) for a, b in zip(expected, got))
    print(f"{path}: resumed vs uninterrupted, max |loss difference| {diff:.2e}")
    assert diff <= 1e-6, f"{path}: resumed vs uninterrupted: max |diff| {diff}\n{expected}\n{got}"
    # The checkpoint says N: resuming it with another is refused before anything loads (the data position is N's).
    folder = out / f"checkpoint-{save}"
    assert checkpoint.read_meta(folder)["sequence_parallel"] == 2
    with pytest.raises(checkpoint.ResumeError, match="saved by a run with --sequence_parallel_size 2, this run has 1"):
        checkpoint.check_compatible(folder, path=path, world_size=2, zero_stage=2)


def _widen_mlp(model: Path, intermediate: int) -> None:
    """The tiny model with a wider MLP (re-initialized from the changed config, same seed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(model)
    config.intermediate_size = intermediate
    config.max_position_embeddings = 32768
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model)


def test_plan_knows_the_split(tmp_path):
    """`finetune plan --sequence_parallel_size 2`: each rank's activations are a half-row slice's (no mask) plus the
    all-to-all buffers, and the longest record that fits is the bisection's boundary, about twice the unsplit one
    on a model whose activations dominate."""
    from finetune.plan import planner

    model = tiny.build(tmp_path / "model", hidden=64, layers=8)
    argv = ["--model_name_or_path", str(model), "--max_seq_length", "16384", "--per_device_train_batch_size", "1",
            "--config", "zero2", "--devices_per_node", "2", "--accelerator", "cpu", "--host_memory", "16GB",
            # Packed rows: no padding mask in either plan (the planner counts a [length x length] one per layer for
            # padded batches, which a split row never builds).
            "--packing", "true"]
    one, two = planner.make_plan(argv), planner.make_plan([*argv, "--sequence_parallel_size", "2"])
    assert 0 < two["per_device"]["activations"] < one["per_device"]["activations"] * 0.6
    assert any("sequence parallel over 2 ranks: activations of a 8192-token slice" in n for n in two["notes"])
    longest_one, longest_two = one["longest_record"]["tokens"], two["longest_record"]["tokens"]
    assert 1.8 * longest_one < longest_two < 2.6 * longest_one, (longest_one, longest_two)
    cfg, _ = planner.parse_plan_args([*argv, "--sequence_parallel_size", "2"])
    job = planner.workload_from_config(cfg, world_size=2, devices_per_node=2, accelerator="cpu")
    limits = planner.Limits(16 * 10**9 // 2, 16 * 10**9)
    assert planner.fits(planner.predict(job.replace(seq_len=longest_two)), limits)[0]
    assert not planner.fits(planner.predict(job.replace(seq_len=longest_two + 2)), limits)[0]
    assert f"longest record that fits: {longest_two:,} tokens" in planner.render(two)
    assert "each record split over 2 ranks" in planner.render(two)
    with pytest.raises(planner.PlanError, match="does not divide the 2 devices"):
        planner.make_plan([*argv, "--sequence_parallel_size", "3"])
    # --config ddp with a split runs on the engine (DeepSpeed's stage 0): no DDP gradient buckets.
    ddp = [*argv[:argv.index("zero2")], "ddp", *argv[argv.index("zero2") + 1:]]
    assert any("DDP gradient buckets" in n for n in planner.make_plan(ddp)["notes"])
    split = planner.make_plan([*ddp, "--sequence_parallel_size", "2"])
    assert not any("DDP gradient buckets" in n for n in split["notes"])


def test_path_refusals():
    from types import SimpleNamespace

    def cfg(preset="zero2", method="sft", eval_dataset=None):
        return SimpleNamespace(launch=SimpleNamespace(sequence_parallel_size=2), preset=Preset.named(preset),
                               objective=SimpleNamespace(method=method),
                               data=SimpleNamespace(eval_dataset=eval_dataset, eval_split_size=None))

    assert sequence_parallel.path_problems(cfg(), "scripts/sft.py") == []
    assert sequence_parallel.path_problems(cfg(), "finetune/loop.py") == []
    assert sequence_parallel.path_problems(cfg("ddp"), "scripts/sft.py") == []  # DeepSpeed's stage 0 there
    [ddp] = sequence_parallel.path_problems(cfg("ddp"), "finetune/loop.py")
    assert "needs a DeepSpeed preset" in ddp and "--config zero2" in ddp
    [trainer] = sequence_parallel.path_problems(cfg(), "finetune/train.py")
    assert "finetune/train.py does not split records" in trainer and "finetune/loop.py" in trainer
    [dpo] = sequence_parallel.path_problems(cfg(method="dpo"), "scripts/sft.py")
    assert "method dpo is not supported" in dpo
    [ev] = sequence_parallel.path_problems(cfg(eval_dataset="eval.jsonl"), "scripts/sft.py")
    assert "evaluation during training is not supported" in ev
