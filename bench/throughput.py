"""Training throughput: this project (padded, packed, padding-free) against TRL's SFTTrainer and a bare loop.

    .venv/bin/python bench/throughput.py                # CPU preset (~10M Llama, seq 256); writes "## Throughput"
    .venv/bin/python bench/throughput.py --gpu          # CUDA, bf16, ~0.6B Llama at seq 2048, reports MFU
    .venv/bin/python bench/throughput.py --no-write     # print only

One invocation runs every configuration on the same model, data, sequence length, per-device batch and step
count, each in a forked child (modules imported once, peak memory per configuration):

- ft_padded / ft_packed / ft_padding_free: finetune/train.py's pipeline (config.parse -> prepare_dataset ->
  load_model -> finetune.training.trainer.Trainer with data.make_collator), flags as a user types them;
- trl_default / trl_packing: TRL's SFTTrainer with its defaults (gradient checkpointing on, as TRL defaults),
  and with `packing=True` (its BFD packing, padding-free); *_nogc: the same with gradient checkpointing off;
- bare: a plain PyTorch loop over the ft_packed batches: forward, backward, clip, AdamW (the Trainer's optimizer).
  The floor for ft_packed's step time.

Data: the bundled data/demo.jsonl and a deterministic mixed-length chat set (record lengths over >= 20x).
Throughput counts real (non-padding) tokens: every configuration sees the same records, but TRL by default
trains on every token and the project on assistant tokens only, so "trained" labels differ while the forward and
backward work per real token does not. Step time: median over the timed steps (the first steps are warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PRESETS = {
    # ~10M parameters, 2 x 512 tokens a step: ~2 s steps on 2 shared CPU cores, the grid in a few minutes.
    "cpu": dict(hidden=384, layers=6, heads=6, kv_heads=3, intermediate=1024, vocab=None, seq=512, batch=2,
                warmup=2, timed=4, dtype="float32", threads=1),
    # For tests of this script only.
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=None, seq=128, batch=2,
                 warmup=1, timed=2, dtype="float32"),
    # ~0.6B parameters (vocabulary 32000), sequence length 2048.
    "gpu": dict(hidden=1536, layers=16, heads=16, kv_heads=8, intermediate=4096, vocab=32000, seq=2048, batch=8,
                warmup=3, timed=10, dtype="bfloat16"),
}
CONFIGS = ["ft_padded", "ft_packed", "ft_padding_free", "trl_default", "trl_packing", "trl_default_nogc",
           "trl_packing_nogc", "bare"]
# Dense bf16 peak FLOP/s by device name (no sparsity).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12,
             "A10G": 70e12, "RTX 4090": 165e12}
MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm", "aten::_addmm_activation")
ATTENTION = ("scaled_dot_product", "flash", "attention", "aten::_softmax", "aten::softmax")
OPTIMIZER = ("adam", "_foreach", "optimizer")


# ----------------------------------------------------------------------------------------------
# Data and model.


def mixed_records(n: int, max_tokens: int, seed: int = 0) -> list[dict]:
    """Chat records whose token lengths are log-uniform over [19, max_tokens] (a 20x+ spread at 512)."""
    from finetune.models.tiny import WORDS

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        # The template costs ~18 tokens (an empty system turn keeps the ChatML default system prompt out), then
        # ~2.4 tokens per word (the words appear in the user turn and again in the answer).
        target = 19 * (max_tokens / 19) ** rng.random()
        words = [rng.choice(WORDS) for _ in range(max(1, int((target - 18) / 2.4)))]
        task = rng.choice(["copy", "reverse"])
        answer = " ".join(words if task == "copy" else words[::-1])
        out.append({"messages": [{"role": "system", "content": ""},
                                 {"role": "user", "content": f"{task}: {' '.join(words)}"},
                                 {"role": "assistant", "content": answer}]})
    return out


def build_assets(work: Path, preset: dict) -> tuple[Path, dict[str, Path]]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.models import tiny

    model_dir = work / "model"
    tok = tiny.build_tokenizer(model_dir, style="chatml")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=preset["vocab"] or len(tok), hidden_size=preset["hidden"], intermediate_size=preset["intermediate"],
        num_hidden_layers=preset["layers"], num_attention_heads=preset["heads"], num_key_value_heads=preset["kv_heads"],
        max_position_embeddings=max(4096, preset["seq"]), tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(model_dir)
    data = {"demo": REPO / "data" / "demo.jsonl",
            "mixed": tiny.write_jsonl(work / "mixed.jsonl", mixed_records(600, preset["seq"], seed=0))}
    return model_dir, data


# ----------------------------------------------------------------------------------------------
# One configuration (runs in a forked child).


class Counting:
    """Wraps a collator: per batch, real tokens (sum of the features' lengths), slots (tensor positions computed)
    and the sum over records of length^2 (for attention FLOPs)."""

    def __init__(self, inner):
        self.inner, self.batches = inner, []

    def __call__(self, features):
        features = list(features)
        batch = self.inner(features)
        real = sum(len(f["input_ids"]) for f in features)
        seq = [n for f in features for n in (f.get("seq_lens") or f.get("seq_lengths") or [len(f["input_ids"])])]
        self.batches.append({"real": real, "slots": int(batch["input_ids"].numel()), "sq": sum(n * n for n in seq)})
        return batch


def step_timer():
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_train_begin(self, args, state, control, **kw):
            self.ends.append(_now())

        def on_step_end(self, args, state, control, **kw):
            _sync()
            self.ends.append(_now())

    return Timer()


def _now() -> tuple[float, float]:
    """(wall, this process's CPU time): on a shared CPU the CPU time of a one-thread run is the work done, while
    wall time also counts the time other users' processes held the cores."""
    return time.perf_counter(), time.process_time()


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ft_args(name: str, model_dir: Path, data: Path, work: Path, p: dict, steps: int, gpu: bool) -> list[str]:
    argv = ["--model_name_or_path", str(model_dir), "--dataset", str(data), "--output_dir", str(work / "out" / name),
            "--dataset_cache_dir", str(work / "cache"), "--max_seq_length", str(p["seq"]),
            "--per_device_train_batch_size", str(p["batch"]), "--max_steps", str(steps), "--learning_rate", "1e-4",
            "--seed", "0", "--disable_tqdm", "true", "--logging_steps", "1000", "--torch_dtype", p["dtype"],
            "--attn_implementation", p["attn"]]
    if gpu:
        argv += ["--bf16", "true"]
    if name in ("ft_packed", "bare", "profile"):
        argv.append("--packing")
    if name == "ft_padding_free":
        argv.append("--padding_free")
    return argv


def run_config(name: str, dataset: str, model_dir: Path, data: Path, work: Path, p: dict, gpu: bool) -> dict:
    import torch

    from finetune import config as C
    from finetune.data.prepare import make_collator, prepare_dataset
    from finetune.models.load import load_model, load_tokenizer

    torch.manual_seed(0)
    if not gpu:
        torch.set_num_threads(p.get("threads", 1))
    steps = p["warmup"] + p["timed"]
    cfg = C.parse(ft_args(name, model_dir, data, work, p, steps + (1 if name == "ft_packed" else 0), gpu))
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model, cfg.training)
    if gpu:
        model.to("cuda")
        torch.cuda.reset_peak_memory_stats()
    result: dict = {"config": name, "dataset": dataset}
    profile = None

    if name.startswith("ft_"):
        from finetune.training.trainer import Trainer

        dataset_obj, stats = prepare_dataset(cfg.data, tokenizer, log=lambda *a: None)
        counting = Counting(make_collator(cfg, tokenizer))
        timer = step_timer()
        callbacks = [timer]
        if name == "ft_packed":
            profile = {}
            callbacks.append(profile_callback(steps, profile))
        trainer = Trainer(model=model, args=cfg.training, train_dataset=dataset_obj, data_collator=counting,
                          processing_class=tokenizer, callbacks=callbacks)
        trainer.train()
        ends = timer.ends[: steps + 1]
        if stats.packed_rows:
            result["packing_efficiency"] = stats.packing_efficiency
    elif name.startswith("trl_"):
        import datasets
        from trl import SFTConfig, SFTTrainer

        records = [json.loads(line) for line in Path(data).read_text().splitlines() if line.strip()]
        kwargs = dict(output_dir=str(work / "out" / name), max_steps=steps, per_device_train_batch_size=p["batch"],
                      max_length=p["seq"], packing="packing" in name, report_to="none", save_strategy="no", seed=0,
                      disable_tqdm=True)
        if not gpu:
            kwargs.update(use_cpu=True, bf16=False)  # fp32 on CPU, like the project's runs
        if name.endswith("_nogc"):
            kwargs["gradient_checkpointing"] = False
        trainer = SFTTrainer(model=model, args=SFTConfig(**kwargs),
                             train_dataset=datasets.Dataset.from_list(records), processing_class=tokenizer)
        result["gradient_checkpointing"] = trainer.args.gradient_checkpointing
        counting = Counting(trainer.data_collator)
        trainer.data_collator = counting
        timer = step_timer()
        trainer.add_callback(timer)
        trainer.train()
        ends = timer.ends[: steps + 1]
    else:  # bare: the ft_packed batches through forward, backward, clip, AdamW
        from transformers import Trainer as HFTrainer

        from finetune.data.sampler import distributed_dataloader

        dataset_obj, stats = prepare_dataset(cfg.data, tokenizer, log=lambda *a: None)
        counting = Counting(make_collator(cfg, tokenizer))
        args = cfg.training
        loader = distributed_dataloader(dataset_obj, counting, world=1, batch_size=p["batch"], shuffle=True, seed=0)
        opt_cls, opt_kwargs = HFTrainer.get_optimizer_cls_and_kwargs(args, model)
        optimizer = opt_cls([q for q in model.parameters() if q.requires_grad], **opt_kwargs)
        device = next(model.parameters()).device
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if gpu else _null()
        model.train()
        ends = [_now()]
        batches = iter(loader)
        for _ in range(steps):
            batch = {k: v.to(device) for k, v in next(batches).items()}
            with autocast:
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _sync()
            ends.append(_now())

    wall = [b[0] - a[0] for a, b in zip(ends[p["warmup"] : -1], ends[p["warmup"] + 1 :])]
    cpu = [b[1] - a[1] for a, b in zip(ends[p["warmup"] : -1], ends[p["warmup"] + 1 :])]
    # GPU: wall time. CPU: CPU time of the (one-thread) process, see _now().
    timed = wall if gpu else cpu
    batches = counting.batches[p["warmup"] : steps]
    real, slots, sq = (sum(b[k] for b in batches) for k in ("real", "slots", "sq"))
    seconds = sum(timed)
    result.update(
        step_s=statistics.median(timed), timed_s=seconds, steps=len(timed), real_tokens=real, slots=slots,
        wall_step_s=statistics.median(wall), wall_tokens_per_s=real / sum(wall), clock="wall" if gpu else "cpu",
        tokens_per_s=real / seconds, efficiency=real / max(slots, 1), flops=model_flops(model, real, sq) / seconds,
        peak_mb=(torch.cuda.max_memory_allocated() / 2**20 if gpu
                 else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        peak_kind="CUDA max allocated" if gpu else "peak RSS",
    )
    if profile:
        result["profile"] = profile
    return result


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def model_flops(model, real_tokens: int, sum_sq: int) -> float:
    """Model FLOPs (not hardware FLOPs: padding and recomputation do not count): 6 x non-embedding parameters per
    token, plus causal attention 6 x layers x hidden x length^2 per record (QK^T and AV, half masked, x3 for backward)."""
    cfg = model.config
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    return 6 * params * real_tokens + 6 * cfg.num_hidden_layers * cfg.hidden_size * sum_sq


def profile_callback(at_step: int, out: dict):
    """Profile the step after the timed ones (so profiling does not distort the timing)."""
    import torch
    from transformers import TrainerCallback

    class Prof(TrainerCallback):
        prof = None

        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == at_step:
                acts = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                self.prof = torch.profiler.profile(activities=acts)
                self.prof.__enter__()

        def on_step_end(self, args, state, control, **kw):
            if self.prof is not None:
                _sync()
                self.prof.__exit__(None, None, None)
                out.update(summarize_profile(self.prof))
                self.prof = None

    return Prof()


def op_group(name: str) -> str:
    low = name.lower()
    if any(low.startswith(m) for m in MATMUL):
        return "matmul"
    if any(k in low for k in ATTENTION):
        return "attention"
    if any(k in low for k in OPTIMIZER):
        return "optimizer"
    return "other"


def summarize_profile(prof) -> dict:
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0 or getattr(e, "self_device_time_total", 0) > 0]
    total = sum(e.self_cpu_time_total for e in events)
    groups: dict[str, float] = {}
    for e in events:
        groups[op_group(e.key)] = groups.get(op_group(e.key), 0.0) + e.self_cpu_time_total
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
    return {
        "total_self_cpu_ms": total / 1000,
        "groups_ms": {k: v / 1000 for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        "top": [{"op": e.key, "group": op_group(e.key), "self_cpu_ms": e.self_cpu_time_total / 1000,
                 "self_device_ms": getattr(e, "self_device_time_total", 0) / 1000, "calls": e.count} for e in top],
    }


def _child(conn, *args):
    try:
        conn.send(("ok", run_config(*args)))
    except BaseException as e:  # report, so the grid goes on
        import traceback

        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))
    conn.close()


# ----------------------------------------------------------------------------------------------
# The grid and the report.


def machine(gpu: bool) -> dict:
    import torch
    import transformers
    import trl

    info = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
            "python": platform.python_version()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info["device"] = "cpu"
    return info


def device_info() -> dict:
    """Queried in a child: CUDA must not be initialized in the parent before it forks."""
    import torch

    if not torch.cuda.is_available():
        return {"device": "cpu", "peak": None}
    name = torch.cuda.get_device_name(0)
    peak = next((v for k, v in PEAK_BF16.items() if k.lower() in name.lower()), None)
    return {"device": name, "peak": peak}


def _device_child(conn):
    conn.send(device_info())
    conn.close()


def fork_run(target, *args):
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(child, *args))
    proc.start()
    child.close()
    out = parent.recv() if parent.poll(None) else None
    proc.join()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true", help="CUDA preset: bf16, ~0.6B Llama, seq 2048, MFU")
    ap.add_argument("--preset", choices=list(PRESETS), help="model/sequence preset (default: cpu, or gpu with --gpu)")
    ap.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    ap.add_argument("--datasets", nargs="+", default=["demo", "mixed"], choices=["demo", "mixed"])
    ap.add_argument("--work", default=str(REPO / "tmp" / "bench-throughput"))
    ap.add_argument("--no-write", action="store_true", help="do not rewrite bench/RESULTS.md")
    args = ap.parse_args(argv)

    # Import everything once; children are forked with the modules loaded (no per-run start-up cost).
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import trl  # noqa: F401

    import finetune.training.trainer  # noqa: F401

    p = dict(PRESETS[args.preset or ("gpu" if args.gpu else "cpu")])
    if args.gpu:
        try:
            import flash_attn  # noqa: F401

            p["attn"] = "flash_attention_2"
        except ImportError:
            p["attn"] = "sdpa"
    else:
        p["attn"] = "sdpa"
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    start = time.time()
    model_dir, data = build_assets(work, p)
    dev = fork_run(_device_child)
    info = machine(args.gpu)
    info.update(device=dev["device"])
    nparams = _count_params(model_dir)
    print(f"model: {nparams:,} parameters; seq {p['seq']}; batch {p['batch']}; steps {p['warmup']} warm-up + "
          f"{p['timed']} timed; attention {p['attn']}; dtype {p['dtype']}; device {dev['device']}", flush=True)
    results = []
    for ds in args.datasets:
        for name in args.configs:
            t0 = time.time()
            status, payload = fork_run(_child, name, ds, model_dir, data[ds], work, p, args.gpu)
            if status != "ok":
                print(f"{ds:6s} {name:18s} FAILED: {payload}", flush=True)
                results.append({"config": name, "dataset": ds, "error": payload.splitlines()[0]})
                continue
            results.append(payload)
            print(f"{ds:6s} {name:18s} {payload['tokens_per_s']:9.0f} tok/s  step {payload['step_s']:.3f}s  "
                  f"eff {100 * payload['efficiency']:.1f}%  peak {payload['peak_mb']:.0f} MB  ({time.time() - t0:.0f}s)",
                  flush=True)
    load_after = os.getloadavg()
    report = render(results, p, info, dev, nparams, load_before, load_after, time.time() - start, args, sys.argv)
    print(report)
    (work / "results.json").write_text(json.dumps(results, indent=2))
    if not args.no_write:
        write_results(report)


def _count_params(model_dir: Path) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    with __import__("torch").device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters())


def render(results, p, info, dev, nparams, load_before, load_after, wall, args, argv) -> str:
    by = {(r["dataset"], r["config"]): r for r in results if "error" not in r}
    lines = ["## Throughput", ""]
    cmd = " ".join([".venv/bin/python", "bench/throughput.py", *argv[1:]])
    lines += [
        "Written by `bench/throughput.py` (one invocation, all rows; see its docstring for what each row runs).", "",
        f"**Command**: `{cmd}`  ", 
        f"**Machine**: {info['cpu']}, {info['cores']} cores, device {dev['device']}; torch {info['torch']}, "
        f"transformers {info['transformers']}, TRL {info['trl']}, Python {info['python']}.  ",
        f"**Load average** (1/5/15 min) before {'/'.join(f'{x:.2f}' for x in load_before)}, after "
        f"{'/'.join(f'{x:.2f}' for x in load_after)}: the cores are shared, so absolute numbers are noisy; "
        "ratios within one run are the result.  ",
        f"**Model**: random Llama, {nparams:,} parameters (hidden {p['hidden']}, {p['layers']} layers, "
        f"{p['heads']}/{p['kv_heads']} heads, intermediate {p['intermediate']}), {p['dtype']}, attention {p['attn']}.  ",
        f"**Run**: max_seq_length {p['seq']}, per-device batch {p['batch']} (records, or packed rows), one process, "
        f"{p['warmup']} warm-up + {p['timed']} timed steps"
        + (f", {p.get('threads', 1)} torch thread(s)" if dev["device"] == "cpu" else "")
        + f"; total wall time {wall:.0f} s.  ",
        "**Columns**: tokens/s = real (non-padding) tokens per second over the timed steps; efficiency = real tokens / "
        "tensor positions computed; step = median step time. "
        + ("Times are wall-clock (CUDA synchronized). " if dev.get("peak") or dev["device"] != "cpu" else
           "On CPU every configuration runs on ONE thread and times are the process's CPU time (the work done: "
           "wall time on these shared cores mostly measured other users' load; it is kept in the `wall tok/s` "
           "column for reference). ")
        + "peak = peak RSS of the configuration's process (CPU) "
        "or CUDA max allocated (GPU); ratios = tokens/s over TRL's (defaults: gradient checkpointing on; nogc: off).",
        "",
    ]
    peak = dev.get("peak")
    head = "| data | config | tokens/s | vs TRL default | vs TRL packing | vs TRL default nogc | vs TRL packing nogc | efficiency | step s | vs bare | wall tok/s | peak MB |"
    if peak:
        head += " MFU |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        ds, name = r["dataset"], r["config"]
        if "error" in r:
            lines.append(f"| {ds} | {name} | failed: {r['error'][:80]} |")
            continue

        def ratio(other):
            o = by.get((ds, other))
            return f"{r['tokens_per_s'] / o['tokens_per_s']:.2f}x" if o else "-"

        bare = by.get((ds, "bare"))
        vs_bare = f"{r['step_s'] / bare['step_s']:.2f}x" if bare and name in ("ft_packed", "bare") else ""
        row = (f"| {ds} | {name} | {r['tokens_per_s']:,.0f} | {ratio('trl_default')} | {ratio('trl_packing')} | "
               f"{ratio('trl_default_nogc')} | {ratio('trl_packing_nogc')} | {100 * r['efficiency']:.1f}% | "
               f"{r['step_s']:.3f} | {vs_bare} | {r['wall_tokens_per_s']:,.0f} | {r['peak_mb']:,.0f} |")
        if peak:
            row += f" {100 * r['flops'] / peak:.1f}% |"
        lines.append(row)
    packed = [r for r in results if r.get("packing_efficiency")]
    if packed:
        lines += ["", "Packing efficiency (real tokens / (rows x max_seq_length), whole data set, logged at start): "
                  + ", ".join(f"{r['dataset']} {100 * r['packing_efficiency']:.1f}%" for r in packed) + "."]
    prof = next((r["profile"] for r in results if r.get("profile") and r["dataset"] == "mixed"), None) or \
        next((r["profile"] for r in results if r.get("profile")), None)
    if prof:
        ds = next(r["dataset"] for r in results if r.get("profile") is prof)
        lines += ["", f"### Profile: one ft_packed step ({ds}), torch.profiler, self CPU time", "",
                  "| group | self CPU ms | share |", "|---|---|---|"]
        total = prof["total_self_cpu_ms"]
        for g, ms in prof["groups_ms"].items():
            lines.append(f"| {g} | {ms:.1f} | {100 * ms / total:.1f}% |")
        lines += ["", "| op | group | calls | self CPU ms |" + (" self device ms |" if peak else ""),
                  "|---|---|---|---|" + ("---|" if peak else "")]
        for t in prof["top"]:
            lines.append(f"| `{t['op']}` | {t['group']} | {t['calls']} | {t['self_cpu_ms']:.1f} |"
                         + (f" {t['self_device_ms']:.1f} |" if peak else ""))
    return "\n".join(lines) + "\n"


def write_results(section: str, path: Path = REPO / "bench" / "RESULTS.md") -> None:
    """Replace (or append) the "## Throughput" section of bench/RESULTS.md; other sections stay as they are."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start = text.find("## Throughput")
    if start >= 0:
        end = text.find("\n## ", start + 1)
        text = text[:start] + section + (text[end + 1 :] if end >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


if __name__ == "__main__":
    main()
