"""`finetune export --to gguf`: tiny Llamas (ChatML and Llama-3 tokenizers, tied and untied embeddings) written as
f32/f16/bf16/q8_0 GGUF; the file's metadata and tensor types, the Q/K permutation, the round trip through
`finetune import-gguf` (weights exactly the HF weights rounded to the type, logits within the type's bound), the
Ollama Modelfile, and the user mistakes (exit 2, nothing left behind). One slow test on the real SmolLM2-135M."""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pytest
import torch

from finetune.convert import export as E
from finetune.convert.writers import gguf as X
from finetune.convert import gguf_import as G
from finetune.models import tiny
from finetune.models.families import llama
from finetune.models.verify import fixed_input, logits_of

from conftest import MISTRAL_TEMPLATE

pytestmark = pytest.mark.usefixtures("one_thread")

TYPES = ("f32", "f16", "bf16", "q8_0")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_export")
    return {(style, tied): tiny.build(root / f"{style}-{'tied' if tied else 'untied'}", style, seed=3, tied=tied)
            for style in ("chatml", "llama3") for tied in (False, True)}


def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def rounded(weight: torch.Tensor, gguf_type: str, ndim: int) -> torch.Tensor:
    """What the file must hold for an HF weight (in HF layout), computed independently of the exporter for f16/bf16."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    if gguf_type == "f32" or ndim < 2:
        return weight
    if gguf_type == "f16":
        return weight.half().float()
    if gguf_type == "bf16":
        return weight.bfloat16().float()
    a = weight.numpy()
    return torch.from_numpy(quants.dequantize(quants.quantize(a, Q.Q8_0), Q.Q8_0).reshape(a.shape))


def fields(path):
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return reader, {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


@pytest.mark.parametrize("gguf_type", TYPES)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_export_round_trip(models, tmp_path, capsys, style, tied, gguf_type):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = models[(style, tied)]
    out = tmp_path / "gguf" / "model.gguf"
    E.main(["--to", "gguf", "--model_name_or_path", str(src), str(out), "--gguf_type", gguf_type])
    err = capsys.readouterr().err
    assert f"wrote {out} ({gguf_type}" in err
    assert sorted(p.name for p in out.parent.iterdir()) == ["Modelfile", "model.gguf"]  # no temp file left

    model = hf(src)
    cfg = model.config
    reader, meta = fields(out)
    assert meta["general.architecture"] == "llama"
    assert meta["llama.context_length"] == cfg.max_position_embeddings
    assert meta["llama.embedding_length"] == cfg.hidden_size
    assert meta["llama.block_count"] == cfg.num_hidden_layers
    assert meta["llama.feed_forward_length"] == cfg.intermediate_size
    assert meta["llama.attention.head_count"] == cfg.num_attention_heads
    assert meta["llama.attention.head_count_kv"] == cfg.num_key_value_heads == 2
    assert meta["llama.rope.freq_base"] == pytest.approx(cfg.rope_parameters["rope_theta"])
    assert meta["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg.rms_norm_eps)
    assert meta["llama.vocab_size"] == cfg.vocab_size == len(meta["tokenizer.ggml.tokens"])
    assert meta["general.file_type"] == {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7}[gguf_type]
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "gpt-2"
    tok = AutoTokenizer.from_pretrained(src)
    assert meta["tokenizer.chat_template"] == tok.chat_template
    assert meta["tokenizer.ggml.eos_token_id"] == tok.eos_token_id
    assert meta.get("tokenizer.ggml.bos_token_id") == tok.bos_token_id
    assert len(meta["tokenizer.ggml.merges"]) > 100
    specials = [i for i, t in enumerate(meta["tokenizer.ggml.token_type"]) if t == 3]  # CONTROL
    assert sorted(specials) == sorted(tok.all_special_ids + [i for i in tok.added_tokens_decoder if i not in tok.all_special_ids])

    tensors = {t.name: t for t in reader.tensors}
    assert ("output.weight" in tensors) == (not tied)
    want_2d = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}[gguf_type]
    assert {t.tensor_type.name for n, t in tensors.items() if len(t.shape) == 2 or n.endswith("_embd.weight")} == {want_2d}
    assert {t.tensor_type.name for t in tensors.values() if len(t.shape) == 1} == {"F32"}  # norms stay fp32
    if gguf_type == "f32":
        # llama.cpp's Q/K layout: the file holds permute(W), which is not W (this is what a missing permute breaks).
        q = model.model.layers[0].self_attn.q_proj.weight.detach().numpy()
        k = model.model.layers[0].self_attn.k_proj.weight.detach().numpy()
        raw_q = np.asarray(tensors["blk.0.attn_q.weight"].data).reshape(q.shape)
        raw_k = np.asarray(tensors["blk.0.attn_k.weight"].data).reshape(k.shape)
        assert np.array_equal(raw_q, llama.permute(q, 4, 4)) and not np.array_equal(raw_q, q)
        assert np.array_equal(raw_k, llama.permute(k, 4, 2)) and not np.array_equal(raw_k, k)

    # Round trip: `finetune import-gguf` of the exported file gives back the HF weights rounded to the type, exactly.
    back = tmp_path / "back"
    G.main([str(out), str(back)])
    imported = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    assert imported.config.tie_word_embeddings == tied
    got = imported.state_dict()
    worst = 0.0
    for name, weight in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        assert torch.equal(got[name], rounded(weight, gguf_type, weight.ndim)), name
        worst = max(worst, (got[name] - weight).abs().max().item())
    assert (worst == 0.0) == (gguf_type == "f32")
    ids = fixed_input(cfg.vocab_size, batch=2, length=24, seed=5)
    ref = logits_of(model, ids)
    diff = (logits_of(imported, ids) - ref).abs().max().item()
    bound = X.LOGIT_BOUNDS[gguf_type] * (1.0 if gguf_type == "f32" else ref.abs().max().item())
    assert diff <= bound, (diff, bound)
    if gguf_type == "f32":
        assert diff <= 1e-5

    modelfile = (out.parent / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./model.gguf\n")
    if style == "chatml":
        assert "<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>" in modelfile
        assert 'PARAMETER stop "<|im_end|>"' in modelfile
        assert 'SYSTEM """You are a helpful AI assistant named SmolLM, trained by Hugging Face"""' in modelfile
    else:
        assert "<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>" in modelfile
        assert 'PARAMETER stop "<|eot_id|>"' in modelfile and 'PARAMETER stop "<|end_of_text|>"' in modelfile
        assert "SYSTEM" not in modelfile


def test_modelfile_template_matches_hf_rendering(models):
    """The Ollama TEMPLATE, executed by hand on a conversation, writes what the HF chat template writes."""
    from transformers import AutoTokenizer

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "count: a b"},
            {"role": "assistant", "content": "2"}, {"role": "user", "content": "again"}]
    for style, template in (("chatml", X.OLLAMA_CHATML), ("llama3", X.OLLAMA_LLAMA3)):
        tok = AutoTokenizer.from_pretrained(models[(style, False)])
        hf_text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        # Go template semantics for these two: `{{-` trims the whitespace before it; range writes the body per message.
        body = template.split("{{- range .Messages }}", 1)[1]
        each, after = body.split("{{- end }}" if "{{- end }}" in body else "{{ end }}", 1)
        if "{{- end }}" in body:
            each = each.rstrip()
        ollama = "".join(each.replace("{{ .Role }}", m["role"]).replace("{{ .Content }}", m["content"]) for m in msgs) + after
        assert hf_text.removeprefix(tok.bos_token or "") == ollama, (style, hf_text, ollama)


def test_adapter_merged_then_exported(models, tmp_path, capsys):
    """--adapter: merged into its base first; the GGUF model computes base + adapter (f32, within 1e-5)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = models[("llama3", True)]
    adapter = tiny.save_random_adapter(base, tmp_path / "adapter", seed=4)
    out = tmp_path / "out" / "merged.gguf"
    E.main(["--to", "gguf", "--adapter", str(adapter), str(out)])
    assert "merged vs base+adapter logits max diff" in capsys.readouterr().err
    assert sorted(p.name for p in out.parent.iterdir()) == ["Modelfile", "merged.gguf"]
    reference = PeftModel.from_pretrained(hf(base), str(adapter)).eval()
    loaded = AutoModelForCausalLM.from_pretrained(out.parent, gguf_file=out.name, dtype=torch.float32).eval()
    ids = fixed_input(loaded.config.vocab_size)
    with_adapter = logits_of(reference, ids)
    assert (logits_of(loaded, ids) - with_adapter).abs().max().item() <= 1e-5
    assert (logits_of(hf(base), ids) - with_adapter).abs().max().item() > 1e-2  # the adapter did change the model


def run_main(capsys, argv):
    with pytest.raises(SystemExit) as e:
        E.main(argv)
    return e.value.code, capsys.readouterr().err


def test_bad_input_exit_2_nothing_left(models, tmp_path, capsys):
    src = models[("chatml", False)]
    # An architecture GGUF export cannot write (GPT-2: no family writes it).
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(src, gpt2)
    cfg = json.loads((gpt2 / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (gpt2 / "config.json").write_text(json.dumps(cfg))
    out_dir = tmp_path / "out"
    code, err = run_main(capsys, ["--to", "gguf", "--model_name_or_path", str(gpt2), str(out_dir / "m.gguf")])
    assert code == 2 and "model_type 'gpt2' cannot be written as GGUF" in err, err
    assert not out_dir.exists()

    # Weights that are not the config's model (a Llama relabelled as Phi-3: no fused qkv/gate_up weights): refused
    # by name, not written with from_pretrained's random values and then verified against those.
    phi3 = tmp_path / "phi3"
    shutil.copytree(src, phi3)
    cfg = json.loads((phi3 / "config.json").read_text())
    cfg.update(model_type="phi3", architectures=["Phi3ForCausalLM"], tie_word_embeddings=False)
    (phi3 / "config.json").write_text(json.dumps(cfg))
    code, err = run_main(capsys, ["--to", "gguf", "--model_name_or_path", str(phi3), str(out_dir / "m.gguf")])
    assert code == 2 and "do not match its config.json" in err and "qkv_proj" in err, err
    assert not out_dir.exists()

    # A vocabulary that is neither byte-level BPE nor BPE with byte fallback (Metaspace over a BPE without it).
    sp = tmp_path / "sp"
    shutil.copytree(src, sp)
    tj = json.loads((sp / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False}
    (sp / "tokenizer.json").write_text(json.dumps(tj))
    code, err = run_main(capsys, ["--to", "gguf", "--model_name_or_path", str(sp), str(out_dir / "m.gguf")])
    assert code == 2 and "a 'BPE' vocabulary without byte fallback" in err, err
    assert not out_dir.exists()

    # An existing output without --overwrite: untouched; with --overwrite: replaced.
    out_dir.mkdir()
    existing = out_dir / "m.gguf"
    existing.write_bytes(b"old")
    code, err = run_main(capsys, ["--to", "gguf", "--model_name_or_path", str(src), str(existing)])
    assert code == 2 and "already exists; pass --overwrite" in err, err
    assert existing.read_bytes() == b"old" and sorted(p.name for p in out_dir.iterdir()) == ["m.gguf"]
    E.main(["--to", "gguf", "--model_name_or_path", str(src), str(existing), "--overwrite"])
    assert existing.read_bytes()[:4] == b"GGUF" and sorted(p.name for p in out_dir.iterdir()) == ["Modelfile", "m.gguf"]

    # An adapter whose base is not there.
    adapter = tmp_path / "adapter"
    tiny.save_random_adapter(src, adapter, seed=1)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(tmp_path / "gone")
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    before = sorted(p.name for p in tmp_path.iterdir())
    code, err = run_main(capsys, ["--to", "gguf", "--adapter", str(adapter), str(tmp_path / "a.gguf")])
    assert code == 2 and "is not a local model folder; pass --model_name_or_path" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before

    # Flag mistakes, all at once.
    code, err = run_main(capsys, ["--to", "gguf", str(tmp_path / "x.bin"), "--gguf_type", "q4"])
    assert code == 2
    for line in ("--model_name_or_path, --adapter and --zero_checkpoint: give exactly one", "--gguf_type: 'q4' is not one of",
                 "must be a file name ending in .gguf"):
        assert line in err, err


def test_other_chat_template_has_no_template(models, tmp_path, capsys, monkeypatch):
    """(Given by the old spelling --model_dir, which still works and says the new name once.)"""
    from finetune.config import parser

    monkeypatch.setattr(parser, "_NOTED", set())
    src = tmp_path / "plain"
    tiny.build(src, "plain", seed=2)
    out = tmp_path / "o" / "p.gguf"
    E.main(["--to", "gguf", "--model_dir", str(src), str(out)])
    err = capsys.readouterr().err
    assert "without TEMPLATE" in err
    assert err.count("finetune export: --model_dir is now --model_name_or_path (the old spelling still works)") == 1, err
    assert (out.parent / "Modelfile").read_text() == "FROM ./p.gguf\n"


@pytest.mark.slow
def test_smollm2_f32_and_q8_0(smollm2_dir, tmp_path, capsys):
    """The real SmolLM2-135M-Instruct: f32 within 1e-5 of HF, q8_0 within its bound; the numbers go to the log."""
    from transformers import AutoModelForCausalLM

    model = hf(smollm2_dir)
    ids = fixed_input(model.config.vocab_size)
    ref = logits_of(model, ids)
    for gguf_type in ("f32", "q8_0"):
        out = tmp_path / gguf_type / "smollm2.gguf"
        start = time.perf_counter()
        report = X.write_folder(smollm2_dir, out, gguf_type=gguf_type)
        seconds = time.perf_counter() - start
        _, meta = fields(out)
        assert meta["tokenizer.ggml.pre"] == "gpt-2" and meta["llama.attention.head_count_kv"] == 3
        loaded = AutoModelForCausalLM.from_pretrained(out.parent, gguf_file=out.name, dtype=torch.float32).eval()
        diff = (logits_of(loaded, ids) - ref).abs().max().item()
        bound = 1e-5 if gguf_type == "f32" else X.LOGIT_BOUNDS["q8_0"] * ref.abs().max().item()
        print(f"smollm2 {gguf_type}: {out.stat().st_size / 2**20:.1f} MiB, logit diff {diff:.3g} (bound {bound:.3g}), "
              f"weight diff {report.weight_diff:.3g}, export {seconds:.1f}s")
        assert diff <= bound and report.logit_diff == pytest.approx(diff, rel=1e-3, abs=1e-9)
        assert (out.parent / "Modelfile").read_text().count('PARAMETER stop "<|im_end|>"') == 1
        assert seconds < 300


def test_quickstart_export_flag(models, tmp_path):
    """`finetune quickstart --export gguf`: the flag parses, a wrong value is refused, and the step it runs after
    training (a LoRA run: the run folder holds the adapter) writes a verified GGUF of the merged model."""
    from finetune.apps import quickstart as Q

    base = models[("chatml", True)]
    data = ["--model_dir", str(base), "--train_file", str(tiny.write_jsonl(tmp_path / "t.jsonl", tiny.synthetic_records(4))),
            "--eval_file", str(tmp_path / "t.jsonl")]
    cfg = Q.parse(data + ["--export", "gguf", "--gguf_type", "f32"])
    assert cfg.export == "gguf" and cfg.gguf_type == "f32"
    with pytest.raises(Q.QuickstartFlagsError) as e:
        Q.parse(data + ["--export", "onnx", "--gguf_type", "q4"])
    assert any("--export: 'onnx'" in p for p in e.value.problems) and any("--gguf_type: 'q4'" in p for p in e.value.problems)

    run_dir = tiny.save_random_adapter(base, tmp_path / "run" / "model", seed=6)
    lines = []
    path = Q.export_run_as_gguf(cfg, str(base), run_dir, tmp_path / "run" / "gguf" / "model.gguf", lines.append)
    assert path.endswith("model.gguf") and "ollama create my-model -f" in lines[0]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    reference = PeftModel.from_pretrained(hf(base), str(run_dir)).eval()
    out = tmp_path / "run" / "gguf"
    loaded = AutoModelForCausalLM.from_pretrained(out, gguf_file="model.gguf", dtype=torch.float32).eval()
    ids = fixed_input(loaded.config.vocab_size)
    assert (logits_of(loaded, ids) - logits_of(reference, ids)).abs().max().item() <= 1e-5


def test_pre_tokenizer_names(tmp_path):
    """tokenizer.json pre-tokenizers -> llama.cpp's names (the structures of GPT-2, SmolLM2 and Llama-3 files)."""
    from finetune.convert.messages import ExportError

    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    cases = {
        "gpt-2": byte_level,
        "smollm": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level]},
        "llama-bpe": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": X.LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False},
            dict(byte_level, use_regex=False)]},
    }
    for name, pre in cases.items():
        assert X.pre_tokenizer_name({"pre_tokenizer": pre}, tmp_path) == name
    with pytest.raises(ExportError, match="is not one finetune can name for llama.cpp"):
        X.pre_tokenizer_name({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\s+"}}, dict(byte_level, use_regex=False)]}}, tmp_path)


# ----------------------------------------------------------------------------------------------
# SentencePiece vocabularies ("llama" tokenizer model): a real one, Mistral-7B's 32k (tests/data/sentencepiece)

# Plain text, leading/double spaces, newlines and tabs, accents, CJK, emoji and a rare symbol (byte fallback: these
# are not in the vocabulary), digits, code, a special token inside text.
SP_TEXTS = [
    "Hello world", "Hello, world! How are you?", " leading space", "two  spaces   three", "line one\nline two\n\n",
    "\ttabbed\tvalues", "naïve café, Straße, ÆØÅ, ﬁ ligature", "日本語のテキスト 中文 한국어", "emoji 🦙🚀 and ⨂ ∰",
    "1234567 + 89 = 1234656", "def f(x):\n    return x ** 2  # square", "</s> after an end", "x" * 50, "",
]
# Text right after a special token: the HF tokenizer (legacy=true) and llama.cpp put "▁" before "[INST]";
# transformers 5.23's GGUF reader builds a non-legacy LlamaTokenizer (no "▁" there), a GGUF file has no key for
# it. Checked against llama.cpp itself in test_gguf_llamacpp.py.
AFTER_SPECIAL = ["<s>[INST] hi [/INST]", "x<s>y"]


@pytest.mark.slow
def test_sentencepiece_vocabulary(sentencepiece_model, tmp_path, capsys):
    """Mistral's vocabulary written as llama.cpp's "llama" tokenizer: tokens with scores and types, no merges.
    transformers rebuilds the tokenizer from the file alone (its merges derived from our scores) and it encodes every
    sample like the HF tokenizer; the transformers-loaded file's logits equal the HF model's (f32, 1e-5)."""
    from transformers import AutoTokenizer

    src = sentencepiece_model
    tok = AutoTokenizer.from_pretrained(src)
    out = tmp_path / "f32" / "mistral-tiny.gguf"
    report = X.write_folder(src, out, gguf_type="f32")
    assert report.logit_diff <= 1e-5 and report.weight_diff == 0.0
    _, meta = fields(out)
    assert meta["tokenizer.ggml.model"] == "llama" and meta["tokenizer.ggml.add_space_prefix"] is True
    assert "tokenizer.ggml.merges" not in meta  # llama.cpp's SentencePiece tokenizer reads scores
    tokens, scores, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == len(scores) == len(types) == 32000
    assert tokens == tok.convert_ids_to_tokens(list(range(32000)))
    assert (types[0], types[1], types[2]) == (2, 3, 3)  # <unk> UNKNOWN, <s> and </s> CONTROL
    assert [i for i, t in enumerate(types) if t == 6] == list(range(3, 259))  # <0x00>..<0xFF> BYTE
    assert set(types[259:]) == {1}  # NORMAL
    # Scores follow tokenizer.json's merge order: "▁t" (the first merge) outranks "in" (the second), and the
    # whitespace runs HF ranks last come after every other merged token.
    vocab = tok.get_vocab()
    assert scores[vocab["▁t"]] == 0.0 and scores[vocab["in"]] == -1.0
    assert scores[vocab["▁▁"]] < scores[vocab["▁the"]] < scores[vocab["in"]]
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"], meta["tokenizer.ggml.unknown_token_id"]) == (1, 2, 0)
    assert meta["tokenizer.ggml.add_bos_token"] is True and meta["tokenizer.chat_template"] == MISTRAL_TEMPLATE
    assert (out.parent / "Modelfile").read_text() == "FROM ./mistral-tiny.gguf\n"  # [INST] style: no TEMPLATE

    gguf_tok = AutoTokenizer.from_pretrained(out.parent, gguf_file=out.name)
    for text in SP_TEXTS:
        want = tok(text)["input_ids"]
        assert gguf_tok(text)["input_ids"] == want, (text, tok.convert_ids_to_tokens(want))
        assert gguf_tok.decode(want, skip_special_tokens=True) == tok.decode(want, skip_special_tokens=True)
    assert any(3 <= i < 259 for i in tok("emoji 🦙🚀 and ⨂ ∰")["input_ids"])  # the sample does use byte fallback


def test_sentencepiece_scores_follow_merges():
    """A token scores minus the rank of the first merge that makes it; characters 0; unmade longer tokens lowest."""
    tj = {"model": {"vocab": {"<unk>": 0, "a": 1, "b": 2, "ab": 3, "abb": 4, "ba": 5, "zz": 6},
                    "merges": ["a b", "b a", "ab b", "a bb"]}}
    assert X.sentencepiece_scores(tj, 8) == [-5.0, 0.0, 0.0, -0.0, -2.0, -1.0, -5.0, 0.0]
