"""The Qwen2 (Qwen2.5), Qwen3 and Mistral families (finetune/models/families/qwen2.py, qwen3.py, mistral.py): the
parameter totals of the family and of `finetune plan` equal the real model's tensors (built on the meta device from
the published config numbers of Qwen2.5-7B, Qwen3-8B, Qwen3-0.6B and Mistral-7B-v0.1), LoRA's default targets are
what peft's all-linear wraps, the GGUF names are what transformers' GGUF loader reads back, and a tiny random model
of each family goes through `finetune export --to gguf` (f32: logits within 1e-5 as transformers loads the file)
and back through `finetune import-gguf` with the same weights."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from finetune.convert import export as E
from finetune.convert import gguf_import as G
from finetune.models import families, tiny
from finetune.models.families.llama import LLAMA
from finetune.models.families.mistral import MISTRAL
from finetune.models.families.qwen2 import QWEN2
from finetune.models.families.qwen3 import QWEN3
from finetune.models.load import lora_target_modules
from finetune.models.verify import fixed_input, logits_of
from finetune.plan import planner as plan


def real_config(name: str):
    """The published config.json numbers of each checkpoint (shapes and the keys that change them)."""
    from transformers import MistralConfig, Qwen2Config, Qwen3Config

    if name == "Qwen2.5-7B":
        return Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                           num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
                           max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1000000.0)
    if name == "Qwen3-8B":
        return Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                           num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                           max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0)
    if name == "Qwen3-0.6B":
        return Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                           max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0)
    assert name == "Mistral-7B-v0.1"
    return MistralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
                         max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096)


# name -> (family, parameter total of the published safetensors)
REAL = {
    "Qwen2.5-7B": (QWEN2, 7_615_616_512),
    "Qwen3-8B": (QWEN3, 8_190_735_360),
    "Qwen3-0.6B": (QWEN3, 596_049_920),
    "Mistral-7B-v0.1": (MISTRAL, 7_241_732_096),
}


@pytest.mark.parametrize("name", list(REAL))
def test_parameter_count_equals_the_meta_device_model(name, tmp_path):
    from transformers import AutoModelForCausalLM

    family, total = REAL[name]
    cfg = real_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert type(model).__name__ == family.hf_classes[0]
    expected = [(n, tuple(p.shape)) for n, p in model.named_parameters()]  # a tied lm_head is listed once
    assert sum(int(np.prod(s)) for _, s in expected) == total

    d = cfg.to_dict()
    assert families.family_of(d) is family and families.family_of(cfg) is family
    shape = family.shape(d)
    assert [(t.name, t.shape) for t in shape.tensors()] == expected  # every tensor, in named_parameters() order
    assert shape.num_params == plan.model_shape(d).num_params == total
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(d))
    data = plan.make_plan(["--model_name_or_path", str(folder), "--accelerator", "gpu", "--device_memory", "80GB",
                           "--host_memory", "1TB"])
    assert data["model"]["parameters"] == total and data["model"]["model_type"] == cfg.model_type
    lora = plan.make_plan(["--model_name_or_path", str(folder), "--use_peft", "--accelerator", "gpu",
                           "--device_memory", "80GB", "--host_memory", "1TB"])
    assert lora["model"]["parameters"] == total
    print(f"{name}: family and plan {total:,} = meta-device model {sum(int(np.prod(s)) for _, s in expected):,}")


def test_qwen3_head_dim_defaults_as_transformers_does():
    """A Qwen3 config.json without head_dim: transformers takes 128, not hidden_size / num_attention_heads."""
    d = real_config("Qwen3-0.6B").to_dict()
    del d["head_dim"]
    assert QWEN3.shape(d).head_dim == 128 and QWEN3.shape(d).num_params == REAL["Qwen3-0.6B"][1]


# ----------------------------------------------------------------------------------------------
# Tiny random models of each family (a ChatML tokenizer built in the test).


def tiny_config(family, vocab_size: int, tied: bool = False):
    from transformers import MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=tied, rms_norm_eps=1e-6)
    if family is QWEN2:
        return Qwen2Config(rope_theta=1000000.0, **common)
    if family is QWEN3:
        return Qwen3Config(head_dim=128, rope_theta=1000000.0, **common)  # 128 != 64 / 4, as in Qwen3-0.6B
    return MistralConfig(sliding_window=4096, **common)


def tiny_model(family, vocab_size: int = 96, tied: bool = False, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, vocab_size, tied), dtype=torch.float32)
    with torch.no_grad():  # random biases and norms, so a wrong name or layout shows in the logits
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.normal_(1.0 if "norm" in n else 0.0, 0.1)
    return model.eval()


FAMILIES = {"qwen2": QWEN2, "qwen3": QWEN3, "mistral": MISTRAL}


@pytest.mark.parametrize("fam", list(FAMILIES))
def test_lora_default_is_peft_all_linear(fam):
    """finetune's all-linear is the family's projections, which peft's own all-linear wraps too; the planner's
    LoRA tensors are the ones peft adds."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    family = FAMILIES[fam]
    config = tiny_config(family, 64)

    def trained(targets):
        model = get_peft_model(AutoModelForCausalLM.from_config(config),
                               LoraConfig(r=2, target_modules=targets, task_type="CAUSAL_LM"))
        return {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}

    ours = lora_target_modules(config, ["all-linear"])
    assert ours == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_all = trained("all-linear")
    assert trained(ours) == peft_all
    shape = family.shape(config.to_dict())
    assert sum(t.numel for t in plan.lora_tensors(shape, 2, ["all-linear"])) == sum(peft_all.values())


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("fam", list(FAMILIES))
def test_gguf_names_round_trip_every_tensor(fam, tied):
    """Every tensor's GGUF name is llama.cpp's (the gguf package's table for the architecture) and transformers'
    GGUF loader maps it back to the same HF name; Q/K rows are permuted for llama (Mistral) only."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    family = FAMILIES[fam]
    model = tiny_model(family, tied=tied)
    shape = family.shape(model.config.to_dict())
    export_names = family.gguf_names(shape)
    params = [n for n, _ in model.named_parameters()]
    assert sorted(export_names) == sorted(params)
    assert len(set(export_names.values())) == len(params)
    assert ("output.weight" in export_names.values()) == (not tied)
    import_names = get_gguf_hf_weights_map(model, TensorProcessor(), family.gguf_arch)
    assert {hf: import_names[g] for hf, g in export_names.items()} == {hf: hf for hf in params}
    if family is QWEN2:
        assert export_names["model.layers.1.self_attn.k_proj.bias"] == "blk.1.attn_k.bias"
    if family is QWEN3:
        assert export_names["model.layers.1.self_attn.q_norm.weight"] == "blk.1.attn_q_norm.weight"
        assert export_names["model.layers.1.self_attn.k_norm.weight"] == "blk.1.attn_k_norm.weight"
    processor = TENSOR_PROCESSORS.get(family.gguf_arch, TensorProcessor)(config=model.config.to_dict())
    for hf_name, weight in model.state_dict().items():
        if hf_name not in export_names:
            continue
        w = weight.numpy()
        stored = family.to_gguf(hf_name, w, shape)
        assert np.array_equal(processor.process(stored, export_names[hf_name]).weights, w), hf_name
        assert np.array_equal(family.from_gguf(hf_name, stored, shape), w), hf_name
        permuted = family.gguf_arch == "llama" and ("q_proj.weight" in hf_name or "k_proj.weight" in hf_name)
        assert np.array_equal(stored, w) != permuted, hf_name


def test_gguf_architectures_and_refusals():
    assert families.by_gguf_arch("qwen2") is QWEN2 and families.by_gguf_arch("qwen3") is QWEN3
    assert families.by_gguf_arch("llama") is LLAMA  # a "llama" file (Mistral's too) imports as Llama
    assert families.gguf_archs() == ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen3moe", "qwen2vl"]
    assert QWEN2.gguf_required_names() == ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_q.bias",
                                           "blk.0.ffn_down.weight")
    assert QWEN3.gguf_required_names() == ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_q_norm.weight",
                                           "blk.0.ffn_down.weight")
    config = tiny_config(QWEN3, 64)
    config.head_dim = 32
    assert "head_dim 32" in QWEN3.gguf_refusal(config)
    config = tiny_config(QWEN2, 64)
    config.use_sliding_window = True
    assert "use_sliding_window" in QWEN2.gguf_refusal(config)
    assert QWEN2.gguf_refusal(tiny_config(QWEN2, 64)) is None
    assert MISTRAL.gguf_refusal(tiny_config(MISTRAL, 64)) is None


# ----------------------------------------------------------------------------------------------
# `finetune export --to gguf` and `finetune import-gguf` of each family.


@pytest.fixture(scope="module")
def chatml_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    return folder, tiny.build_tokenizer(folder, "chatml")


CASES = [("qwen2", False), ("qwen2", True), ("qwen3", False), ("qwen3", True), ("mistral", False)]


@pytest.mark.parametrize("fam, tied", CASES, ids=[f"{f}-{'tied' if t else 'untied'}" for f, t in CASES])
def test_export_and_import_gguf(fam, tied, chatml_tokenizer, tmp_path, capsys, one_thread):
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    family = FAMILIES[fam]
    _, tokenizer = chatml_tokenizer
    src = tmp_path / fam
    model = tiny_model(family, vocab_size=len(tokenizer), tied=tied, seed=3)
    model.config.bos_token_id, model.config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    model.save_pretrained(src)
    tokenizer.save_pretrained(src)
    out = tmp_path / "gguf" / "model.gguf"
    E.main(["--to", "gguf", "--model_name_or_path", str(src), str(out)])  # verified inside: logits within 1e-5
    err = capsys.readouterr().err
    reported = float(re.search(r"transformers-loaded logits vs HF max diff (\S+) ", err).group(1))
    assert reported <= 1e-5

    reader = GGUFReader(str(out))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    assert arch == family.gguf_arch
    names = {t.name for t in reader.tensors}
    assert ("output.weight" in names) == (not tied)
    if family is QWEN2:
        assert {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"} <= names
    if family is QWEN3:
        assert {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"} <= names
    modelfile = (out.parent / "Modelfile").read_text()
    assert ("TEMPLATE" in modelfile) == (family is not MISTRAL)

    # Our own check of the file as transformers loads it.
    loaded = AutoModelForCausalLM.from_pretrained(str(out.parent), gguf_file=out.name, dtype=torch.float32).eval()
    ids = fixed_input(model.config.vocab_size)
    diff = (logits_of(loaded, ids) - logits_of(model, ids)).abs().max().item()
    assert diff <= 1e-5
    print(f"{fam}{'-tied' if tied else ''}: GGUF ({arch}) logits vs HF max diff {diff:.3g}")

    back = tmp_path / "back"
    G.main([str(out), str(back)])
    imported = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32)
    got = imported.state_dict()
    for n, w in model.state_dict().items():
        assert torch.equal(got[n], w), n
    if family is not MISTRAL:
        assert type(imported).__name__ == family.hf_classes[0]
    else:  # written as "llama", read back as Llama: the same weights and logits
        assert type(imported).__name__ == "LlamaForCausalLM"
        assert (logits_of(imported.eval(), ids) - logits_of(model, ids)).abs().max().item() <= 1e-5


@pytest.mark.slow
@pytest.mark.full_matrix  # 60 s (the 151k-token file read back); CI's real-tokenizer GGUF is SmolLM2's
def test_qwen3_with_its_real_tokenizer(qwen3_dir, tmp_path, capsys, one_thread):
    """Qwen3's own tokenizer (151,669 tokens, its pre-tokenizer, chat template and stop token) in the file: the
    exporter's verification encodes a sample the same through the GGUF-built tokenizer; the Modelfile is ChatML."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    src = tmp_path / "qwen3"
    model = tiny_model(QWEN3, vocab_size=151936, tied=True, seed=5)  # Qwen3's vocab_size, tied as in 0.6B
    model.config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.save_pretrained(src)
    tokenizer.save_pretrained(src)
    out = tmp_path / "gguf" / "qwen3.gguf"
    E.main(["--to", "gguf", "--model_name_or_path", str(src), str(out)])
    err = capsys.readouterr().err
    diff = float(re.search(r"transformers-loaded logits vs HF max diff (\S+) ", err).group(1))
    assert diff <= 1e-5
    reader = GGUFReader(str(out))
    pre = bytes(reader.fields["tokenizer.ggml.pre"].parts[-1]).decode()
    assert pre == "qwen2"
    assert "<|im_start|>" in bytes(reader.fields["tokenizer.chat_template"].parts[-1]).decode()
    modelfile = (out.parent / "Modelfile").read_text()
    assert 'PARAMETER stop "<|im_end|>"' in modelfile and "TEMPLATE" in modelfile
    print(f"qwen3 (real tokenizer): GGUF logits vs HF max diff {diff:.3g}")


def test_mistral_chat_template_in_the_file_and_the_modelfile(sentencepiece_model, tmp_path, capsys, one_thread):
    """A tiny Mistral with Mistral-7B-Instruct's 32k SentencePiece tokenizer and [INST] template: the GGUF file holds
    the template and the EOS id; the Modelfile's TEMPLATE, executed by hand, writes what the HF template writes, and
    stops on EOS's turn ends."""
    import re

    from gguf import GGUFReader
    from transformers import AutoTokenizer

    from finetune.convert.writers import gguf as X

    tok = AutoTokenizer.from_pretrained(sentencepiece_model)
    model = tiny_model(MISTRAL, vocab_size=len(tok), seed=3)
    model.config.bos_token_id, model.config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    src = tmp_path / "mistral"
    model.save_pretrained(src)
    tok.save_pretrained(src)
    out = tmp_path / "gguf" / "m.gguf"
    report = X.write_folder(src, out)
    assert report.logit_diff <= 1e-5
    assert "TEMPLATE for the mistral chat format" in capsys.readouterr().err
    meta = {k: f.contents() for k, f in GGUFReader(str(out)).fields.items() if k.startswith("tokenizer.")}
    assert meta["tokenizer.chat_template"] == tok.chat_template and meta["tokenizer.ggml.eos_token_id"] == tok.eos_token_id
    modelfile = (out.parent / "Modelfile").read_text()
    template = re.search(r'TEMPLATE """(.*?)"""', modelfile, re.S).group(1)
    user = re.search(r'if eq .Role "user" }}(.*?){{- else if', template).group(1)
    assistant = re.search(r'else if eq .Role "assistant" }}(.*?){{- end }}', template).group(1)
    msgs = [{"role": "user", "content": "count: a b"}, {"role": "assistant", "content": "2"},
            {"role": "user", "content": "again"}]
    ollama = "".join((user if m["role"] == "user" else assistant).replace("{{ .Content }}", m["content"]) for m in msgs)
    hf_text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert hf_text == tok.bos_token + ollama, (hf_text, ollama)
    assert 'PARAMETER stop "[INST]"' in modelfile and 'PARAMETER stop "[/INST]"' in modelfile
