"""--packing and --padding_free on a vision-language model: a family whose image records share a row exactly (each
record its own positions and attention, its images' features on its own image tokens: LLaVA 1.5) gives the unpacked
loss; a family whose records cannot (mrope's 3-D positions, bidirectional image attention, pixel values per row) is
refused by its name before anything loads, with the reason (VisionFamily.packing_refusal), exit 2, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import matrix
from test_bad_inputs import assert_clear, assert_no_debris, cli, train_args  # noqa: F401
from vision_data import RECORDS, write_images, write_jsonl

from finetune.models import families, tiny

pytestmark = pytest.mark.slow  # tiny vision-language models built (a few seconds each)

# tiny_vlm's names -> the families'
FAMILY = {f: "gemma3_mm" if f == "gemma3" else f for f in tiny.VLMS}
BY_NAME = {f.name: f for f in families.FAMILIES}
REFUSED = [f for f in tiny.VLMS if BY_NAME[FAMILY[f]].packing_refusal]
FLAGS = ["--packing", "--padding_free"]
# CI: each refused family once, the two flags in turn.
REFUSED_CASES = matrix([(f, flag) for f in REFUSED for flag in FLAGS], [(f, FLAGS[k % 2]) for k, f in enumerate(REFUSED)])


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vision-packing")
    write_images(root)
    write_jsonl(root / "data.jsonl", RECORDS)
    return root


@pytest.mark.parametrize("family, flag", REFUSED_CASES)
def test_refused_by_family_name(root, family, flag, tmp_path, monkeypatch, capfd, isolated, one_thread):
    model = tiny.tiny_vlm(family, root / family)
    code, err = cli(train_args(model, root / "data.jsonl", tmp_path / "out", flag, "true"), tmp_path, monkeypatch, capfd)
    name = FAMILY[family]
    assert_clear(code, err, f"{flag[2:]}: the {name} family's records are not packed: "
                            f"{BY_NAME[name].packing_refusal} ({model}/config.json: model_type",
                 f"leave {flag} out")
    assert "Loading weights" not in err  # refused before any model loads
    assert_no_debris(tmp_path)


PACKS = [f for f in tiny.VLMS if not BY_NAME[FAMILY[f]].packing_refusal]


def nll(model, batch) -> tuple[float, int]:
    """The summed float64 next-token loss over the batch's trained labels, and their count."""
    import torch

    from finetune.constants import IGNORE_INDEX

    batch = {k: v.double() if k == "pixel_values" else v for k, v in batch.items()}
    labels = batch.pop("labels")
    with torch.no_grad():
        logits = model(**batch, use_cache=False).logits.double()
    target = labels[:, 1:]
    mask = target != IGNORE_INDEX
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return float(-logp[mask].sum()), int(mask.sum())


@pytest.mark.parametrize("family", PACKS)
def test_packed_loss_equals_unpacked(root, family, tmp_path, one_thread):
    """The records packed into rows (--packing: rows of max_seq_length; --padding_free: the micro-batch as one row)
    give the unpacked batch's trained tokens and loss (float64, within 1e-5): each record its own positions and
    attention, each image's features on its own record's image tokens."""
    import torch
    from test_vision_data import prepare, vision_tokenizer
    from transformers import AutoModelForImageTextToText

    from finetune.data.images import PackedVisionCollator, VisionCollator

    folder = tiny.tiny_vlm(family, root / family)
    records = [dict(r, images=[f"img/{(k + j) % 4}.png" for j in range(len(r.get("images", [])))]) if r.get("images")
               else r for k in range(3) for r in RECORDS]  # 12 records, the images rotated
    data = write_jsonl(root / "many.jsonl", records)
    tok = vision_tokenizer(folder)
    plain, _ = prepare(tok, data, tmp_path / "plain", max_seq_length=1024)
    packed, stats = prepare(tok, data, tmp_path / "packed", max_seq_length=160, packing=True)
    assert stats.packed_rows < len(plain) and any(len(packed[i]["seq_lens"]) > 1 for i in range(len(packed)))
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float64).train()
    processor = tok.finetune_processor
    want = nll(model, VisionCollator(processor, tok.pad_token_id)([plain[i] for i in range(len(plain))]))
    rows = PackedVisionCollator(processor, tok.pad_token_id)([packed[i] for i in range(len(packed))])
    flat = PackedVisionCollator(processor, tok.pad_token_id, layout="flat")([plain[i] for i in range(len(plain))])
    assert "attention_mask" not in rows and rows["position_ids"].shape == rows["input_ids"].shape
    for name, batch in (("packed rows", rows), ("padding-free", flat)):
        got = nll(model, batch)
        print(f"\n{family} {name}: loss sum {got[0]:.10f} over {got[1]} tokens; unpacked {want[0]:.10f} over {want[1]}")
        assert got[1] == want[1] and abs(got[0] - want[0]) / want[0] < 1e-5


@pytest.mark.parametrize("family, flag", matrix([(f, flag) for f in PACKS for flag in FLAGS],
                                                [(f, "--packing") for f in PACKS]))
def test_first_step_loss_packed_equals_unpacked(root, family, flag, isolated, one_thread, capfd):
    """A training run's first step over all the records (one global batch) has the unpacked run's loss: the
    Trainer's packed path (finetune's per-record attention kernel, positions restarting per record, the images'
    features on their own records), within 1e-5."""
    import json

    from finetune.training import trainer

    folder = tiny.tiny_vlm(family, root / family)

    def first_loss(name: str, *flags: str) -> float:
        out = root / f"run-{family}-{name}"
        trainer.main(["--model_name_or_path", str(folder), "--dataset", str(root / "data.jsonl"), "--output_dir",
                      str(out), "--dataset_cache_dir", str(root / f"cache-{family}"), "--per_device_train_batch_size",
                      "4", "--max_steps", "1", "--logging_steps", "1", "--max_seq_length", "96", "--disable_tqdm",
                      "true", "--seed", "3", *flags])
        return [e["loss"] for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e][0]

    want = first_loss("plain")
    capfd.readouterr()
    got = first_loss(flag[2:], flag, "true")
    if flag == "--packing":  # several records share a row
        line = next(x for x in capfd.readouterr().out.splitlines() if x.startswith("packing: "))
        assert line.startswith(f"packing: {len(RECORDS)} records into ") and int(line.split()[4]) < len(RECORDS), line
    print(f"\n{family} {flag}: first-step loss {got:.8f}, unpacked {want:.8f}, diff {abs(got - want):.1e}")
    assert abs(got - want) <= 1e-5 * abs(want)
