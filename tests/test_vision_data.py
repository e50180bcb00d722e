"""Image records (TRL's conversational vision format) through a vision-language model's processor: the tokens are
the processor's, only the assistant turns' content and end-of-turn token are trained (never an image token), text
records sit in the same set, truncation never cuts an image (such a record is dropped and counted), an image column
(a save_to_disk folder, a Hub data set in a real HF cache) gives what paths give, every mistake names its file and
line, and the first step's loss equals a float64 reference made with transformers' processor and model alone."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from vision_data import ANSWERS, RECORDS, reference_labels, tiny_gemma3_vlm, write_images, write_jsonl

from finetune.constants import IGNORE_INDEX
from finetune.data.errors import DataError

IMAGE_TOKENS = 4  # the tiny model's mm_tokens_per_image


def quiet(*_a, **_k):
    pass


# The tests that need the tiny model (its real 262k-token Gemma-3 tokenizer: about 40 s to build on 2 busy cores) are
# `slow`; the fast subset keeps the refusals that need none.
needs_model = pytest.mark.slow


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from test_families_parity import real_tokenizer

    root = tmp_path_factory.mktemp("vlm")
    return tiny_gemma3_vlm(root / "gemma3-vlm", real_tokenizer("gemma3", root / "tok"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision-data")
    write_images(root)
    return write_jsonl(root / "data.jsonl", RECORDS)


def vision_tokenizer(folder: Path):
    """The tokenizer with its processor attached, as a training run loads them (finetune.training.examples)."""
    from finetune.config import ModelConfig
    from finetune.models.load import load_tokenizer
    from finetune.training.examples import attach_processor

    model_cfg = ModelConfig(model_name_or_path=str(folder))
    tokenizer = load_tokenizer(model_cfg)
    attach_processor(model_cfg, tokenizer)
    return tokenizer


@pytest.fixture(scope="module")
def tok(vlm):
    return vision_tokenizer(vlm)


def prepare(tokenizer, dataset, cache, **kw):
    from finetune.config import DataConfig
    from finetune.data.pipeline import prepare_dataset

    return prepare_dataset(DataConfig(dataset=str(dataset), dataset_cache_dir=str(cache), **kw), tokenizer, log=quiet)


@needs_model
def test_tokens_are_the_processors_and_only_answers_are_trained(tok, data, tmp_path):
    from PIL import Image

    ds, stats = prepare(tok, data, tmp_path / "cache", max_seq_length=256)
    assert stats.format == "vision" and stats.examples == len(RECORDS) and stats.dropped_image_cut == 0
    processor = tok.finetune_processor
    image_ids = {tok.image_token_id, tok.convert_tokens_to_ids(tok.boi_token), tok.convert_tokens_to_ids(tok.eoi_token)}
    for row, record, answers in zip(ds, RECORDS, ANSWERS):
        # The processor's own tokens, from its own chat template and call.
        text = processor.apply_chat_template(record["messages"], tokenize=False)
        images = [Image.open(data.parent / p) for p in record.get("images", [])]
        want = processor(text=[text], images=[images] if images else None, add_special_tokens=False)["input_ids"][0]
        assert row["input_ids"] == list(want)
        assert row["input_ids"].count(tok.image_token_id) == IMAGE_TOKENS * len(images)
        # Trained: each answer and its <end_of_turn>, nothing else; never an image token.
        trained = [t for t in row["labels"] if t != IGNORE_INDEX]
        assert tok.decode(trained) == "".join(a + "<end_of_turn>" for a in answers)
        assert not image_ids & set(trained)
        assert torch.equal(torch.tensor(row["labels"]),
                           reference_labels(torch.tensor([row["input_ids"]]), torch.ones(1, len(row["input_ids"])))[0])
        assert len(row["images"]) == len(images)


@needs_model
def test_collator_batches_what_the_processor_makes(tok, data, tmp_path, vlm):
    """A mixed batch (images and text only): the processor's pixel values and token types, the cached labels."""
    from transformers import AutoModelForImageTextToText

    from finetune.data.prepare import make_collator

    ds, _ = prepare(tok, data, tmp_path / "cache", max_seq_length=256)
    batch = make_collator(None, tok)([ds[i] for i in range(len(ds))])
    assert batch["pixel_values"].shape == (4, 3, 28, 28)  # 1 + 0 + 2 + 1 images
    assert batch["token_type_ids"].sum().item() == 4 * IMAGE_TOKENS
    assert torch.equal(batch["labels"], reference_labels(batch["input_ids"], batch["attention_mask"]))
    model = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32)
    assert torch.isfinite(model(**batch).loss)


@needs_model
def test_truncation_never_cuts_an_image(tok, data, tmp_path, vlm):
    """A record whose cut falls before the end of its images' tokens is dropped and counted (and printed); one cut
    after them is truncated and trains."""
    from transformers import AutoModelForImageTextToText

    from finetune.data.prepare import make_collator

    long_answer = "word " * 40
    records = [
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Tell me."}]},
                      {"role": "assistant", "content": long_answer}], "images": ["img/0.png"]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "many words " * 20}, {"type": "image"}]},
                      {"role": "assistant", "content": "Short."}], "images": ["img/1.png"]},
    ]
    path = write_jsonl(data.parent / "long.jsonl", records)
    ds, stats = prepare(tok, path, tmp_path / "cache", max_seq_length=32)
    assert (stats.examples, stats.truncated, stats.dropped_image_cut) == (1, 1, 1)
    assert "1 dropped because truncation at max_seq_length=32 would cut an image's tokens" in stats.summary()
    row = ds[0]
    assert len(row["input_ids"]) == 32 and row["input_ids"].count(tok.image_token_id) == IMAGE_TOKENS
    batch = make_collator(None, tok)([row])
    assert batch["input_ids"].shape == (1, 32)
    model = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32)
    assert torch.isfinite(model(**batch).loss)


def arrow_rows(base: Path) -> list[dict]:
    """RECORDS as an Arrow table holds them: every content a list of {type, text} parts (a column has one type), images
    as absolute paths for datasets.Image to embed."""
    def parts(content):
        return [{"type": "text", "text": content}] if isinstance(content, str) else \
            [{"type": p["type"], "text": p.get("text")} for p in content]

    return [{"messages": [{"role": m["role"], "content": parts(m["content"])} for m in r["messages"]],
             "images": [str(base / p) for p in r.get("images", [])]} for r in RECORDS]


@needs_model
def test_an_image_column_gives_what_paths_give(tok, data, tmp_path):
    """A save_to_disk folder whose `images` is a datasets.Image column (the bytes embedded): the same tokens and
    labels as the JSON lines with paths, with the image files gone."""
    import datasets

    from_paths, _ = prepare(tok, data, tmp_path / "cache", max_seq_length=256)
    ds = datasets.Dataset.from_list(arrow_rows(data.parent)).cast_column("images", datasets.List(datasets.Image()))
    ds.to_parquet(tmp_path / "embedded.parquet")  # Parquet embeds the images' bytes
    datasets.Dataset.from_parquet(str(tmp_path / "embedded.parquet")).save_to_disk(tmp_path / "saved")
    moved = data.parent / "img-moved"
    (data.parent / "img").rename(moved)  # nothing left to read but the column's bytes
    try:
        from_column, stats = prepare(tok, tmp_path / "saved", tmp_path / "cache", max_seq_length=256)
    finally:
        moved.rename(data.parent / "img")
    assert stats.format == "vision"
    assert list(from_column["input_ids"]) == list(from_paths["input_ids"])
    assert list(from_column["labels"]) == list(from_paths["labels"])


# ----------------------------------------------------------------------------------------------
# Mistakes, each named by file and line.

GOOD = RECORDS[0]


def one_image(path: str) -> dict:
    return dict(GOOD, images=[path])


@needs_model
@pytest.mark.parametrize("bad, message", [
    (one_image("img/missing.png"), r"bad\.jsonl:2: images\[0\]: image file 'img/missing.png' not found \(looked for .*img/missing\.png\)"),
    (one_image("notes.txt"), r"bad\.jsonl:2: images\[0\]: 'notes.txt' cannot be read as an image \(UnidentifiedImageError"),
    (dict(GOOD, images=["img/0.png", "img/1.png"]), r"bad\.jsonl:2: 1 image part .* in 'messages' but 2 images in 'images'"),
    (dict(GOOD, messages=[{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}, GOOD["messages"][1]]),
     r"bad\.jsonl:2: 2 image parts .* in 'messages' but 1 image in 'images'"),
    (one_image("https://example.com/cat.png"),
     r"bad\.jsonl:2: images\[0\] is a URL \(https://example.com/cat.png\) and this run is offline"),
    (dict(GOOD, messages=[{"role": "user", "content": [{"type": "picture"}]}, GOOD["messages"][1]]),
     r"bad\.jsonl:2: messages\[0\]\.content\[0\] must be .*\"type\": \"image\""),
], ids=["missing", "unreadable", "more-images", "more-parts", "url-offline", "bad-part"])
def test_mistakes_name_the_file_and_line(tok, data, tmp_path, bad, message, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (data.parent / "notes.txt").write_text("not an image")
    path = write_jsonl(data.parent / "bad.jsonl", [GOOD, bad])
    with pytest.raises(DataError, match=message):
        prepare(tok, path, tmp_path / "cache", max_seq_length=256)


def test_images_for_a_text_only_model_are_refused(tiny_chatml, data, tmp_path):
    from finetune.config import ModelConfig
    from finetune.models.load import load_tokenizer

    text_only = load_tokenizer(ModelConfig(model_name_or_path=str(tiny_chatml)))
    # The first record decides the format (messages, then vision): either way the record with an image is named.
    for name, records, line in (("text-first", [RECORDS[1], RECORDS[0]], 2), ("image-first", [RECORDS[0], RECORDS[1]], 1)):
        path = write_jsonl(data.parent / f"{name}.jsonl", records)
        with pytest.raises(DataError, match=rf"{name}\.jsonl:{line}: the record has 1 image, and the model( \(.*\))? "
                                            r"is text-only: it has no image processor"):
            prepare(text_only, path, tmp_path / "cache", max_seq_length=256)


@needs_model
def test_a_url_is_fetched_online(tok, data, tmp_path, monkeypatch):
    """Online (no HF_HUB_OFFLINE), an image URL is fetched once, at tokenization, and cached as bytes."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    image = (data.parent / "img" / "0.png").read_bytes()

    class Serve(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/cat.png" else 404)
            self.end_headers()
            if self.path == "/cat.png":
                self.wfile.write(image)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Serve)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        ds, _ = prepare(tok, write_jsonl(data.parent / "url.jsonl", [one_image(f"{url}/cat.png")]), tmp_path / "c1",
                        max_seq_length=256)
        want, _ = prepare(tok, write_jsonl(data.parent / "path.jsonl", [GOOD]), tmp_path / "c2", max_seq_length=256)
        assert list(ds["input_ids"]) == list(want["input_ids"])
        with pytest.raises(DataError, match=r"nourl\.jsonl:1: images\[0\]: cannot fetch http://127.*/dog.png \(HTTPError"):
            prepare(tok, write_jsonl(data.parent / "nourl.jsonl", [one_image(f"{url}/dog.png")]), tmp_path / "c3",
                    max_seq_length=256)
    finally:
        server.shutdown()


@needs_model
def test_packing_is_refused_by_name(tok, data, tmp_path):
    with pytest.raises(DataError, match=r"--packing is not supported for vision-language models \(Gemma3Processor\)"):
        prepare(tok, data, tmp_path / "cache", max_seq_length=256, packing=True)


# ----------------------------------------------------------------------------------------------
# The Hub: an image column read by datasets.load_dataset offline from a real HF cache.


@pytest.mark.slow
def test_hub_image_dataset(tok, vlm, data, tmp_path):
    """`--dataset org/name`, a Parquet data set with an image column, prepared in HF_HOME by datasets' own Parquet
    builder (the layout an online load leaves) and read offline by datasets.load_dataset: the same tokens and labels
    as the local paths."""
    import datasets
    from test_hub import hf_env

    from finetune.testing import env

    commit = "0123456789abcdef0123456789abcdef01234567"
    hf_home = tmp_path / "hf"
    datasets.Dataset.from_list(arrow_rows(data.parent)).cast_column("images", datasets.List(datasets.Image())) \
        .to_parquet(tmp_path / "pics.parquet")
    build = (
        "import sys\n"
        "from datasets.packaged_modules.parquet.parquet import Parquet\n"
        "from datasets.data_files import DataFilesDict\n"
        "data, commit = sys.argv[1:]\n"
        "b = Parquet(data_files=DataFilesDict.from_patterns({'train': [data]}), dataset_name='pics',\n"
        "            config_name='default', config_id='default', hash=commit)\n"
        "b.repo_id = 'tinyorg/pics'\n"
        "b._cache_dir = b._build_cache_dir()\n"
        "b.download_and_prepare()\n"
        "print(b.cache_dir)\n"
    )
    read = (
        "import json, sys\n"
        "sys.path.insert(0, 'tests')\n"
        "from test_vision_data import vision_tokenizer, prepare\n"
        "ds, stats = prepare(vision_tokenizer(sys.argv[1]), 'tinyorg/pics', sys.argv[2], max_seq_length=256)\n"
        "print(json.dumps([stats.path, list(ds['input_ids']), list(ds['labels'])]))\n"
    )
    environ = env(**hf_env(hf_home), HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", build, str(tmp_path / "pics.parquet"), commit], capture_output=True,
                       text=True, timeout=300, env=environ)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip().splitlines()[-1]).name == commit
    (tmp_path / "pics.parquet").unlink()
    r = subprocess.run([sys.executable, "-c", read, str(vlm), str(tmp_path / "cache-hub")], capture_output=True,
                       text=True, timeout=300, env=environ, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr
    path, ids, labels = json.loads(r.stdout.strip().splitlines()[-1])
    want, _ = prepare(tok, data, tmp_path / "cache", max_seq_length=256)
    assert path == "tinyorg/pics" and ids == list(want["input_ids"]) and labels == list(want["labels"])


def test_methods_without_images_refuse_image_records():
    """The other pair methods' pairs (DPO reads image pairs: tests/test_vision_dpo.py), KTO's examples and GRPO's
    prompts do not carry images yet: a record with one is refused by file and line, naming the method and the fix,
    instead of training on the placeholder text alone."""
    from finetune.data import preference, prompts, unpaired

    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour?"}]}]
    pair = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "Red."}],
            "rejected": [{"role": "assistant", "content": "Blue."}], "images": ["img/0.png"]}
    with pytest.raises(DataError, match=r"p\.jsonl:3: the record has 1 image, and preference training \(ORPO, .*\) "
                                        r"does not train on images yet \(SFT and DPO do: docs/vision\.md\); leave the images out, or train "
                                        r"with --method dpo"):
        preference.pair_of(pair, "p.jsonl:3", chat=True)
    example = {"prompt": prompt, "completion": [{"role": "assistant", "content": "Red."}], "label": True}
    with pytest.raises(DataError, match=r"k\.jsonl:1: the record has 1 image, and KTO does not train on images"):
        unpaired.example_of(example, "k.jsonl:1", chat=True)
    with pytest.raises(DataError, match=r"g\.jsonl:2: the record has 1 image, and generating methods \(GRPO, RLOO\)"):
        prompts.prompt_of(None, RECORDS[0], "vision", "g.jsonl:2")


def test_a_multimodal_checkpoint_without_processor_files_takes_text_and_refuses_images(tiny_chatml, data, tmp_path):
    """A vision-language folder saved with its tokenizer alone (no processor_config.json or preprocessor_config.json)
    loads for text records on that tokenizer; a record with an image is refused by file and line, naming the files."""
    from family_configs import tiny_model
    from transformers import AutoTokenizer

    folder = tmp_path / "gemma3-mm-no-processor"
    tokenizer = AutoTokenizer.from_pretrained(tiny_chatml)
    tiny_model("gemma3_mm", vocab_size=len(tokenizer) + (-len(tokenizer) % 64)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    tokenizer = vision_tokenizer(folder)
    text = write_jsonl(data.parent / "text-only.jsonl", [RECORDS[1]])
    assert prepare(tokenizer, text, tmp_path / "cache-text", max_seq_length=256)[1].examples == 1
    with pytest.raises(DataError, match=r"data\.jsonl:1: the record has 1 image, .* is text-only: it has no image "
                                        r"processor.* its processor files \(processor_config\.json or "
                                        r"preprocessor_config\.json\)"):
        prepare(tokenizer, data, tmp_path / "cache", max_seq_length=256)
