"""--packing and --padding_free on a vision-language model: a family whose image records cannot share a row exactly
(each record its own positions and attention, mrope's 3-D positions included, its images in order) is refused by its
name before anything loads, with the reason (VisionFamily.packing_refusal), exit 2, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_bad_inputs import assert_clear, assert_no_debris, cli, train_args  # noqa: F401
from vision_data import RECORDS, write_images, write_jsonl

from finetune.models import families, tiny

# tiny_vlm's names -> the families'
FAMILY = {f: "gemma3_mm" if f == "gemma3" else f for f in tiny.VLMS}
BY_NAME = {f.name: f for f in families.FAMILIES}
REFUSED = [f for f in tiny.VLMS if BY_NAME[FAMILY[f]].packing_refusal]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vision-packing")
    write_images(root)
    write_jsonl(root / "data.jsonl", RECORDS)
    return root


@pytest.mark.parametrize("family", REFUSED)
@pytest.mark.parametrize("flag", ["--packing", "--padding_free"])
def test_refused_by_family_name(root, family, flag, tmp_path, monkeypatch, capfd, isolated, one_thread):
    model = tiny.tiny_vlm(family, root / family)
    code, err = cli(train_args(model, root / "data.jsonl", tmp_path / "out", flag, "true"), tmp_path, monkeypatch, capfd)
    name = FAMILY[family]
    assert_clear(code, err, f"{flag[2:]}: the {name} family's records are not packed: "
                            f"{BY_NAME[name].packing_refusal} ({model}/config.json: model_type",
                 f"leave {flag} out")
    assert "Loading weights" not in err  # refused before any model loads
    assert_no_debris(tmp_path)
