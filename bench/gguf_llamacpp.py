"""GGUF export per type, checked in llama.cpp itself: size, logit difference, greedy agreement, exact match, time.

    .venv/bin/python bench/gguf_llamacpp.py --model_dir MODEL [--adapter RUN/model] [--examples 80] [--types f32,f16,bf16,q8_0]

Needs llama-cpp-python (`pip install '.[llamacpp]'`). For each type: `finetune export --to gguf` (with its own
verification; the time includes it), the file size, the transformers-loaded logit difference from that export's
report, then llama.cpp (llama-cpp-python) loads the file and decodes greedily (argmax of its logits, no sampler) the
quickstart's held-out prompts (`data/quickstart/heldout.jsonl`, chat template applied by the HF tokenizer, same
prompt ids for both): how many completions equal the HF model's token for token, and the exact match of each
against the reference answers. The HF model decodes with `generate(do_sample=False)`, one prompt at a time.
`--adapter`: a LoRA run (the quickstart's `OUTPUT_DIR/model`) merged into `--model_dir` first.
tests/test_gguf_llamacpp.py uses the same functions.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout, before any installed copy

HELDOUT = REPO / "data" / "quickstart" / "heldout.jsonl"


def heldout(n: int, path: Path = HELDOUT) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()[:n]]


def prompt_ids(tokenizer, record: dict) -> list[int]:
    """The record's conversation without its answer, as the quickstart renders it (chat template, generation prompt)."""
    text = tokenizer.apply_chat_template(record["messages"][:-1], tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def max_new_tokens(tokenizer, records: list[dict]) -> int:
    """The quickstart's budget: the longest reference answer + 8 tokens."""
    return max(len(tokenizer(r["messages"][-1]["content"], add_special_tokens=False)["input_ids"]) for r in records) + 8


def hf_greedy(model, ids: list[int], max_new: int, eos: set[int]) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new, eos_token_id=sorted(eos), pad_token_id=min(eos))
    new = out[0, len(ids):].tolist()
    return new[: next((i + 1 for i, t in enumerate(new) if t in eos), len(new))]


def open_llamacpp(path: Path, n_ctx: int = 1024, threads: int = 2, repack: bool = False):
    import llama_cpp.llama_cpp as low  # the module whose llama_model_default_params Llama() calls
    from llama_cpp import Llama

    # llama-cpp-python 0.3.36's llama.cpp repacks Q8_0 weights for its CPU kernels ("extra buffer types"), and on this
    # AVX-512 machine the first decode of any file with a Q8_0 matmul weight then ends in a segmentation fault; the
    # same file decodes with repacking off (llama-cli: --no-repack). Off unless asked: it only changes the kernel.
    default_params = low.llama_model_default_params

    def params():
        p = default_params()
        p.use_extra_bufts = repack
        return p

    # An f32 KV cache (GGML type 0): llama.cpp's default f16 cache alone moves SmolLM2's logits by 0.05 from the HF
    # model's (f32 file; 1e-4 with the f32 cache), which would hide what the exported weights do.
    low.llama_model_default_params = params
    try:
        return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, logits_all=True,
                     verbose=False, type_k=0, type_v=0)
    finally:
        low.llama_model_default_params = default_params


def llamacpp_greedy(llm, ids: list[int], max_new: int, eos: set[int]) -> list[int]:
    """Greedy decoding in llama.cpp: argmax of its own logits at each step (no sampler in between)."""
    import numpy as np

    llm.reset()
    llm.eval(ids)
    new: list[int] = []
    while len(new) < max_new:
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        new.append(token)
        if token in eos:
            break
        llm.eval([token])
    return new


def llamacpp_logits(llm, ids: list[int]):
    """llama.cpp's logits for every position of ids (n, vocab)."""
    import numpy as np

    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)])


def eos_ids(tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id}
    for token in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>"):
        if token in tokenizer.get_vocab():
            ids.add(tokenizer.convert_tokens_to_ids(token))
    return {i for i in ids if i is not None}


def main(argv: list[str] | None = None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.apps.quickstart import exact_match
    from finetune.convert.writers.gguf import write_folder

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--adapter", help="a LoRA run folder, merged into --model_dir first")
    parser.add_argument("--examples", type=int, default=80)
    parser.add_argument("--types", default="f32,f16,bf16,q8_0")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    work = Path(tempfile.mkdtemp(prefix="bench-gguf-"))
    model_dir = args.model_dir
    if args.adapter:
        from finetune.convert.export import main as export_main

        model_dir = str(work / "merged")
        export_main(["--adapter", args.adapter, "--model_name_or_path", args.model_dir, "--output_dir", model_dir])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    records = heldout(args.examples)
    eos = eos_ids(tokenizer)
    budget = max_new_tokens(tokenizer, records)
    prompts = [prompt_ids(tokenizer, r) for r in records]
    refs = [r["messages"][-1]["content"] for r in records]
    t = time.time()
    hf = [hf_greedy(model, ids, budget, eos) for ids in prompts]
    hf_text = [tokenizer.decode(c, skip_special_tokens=True) for c in hf]
    hf_em = sum(exact_match(c, ref) for c, ref in zip(hf_text, refs)) / len(refs)
    print(f"HF fp32: exact match {hf_em:.1%} on {len(refs)} held-out records ({time.time() - t:.0f} s), "
          f"max_new_tokens {budget}", flush=True)
    rows = []
    for gguf_type in args.types.split(","):
        out = work / gguf_type / "model.gguf"
        t = time.time()
        report = write_folder(model_dir, out, gguf_type=gguf_type)
        seconds = time.time() - t
        llm = open_llamacpp(out, threads=args.threads)
        t = time.time()
        got = [llamacpp_greedy(llm, ids, budget, eos) for ids in prompts]
        text = [tokenizer.decode(c, skip_special_tokens=True) for c in got]
        same = sum(a == b for a, b in zip(got, hf))
        em = sum(exact_match(c, ref) for c, ref in zip(text, refs)) / len(refs)
        ref_logits = model(torch.tensor([prompts[0]])).logits[0].detach().numpy()
        cpp_diff = float(abs(llamacpp_logits(llm, prompts[0]) - ref_logits).max())
        rows.append((gguf_type, report.size_bytes / 2**20, report.logit_diff, cpp_diff, same, em, seconds))
        print(f"{gguf_type}: {rows[-1][1]:.1f} MiB, transformers-loaded logit diff {report.logit_diff:.3g}, llama.cpp "
              f"logit diff {cpp_diff:.3g} (prompt 1), llama.cpp greedy = HF {same}/{len(hf)}, exact match {em:.1%} "
              f"(HF {hf_em:.1%}), export {seconds:.0f} s, llama.cpp decoding {time.time() - t:.0f} s", flush=True)
        del llm
    print("\n| type | file | logit diff (transformers / llama.cpp) | llama.cpp greedy = HF | exact match (HF "
          f"{hf_em:.1%}) | export |\n|---|---|---|---|---|---|")
    for gguf_type, mib, diff, cpp_diff, same, em, seconds in rows:
        print(f"| {gguf_type} | {mib:.1f} MiB | {diff:.3g} / {cpp_diff:.3g} | {same}/{len(hf)} | {em:.1%} | {seconds:.0f} s |")


if __name__ == "__main__":
    main()
