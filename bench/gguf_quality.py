"""GGUF quality per type: file size, held-out perplexity relative to f16, exact match, tokens/s; results to a file.

    .venv/bin/python bench/gguf_quality.py --model_name_or_path outputs/quickstart/model \\
        [--base SmolLM2-folder] [--types f16,q8_0,q5_1,q5_0,q4_1,q4_0,q6_K,q5_K_M,q4_K_M] [--examples 80] \\
        [--out bench/gguf_quality.json]

The model: a full HF folder, or a quickstart run's LoRA adapter (`OUTPUT_DIR/model`, merged into --base first:
`finetune export --adapter`). Each type is written by `finetune export --to gguf` (its own verification included; the
K-quant presets q4_K_M, q5_K_M, q6_K by llama.cpp's quantizer, which needs llama-cpp-python) and measured on the
quickstart's held-out records (data/quickstart/heldout.jsonl):

- perplexity of the reference answers (the tokens after the generation prompt, end-of-turn included; teacher
  forcing), in transformers (the GGUF file loaded by `from_pretrained(gguf_file=...)`, which dequantizes every
  weight to fp32 and computes in fp32: the weights' rounding alone) and, where llama-cpp-python is installed, in
  llama.cpp (its own kernels: activations rounded too);
  `--no-transformers_ppl` leaves the transformers column out (minutes per type on 2 loaded cores);
- exact match of greedy completions (the quickstart's scorer and budget; `--exact_match N` records, in llama.cpp
  where it is installed, else in transformers);
- llama.cpp's generation speed, where it is installed: `--speed_runs` runs (default 5) each decoding `--speed_tokens`
  tokens (default 128) greedily after the first held-out prompt, without stopping at end of turn, `--threads`
  threads; the decoding alone is timed (the prompt evaluated first), median and min-max of the runs' tokens/s.

`--no-verify` writes each file with the exporter's writer alone (`write_gguf`: the same bytes `finetune export`
writes, without its read-back check, which tests/test_gguf_export.py, test_gguf_quant.py and test_gguf_llamacpp.py
cover): for a loaded machine. `--hf_exact_match 0` skips the HF fp32 model's own greedy decoding (transformers'
generate, minutes for 80 records on 2 cores).

The HF fp32 model is measured the same way as the first row. The results are written to --out (JSON) and printed as
the Markdown table of docs/export.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout, before any installed copy
sys.path.insert(0, str(REPO / "bench"))

import gguf_llamacpp as B  # noqa: E402


def answer_ids(tokenizer, record: dict) -> tuple[list[int], int]:
    """(the whole conversation's ids, where the answer starts): the prompt as the quickstart renders it, then the
    reference answer with its end-of-turn, as the chat template writes the full conversation."""
    prompt = B.prompt_ids(tokenizer, record)
    full = tokenizer(tokenizer.apply_chat_template(record["messages"], tokenize=False), add_special_tokens=False)["input_ids"]
    if full[: len(prompt)] != prompt:
        raise SystemExit("the chat template renders the prompt differently inside the full conversation")
    return full, len(prompt)


def nll(logits, ids: list[int], start: int) -> tuple[float, int]:
    """(summed negative log-likelihood of ids[start:], their number) from next-token logits (n, vocab), numpy."""
    import numpy as np

    x = np.asarray(logits[start - 1: len(ids) - 1], dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    targets = np.asarray(ids[start:])
    return float(-logp[np.arange(len(targets)), targets].sum()), len(targets)


def hf_perplexity(model, conversations) -> float:
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for ids, start in conversations:
            s, n = nll(model(torch.tensor([ids])).logits[0].float().numpy(), ids, start)
            total, count = total + s, count + n
    return math.exp(total / count) if count else None  # --examples 0: exact match only


def llamacpp_pass(llm, conversations, n_ppl: int, n_em: int, budget: int, eos: set[int]) -> tuple[float, list, float]:
    """(answer perplexity over the first N_PPL conversations, greedy completions of the first N_EM, seconds of the
    decoding): one evaluation of each whole conversation serves both, as the prompt's logits and KV cache are the
    same in it (llama.cpp evaluates causally); the completion then continues from the prompt (n_tokens set back to
    it: Llama.eval drops the cache past n_tokens first)."""
    import numpy as np

    total, count, completions, decoding = 0.0, 0, [], 0.0
    for i, (ids, start) in enumerate(conversations[: max(n_ppl, n_em)]):
        llm.reset()
        llm.eval(ids)
        if i < n_ppl:
            s, n = nll(np.array(llm.scores[: len(ids)]), ids, start)
            total, count = total + s, count + n
        if i < n_em:
            t = time.perf_counter()
            llm.n_tokens = start
            new: list[int] = []
            while len(new) < budget:
                token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                new.append(token)
                if token in eos:
                    break
                llm.eval([token])
            completions.append(new)
            decoding += time.perf_counter() - t
    return (math.exp(total / count) if count else None), completions, decoding


def llamacpp_speed(llm, ids: list[int], tokens: int, runs: int) -> list[float]:
    """tokens/s of llama.cpp's greedy decoding of TOKENS tokens after IDS (evaluated first, not timed), per run."""
    import numpy as np

    speeds = []
    for _ in range(runs):
        llm.reset()
        llm.eval(ids)
        start = time.perf_counter()
        for _ in range(tokens):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        speeds.append(tokens / (time.perf_counter() - start))
    return speeds


def save(args, argv, rows: list[dict], has_llamacpp: bool) -> None:
    """Each row's perplexities relative to the f16 row's, and the results file."""
    f16 = next((r for r in rows if r["type"] == "f16"), None)
    for r in rows:
        for key in ("ppl_transformers", "ppl_llamacpp"):
            if f16 and r.get(key) and f16.get(key):
                r[key + "_vs_f16"] = r[key] / f16[key] - 1
    result = dict(model=args.model_name_or_path, base=args.base, examples=args.examples,
                  exact_match_examples=args.exact_match, threads=args.threads, llamacpp=has_llamacpp, verify=args.verify,
                  command="bench/gguf_quality.py " + " ".join(sys.argv[1:] if argv is None else argv), rows=rows)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.apps.quickstart import exact_match
    from finetune.convert.writers.gguf import tensor_types, write_folder, write_unverified

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_name_or_path", required=True, help="an HF model folder, or a LoRA adapter folder")
    parser.add_argument("--base", help="the adapter's base model folder (default: its adapter_config.json's)")
    parser.add_argument("--types", default="f16,q8_0,q5_1,q5_0,q4_1,q4_0,q6_K,q5_K_M,q4_K_M")
    parser.add_argument("--examples", type=int, default=80, help="held-out records for perplexity")
    parser.add_argument("--exact_match", type=int, default=80, help="held-out records decoded for exact match")
    parser.add_argument("--hf_exact_match", type=int, default=None,
                        help="held-out records the HF fp32 model decodes (default: --exact_match)")
    parser.add_argument("--transformers_ppl", action=argparse.BooleanOptionalAction, default=True,
                        help="also the perplexity in transformers (the HF model, and each file as transformers loads it)")
    parser.add_argument("--speed_runs", type=int, default=5, help="llama.cpp timing runs per type")
    parser.add_argument("--speed_tokens", type=int, default=128, help="tokens decoded per timing run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "bench" / "gguf_quality.json"))
    parser.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                        help="write each file through finetune export's verified path (default) or write_gguf alone")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    has_llamacpp = importlib.util.find_spec("llama_cpp") is not None

    work = Path(tempfile.mkdtemp(prefix="bench-gguf-quality-"))
    model_dir = args.model_name_or_path
    if (Path(model_dir) / "adapter_config.json").is_file():
        from finetune.convert.export import main as export_main

        merged = str(work / "merged")
        export_main(["--adapter", model_dir, "--output_dir", merged]
                    + (["--model_name_or_path", args.base] if args.base else []))
        model_dir = merged
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    records = B.heldout(max(args.examples, args.exact_match))
    all_conversations = [answer_ids(tokenizer, r) for r in records]
    conversations = all_conversations[: args.examples]
    em_records = records[: args.exact_match]
    prompts = [B.prompt_ids(tokenizer, r) for r in em_records]
    refs = [r["messages"][-1]["content"] for r in em_records]
    eos = B.eos_ids(tokenizer)
    budget = B.max_new_tokens(tokenizer, em_records) if em_records else 0

    def score(completions) -> float:
        texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        return sum(exact_match(t, r) for t, r in zip(texts, refs)) / max(len(refs), 1)

    rows = []
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf_n = args.exact_match if args.hf_exact_match is None else min(args.hf_exact_match, args.exact_match)
    if args.transformers_ppl or hf_n:  # the HF fp32 model's own row
        t = time.time()
        hf_ppl = hf_perplexity(model, conversations) if args.transformers_ppl else None
        hf_em = (sum(exact_match(tokenizer.decode(B.hf_greedy(model, ids, budget, eos), skip_special_tokens=True), ref)
                     for ids, ref in zip(prompts[:hf_n], refs)) / hf_n) if hf_n else None
        rows.append(dict(type="HF fp32", size_mib=None, ppl_transformers=hf_ppl, exact_match=hf_em, exact_match_n=hf_n,
                         exact_match_in="transformers", seconds=time.time() - t))
        print(json.dumps(rows[-1]), flush=True)
        save(args, argv, rows, has_llamacpp)
    for gguf_type in args.types.split(","):
        out = work / gguf_type / "model.gguf"
        t = time.time()
        if args.verify:
            report = write_folder(model_dir, out, gguf_type=gguf_type, modelfile=False)
            row = dict(type=gguf_type, size_mib=report.size_bytes / 2**20, tensors=report.types,
                       logit_diff=report.logit_diff)
        else:
            out.parent.mkdir(parents=True)
            tensors, _ = write_unverified(model, Path(model_dir), out, gguf_type, "model")
            row = dict(type=gguf_type, size_mib=out.stat().st_size / 2**20, tensors=tensor_types(tensors))
        row["export_seconds"] = time.time() - t
        loaded = None
        if args.transformers_ppl or not has_llamacpp:
            loaded = AutoModelForCausalLM.from_pretrained(str(out.parent), gguf_file=out.name,
                                                          dtype=torch.float32).eval()
        row["ppl_transformers"] = hf_perplexity(loaded, conversations) if args.transformers_ppl else None
        if has_llamacpp:
            llm = B.open_llamacpp(out, n_ctx=2048, threads=args.threads)
            t = time.time()
            row["ppl_llamacpp"], completions, decoding = llamacpp_pass(
                llm, all_conversations, args.examples, args.exact_match, budget, eos)
            row["llamacpp_seconds"], row["exact_match_decoding_seconds"] = time.time() - t, decoding
            if args.speed_runs and prompts:
                speeds = llamacpp_speed(llm, prompts[0], args.speed_tokens, args.speed_runs)
                row["tokens_per_s_runs"] = speeds
                row["tokens_per_s_llamacpp"] = statistics.median(speeds)
            row["exact_match_in"] = "llama.cpp"
            del llm
        else:
            completions = [B.hf_greedy(loaded, ids, budget, eos) for ids in prompts]
            row["exact_match_in"] = "transformers"
        row["exact_match"] = score(completions) if prompts else None
        row["exact_match_n"] = len(prompts)
        del loaded
        out.unlink()
        rows.append(row)
        print(json.dumps(row), flush=True)
        save(args, argv, rows, has_llamacpp)  # after each type: a run cut short keeps what it measured
    save(args, argv, rows, has_llamacpp)

    def pct(x):
        return "" if x is None else f"{x:+.2%}"

    print("\n| type | file | perplexity (transformers) | vs f16 | perplexity (llama.cpp) | vs f16 | exact match | "
          "tokens/s (llama.cpp): median (min-max) |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        size = f"{r['size_mib']:.1f} MiB" if r.get("size_mib") else "-"
        em = "-" if r.get("exact_match") is None else \
            f"{round(r['exact_match'] * r['exact_match_n'])}/{r['exact_match_n']} ({r['exact_match_in']})"
        cpp = f"{r['ppl_llamacpp']:.4f}" if "ppl_llamacpp" in r else "-"
        tps = (f"{r['tokens_per_s_llamacpp']:.1f} ({min(r['tokens_per_s_runs']):.1f}-{max(r['tokens_per_s_runs']):.1f})"
               if r.get("tokens_per_s_llamacpp") else "-")
        ppl = "-" if r["ppl_transformers"] is None else f"{r['ppl_transformers']:.4f}"
        print(f"| {r['type']} | {size} | {ppl} | {pct(r.get('ppl_transformers_vs_f16'))} | {cpp} | "
              f"{pct(r.get('ppl_llamacpp_vs_f16'))} | {em} | {tps} |")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
