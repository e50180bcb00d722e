"""DPO on image pairs (TRL's vision preference format, finetune.data.preference's image path): one micro-batch's
loss and chosen/rejected log-probabilities on a tiny vision-language model against TRL 1.16's DPOTrainer on the same
batch and against a float64 computation made from transformers' processor and model alone; the pipeline's checks
(bad records by file and line, truncation that never cuts an image, image tokens never scored); a short training run
that moves the reward margin. CI runs Qwen2.5-VL (mrope positions, dynamic image grids) and Gemma-3 (token types,
pooled image tokens); FINETUNE_FULL_MATRIX=1 adds Qwen3-VL and SmolVLM."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from launch import matrix
from vision_data import write_images, write_jsonl

from finetune.constants import IGNORE_INDEX
from finetune.data import preference as PR
from finetune.data.errors import DataError
from finetune.methods import dpo
from finetune.models import tiny

# family -> the token that ends an assistant turn (scored, as SFT trains it; what the template writes after it is not).
END = {"gemma3": "<end_of_turn>", "qwen2_5_vl": "<|im_end|>", "qwen3_vl": "<|im_end|>", "smolvlm": "<end_of_utterance>"}


def user(*parts) -> dict:
    return {"role": "user", "content": [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]}


def answer(text: str) -> list[dict]:
    return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]


# TRL's vision preference records: images beside a conversational pair, the image parts in the prompt.
PAIRS = [
    {"images": ["img/0.png"], "prompt": [user(None, "What colour is this?")], "chosen": answer("Mostly grey noise."),
     "rejected": answer("Bright red.")},
    {"images": ["img/1.png", "img/2.png"], "prompt": [user("Compare", None, "with", None)],
     "chosen": answer("Both are noise."), "rejected": answer("The first one is a cat, the second a dog.")},
    {"images": ["img/3.png"], "prompt": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                                         user(None, "Describe it.")],
     "chosen": answer("Random dots."), "rejected": answer("A quiet lake at dawn, with mist.")},
]


def quiet(*_a, **_k):
    pass


def vision_tokenizer(folder: Path):
    """The tokenizer with its processor attached, as a training run loads them (finetune.training.examples)."""
    from finetune.config import ModelConfig
    from finetune.models.load import load_tokenizer
    from finetune.training.examples import attach_processor

    model_cfg = ModelConfig(model_name_or_path=str(folder))
    tokenizer = load_tokenizer(model_cfg)
    attach_processor(model_cfg, tokenizer)
    return tokenizer


def prepare(tokenizer, dataset: Path, cache: Path, **kw):
    """The pairs as `--method dpo` prepares them (the pipeline's map and cache, images included)."""
    from finetune.config import DataConfig
    from finetune.methods import get

    cfg = DataConfig(dataset=str(dataset), dataset_cache_dir=str(cache), **kw)
    return get("dpo").prepare(cfg, tokenizer, local_rank=0, log=quiet)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision-dpo")
    write_images(root)
    write_jsonl(root / "pairs.jsonl", PAIRS)
    return root


def load_vlm(folder: Path, dtype=torch.float32):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype)


def perturbed(model, seed: int = 1):
    """A policy away from its reference, so the log-ratios (and the loss) are not those of equal models."""
    policy = copy.deepcopy(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return policy


# ----------------------------------------------------------------------------------------------
# The float64 reference: transformers' processor and model alone, one pair side at a time (no padding).


def float64_logps(processor, policy, ref, family: str, records: list[dict], base: Path) -> torch.Tensor:
    """[pairs, 2 (chosen, rejected), 2 (policy, reference)] float64: the prompt rendered by the processor's chat
    template with the generation prompt and run through the processor with its images, each completion the rest of
    the prompt + completion rendering, tokenized by the tokenizer; scored through the family's end-of-turn token."""
    from PIL import Image

    end = processor.tokenizer.convert_tokens_to_ids(END[family])
    out = torch.zeros(len(records), 2, 2, dtype=torch.float64)
    for i, r in enumerate(records):
        prompt_text = processor.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        images = [Image.open(base / p) for p in r["images"]]
        for j, side in enumerate(("chosen", "rejected")):
            full = processor.apply_chat_template(r["prompt"] + r[side], tokenize=False)
            assert full.startswith(prompt_text)
            enc = processor(text=[prompt_text], images=[images], add_special_tokens=False, return_tensors="pt")
            completion = processor.tokenizer(full[len(prompt_text):], add_special_tokens=False)["input_ids"]
            scored = completion[:completion.index(end) + 1]
            n = enc["input_ids"].shape[1]
            enc["input_ids"] = torch.cat([enc["input_ids"], torch.tensor([completion])], dim=1)
            enc["attention_mask"] = torch.ones_like(enc["input_ids"])
            for key in ("token_type_ids", "mm_token_type_ids"):
                if key in enc:
                    enc[key] = torch.cat([enc[key], torch.zeros(1, len(completion), dtype=enc[key].dtype)], dim=1)
            enc["pixel_values"] = enc["pixel_values"].double()
            for k, model in enumerate((policy, ref)):
                with torch.no_grad():
                    logp = torch.log_softmax(model(**enc).logits[0].double(), dim=-1)
                out[i, j, k] = sum(logp[n + t - 1, tok] for t, tok in enumerate(scored))
    return out


def float64_loss(logps: torch.Tensor, beta: float) -> float:
    d = (logps[:, 0, 0] - logps[:, 0, 1]) - (logps[:, 1, 0] - logps[:, 1, 1])
    return float(-F.logsigmoid(beta * d).mean())


# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=matrix(list(END), ["qwen2_5_vl"]))  # CI: mrope; the rest in the full matrix
def family(request, root):
    folder = tiny.tiny_vlm(request.param, root / request.param)
    return request.param, folder, vision_tokenizer(folder)


@pytest.mark.slow
def test_loss_and_logps_equal_trl_and_float64(family, root, one_thread, isolated):
    """Our micro-batch (the pipeline's cached pairs, VisionPairCollator) scored by finetune's DPO loss, by TRL's
    DPOTrainer.compute_loss on the same batch, and in float64 from transformers' processor and model alone: the
    chosen/rejected log-probabilities and the loss agree within 1e-5 (float64 decides). TRL's own vision collator
    makes the same tokens and pixels from the same records; it scores the template's text after the end-of-turn
    token too (Qwen's and Gemma's newline), which finetune does not train (as SFT): counted here."""
    trl = pytest.importorskip("trl")
    import datasets
    from PIL import Image

    name, folder, tokenizer = family
    processor = tokenizer.finetune_processor
    ds, stats, _ = prepare(tokenizer, root / "pairs.jsonl", root / f"cache-{name}", max_seq_length=1024)
    assert stats.pairs == len(PAIRS) and stats.dropped == 0 and stats.without_images == 0
    batch = dpo.DPO().collator(None, tokenizer)([ds[i] for i in range(len(ds))])
    beta = 0.3
    base = load_vlm(folder).train()  # as trained: no dropout in these models, train mode as the Trainer runs them
    policy, ref = perturbed(base), base.eval()

    window = dpo.Metrics()
    options = dpo.DPOConfig(beta=beta)
    ours = dpo.micro_batch_loss(policy, batch, lambda b: dpo.sequence_logps(ref, b), options, len(PAIRS), window).item()
    with torch.no_grad():
        got = torch.stack([t.double() for t in (dpo.sequence_logps(policy, batch), dpo.sequence_logps(ref, batch))], 1)
    got = torch.stack(got.chunk(2), 1)  # [pairs, side, model]

    want = float64_logps(processor, copy.deepcopy(policy).double(), copy.deepcopy(ref).double(), name, PAIRS, root)
    f64 = float64_loss(want, beta)

    records = [dict(r, images=[Image.open(root / p).convert("RGB") for p in r["images"]]) for r in PAIRS]
    args = trl.DPOConfig(output_dir=str(root / f"trl-{name}"), beta=beta, report_to="none", use_cpu=True,
                         per_device_train_batch_size=len(PAIRS), max_length=None, gradient_checkpointing=False,
                         bf16=False)  # TRL 1.16 defaults to bf16: its reference would run under bf16 autocast
    trainer = trl.DPOTrainer(model=copy.deepcopy(policy), ref_model=copy.deepcopy(ref), args=args,
                             train_dataset=datasets.Dataset.from_list(records), processing_class=processor)
    theirs_batch = trainer.data_collator(copy.deepcopy(records))
    rows = batch["attention_mask"].sum(1)
    for r in range(2 * len(PAIRS)):  # the same tokens, row by row (TRL flushes its left-padded prompts left)
        n = int(rows[r])
        assert theirs_batch["input_ids"][r, :n].tolist() == batch["input_ids"][r, :n].tolist()
        assert int(theirs_batch["attention_mask"][r].sum()) == n
    for key in ("pixel_values", "image_grid_thw"):
        if key in batch:
            assert torch.equal(theirs_batch[key], batch[key])
    ours_mask = (batch["labels"] != IGNORE_INDEX).long()
    extra = (theirs_batch["completion_mask"][:, :ours_mask.shape[1]] - ours_mask)
    assert extra.min() >= 0  # TRL scores every token finetune scores ...
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    after_end = [batch["input_ids"][r][extra[r].bool()].tolist() for r in range(extra.shape[0])]
    assert all(t == newline for t in after_end), after_end  # ... and the newline the template writes after the turn

    trl_inputs = {**PR.model_inputs(batch), "completion_mask": ours_mask}
    with torch.no_grad():
        theirs = trainer.compute_loss(trainer.model, trl_inputs).item()
    metrics = window.pop()
    print(f"\n{name}: loss ours {ours:.8f} TRL {theirs:.8f} float64 {f64:.8f} | ours-f64 {abs(ours - f64):.1e} "
          f"TRL-f64 {abs(theirs - f64):.1e} | logps max diff to float64 {(got - want).abs().max():.1e} | "
          f"logps/chosen {metrics['logps/chosen']:.4f}")
    assert abs(ours - f64) < 1e-5 and abs(theirs - f64) < 1e-5
    assert abs(ours - math.log(2)) > 1e-3  # not the loss of a policy equal to its reference
    # Each log-probability sums 5-40 float32 token log-probabilities (magnitudes 40-160; Gemma-3's over a 262k
    # vocabulary): measured within 2.0e-5 of float64, a relative 1.3e-7.
    torch.testing.assert_close(got, want, atol=0, rtol=1e-6)
    assert abs(metrics["logps/chosen"] - float(want[:, 0, 0].mean())) < 1e-6 * abs(float(want[:, 0, 0].mean()))


# ----------------------------------------------------------------------------------------------
# Bad records, by file and line (the `vision` format's checks, as SFT's).


def pair_with(**changes) -> dict:
    return {**copy.deepcopy(PAIRS[0]), **changes}


@pytest.mark.parametrize("record, message", [
    (pair_with(images=["img/0.png", "img/1.png"]),
     r"d\.jsonl:4 \(chosen\): 1 image part \(\{\"type\": \"image\"\}\) in 'messages' but 2 images in 'images'; give "
     r"one image per image part"),
    (pair_with(images=[]), r"d\.jsonl:4 \(chosen\): 1 image part .* but 0 images in 'images'"),
    (pair_with(prompt=[{"role": "user", "content": "What colour is this?"}]),
     r"d\.jsonl:4 \(chosen\): 0 image parts .* but 1 image in 'images'"),
    (pair_with(chosen=[{"role": "assistant", "content": [{"type": "image"}, {"type": "text", "text": "This."}]}]),
     r"d\.jsonl:4: 'chosen'\[0\] has an image part; a pair's images belong to its prompt"),
    (pair_with(prompt=[user(None), {"role": "human", "content": "Which?"}]),
     r"d\.jsonl:4 \(prompt\): messages\[1\]\.role is 'human'.*did you mean 'user'"),
    (pair_with(prompt=[{"role": "user", "content": [{"type": "video"}]}]),
     r"d\.jsonl:4 \(chosen\): messages\[0\]\.content\[0\] must be \{\"type\": \"text\", \"text\": \.\.\.\} or "
     r"\{\"type\": \"image\"\}"),
])
def test_bad_image_pairs_name_file_and_line(record, message):
    with pytest.raises(DataError, match=message):
        PR.pair_of(record, "d.jsonl:4", chat=True, images=True)


def test_images_for_a_text_only_model_are_refused(tiny_chatml):
    """DPO reads image pairs; a model without an image processor refuses them by file and line, as SFT does."""
    from finetune.config import ModelConfig
    from finetune.models.load import load_tokenizer

    tokenizer = load_tokenizer(ModelConfig(model_name_or_path=str(tiny_chatml)))
    with pytest.raises(DataError, match=r"d\.jsonl:2: the record has 1 image, and the model \(.*\) is text-only: it "
                                        r"has no image processor"):
        PR.tokenize_image_pair(tokenizer, PAIRS[0], "d.jsonl:2")
    text = {"prompt": "Say hello.", "chosen": "Hello!", "rejected": "Go away."}  # a text pair: as tokenize_pair's
    assert PR.tokenize_image_pair(tokenizer, text, "d.jsonl:3").tokens == PR.tokenize_pair(tokenizer, text, "d.jsonl:3")


# ----------------------------------------------------------------------------------------------
# With a tiny Qwen2.5-VL: the pipeline, truncation, and a short training run.


@pytest.fixture(scope="module")
def qwen(root):
    folder = tiny.tiny_vlm("qwen2_5_vl", root / "qwen2_5_vl")
    return folder, vision_tokenizer(folder)


@pytest.mark.slow
def test_missing_image_names_file_line_and_image(qwen, root):
    bad = write_jsonl(root / "missing.jsonl", [PAIRS[0], pair_with(images=["img/nope.png"])])
    with pytest.raises(DataError, match=r"missing\.jsonl:2: images\[0\]: image file 'img/nope\.png' not found"):
        prepare(qwen[1], bad, root / "cache-missing", max_seq_length=1024)


@pytest.mark.slow
def test_truncation_never_cuts_an_image_and_image_tokens_are_never_scored(qwen, root):
    """An image pair's prompt is kept whole: a max_seq_length that its prompt fills drops the pair (counted); one
    that leaves room cuts the completions' ends only. No image token, and no prompt token, is ever scored."""
    _, tokenizer = qwen
    processor = tokenizer.finetune_processor
    image_ids = {processor.image_token_id, tokenizer.convert_tokens_to_ids("<|vision_start|>"),
                 tokenizer.convert_tokens_to_ids("<|vision_end|>")}
    text = {"prompt": "Say hello.", "chosen": "Hello there, friend!", "rejected": "Go away."}
    data = write_jsonl(root / "mixed.jsonl", PAIRS + [text])
    full, stats, _ = prepare(tokenizer, data, root / "cache-full", max_seq_length=1024)
    assert stats.pairs == 4 and stats.dropped == 0 and stats.without_images == 1
    prompts = [len(p) for p in full["prompt_ids"]]
    # Between the shortest and the longest image prompt (+ 2: one completion token left to score, after the shift).
    limit = sorted(prompts[:3])[1] + 2
    cut, cut_stats, _ = prepare(tokenizer, data, root / "cache-cut", max_seq_length=limit)
    dropped = sum(p >= limit for p in prompts[:3])
    print(f"\nprompts {prompts}, max_seq_length {limit}: {cut_stats.summary()}")
    assert dropped and cut_stats.dropped_image_cut == dropped and cut_stats.pairs == 4 - dropped
    summary = cut_stats.summary()
    assert f"{dropped} because their prompt, kept whole with its images, fills max_seq_length={limit}" in summary
    kept = [i for i in range(3) if prompts[i] < limit]
    for row, i in enumerate(kept):  # the image prompts kept are whole, their completions cut to fit
        assert cut[row]["prompt_ids"] == full[i]["prompt_ids"] and cut[row]["text"] == full[i]["text"]
        assert len(cut[row]["prompt_ids"]) + len(cut[row]["chosen_ids"]) <= limit
    batch = dpo.DPO().collator(None, tokenizer)([full[i] for i in range(len(full))])
    scored = batch["labels"] != IGNORE_INDEX
    assert not any(t in image_ids for t in batch["input_ids"][scored].tolist())
    assert not (scored & (batch["mm_token_type_ids"] != 0)).any()
    for r in range(batch["input_ids"].shape[0]):  # nothing of the prompt is scored
        n = len(full[r % len(full)]["prompt_ids"])
        assert not scored[r, :n].any() and scored[r, n:].any()
    assert int(batch["image_grid_thw"].shape[0]) == 2 * 4  # each image twice: the chosen rows, then the rejected


def train(folder: Path, data: Path, out: Path, cache: Path, *flags: str, path: str = "trainer",
          steps: int = 6) -> list[dict]:
    from finetune.training import loop, trainer

    main = {"trainer": trainer.main, "loop": loop.main}[path]
    main(["--method", "dpo", "--model_name_or_path", str(folder), "--dataset", str(data), "--output_dir", str(out),
          "--dataset_cache_dir", str(cache), "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
          "--max_steps", str(steps), "--logging_steps", "1", "--optim", "sgd", "--lr_scheduler_type", "constant",
          "--max_grad_norm", "0", "--weight_decay", "0", "--beta", "0.5", "--max_seq_length", "1024",
          "--disable_tqdm", "true", "--seed", "3", *flags])
    return [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e]


@pytest.mark.slow
def test_training_moves_the_reward_margin(qwen, root, one_thread, isolated):
    """The Trainer path with LoRA on image pairs (the reference: the model with its adapters disabled): the first
    step is the base model's (loss log 2, its chosen log-probabilities those of float64), then the reward margin
    grows step by step; the reference log-probabilities precomputed once (and cached) give the same run, and so does
    the accelerate loop. Full fine-tuning (the reference a frozen copy) moves the margin too."""
    folder, tokenizer = qwen
    data = write_jsonl(root / "train.jsonl", PAIRS + [{"prompt": "Say hello.", "chosen": "Hello!", "rejected": "No."}])
    flags = ("--use_peft", "--lora_r", "8", "--learning_rate", "1.0")
    logs = train(folder, data, root / "out-lora", root / "cache-train", *flags)
    margins = [e["rewards/margins"] for e in logs]
    print("\nloss", [round(e["loss"], 5) for e in logs], "margins", [round(m, 4) for m in margins])
    assert logs[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and margins[0] == pytest.approx(0.0, abs=1e-6)
    base = load_vlm(folder, torch.float64).eval()
    records = [json.loads(line) for line in data.read_text().splitlines()]
    want = float64_logps(tokenizer.finetune_processor, base, base, "qwen2_5_vl", records[:3], root)
    # The first step's 4 pairs: the three image pairs and the text pair, whose chosen side is scored here alone.
    text_chosen = float64_text_logp(tokenizer, base, records[3])
    want_chosen = (float(want[:, 0, 0].sum()) + text_chosen) / 4
    print(f"step 1 logps/chosen {logs[0]['logps/chosen']:.6f}, float64 {want_chosen:.6f}")
    assert abs(logs[0]["logps/chosen"] - want_chosen) < 1e-6 * abs(want_chosen)
    assert all(b > a for a, b in zip(margins, margins[1:])) and margins[-1] > 0.2
    assert logs[-1]["loss"] < logs[0]["loss"] - 0.1
    pre = train(folder, data, root / "out-lora-pre", root / "cache-train", *flags, "--precompute_ref_log_probs")
    assert [e["loss"] for e in pre] == pytest.approx([e["loss"] for e in logs], abs=1e-6)
    looped = train(folder, data, root / "out-lora-loop", root / "cache-train", *flags, path="loop")
    print("loop", [round(e["loss"], 5) for e in looped])
    assert [e["loss"] for e in looped] == pytest.approx([e["loss"] for e in logs], abs=1e-5)
    # Full fine-tuning: the reference is a frozen copy of the model as loaded (the vision tower frozen as in SFT).
    full = train(folder, data, root / "out-full", root / "cache-train", "--learning_rate", "0.5", steps=3)
    full_margins = [e["rewards/margins"] for e in full]
    print("full", [round(e["loss"], 5) for e in full], "margins", [round(m, 4) for m in full_margins])
    assert full[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert full[0]["logps/chosen"] == logs[0]["logps/chosen"]
    assert all(b > a for a, b in zip(full_margins, full_margins[1:]))


def float64_text_logp(tokenizer, model, record: dict) -> float:
    """A text pair's chosen log-probability, from the processor's chat template and model alone (string records are
    one user turn and one assistant answer)."""
    processor = tokenizer.finetune_processor
    prompt = [{"role": "user", "content": [{"type": "text", "text": record["prompt"]}]}]
    chosen = [{"role": "assistant", "content": [{"type": "text", "text": record["chosen"]}]}]
    prompt_text = processor.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    full = processor.apply_chat_template(prompt + chosen, tokenize=False)
    ids = processor.tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    completion = processor.tokenizer(full[len(prompt_text):], add_special_tokens=False)["input_ids"]
    scored = completion[:completion.index(processor.tokenizer.convert_tokens_to_ids(END["qwen2_5_vl"])) + 1]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids + completion])).logits[0].double(), dim=-1)
    return float(sum(logp[len(ids) + t - 1, tok] for t, tok in enumerate(scored)))


@pytest.mark.slow
def test_an_image_column_gives_the_tokens_and_pixels_of_the_paths(qwen, root):
    """The same pairs from a Parquet file whose `images` column is a datasets.Image column (the images' bytes
    embedded, as a Hub data set has them): the same cached tokens, and the same batch, pixel values included."""
    import shutil

    import datasets
    from datasets.table import embed_table_storage

    _, tokenizer = qwen
    shutil.copytree(root / "img", root / "gone")
    rows = [dict(r, images=[str(root / "gone" / Path(p).name) for p in r["images"]]) for r in PAIRS]
    table = datasets.Dataset.from_list(rows).cast_column("images", datasets.List(datasets.Image()))
    # The images' bytes embedded, as push_to_hub writes them; then the files are gone.
    table = table.with_format("arrow").map(embed_table_storage, batched=True).with_format(None)
    table.to_parquet(str(root / "pairs.parquet"))
    shutil.rmtree(root / "gone")
    from_paths, _, _ = prepare(tokenizer, root / "pairs.jsonl", root / "cache-paths", max_seq_length=1024)
    from_column, _, _ = prepare(tokenizer, root / "pairs.parquet", root / "cache-column", max_seq_length=1024)
    for key in PR.PAIR_COLUMNS + ("text",):
        assert from_column[key] == from_paths[key]
    collate = dpo.DPO().collator(None, tokenizer)
    a = collate([from_paths[i] for i in range(len(PAIRS))])
    b = collate([from_column[i] for i in range(len(PAIRS))])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.full_matrix  # ~2 min; CI's cover: DPO's own 2-process cells and the image collator's Trainer run above
def test_two_processes_equal_one(qwen, root):
    """The Trainer path on 2 processes (DDP, accelerate launch) equals 1 at every step within 1e-4: each rank's
    image pairs, their pixel values and grids, and the reference with the adapters disabled. 12 image pairs, the
    images rotated; a global batch of 4 pairs (1 process: 2 per micro-batch; 2 processes: 1 each), 3 steps."""
    import sys

    from launch import TRAIN, launcher, losses, run, unexpected_warnings

    folder, _ = qwen
    pairs = [dict(r, images=[f"img/{(k + j) % 4}.png" for j in range(len(r["images"]))])
             for k in range(4) for r in PAIRS]
    data = write_jsonl(root / "ddp.jsonl", pairs)
    flags = ["--method", "dpo", "--model_name_or_path", str(folder), "--dataset", str(data), "--dataset_cache_dir",
             str(root / "cache-ddp"), "--gradient_accumulation_steps", "2", "--max_steps", "3", "--use_peft",
             "--lora_r", "8", "--lora_dropout", "0", "--learning_rate", "0.05", "--beta", "0.5", "--seed", "5",
             "--logging_steps", "1", "--max_seq_length", "1024", "--disable_tqdm", "true"]
    got = {}
    for name, cmd, micro in (("one", [sys.executable, TRAIN], 2), ("two", launcher("accelerate", 2, script=TRAIN), 1)):
        out = root / f"ddp-{name}"
        result = run(cmd + ["--config", "ddp", "--output_dir", str(out), "--per_device_train_batch_size", str(micro),
                            *flags], timeout=600).check()
        assert not unexpected_warnings(result.output), unexpected_warnings(result.output)
        got[name] = losses(out)
    worst = max(abs(a - b) / abs(a) for a, b in zip(got["one"], got["two"]))
    print(f"\nDPO image pairs, 2 processes vs 1: losses {got['one']} / {got['two']}, largest relative difference "
          f"{worst:.1e}")
    # Each step trains on other pairs: the policy has moved from its reference after the first (log 2).
    assert len(got["one"]) == len(got["two"]) == 3 and abs(got["one"][1] - math.log(2)) > 1e-2
    assert worst <= 1e-4
