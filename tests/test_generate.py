"""`finetune generate`: greedy output of a sharded / disk-offloaded model (with and without a LoRA adapter) is token
for token the output of the model in one piece, prompts come from the command line or a JSONL file (plain text or
chat messages), and bad device maps, memory limits and adapters stop with one clear message."""

from __future__ import annotations

import json
import re

import pytest
import torch

from finetune.inference import generate as G
from finetune.models import tiny
from launch import BIN, run

# Tiny models: one thread avoids OpenMP spin-waiting when the 2 cores are shared.
pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["count: red blue green", "reverse: the cat sat on the long road", "hi", "copy: one two three four five six"]
# Tight enough that only the embeddings and the first blocks fit in RAM: the rest goes to disk.
TIGHT = "cpu=600KB,disk=1GB"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    model = tiny.build(root / "model", style="chatml", hidden=64, layers=4)
    other = tiny.build(root / "other", style="chatml", hidden=32, layers=2)
    adapters = {name: tiny.save_random_adapter(base, root / name, r=4, seed=1)
                for name, base in (("adapter", model), ("other_adapter", other))}
    device_map = root / "map.json"
    device_map.write_text(json.dumps({
        "model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "cpu",
        "model.layers.3": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "disk",
    }))
    prompts = tiny.write_jsonl(root / "prompts.jsonl", [
        {"prompt": PROMPTS[0], "id": "a"},
        {"messages": [{"role": "user", "content": "reverse: red blue"}]},
        {"text": PROMPTS[2]},
    ])
    with prompts.open("a") as f:
        f.write(json.dumps(PROMPTS[3]) + "\n\n")  # a bare JSON string, then a blank line
    return dict(root=root, model=model, map=device_map, prompts=prompts, **adapters)


def generate(capsys, tmp_path, *argv):
    """Run `finetune generate` in-process; returns (output records, stderr)."""
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}.jsonl"
    G.main([*map(str, argv), "--output", str(out), "--with_ids", "--max_new_tokens", "12"])
    err = capsys.readouterr().err
    return [json.loads(line) for line in out.read_text().splitlines()], err


def placement(stderr: str) -> dict[str, str]:
    return dict(re.findall(r"^\s+(\S+)\s+-> (\S+)$", stderr, flags=re.M))


def prompt_flags():
    return [arg for p in PROMPTS for arg in ("--prompt", p)]


@pytest.fixture(scope="module")
def unsharded(files, tmp_path_factory):
    """Reference runs, the model in one piece (with and without the adapter)."""
    out = {}
    for key, extra in (("base", []), ("adapter", ["--adapter", files["adapter"]])):
        path = tmp_path_factory.mktemp("ref") / "out.jsonl"
        G.main(["--model_name_or_path", str(files["model"]), *prompt_flags(), *map(str, extra), "--output", str(path),
                "--with_ids", "--max_new_tokens", "12"])
        out[key] = [json.loads(line) for line in path.read_text().splitlines()]
    return out


def _ids(records):
    return [r["completion_ids"] for r in records]


def test_auto_with_tight_max_memory_offloads_to_disk_and_matches(files, unsharded, capsys, tmp_path):
    records, err = generate(capsys, tmp_path, "--model_name_or_path", files["model"], *prompt_flags(),
                            "--device_map", "auto", "--max_memory", TIGHT)
    where = placement(err)
    blocks = {k: v for k, v in where.items() if k.startswith("model.layers.")}
    assert len(blocks) == 4, where
    assert "disk" in blocks.values() and "cpu" in blocks.values(), where  # some layers on disk, some in RAM
    assert "disk offload folder:" in err
    assert _ids(records) == _ids(unsharded["base"])
    assert all(len(ids) == 12 for ids in _ids(records))


def test_explicit_json_map_matches(files, unsharded, capsys, tmp_path):
    records, err = generate(capsys, tmp_path, "--model_name_or_path", files["model"], *prompt_flags(),
                            "--device_map", files["map"])
    assert placement(err) == {
        "model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "cpu",
        "model.layers.3": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "disk",
    }
    assert _ids(records) == _ids(unsharded["base"])


@pytest.mark.parametrize("placement_flags", [["--device_map", "auto", "--max_memory", TIGHT], ["--device_map", "MAP"]])
def test_adapter_on_sharded_base_matches(files, unsharded, capsys, tmp_path, placement_flags):
    flags = [str(files["map"]) if f == "MAP" else f for f in placement_flags]
    records, err = generate(capsys, tmp_path, "--model_name_or_path", files["model"], "--adapter", files["adapter"],
                            *prompt_flags(), *flags)
    assert "disk" in placement(err).values()
    assert _ids(records) == _ids(unsharded["adapter"])
    assert _ids(unsharded["adapter"]) != _ids(unsharded["base"])  # the adapter changes the output


def test_logits_of_sharded_models_equal_unsharded(files):
    """The numbers behind token equality: full-vocabulary logits on a batch, with and without the adapter."""
    ids = torch.randint(0, 400, (2, 24), generator=torch.Generator().manual_seed(0))
    for adapter in (None, str(files["adapter"])):
        logits = {}
        for name, device_map, max_memory in (("one piece", None, None), ("auto tight", "auto", TIGHT),
                                             ("json map", str(files["map"]), None)):
            model, _, placed = G.load_for_inference(
                G.LoadOptions(str(files["model"]), adapter=adapter, device_map=device_map,
                              max_memory=G.parse_max_memory(max_memory)), log=lambda *a: None)
            with torch.no_grad():
                logits[name] = model(input_ids=ids).logits
            if device_map:
                assert "disk" in placed.values()
        for name in ("auto tight", "json map"):
            diff = (logits[name] - logits["one piece"]).abs().max().item()
            assert diff == 0.0, f"{name} (adapter={adapter}): logits differ by {diff}"


def test_prompt_file_formats_chat_and_output_fields(files, capsys, tmp_path):
    records, _ = generate(capsys, tmp_path, "--model_name_or_path", files["model"], "--prompts", files["prompts"],
                          "--prompt", "hello there", "--chat", "--batch_size", "2")
    # Command-line prompts first, then the file, in order; ids copied; chat prompts keep their messages.
    assert [r["prompt"] for r in records] == [
        "hello there", PROMPTS[0], [{"role": "user", "content": "reverse: red blue"}], PROMPTS[2], PROMPTS[3],
    ]
    assert records[1]["id"] == "a" and "id" not in records[0]
    for r in records:
        assert isinstance(r["completion"], str) and r["finish_reason"] in ("eos", "length")
        assert r["completion_tokens"] == len(r["completion_ids"]) <= 12

    # --chat sends a plain prompt through the chat template: the same tokens as the equivalent messages record.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(files["model"])
    chat = G.read_prompts(tok, ["reverse: red blue"], None, chat=True)[0]
    plain = G.read_prompts(tok, ["reverse: red blue"], None, chat=False)[0]
    assert chat.text.startswith("<|im_start|>system") and chat.text.endswith("<|im_start|>assistant\n")
    assert plain.text == "reverse: red blue"
    assert records[2]["completion_ids"] == generate(
        capsys, tmp_path, "--model_name_or_path", files["model"], "--prompt", "reverse: red blue", "--chat")[0][0]["completion_ids"]


def test_stops_at_eos(files, unsharded, capsys, tmp_path):
    """Declare a later greedy token of a prompt as an extra EOS (generation_config): generation stops right there."""
    import shutil

    # The first (prompt, position) whose token did not occur earlier in the completion.
    prompt, first, at = next((PROMPTS[k], r["completion_ids"], i) for k, r in enumerate(unsharded["base"])
                             for i, t in enumerate(r["completion_ids"]) if i >= 1 and t not in r["completion_ids"][:i])
    stop = first[at]
    model = tmp_path / "model"
    shutil.copytree(files["model"], model)
    cfg = json.loads((model / "generation_config.json").read_text())
    cfg["eos_token_id"] = [cfg["eos_token_id"], stop]
    (model / "generation_config.json").write_text(json.dumps(cfg))
    records, _ = generate(capsys, tmp_path, "--model_name_or_path", model, "--prompt", prompt)
    assert records[0]["finish_reason"] == "eos"
    assert records[0]["completion_ids"] == first[:at]


def test_sampling_is_seeded(files, capsys, tmp_path):
    args = ["--model_name_or_path", files["model"], "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--do_sample",
            "--temperature", "1.5"]
    a, _ = generate(capsys, tmp_path, *args, "--seed", "1")
    b, _ = generate(capsys, tmp_path, *args, "--seed", "1")
    c, _ = generate(capsys, tmp_path, *args, "--seed", "2")
    assert _ids(a) == _ids(b)
    assert _ids(a) != _ids(c)


@pytest.mark.slow
def test_entry_points_write_the_same_jsonl(files, unsharded, tmp_path, monkeypatch, capsys):
    """`finetune generate` as users type it (a real process, JSON lines on stdout), and `python -m finetune.inference.generate`."""
    import runpy
    import sys

    common = ["--model_name_or_path", str(files["model"]), *prompt_flags(), "--max_new_tokens", "12", "--with_ids",
              "--device_map", "auto", "--max_memory", TIGHT]
    result = run([str(BIN / "finetune"), "generate", *common], timeout=180).check()
    lines = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    assert _ids(lines) == _ids(unsharded["base"])
    assert re.search(r"model\.layers\.3\s+-> disk", result.output)
    out = tmp_path / "m.jsonl"
    monkeypatch.setattr(sys, "argv", ["python -m finetune.inference.generate", *common, "--output", str(out)])
    runpy.run_module("finetune.inference.generate", run_name="__main__", alter_sys=True)
    assert _ids(json.loads(line) for line in out.read_text().splitlines()) == _ids(unsharded["base"])


# ----------------------------------------------------------------------------------------------
# Bad input: one clear message, exit status 2, before any weight is read.


def bad_map(tmp_path, entries) -> str:
    path = tmp_path / "bad_map.json"
    path.write_text(json.dumps(entries))
    return str(path)


FULL_MAP = {"model.embed_tokens": "cpu", "model.layers": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}


@pytest.mark.parametrize("case, flags, message", [
    ("unknown device in map", {"model.layers": "cuda:1"},
     "'model.layers': device 'cuda:1' does not exist on this machine (available: cpu, disk"),
    ("device that is no device", {"model.layers": "gpu7"}, "device 'gpu7' does not exist on this machine"),
    ("module typo", {"model.layer": "cpu"}, "the model has no module 'model.layer'; did you mean 'model.layers'?"),
    ("weights left out", "drop lm_head", "these weights are not placed on any device: lm_head.weight"),
    ("no disk allowed", ["--max_memory", "cpu=300KB"],
     r"cannot hold the model \([\d.]+ KiB of weights\): [\d.]+ KiB would have to go to disk, which --max_memory does not allow"),
    ("disk too small", ["--max_memory", "cpu=300KB,disk=200KB"], r"KiB would go to disk, over its limit of 195.31 KiB"),
    ("missing GPU in max_memory", ["--max_memory", "0=20GiB"], "--max_memory 0=20GiB: device '0' does not exist on this machine"),
    ("bad size", ["--max_memory", "cpu=lots"], "--max_memory cpu=lots: 'lots' is not a size"),
    ("quantized on disk", ["--load_in_8bit", "--device_map", "MAP"], "bitsandbytes-quantized layers cannot be offloaded to disk"),
    ("adapter for another base", ["--adapter", "OTHER"],
     "was trained on base model {other}, which differs from {model}: hidden_size 32 vs 64"),
    ("prompt file", ["--prompts", "BADPROMPTS"], "bad.jsonl:2: invalid JSON"),
])
def test_bad_input(files, capsys, tmp_path, case, flags, message):
    if isinstance(flags, dict):
        flags = ["--device_map", bad_map(tmp_path, {**FULL_MAP, **flags})]
    elif flags == "drop lm_head":
        flags = ["--device_map", bad_map(tmp_path, {k: v for k, v in FULL_MAP.items() if k != "lm_head"})]
    bad_prompts = tmp_path / "bad.jsonl"
    bad_prompts.write_text('{"prompt": "fine"}\n{"prompt": \n')
    subst = {"MAP": str(files["map"]), "OTHER": str(files["other_adapter"]), "BADPROMPTS": str(bad_prompts)}
    flags = [subst.get(f, f) for f in flags]
    with pytest.raises(SystemExit) as exit_:
        G.main(["--model_name_or_path", str(files["model"]), "--prompt", "hi", *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    expected = message.format(other=files["root"] / "other", model=files["model"])
    assert err.startswith("finetune generate: ") or "\nfinetune generate: " in err, err
    assert expected in err or re.search(expected, err), err
    assert "Traceback" not in err


def test_adapter_with_matching_config_but_wrong_shapes_is_refused(files, tmp_path, capsys):
    """Without a recorded base folder to compare, the LoRA shapes themselves must fit the base."""
    import shutil

    adapter = tmp_path / "moved_adapter"
    shutil.copytree(files["other_adapter"], adapter)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = "/nowhere/base"
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit):
        G.main(["--model_name_or_path", str(files["model"]), "--prompt", "hi", "--adapter", str(adapter)])
    err = capsys.readouterr().err
    assert "does not fit base model" in err and "adapter expects 32 input features, the base layer has 64" in err


def test_weights_that_do_not_match_the_config_are_refused(files, tmp_path, capsys):
    """Tensor names with a 'module.' prefix: from_pretrained would generate from random weights (exit 0)."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "renamed"
    shutil.copytree(files["model"], model)
    weights = load_file(model / "model.safetensors")
    save_file({f"module.{k}": v.contiguous() for k, v in weights.items()}, model / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(SystemExit) as exit_:
        G.main(["--model_name_or_path", str(model), "--prompt", "hi", "--output", str(tmp_path / "o.jsonl")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"the weights in {model / 'model.safetensors'} do not match its config.json" in err, err
    assert "39 missing keys: lm_head.weight, model.embed_tokens.weight" in err and "module.model.embed_tokens.weight" in err, err
    assert not (tmp_path / "o.jsonl").exists()
