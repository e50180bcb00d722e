"""Attention over packed rows on this machine's CPU: the kernels finetune.models.attention can choose from.

    python bench/attention.py                      # prints a table, writes bench/results/attention_cpu.json
    python bench/attention.py --rows 2 --length 1024 --repeats 5 --threads 1

One layer of SmolLM2-135M's attention shapes (9 query / 3 key-value heads of 64, fp32) on packed rows of records
log-uniform between 19 and --longest tokens (best-fit decreasing, as the packer does), timed as the median of
--repeats after one warm-up:
- "loop": finetune's per-record sdpa (`_run_loop`), the host bounds from the collator;
- "block mask": transformers' sdpa over the rows' block-diagonal mask (what `--attn_implementation sdpa` runs
  without finetune's attention; the mask built once, not timed);
- "flex": FlexAttention with the document mask (`_run_flex`; its BlockMask built once, not timed). Forward only:
  torch has no CPU backward for FlexAttention, so on a CPU it cannot train at all.
Forward + backward for the two that train, forward alone for all three. PREFERENCE["cpu"] in
finetune/models/attention.py is set from these numbers (bench/RESULTS.md, "Attention on packed rows").
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def rows_of_records(rows: int, length: int, longest: int, seed: int) -> list[list[int]]:
    """`rows` rows drawn at random from those at least 90% full that best-fit decreasing makes of 400 records
    log-uniform in [19, longest] (BFD's first rows hold the longest records, its last ones the shortest)."""
    from finetune.data.packing import bfd_pack

    rng = random.Random(seed)
    lens = [int(math.exp(rng.uniform(math.log(19), math.log(longest)))) for _ in range(400)]
    full = [[lens[i] for i in b] for b in bfd_pack(lens, length) if sum(lens[i] for i in b) >= 0.9 * length]
    return rng.sample(full, rows)


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--longest", type=int, nargs="+", default=[1024, 128],
                   help="records log-uniform from 19 tokens to this; one measurement each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "attention_cpu.json"))
    a = p.parse_args(argv)

    import torch

    torch.set_num_threads(a.threads)
    runs = [measure(a, longest) for longest in a.longest]
    result = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "threads": a.threads, "repeats": a.repeats, "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


def measure(a, longest: int) -> dict:
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from finetune.data.packing import PackedCollator
    from finetune.models import attention

    torch.manual_seed(a.seed)
    heads, kv_heads, dim = 9, 3, 64
    rows = rows_of_records(a.rows, a.length, longest, a.seed)
    batch = PackedCollator(0, layout="rows")([{"input_ids": [1] * sum(r), "labels": [1] * sum(r), "seq_lens": r}
                                              for r in rows])
    b, length = batch["input_ids"].shape
    call = attention.Call(batch=b, length=length, heads=heads, kv_heads=kv_heads, head_dim=dim,
                          scaling=dim ** -0.5, window=None,
                          softcap=None, dropout=0.0, dtype=torch.float32, device_type="cpu", grad=True,
                          cu=batch["cu_seq_lens_q"], longest=batch["max_length_q"], bounds=batch["seq_bounds"])
    q = torch.randn(b, heads, length, dim, requires_grad=True)
    k = torch.randn(b, kv_heads, length, dim, requires_grad=True)
    v = torch.randn(b, kv_heads, length, dim, requires_grad=True)
    grad_out = torch.randn(b, length, heads, dim)
    doc = torch.searchsorted(batch["cu_seq_lens_q"][1:], torch.arange(b * length, dtype=torch.int32),
                             right=True).view(b, length)
    i = torch.arange(length)
    mask = ((doc[:, :, None] == doc[:, None, :]) & (i[:, None] >= i[None, :]))[:, None]  # [rows, 1, L, L]
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, heads // kv_heads

    def loop():
        return attention._run_loop(attention.kernel_fn("loop"), q, k, v, call)

    def block_mask():
        return sdpa_attention_forward(module, q, k, v, mask, scaling=call.scaling)[0]

    def flex():  # inputs that need no gradient: FlexAttention refuses any other on a CPU
        return attention._run_flex(attention.kernel_fn("flex"), q.detach(), k.detach(), v.detach(), call)

    torch.testing.assert_close(loop(), block_mask(), rtol=0, atol=1e-5)
    torch.testing.assert_close(flex(), loop().detach(), rtol=0, atol=1e-5)

    def train(fn):
        def step():
            q.grad = k.grad = v.grad = None
            fn().backward(grad_out)
        return step

    def forward(fn):
        def step():
            with torch.no_grad():
                fn()
        return step

    ms = {}
    for name, fn in (("loop", loop), ("block mask", block_mask), ("flex", flex)):
        ms[name] = {"forward": 1e3 * timed(forward(fn), a.repeats)}
        if name != "flex":
            ms[name]["forward+backward"] = 1e3 * timed(train(fn), a.repeats)
    result = {"longest_record": longest, "rows": b, "length": length, "records": sum(len(r) for r in rows),
              "record_lengths": rows, "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "ms": ms}
    print(f"{b} rows of {length} positions, {result['records']} records of 19-{longest} tokens; "
          f"{heads}/{kv_heads} heads of {dim}; {a.threads} thread(s); median of {a.repeats}")
    print(f"{'kernel':<12}{'forward ms':>12}{'fwd+bwd ms':>12}")
    for name, t in ms.items():
        print(f"{name:<12}{t['forward']:>12.1f}{t.get('forward+backward', float('nan')):>12.1f}")
    return result




if __name__ == "__main__":
    main()
