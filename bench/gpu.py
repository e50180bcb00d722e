"""One GPU, one run (at most ~8.5 minutes): activation memory at one long record, throughput against TRL, bf16
correctness, padding-free on GPU kernels, and the memory planner's DPO and chunked-loss cells, each section guarded so
that one failing still lets the others report.

    bash bench/gpu_run.sh                                   # on the GPU machine: wheels, versions, then the line below
    python3 bench/gpu.py --write "$OUT"                     # the run; writes $OUT/gpu.json, $OUT/gpu.md, $OUT/logs/
    .venv/bin/python bench/gpu.py --cpu-smoke               # every section end to end on CPU with tiny shapes (~2 min)
    .venv/bin/python bench/gpu.py --record gpu.json         # later: put that run's section into bench/RESULTS.md

Sections, in the order they run (--sections picks some; a GPU run's default: long, then rows):

0. long (docs/long-context.md): one record of long_seq tokens (32,768 on a GPU; --long-seq) on the rows' 1B shape,
   bf16 weights, full fine-tuning, --gradient_checkpointing, long_steps steps in each of LONG_MODES: plain,
   --offload_activations, --tiled_mlp, both. Each mode is a forked child running bench/memory.py's worker (config.parse
   -> load_model -> install_loss / install_tiling -> the HF Trainer, which enables the checkpointing with its offload
   from the config's checkpointing kwargs, as every Trainer run does). Per mode: torch.cuda.max_memory_allocated, the
   step time (the best after the first), every step's loss, and the planner's device peak for the same flags (its
   error). Step 1's loss of every mode against plain checkpointing's, relative bound LONG_LOSS_RTOL. Bounded to
   long_budget seconds; on CPU the offload modes are recorded as needing CUDA, with finetune.config's refusal.
1. padfree: one batch of records of mixed lengths as a padded batch, as one padding-free row (flat, position ids
   restarting at every record) and, with sdpa, as packed rows (transformers' block mask, and this project's
   per-record sdpa); bf16 weights under bf16 autocast; each loss against the padded batch's, relative bound
   PADFREE_RTOL. A control (the packed rows with plain positions, so records attend to each other) shows the bound
   can see a wrong mask. flash_attention_2 too where flash_attn imports.
2. bf16: finetune/train.py's pipeline (finetune.training.trainer.main: config, data, model, Trainer, the verified
   final save) for STEPS steps in fp32, in bf16 mixed precision (fp32 weights, `--bf16 true`: autocast), with bf16
   weights, and LoRA on a bf16 base; same data, seed and order. Loss of mixed precision against fp32 within
   BF16_STEP1_RTOL at step 1 and BF16_MIXED_RTOL at every step (relative; bf16 weights, whose small updates bf16
   rounds away, are reported without a bound: 3.3e-2 after 20 steps on CPU), and every save reloads to the same
   logits (finetune.models.verify, limit verify.DEFAULT_ATOL).
3. memory: bench/memory_gpu.py's cells (the planner's prediction against torch.cuda.max_memory_allocated of
   bench/memory.py's worker): the chunked loss against transformers' (liger-kernel hidden from the worker: the
   planner models the chunk loop, not Liger's kernel) and DPO (LoRA, and full with its frozen reference copy).
4. throughput: bench/throughput.py's rows, each in a forked child: ft_packed (this project's packed path: config.parse
   -> prepare_dataset -> load_model -> the chunked loss -> per-record sdpa -> the HF Trainer) against trl_packing
   (TRL's SFTTrainer with packing, padding_free and, where liger_kernel imports and runs, use_liger_kernel), LoRA and
   full, bf16, on random models of SmolLM2-135M's and Llama-3.2-1B's shapes (bench/memory_gpu.py's LLAMA_1B),
   1,024-token rows; the rows take turns, --repeats times (the order flips every repeat). Tokens/s, the ratio ft/TRL
   within each repeat with its spread (max - min over the median), MFU against the card's dense bf16 peak read from
   its name (bench/throughput.py's PEAK_BF16; the number used is printed).

Time: --budget seconds from the start (imports included); a row, cell or run that its estimate (the last one like
it, or a first guess) does not fit is skipped, with a note; a child that overruns what is left is killed. Every child
writes its output to DIR/logs/ (--write DIR; else WORK/logs/); the parent prints one timestamped line per step, and
the JSON is rewritten after every section and every throughput row (a run killed from outside keeps what it did).
Where Liger is in use and a child fails, it runs once more with liger-kernel hidden (and later ones of its kind
without it), said in the output.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import sys
import time
import traceback
from pathlib import Path

# Before torch is imported anywhere: torch.cuda.is_available() asks NVML instead of initializing CUDA, so the parent
# stays fork-safe (a forked child of a process that initialized CUDA cannot use it).
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent
for _p in (str(REPO), str(REPO / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import memory_gpu as MG  # noqa: E402  (bench/: light at import)
import throughput as T  # noqa: E402

T0 = time.time()

# Bounds (stated in the output).
PADFREE_RTOL = 1e-3  # |loss(layout) - loss(padded)| / loss(padded), bf16
# |loss(bf16 mixed) - loss(fp32)| / loss(fp32): at step 1 (the same weights: the forward's rounding only; 1e-5 seen on
# CPU) and at every step (the trajectories part a little: at most 3.6e-3 seen on CPU, SmolLM2's shape with 8 layers,
# 20 steps of 256 tokens, at the steps where the loss fell fastest; 3e-4 after).
BF16_STEP1_RTOL = 1e-3
BF16_MIXED_RTOL = 0.02
MEMORY_RTOL = 0.05  # planner against torch.cuda.max_memory_allocated (test_plan holds the SFT cells to this)
# The long section: step 1's loss of each mode against plain checkpointing's (the same weights and record: the options
# move memory, not numbers). The offload copies the same tensors out and back (exact); the tiled MLP's GEMMs over
# fewer rows may sum in another order, each rounded to bf16 (2^-8 relative), which the mean over the record's tokens
# averages down (on CPU, 512 tokens in tiles of 64: equal to the bit).
LONG_LOSS_RTOL = 1e-2
# mode -> its flags beside long_flags' common ones; the offload modes need CUDA (finetune.config refuses them without it).
LONG_MODES = {
    "ckpt": [],
    "ckpt+offload": ["--offload_activations", "true"],
    "ckpt+tiled": ["--tiled_mlp", "true"],
    "ckpt+tiled+offload": ["--tiled_mlp", "true", "--offload_activations", "true"],
}

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=True)
LLAMA_1B = {k: v for k, v in MG.LLAMA_1B.items() if k not in ("bos_token_id", "eos_token_id")}
TINY = dict(vocab_size=None, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False)

SETTINGS = {
    "gpu": dict(
        models={"smollm2-shape": SMOLLM2, "llama1b-shape": LLAMA_1B}, seq=1024, batch=8, warmup=3, timed=10,
        repeats=3, methods=("lora", "full"), rows=("ft_packed", "trl_packing"), records=600,
        bf16_model="smollm2-shape", bf16_steps=20, bf16_batch=4, padfree_model="smollm2-shape", padfree_records=16,
        memory_model="llama1b-shape",
        # DPO first: never measured on a GPU (the chunked-loss cells were, on an H200: bench/RESULTS.md)
        memory_cells=("dpo-lora-bf16", "dpo-full-bf16", "full-bf16", "full-bf16-unchunked"),
        # first guesses of a child's seconds (replaced by what the last one like it took)
        guess={"llama1b-shape": 30, "smollm2-shape": 20, "bf16": 20, "padfree": 25, "memory": 45},
        throughput_reserve=240, budget=510,
        # The rows section (the default on a GPU): the issue's table.
        row_models={"1b": "LLAMA_1B", "8b": "LLAMA_8B"},
        table_rows=(("1b", "full"), ("1b", "lora"), ("8b", "lora"), ("8b", "qlora")), row_records=2000,
        # logging every 5 steps inside the timed window: the idle gap a logged step costs, measured (see
        # bench_row_child's gap_ms), priced at the default interval (finetune.config.training.GPU_DEFAULTS)
        seq_rows=2048, batches={"1b": 8, "8b": 4}, warmup_rows=2, timed_rows=15, logging_steps=5,
        row_guess={"1b-full": 40, "1b-lora": 35, "8b-lora": 50, "8b-qlora": 70},
        # The long section: one record of long_seq tokens on the rows' 1B shape, bounded to long_budget seconds.
        long_model="1b", long_seq=32768, long_steps=3, long_budget=90, long_guess=25,
    ),
    "cpu-smoke": dict(
        models={"tiny": TINY}, seq=128, batch=2, warmup=1, timed=3, repeats=3, methods=("lora", "full"),
        rows=("ft_packed", "trl_packing"), records=120, bf16_model="tiny", bf16_steps=20, bf16_batch=2,
        padfree_model="tiny", padfree_records=8, memory_model="tiny", memory_cells=("full-bf16", "dpo-lora-bf16"),
        guess={"tiny": 10, "bf16": 15, "padfree": 15, "memory": 30}, throughput_reserve=60, budget=240,
        row_models={"tiny": "TINY"}, table_rows=(("tiny", "full"), ("tiny", "lora"), ("tiny", "qlora")),
        row_records=120,
        seq_rows=128, batches={"tiny": 2}, warmup_rows=1, timed_rows=3, logging_steps=2,
        row_guess={"tiny-full": 20, "tiny-lora": 20, "tiny-qlora": 25},
        long_model="tiny", long_seq=512, long_steps=2, long_budget=200, long_guess=30,
    ),
}
SECTIONS = ("long", "rows", "padfree", "bf16", "memory", "throughput", "profile")
# A GPU run: the long section (at most long_budget seconds, first: never measured on a GPU), then the issue's rows
# in the 7 minutes left.
DEFAULT_SECTIONS = {"gpu": ("long", "rows"), "cpu-smoke": SECTIONS}
# The profile section: the ft_packed step taken apart, one change at a time, beside TRL's (smollm2-shape, full).
PROFILE_VARIANTS = ("ft_packed", "trl_packing", "ft_no_per_record_sdpa", "ft_unchunked_loss")


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now(datetime.timezone.utc):%H:%M:%S} +{time.time() - T0:4.0f}s] {msg}", flush=True)


class Budget:
    def __init__(self, seconds: float):
        self.seconds, self.deadline = seconds, T0 + seconds
        self.seen: dict[str, float] = {}

    def left(self) -> float:
        return self.deadline - time.time()

    def estimate(self, kind: str, guess: float) -> float:
        return self.seen.get(kind, guess)

    def fits(self, kind: str, guess: float, reserve: float = 0.0) -> bool:
        return self.left() - reserve >= self.estimate(kind, guess)

    def took(self, kind: str, seconds: float) -> None:
        self.seen[kind] = max(seconds, self.seen.get(kind, 0.0) * 0.5)


# ----------------------------------------------------------------------------------------------
# Children: each step in a forked process (modules imported once in the parent; CUDA only in the child; a child's
# GPU memory, Liger's module patches and any crash end with it). If a forked child cannot use CUDA, spawn instead.

CTX = None
LOGS: Path | None = None
_COUNT = [0]


def _entry(conn, log_path, fn, args, kwargs):
    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    try:
        conn.send(("ok", fn(*args, **kwargs)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which goes on
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"))
    finally:
        conn.close()


def run_child(name: str, fn, *args, timeout: float, **kwargs) -> tuple[str, object, float]:
    """(status, result or error text, seconds)."""
    _COUNT[0] += 1
    log_path = LOGS / f"{_COUNT[0]:03d}-{name}.log" if LOGS else None
    parent, child = CTX.Pipe(duplex=False)
    proc = CTX.Process(target=_entry, args=(child, str(log_path) if log_path else None, fn, args, kwargs))
    start = time.time()
    proc.start()
    child.close()
    timeout = max(timeout, 1.0)
    msg = None
    while msg is None:
        if parent.poll(0.5):
            try:
                msg = parent.recv()
            except EOFError:
                msg = ("error", f"its process ended (exit code {proc.exitcode}) without a result")
        elif not proc.is_alive():
            if not parent.poll(0.2):
                msg = ("error", f"its process ended (exit code {proc.exitcode}) without a result")
        elif time.time() - start > timeout:
            proc.kill()
            msg = ("error", f"no result within {timeout:.0f} s: its process was killed")
    proc.join(30)
    if proc.is_alive():
        proc.kill()
        proc.join(10)
    seconds = time.time() - start
    if msg[0] != "ok" and log_path and log_path.is_file():
        tail = log_path.read_text(errors="replace")[-2500:]
        msg = ("error", f"{msg[1]}\n--- last lines of {log_path.name} ---\n{tail}")
    return msg[0], msg[1], seconds


def run_guarded(ctx, name: str, kind: str, fn, *args, before_retry=None) -> tuple[str, object, float]:
    """run_child(fn, no_liger, *args) with the time left as its limit. Where Liger is in use and the child fails
    (not for time), once more with liger-kernel hidden; if that runs, `kind`'s later children go without it too
    (said in the result: "liger_hidden")."""
    hide = ctx["no_liger"] or kind in ctx["liger_failed"]
    status, res, secs = run_child(name, fn, hide, *args, timeout=ctx["budget"].left())
    if (status != "ok" and not hide and ctx["info"].get("liger") and "no result within" not in str(res)
            and ctx["budget"].left() > secs + 5):
        log(f"{name}: FAILED with Liger in use ({_first_line(res)}); once more with liger-kernel hidden")
        if before_retry:
            before_retry()
        status2, res2, secs2 = run_child(name + "-no-liger", fn, True, *args, timeout=ctx["budget"].left())
        if status2 == "ok":
            ctx["liger_failed"][kind] = _first_line(res)
            res2["liger_hidden"] = _first_line(res)
            return status2, res2, secs2
        res = f"{res}\n--- and with liger-kernel hidden ---\n{res2}"
    elif status == "ok" and hide and kind in ctx["liger_failed"] and isinstance(res, dict):
        res["liger_hidden"] = ctx["liger_failed"][kind]
    return status, res, secs


def _first_line(text: str) -> str:
    return str(text).strip().splitlines()[0][:300] if str(text).strip() else "?"


# ----------------------------------------------------------------------------------------------
# Setup: device, versions, models, data.


def _version(dist: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def peak_for(name: str) -> tuple[float | None, str]:
    """Dense bf16 peak FLOP/s from the device name (bench/throughput.py's PEAK_BF16, first key found)."""
    for key, value in T.PEAK_BF16.items():
        if key.lower() in name.lower():
            return value, key
    return None, ""


def device_child(gpu: bool) -> dict:
    import importlib.util

    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda_runtime": torch.version.cuda,
            "versions": {d: _version(d) for d in ("transformers", "trl", "peft", "accelerate", "datasets", "liger-kernel",
                                                  "triton", "flash-attn", "huggingface-hub", "tokenizers", "safetensors")},
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    info["cuda"] = torch.cuda.is_available()
    if gpu and not info["cuda"]:
        raise RuntimeError("no CUDA device (run --cpu-smoke on a machine without one)")
    if info["cuda"]:
        props = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
                    memory_gib=round(props.total_memory / 2**30, 1), bf16=torch.cuda.is_bf16_supported(),
                    device_count=torch.cuda.device_count())
        torch.ones(1, device="cuda").sum().item()  # CUDA works in a child of this parent
    else:
        info["device"] = "cpu"
    # flash-attention: only if it imports (a wheel built for another torch fails here, not in a row).
    info["flash_attn"] = None
    if importlib.util.find_spec("flash_attn") is not None:
        try:
            import flash_attn  # noqa: F401

            info["flash_attn"] = True
        except Exception as e:  # noqa: BLE001
            info["flash_attn"] = f"does not import: {type(e).__name__}: {e}"[:300]
    # Liger: imported and run once on this GPU (a Triton failure here keeps it out of every row, said so).
    info["liger"] = None
    if importlib.util.find_spec("liger_kernel") is None:
        info["liger_note"] = "liger-kernel not installed"
    elif not info["cuda"]:
        info["liger_note"] = "no CUDA: Liger not used"
    else:
        try:
            import torch.nn.functional as F
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss, LigerRMSNorm

            g = torch.Generator(device="cuda").manual_seed(0)
            h = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            w = (torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05).requires_grad_()
            y = torch.randint(0, 1000, (256,), device="cuda", generator=g)
            out = LigerFusedLinearCrossEntropyLoss(reduction="sum")(w, h, y)
            out = out[0] if isinstance(out, tuple) else out
            out.backward()
            ref = F.cross_entropy(h.float() @ w.float().T, y, reduction="sum")
            norm = LigerRMSNorm(256).to("cuda", torch.bfloat16)
            norm(h).float().sum().backward()
            torch.cuda.synchronize()
            rel = abs(out.item() - ref.item()) / abs(ref.item())
            if not rel < 1e-2:
                raise RuntimeError(f"Liger's fused linear cross-entropy is {rel:.2e} off the plain one")
            info["liger"] = True
            info["liger_note"] = f"liger-kernel {info['versions']['liger-kernel']} ran on this GPU (loss within {rel:.1e})"
        except Exception as e:  # noqa: BLE001
            info["liger"] = False
            info["liger_note"] = f"liger-kernel unusable here, hidden from every row: {type(e).__name__}: {e}"[:400]
    return info


def _hide_liger() -> None:
    sys.modules["liger_kernel"] = None  # `import liger_kernel...` raises ImportError: nothing uses it


def build_child(folder: str, dims: dict, gpu: bool) -> dict:
    """A random Llama of the given shape (bf16 safetensors) with the tiny chatml tokenizer (nothing downloaded)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.models import tiny

    folder = Path(folder)
    if not ((folder / "config.json").is_file() and list(folder.glob("*.safetensors"))):
        tok = tiny.build_tokenizer(folder, style="chatml")
        dims = dict(dims)
        vocab = dims.pop("vocab_size") or len(tok)
        config = LlamaConfig(vocab_size=vocab, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                             pad_token_id=None, **dims)
        torch.manual_seed(0)
        if gpu:  # built in bf16 on the GPU (an 8B model in fp32 would be 32 GB and twice the time)
            torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda" if gpu else "cpu"):
            model = LlamaForCausalLM(config)
        model.to(torch.bfloat16).save_pretrained(folder)
        del model
    with torch.device("meta"):
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(folder)
        model = AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in model.parameters())
    return {"parameters": n, "description": (
        f"{n:,} parameters (hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
        f"{config.num_attention_heads}/{config.num_key_value_heads} heads, intermediate {config.intermediate_size}, "
        f"vocabulary {config.vocab_size}{', tied' if config.tie_word_embeddings else ''})")}


# ----------------------------------------------------------------------------------------------
# Section: padded against padding-free / packed, on the GPU's kernels.


def padfree_child(no_liger: bool, model_dir: str, data: str, work: str, attn: str, seq: int, n_records: int,
                  gpu: bool) -> dict:
    if no_liger:
        _hide_liger()
    import torch

    from finetune import config as C
    from finetune.data.packing import PackedCollator, bfd_pack, to_device
    from finetune.data.pipeline import prepare_dataset
    from finetune.data.prepare import Collator
    from finetune.models import attention
    from finetune.models.load import load_model, load_tokenizer

    device = torch.device("cuda" if gpu else "cpu")
    if not gpu:
        torch.set_num_threads(1)
    cfg = C.parse(["--model_name_or_path", model_dir, "--dataset", data, "--output_dir", f"{work}/padfree-{attn}",
                   "--dataset_cache_dir", f"{work}/cache-padfree", "--max_seq_length", str(seq),
                   "--torch_dtype", "bfloat16", "--attn_implementation", attn, "--completion_only_loss", "false",
                   "--seed", "0"])
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, cfg.training).to(device)
    dataset, _ = prepare_dataset(cfg.data, tok, log=lambda *a: None)
    examples = [{"input_ids": list(dataset[i]["input_ids"]), "labels": list(dataset[i]["labels"])}
                for i in range(min(n_records, len(dataset)))]
    pad = tok.pad_token_id
    batches = {"padded": (Collator(pad)(examples), attn), "padding-free (one flat row)":
               (PackedCollator(pad, layout="flat")(examples), attn)}
    rows = []
    for b in bfd_pack([len(e["input_ids"]) for e in examples], seq):
        rows.append({"input_ids": [t for i in b for t in examples[i]["input_ids"]],
                     "labels": [t for i in b for t in examples[i]["labels"]],
                     "seq_lens": [len(examples[i]["input_ids"]) for i in b]})
    packed = PackedCollator(pad, layout="rows")(rows)
    control = dict(packed, position_ids=torch.arange(packed["input_ids"].shape[1]).repeat(len(rows), 1))
    if attn == "sdpa":
        attention.register()
        batches["packed rows (transformers' sdpa, block mask)"] = (packed, "sdpa")
        batches["packed rows (per-record sdpa, finetune)"] = (packed, attention.PACKED_SDPA)
    batches["control: packed rows, records not separated"] = (control, attn)

    def loss_of(batch, impl):
        model.set_attn_implementation(impl)
        model.zero_grad(set_to_none=True)
        inputs = to_device(batch, device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(**inputs).loss
        loss.backward()
        grads = [p.grad.float().norm() ** 2 for p in model.parameters() if p.grad is not None]
        if gpu:
            torch.cuda.synchronize()
        trained = int((batch["labels"][..., 1:] != -100).sum())
        return {"loss": loss.item(), "grad_norm": math.sqrt(float(sum(grads))), "trained": trained,
                "shape": list(batch["input_ids"].shape)}

    model.train()
    out = {name: loss_of(batch, impl) for name, (batch, impl) in batches.items()}
    ref = out["padded"]
    for name, r in out.items():
        r["rel_diff"] = abs(r["loss"] - ref["loss"]) / abs(ref["loss"])
        r["grad_rel_diff"] = abs(r["grad_norm"] - ref["grad_norm"]) / max(ref["grad_norm"], 1e-30)
        r["control"] = name.startswith("control")
        r["same_targets"] = r["trained"] == ref["trained"]
    return {"attn": attn, "records": len(examples), "tokens": sum(len(e["input_ids"]) for e in examples),
            "lengths": sorted(len(e["input_ids"]) for e in examples), "layouts": out,
            "device": torch.cuda.get_device_name(0) if gpu else "cpu"}


def section_padfree(ctx) -> dict:
    s, info = ctx["settings"], ctx["info"]
    attns = ["sdpa"] + (["flash_attention_2"] if info.get("flash_attn") is True else [])
    out = {"bound": PADFREE_RTOL, "runs": [], "notes": []}
    if info.get("flash_attn") is not True:
        out["notes"].append("flash_attention_2 not checked: " + (
            "flash_attn not installed" if info.get("flash_attn") is None else str(info["flash_attn"])))
    model = ctx["models"][s["padfree_model"]]["dir"]
    for attn in attns:
        if not ctx["budget"].fits("padfree", s["guess"]["padfree"]):
            out["notes"].append(f"{attn}: skipped, over the time budget")
            continue
        log(f"padfree: {attn}, {s['padfree_records']} records on {s['padfree_model']}")
        status, res, secs = run_guarded(ctx, f"padfree-{attn}", "padfree", padfree_child, model, ctx["data"],
                                        ctx["work"], attn, s["seq"], s["padfree_records"], ctx["gpu"])
        ctx["budget"].took("padfree", secs)
        if status != "ok":
            log(f"padfree {attn}: FAILED: {_first_line(res)}")
            out["runs"].append({"attn": attn, "error": res})
            continue
        checked = [r for r in res["layouts"].values() if not r["control"]]
        res["pass"] = all(r["rel_diff"] <= PADFREE_RTOL and r["same_targets"] for r in checked)
        # The control (records attending to each other) must show: in the loss, or at least in the gradient (a
        # random model's loss hardly depends on its context; its gradient does).
        worst = max((r["grad_rel_diff"] for r in checked), default=0.0)
        controls = [r for r in res["layouts"].values() if r["control"]]
        res["control_detected"] = ("loss" if all(c["rel_diff"] > PADFREE_RTOL for c in controls) else
                                   "gradient" if all(c["grad_rel_diff"] > 10 * worst for c in controls) else None)
        out["runs"].append(res)
        for name, r in res["layouts"].items():
            log(f"padfree {attn}: {name:48s} loss {r['loss']:.5f}  rel diff {r['rel_diff']:.2e}  "
                f"grad-norm rel diff {r['grad_rel_diff']:.2e}  {r['trained']} trained tokens  shape {r['shape']}")
        log(f"padfree {attn}: {'PASS' if res['pass'] else 'FAIL'} (bound {PADFREE_RTOL:g} relative; {secs:.0f} s)")
    return out


# ----------------------------------------------------------------------------------------------
# Section: bf16 against fp32, and the verified saves.


def train_child(no_liger: bool, argv: list[str], out_dir: str, threads: int | None) -> dict:
    if no_liger:
        _hide_liger()
    if threads:
        import torch

        torch.set_num_threads(threads)
    from finetune.models import verify

    reports = []
    original = verify.verify_saved

    def recording(*a, **k):
        report = original(*a, **k)
        reports.append({"kind": report.kind, "max_logit_diff": report.max_logit_diff, "atol": report.atol,
                        "tensors": report.tensors})
        return report

    verify.verify_saved = recording
    import torch

    from finetune.training import trainer

    start = time.time()
    trainer.main(argv)
    state = json.loads((Path(out_dir) / "trainer_state.json").read_text())
    losses = [e["loss"] for e in state["log_history"] if "loss" in e]
    return {"losses": losses, "verify": reports[-1] if reports else None, "seconds": time.time() - start,
            # fp32 must mean fp32: TF32 matmuls would make the "fp32" reference itself a reduced-precision run
            "tf32": bool(torch.backends.cuda.matmul.allow_tf32), "matmul_precision": torch.get_float32_matmul_precision()}


BF16_RUNS = {  # name -> (flags, compared with fp32: under this bound / True: reported only / None: not compared)
    "fp32": (["--torch_dtype", "float32"], None),
    "bf16 mixed (fp32 weights, --bf16)": (["--torch_dtype", "float32", "--bf16", "true"], BF16_MIXED_RTOL),
    "bf16 weights, --bf16": (["--torch_dtype", "bfloat16", "--bf16", "true"], True),
    "LoRA, bf16 base, --bf16": (["--torch_dtype", "bfloat16", "--bf16", "true", "--use_peft"], None),
}


def section_bf16(ctx) -> dict:
    s = ctx["settings"]
    model = ctx["models"][s["bf16_model"]]["dir"]
    out = {"steps": s["bf16_steps"], "model": s["bf16_model"], "batch": s["bf16_batch"], "seq": s["seq"], "runs": {},
           "notes": [], "bound": BF16_MIXED_RTOL, "step1_bound": BF16_STEP1_RTOL}
    from finetune.models.verify import DEFAULT_ATOL

    out["save_atol"] = DEFAULT_ATOL
    for name, (flags, _) in BF16_RUNS.items():
        if not ctx["budget"].fits("bf16", s["guess"]["bf16"]):
            out["notes"].append(f"{name}: skipped, over the time budget")
            continue
        slug = name.split(" (")[0].replace(",", "").replace(" ", "-").replace("--", "")
        out_dir = Path(ctx["work"]) / f"bf16-{slug}"
        shutil.rmtree(out_dir, ignore_errors=True)
        argv = ["--model_name_or_path", model, "--dataset", ctx["data"], "--output_dir", str(out_dir),
                "--dataset_cache_dir", f"{ctx['work']}/cache-bf16", "--max_seq_length", str(s["seq"]),
                "--per_device_train_batch_size", str(s["bf16_batch"]), "--max_steps", str(s["bf16_steps"]),
                "--learning_rate", "1e-4", "--warmup_steps", "0", "--seed", "0", "--logging_steps", "1",
                "--disable_tqdm", "true", "--packing", "--completion_only_loss", "false", *flags]
        log(f"bf16: {name}: {s['bf16_steps']} steps of {s['bf16_batch']} x {s['seq']} tokens")
        status, res, secs = run_guarded(ctx, f"bf16-{slug}", "bf16", train_child, argv, str(out_dir),
                                        None if ctx["gpu"] else 1, before_retry=lambda: shutil.rmtree(out_dir, True))
        ctx["budget"].took("bf16", secs)
        if status != "ok":
            log(f"bf16 {name}: FAILED: {_first_line(res)}")
            out["runs"][name] = {"flags": flags, "error": res}
            continue
        res["flags"] = flags
        out["runs"][name] = res
        v = res["verify"]
        log(f"bf16 {name}: losses {res['losses'][0]:.4f} -> {res['losses'][-1]:.4f}; save "
            + (f"verified, logits max diff {v['max_logit_diff']:.3g} (limit {v['atol']:g})" if v else "not verified")
            + f" ({secs:.0f} s)")
    base = out["runs"].get("fp32", {}).get("losses")
    for name, (flags, bound) in BF16_RUNS.items():
        r = out["runs"].get(name)
        if not r or "error" in r:
            continue
        r["save_pass"] = bool(r["verify"]) and r["verify"]["max_logit_diff"] <= r["verify"]["atol"]
        if bound is None or not base:
            continue
        n = min(len(base), len(r["losses"]))
        rel = [abs(a - b) / abs(b) for a, b in zip(r["losses"][:n], base[:n])]
        r.update(rel_diffs=rel, max_rel_diff=max(rel), first_rel_diff=rel[0], compared_steps=n,
                 abs_diffs=[abs(a - b) for a, b in zip(r["losses"][:n], base[:n])])
        if bound is True:
            log(f"bf16 {name} vs fp32: step 1 rel diff {rel[0]:.2e}, max over {n} steps {max(rel):.2e} (reported)")
            continue
        r.update(bound=bound, step1_bound=BF16_STEP1_RTOL,
                 loss_pass=n == s["bf16_steps"] and max(rel) <= bound and rel[0] <= BF16_STEP1_RTOL
                 and all(map(math.isfinite, r["losses"])))
        log(f"bf16 {name} vs fp32: step 1 rel diff {rel[0]:.2e} (bound {BF16_STEP1_RTOL:g}), max over {n} steps "
            f"{max(rel):.2e} (bound {bound:g}): {'PASS' if r['loss_pass'] else 'FAIL'}")
    return out


# ----------------------------------------------------------------------------------------------
# Section: long records (docs/long-context.md): gradient checkpointing with --offload_activations and --tiled_mlp.


def long_flags(seq: int, mode: str) -> list[str]:
    """The training flags of one mode: one record of `seq` tokens, bf16 weights, gradient checkpointing."""
    return ["--config", "ddp", "--per_device_train_batch_size", "1", "--max_seq_length", str(seq), "--seed", "0",
            "--torch_dtype", "bfloat16", "--gradient_checkpointing", "true", *LONG_MODES[mode]]


def long_child(model_dir: str, mode: str, seq: int, steps: int, work: str) -> dict:
    """One mode through bench/memory.py's worker (config.parse -> load_model -> install_loss/install_tiling -> the HF
    Trainer, which enables checkpointing with the offload as every Trainer run does), liger-kernel hidden (the
    planner models the project's chunk loop), then the planner's device peak for the same flags."""
    import memory as M

    from finetune import config as C

    flags = long_flags(seq, mode)
    out = Path(work) / mode
    out.mkdir(parents=True, exist_ok=True)
    argv = ["--model_name_or_path", model_dir, "--output_dir", str(out / "out"), *flags]
    try:  # the refusal first, said as the user would see it (a CPU run: the offload modes need CUDA)
        C.parse(argv, check_paths=False)
    except C.ConfigError as e:
        return {"mode": mode, "flags": flags, "refused": "; ".join(e.problems)}
    os.environ["FINETUNE_BENCH_NO_LIGER"] = "1"
    result = out / "result.json"
    M.worker([str(result), "--steps", str(steps), "--", *argv])
    rank = json.loads(Path(f"{result}.0").read_text())
    row = {"mode": mode, "flags": flags, **MG.predict(Path(model_dir), flags),
           "cuda": rank.get("cuda_max_memory_allocated"), "saved_measured": rank.get("saved_for_backward"),
           "losses": rank["losses"], "step_seconds": rank["step_seconds"], "maxrss": rank["maxrss"]}
    # Step 1 warms up (allocator, kernels, the optimizer's states): the time is the best of the later steps.
    row["step_s"] = min(row["step_seconds"][1:] or row["step_seconds"])
    return row


def section_long(ctx) -> dict:
    """Each LONG_MODES mode in its own forked child, within long_budget seconds of the section's start."""
    s, gpu = ctx["settings"], ctx["gpu"]
    model = ctx["models"][s["long_model"]]["dir"]
    out = {"model": s["long_model"], "description": ctx["models"][s["long_model"]].get("description"),
           "seq": s["long_seq"], "steps": s["long_steps"], "bound": LONG_LOSS_RTOL, "planner_bound": MEMORY_RTOL,
           "modes": [], "notes": []}
    ctx["sections_out"]["long"] = out
    deadline = time.time() + min(s["long_budget"], ctx["budget"].left())
    work = Path(ctx["work"]) / "long"
    for mode in LONG_MODES:
        left = deadline - time.time()
        if left < ctx["budget"].estimate("long", s["long_guess"]) and not (not gpu and "offload" in mode):
            out["modes"].append({"mode": mode, "flags": long_flags(s["long_seq"], mode),
                                 "skipped": f"over the section's {s['long_budget']} s ({left:.0f} s left)"})
            log(f"long {mode}: skipped (time: {left:.0f} s left of the section's {s['long_budget']})")
            continue
        status, res, secs = run_child(f"long-{mode}", long_child, model, mode, s["long_seq"], s["long_steps"],
                                      str(work), timeout=max(left, 10))
        if status != "ok":
            log(f"long {mode}: FAILED: {_first_line(res)}")
            out["modes"].append({"mode": mode, "flags": long_flags(s["long_seq"], mode), "error": str(res)[-2500:]})
            continue
        if "refused" in res:
            res["needs"] = "CUDA"
            log(f"long {mode}: needs CUDA, refused here: {res['refused']}")
            out["modes"].append(res)
            continue
        ctx["budget"].took("long", secs)
        res["seconds"] = round(secs, 1)
        if res.get("cuda"):
            res["rel_error"] = (res["device"] - res["cuda"]) / res["cuda"]
            res["within"] = abs(res["rel_error"]) <= MEMORY_RTOL
        log(f"long {mode}: step 1 loss {res['losses'][0]:.6f}, step {res['step_s']:.2f} s, "
            + (f"peak {_bytes(res['cuda'])}, planned {_bytes(res['device'])} ({res['rel_error']:+.1%})"
               if res.get("cuda") else f"planned {_bytes(res['device'])} on a GPU (no CUDA: not measured)")
            + f" ({secs:.0f} s)")
        out["modes"].append(res)
        ctx["save"]()
    ran = [r for r in out["modes"] if r.get("losses")]
    ref = next((r for r in ran if r["mode"] == "ckpt"), None)
    if ref is not None:
        for r in ran:
            r["loss_rel_diff"] = abs(r["losses"][0] - ref["losses"][0]) / abs(ref["losses"][0])
        out["max_loss_rel_diff"] = max(r["loss_rel_diff"] for r in ran)
        out["loss_pass"] = len(ran) > 1 and out["max_loss_rel_diff"] <= LONG_LOSS_RTOL
    return out


def _bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def render_long(sec: dict) -> list[str]:
    lines = ["### Long records: checkpointing with --offload_activations and --tiled_mlp", ""]
    if "error" in sec:
        return lines + [f"Section failed: {_first_line(sec['error'])}", ""]
    lines += [f"{sec['model']} ({sec.get('description') or '?'}), full fine-tuning, bf16 weights, one record of "
              f"{sec['seq']:,} tokens, `--gradient_checkpointing`, {sec['steps']} steps per mode, each mode a process "
              "of bench/memory.py's worker (the HF Trainer path), liger-kernel hidden. Peak: "
              "torch.cuda.max_memory_allocated over the run; planned: `finetune plan`'s device total less its "
              f"CUDA-context allowance (within {sec['planner_bound']:.0%} marked ok). Step: the best of the steps "
              "after the first. Step 1's loss against plain checkpointing's (same weights, same record), bound "
              f"{sec['bound']:g} relative.", "",
              "| mode | peak | planned | error | step | step-1 loss | vs ckpt |", "|---|---|---|---|---|---|---|"]
    for r in sec["modes"]:
        if "refused" in r:
            lines.append(f"| {r['mode']} | needs CUDA: not run here ({r['refused'][:160]}) | | | | | |")
            continue
        if "skipped" in r or "error" in r:
            why = r.get("skipped") or f"FAILED: {_first_line(r['error'])[:150]}"
            lines.append(f"| {r['mode']} | {why} | | | | | |")
            continue
        peak = _bytes(r["cuda"]) if r.get("cuda") else "- (no CUDA)"
        err = f"{r['rel_error']:+.1%} {'ok' if r['within'] else 'OFF'}" if "rel_error" in r else "-"
        diff = f"{r['loss_rel_diff']:.1e}" if "loss_rel_diff" in r else "-"
        lines.append(f"| {r['mode']} | {peak} | {_bytes(r['device'])} | {err} | {1000 * r['step_s']:,.0f} ms | "
                     f"{r['losses'][0]:.6f} | {diff} |")
    if "max_loss_rel_diff" in sec:
        lines += ["", f"Step-1 losses: largest relative difference {sec['max_loss_rel_diff']:.1e} "
                      f"({'within' if sec['loss_pass'] else 'OUTSIDE'} {sec['bound']:g})."]
    for note in sec.get("notes", []):
        lines.append(f"- {note}")
    return lines + [""]


# ----------------------------------------------------------------------------------------------
# Section: the memory planner on the GPU (bench/memory_gpu.py).


def memory_child(model_dir: str, cell: str, work: str, timeout: float) -> dict:
    flags = MG.COMMON + MG.CELLS[cell]
    row = {"cell": cell, "flags": flags, **MG.predict(Path(model_dir), flags)}
    row.update(MG.measure(Path(model_dir), cell, flags, Path(work), timeout, env={"FINETUNE_BENCH_NO_LIGER": "1"}))
    return row


def section_memory(ctx) -> dict:
    s = ctx["settings"]
    model = ctx["models"][s["memory_model"]]["dir"]
    out = {"model": s["memory_model"], "bound": MEMORY_RTOL, "rows": [], "notes": []}
    work = Path(ctx["work"]) / "memory"
    reserve = s["throughput_reserve"] if "throughput" in ctx["sections"] else 0
    for cell in s["memory_cells"]:
        if not ctx["budget"].fits("memory", s["guess"]["memory"], reserve):
            out["notes"].append(f"{cell}: skipped, over the time budget (kept {reserve} s for the throughput)")
            log(f"memory {cell}: skipped (time budget)")
            continue
        log(f"memory: {cell}")
        limit = max(30.0, ctx["budget"].left() - reserve)
        status, res, secs = run_child(f"memory-{cell}", memory_child, model, cell, str(work), limit - 10,
                                      timeout=limit)
        ctx["budget"].took("memory", secs)
        if status != "ok":
            log(f"memory {cell}: FAILED: {_first_line(res)}")
            out["rows"].append({"cell": cell, "error": res})
            continue
        if "error" in res:
            log(f"memory {cell}: FAILED: {_first_line(res['error'])}")
            out["rows"].append(res)
            continue
        if res.get("cuda"):
            res["rel_error"] = (res["device"] - res["cuda"]) / res["cuda"]
            res["within"] = abs(res["rel_error"]) <= MEMORY_RTOL
            log(f"memory {cell}: measured {res['cuda'] / 2**30:.2f} GiB, planned {res['device'] / 2**30:.2f} GiB "
                f"({res['rel_error']:+.1%}); saved for backward measured {(res['saved_measured'] or 0) / 2**20:,.0f} "
                f"MiB, planned {res['saved_planned'] / 2**20:,.0f} MiB ({secs:.0f} s)")
        else:
            log(f"memory {cell}: planned {res['device'] / 2**30:.2f} GiB; no CUDA, nothing measured ({secs:.0f} s)")
        out["rows"].append(res)
    return out


# ----------------------------------------------------------------------------------------------
# Section: throughput (bench/throughput.py's rows).


def row_child(no_liger: bool, name, dataset, model_dir, data, work, p, *rest) -> dict:
    if no_liger:
        _hide_liger()
        p = dict(p, liger=False)  # TRL's use_liger_kernel too
    return T.run_config(name, dataset, model_dir, data, work, p, *rest)


def profile_child(no_liger: bool, variant: str, model_dir: str, data: str, work: str, p: dict, gpu: bool,
                  min_tokens: int) -> dict:
    if no_liger:
        _hide_liger()
        p = dict(p, liger=False)
    if variant == "ft_no_per_record_sdpa":  # transformers' sdpa with its block mask over the packed rows
        from finetune.models import attention

        attention.enable = lambda model, cfg: False
    name = {"ft_unchunked_loss": "ft_packed_unchunked", "ft_no_per_record_sdpa": "ft_packed"}.get(variant, variant)
    return T.run_config(name, "mixed", Path(model_dir), Path(data), Path(work), p, gpu, "full", min_tokens,
                        variant in ("ft_packed", "trl_packing"))


def section_profile(ctx) -> dict:
    """Where an ft_packed step's time goes: torch.profiler over one step of ft_packed and of TRL's row, and the
    step time with per-record sdpa off and with the chunked loss off."""
    s, gpu = ctx["settings"], ctx["gpu"]
    model = s["bf16_model"]
    p = dict(seq=s["seq"], batch=s["batch"], warmup=2, dtype="bfloat16" if gpu else "float32", attn="sdpa",
             threads=1, liger=bool(ctx["info"].get("liger")) and gpu)
    min_tokens = int(3 * s["batch"] * s["seq"] * 0.9)
    out = {"model": model, "settings": p, "variants": {}}
    ctx["sections_out"]["profile"] = out
    for variant in PROFILE_VARIANTS:
        if ctx["budget"].left() < 25:
            out["variants"][variant] = {"error": "skipped, over the time budget"}
            continue
        status, res, secs = run_guarded(ctx, f"profile-{variant}", variant, profile_child, variant,
                                        ctx["models"][model]["dir"], ctx["data"], str(Path(ctx["work"]) / "prof"),
                                        p, gpu, min_tokens)
        if status != "ok":
            log(f"profile {variant}: FAILED: {_first_line(res)}")
            out["variants"][variant] = {"error": str(res)[-1500:]}
            continue
        out["variants"][variant] = res
        log(f"profile {variant}: {res['tokens_per_s']:,.0f} tok/s, step {1000 * res['step_s']:.0f} ms "
            f"({res['steps']} steps, {secs:.0f} s)")
        prof = res.get("profile") or {}
        if prof:
            log(f"  profile of one step: self CPU {prof['total_self_cpu_ms']:.0f} ms; groups "
                + ", ".join(f"{k} {v:.0f} ms" for k, v in prof["groups_ms"].items()))
            log(f"  by self device time (total {prof.get('total_self_device_ms', 0):.0f} ms):")
            for e in prof.get("top_device", []) if gpu else []:
                log(f"  {e['op'][:60]:60s} cpu {e['self_cpu_ms']:8.1f} ms  device {e['self_device_ms']:8.1f} ms  "
                    f"calls {e['calls']}")
            log("  by self CPU time:")
            for e in prof["top"]:
                log(f"  {e['op'][:60]:60s} cpu {e['self_cpu_ms']:8.1f} ms  device {e['self_device_ms']:8.1f} ms  "
                    f"calls {e['calls']}")
        ctx["save"]()
    return out


def section_throughput(ctx) -> dict:
    s, info = ctx["settings"], ctx["info"]
    gpu = ctx["gpu"]
    liger = bool(info.get("liger")) and gpu
    # As bench/throughput.py --gpu: flash-attention 2 where it imports (both sides then split records by it), else sdpa.
    attn = "flash_attention_2" if gpu and info.get("flash_attn") is True else "sdpa"
    p = dict(seq=s["seq"], batch=s["batch"], warmup=s["warmup"], dtype="bfloat16" if gpu else "float32", attn=attn,
             threads=1, liger=liger)
    min_tokens = int(s["timed"] * s["batch"] * s["seq"] * 0.9)  # about `timed` steps of full packed rows
    out = {"settings": dict(p, gpu=gpu, timed=s["timed"], repeats=s["repeats"], min_tokens=min_tokens,
                            rows=list(s["rows"]), methods=list(s["methods"])),
           "peak": ctx["peak"], "peak_key": ctx["peak_key"], "results": [], "notes": [],
           "trl_setting": "packing=True, padding_free=True" + (", use_liger_kernel=True" if liger else
                                                               ", without Liger: " + info.get("liger_note", "?"))}
    ctx["sections_out"]["throughput"] = out  # saved after every row (a run killed from outside keeps them)
    groups = [(m, method) for m in ctx["models"] for method in s["methods"]]
    for repeat in range(s["repeats"]):
        for model, method in groups:
            rows = list(s["rows"]) if repeat % 2 == 0 else list(s["rows"])[::-1]
            # A repeat's rows run together or not at all (a ratio needs both).
            if ctx["budget"].left() < len(rows) * ctx["budget"].estimate(model, s["guess"][model]):
                where = f"{model} {method} (repeat {repeat + 1}/{s['repeats']})"
                out["notes"].append(f"{where}: skipped, over the time budget")
                log(f"throughput {where}: skipped (time budget: {ctx['budget'].left():.0f} s left)")
                continue
            for row in rows:
                where = f"{model} {method} {row} (repeat {repeat + 1}/{s['repeats']})"
                args = (row, "mixed", Path(ctx["models"][model]["dir"]), Path(ctx["data"]),
                        Path(ctx["work"]) / "tp" / model, p, gpu, method, min_tokens, False)
                status, res, secs = run_guarded(ctx, f"tp-{model}-{method}-{row}-r{repeat + 1}", row, row_child,
                                                *args)
                ctx["budget"].took(model, secs)
                if status != "ok":
                    log(f"throughput {where}: FAILED: {_first_line(res)}")
                    out["results"].append({"model": model, "repeat": repeat, "config": row, "dataset": "mixed",
                                           "method": method, "error": res})
                    continue
                out["results"].append({"model": model, "repeat": repeat, **res})
                ctx["save"]()
                mfu = f"  MFU {100 * res['flops'] / ctx['peak']:.1f}%" if ctx["peak"] else ""
                log(f"throughput {where}: {res['tokens_per_s']:,.0f} tok/s{mfu}  {res['steps']} steps timed, "
                    f"{res['real_tokens']:,} tokens  peak {res['peak_mb'] / 1024:.1f} GiB  ({secs:.0f} s)")
    return out



# ----------------------------------------------------------------------------------------------
# Section: rows (the issue's table): ours against TRL, tokens/s, MFU, memory against the plan, launches and syncs.

# Llama-3.1-8B's shape (untied head, 128k vocabulary).
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                rms_norm_eps=1e-5, tie_word_embeddings=False)
# Runtime API calls that make the host wait for the device (torch.profiler's CPU-side CUDA runtime events).
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpy2D")
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                "cudaGraphLaunch", "cudaLaunchCooperativeKernel")


def matmul_peak_child(gpu: bool) -> dict:
    """The device's measured dense matmul rate (bf16 on a GPU, fp32 on a CPU): the best of a few square sizes."""
    import torch

    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    sizes = (8192, 12288) if gpu else (256, 512)
    best = {}
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(3):
            a @ b
        reps = 20 if gpu else 5
        if gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
        if gpu:
            torch.cuda.synchronize()
        best[n] = 2 * n ** 3 * reps / (time.perf_counter() - start)
    return {"peak": max(best.values()), "sizes": {str(k): v for k, v in best.items()}}


def plan_gib(model_dir: str, argv: list[str]) -> float:
    """`finetune plan`'s device total for these flags on one GPU (bench/memory_gpu.py's predict, its CUDA-context
    allowance kept: the reserved memory includes what the allocator holds, not the context)."""
    from finetune import config as C
    from finetune.plan import planner

    cfg = C.parse(argv, check_paths=False)
    job = planner.workload_from_config(cfg, world_size=1, devices_per_node=1, accelerator="gpu")
    pred = planner.predict(job)
    return (pred.device_total - planner.GPU_DEVICE_OVERHEAD) / 2**30


def _profile_counts(prof) -> dict:
    """Kernel launches and host-device syncs of a profiled step (CPU-side CUDA runtime events; cudaMemcpy and
    cudaMemcpy2D are the blocking copies, their Async forms are not counted)."""
    launches = syncs = 0
    sync_kinds: dict[str, int] = {}
    for e in prof.key_averages():
        if e.key.startswith(LAUNCH_CALLS):
            launches += e.count
        if e.key.startswith(SYNC_CALLS[:3]) or e.key.strip() in ("cudaMemcpy", "cudaMemcpy2D"):
            syncs += e.count
            sync_kinds[e.key] = sync_kinds.get(e.key, 0) + e.count
    return {"launches": launches, "syncs": syncs, "sync_calls": sync_kinds}


def _row_stats(dataset, lengths_key: str) -> dict:
    """Per packed row of a data set: its real tokens and the sum of its records' squared lengths (attention FLOPs).
    The steps' batches are collated in loader workers, so the timed tokens are counted from these means."""
    rows = [dataset[i] for i in range(len(dataset))]
    real = [len(r["input_ids"]) for r in rows]
    seqs = [list(r.get(lengths_key) or [len(r["input_ids"])]) for r in rows]
    sq = [sum(n * n for n in s) for s in seqs]
    return {"rows": len(real), "real": sum(real) / len(real), "sq": sum(sq) / len(sq),
            "records": sum(len(s) for s in seqs) / len(seqs)}


def bench_row_child(no_liger: bool, side: str, model_dir: str, data: str, work: str, p: dict, gpu: bool,
                    method: str, sync_mode: str) -> dict:
    """One row side (`ours`: finetune's packed path through its HF Trainer; `trl`: TRL's SFTTrainer with packing,
    padding_free and Liger) on `method` (full, lora, qlora): warm-up steps, timed steps under
    torch.cuda.set_sync_debug_mode(sync_mode) (off while a step logs), then one profiled step."""
    if no_liger:
        _hide_liger()
        p = dict(p, liger=False)  # TRL's use_liger_kernel too
    import statistics

    import torch
    from transformers import TrainerCallback

    from finetune import config as C
    from finetune.data.pipeline import prepare_dataset
    from finetune.data.prepare import make_collator
    from finetune.models import attention
    from finetune.models.load import load_model, load_tokenizer
    from finetune.training import core

    torch.manual_seed(0)
    if not gpu:
        torch.set_num_threads(1)
    warmup, timed, every = p["warmup"], p["timed"], p["logging_steps"]
    steps = warmup + timed + 1  # + the profiled step
    argv = ["--model_name_or_path", model_dir, "--dataset", data, "--output_dir", f"{work}/out-{side}-{method}",
            "--dataset_cache_dir", f"{work}/cache", "--max_seq_length", str(p["seq"]), "--packing", "true",
            "--per_device_train_batch_size", str(p["batch"]), "--max_steps", str(steps), "--learning_rate", "1e-4",
            "--seed", "0", "--disable_tqdm", "true", "--logging_steps", str(every), "--torch_dtype", p["dtype"],
            "--completion_only_loss", "false", "--overwrite_output_dir", "true", "--save_strategy", "no"]
    if method in ("lora", "qlora"):
        argv += ["--use_peft", "--lora_r", "16", "--lora_alpha", "32", "--lora_dropout", "0"]
    if method == "qlora":
        argv += ["--load_in_4bit", "--bnb_4bit_quant_type", "nf4", "--bnb_4bit_compute_dtype", "bfloat16"]
    if gpu:
        argv += ["--bf16", "true"]
    result: dict = {"side": side, "method": method, "sync_mode": sync_mode if gpu else None}
    if side == "ours":
        result["planned_gib"] = plan_gib(model_dir, argv)
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    cfg = C.parse(argv)
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model, cfg.training)
    if gpu and method != "qlora":
        model.to("cuda")
    # Both sides get this project's attention for packed rows (records never attend to each other).
    result["attention_packed"] = bool(attention.enable(model, cfg))
    result["attn_implementation"] = getattr(getattr(model, "config", None), "_attn_implementation", None)
    clock: dict = {"t": None, "tokens": 0, "start_step": warmup + 1, "end_step": warmup + timed, "steps": [],
                   "ends": {}, "begins": {}}

    def mark(where: dict, step: int) -> None:
        # A CUDA event between steps (no sync): the gap from one step's end to the next one's start, as the GPU
        # saw it, is the time it sat idle there (a step that logs waits for the device, then writes the entry).
        if gpu and clock["start_step"] <= step <= clock["end_step"]:
            where[step] = torch.cuda.Event(enable_timing=True)
            where[step].record()

    def set_mode(mode) -> None:
        if gpu:
            torch.cuda.set_sync_debug_mode(mode)

    class Clock(TrainerCallback):
        """Times steps warmup+1 .. warmup+timed (a step that logs runs with sync checks off, then on again) and
        profiles the one after."""

        prof = None

        def on_step_begin(self, args, state, control, **kw):
            step = state.global_step + 1
            if step == clock["start_step"]:
                if gpu:
                    torch.cuda.synchronize()
                clock["t"] = time.perf_counter()
            if clock["start_step"] <= step <= clock["end_step"]:
                set_mode(sync_mode)
            mark(clock["begins"], step)
            if step == clock["end_step"] + 1:
                acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if gpu else [])
                self.prof = torch.profiler.profile(activities=acts)
                self.prof.__enter__()

        def on_step_end(self, args, state, control, **kw):
            step = state.global_step
            mark(clock["ends"], step)
            if step % every == 0 or step == clock["end_step"]:
                set_mode(0)  # the log after this step reads the loss; the clock's own sync
            if step == clock["end_step"]:
                set_mode(0)
                if gpu:
                    torch.cuda.synchronize()
                clock["seconds"] = time.perf_counter() - clock["t"]
            if self.prof is not None and step == clock["end_step"] + 1:
                if gpu:
                    torch.cuda.synchronize()
                self.prof.__exit__(None, None, None)
                clock["profile"] = _profile_counts(self.prof)
                self.prof = None

    if side == "ours":
        from finetune.training.hf_trainer import Trainer

        core.install_loss(model, cfg)
        dataset, stats = prepare_dataset(cfg.data, tokenizer, log=lambda *a: None)
        rows = _row_stats(dataset, "seq_lens")
        trainer = Trainer(model=model, args=cfg.training, train_dataset=dataset,
                          data_collator=make_collator(cfg, tokenizer), processing_class=tokenizer, callbacks=[Clock()])
    else:
        import datasets
        from trl import SFTConfig, SFTTrainer

        records = [json.loads(line) for line in Path(data).read_text().splitlines() if line.strip()]
        kwargs = dict(output_dir=f"{work}/out-trl-{method}", max_steps=steps, per_device_train_batch_size=p["batch"],
                      max_length=p["seq"], packing=True, padding_free=True, report_to="none", save_strategy="no",
                      seed=0, disable_tqdm=True, logging_steps=every, learning_rate=1e-4,
                      dataloader_num_workers=2 if gpu else 0, dataloader_pin_memory=gpu,
                      dataloader_persistent_workers=gpu)
        if gpu:
            kwargs.update(bf16=True, use_liger_kernel=bool(p.get("liger")))
        else:
            kwargs.update(use_cpu=True, bf16=False)
        trainer = SFTTrainer(model=model, args=SFTConfig(**kwargs), train_dataset=datasets.Dataset.from_list(records),
                             processing_class=tokenizer)
        rows = _row_stats(trainer.train_dataset, "seq_lengths")
        trainer.add_callback(Clock())
        result["trl_liger"] = bool(kwargs.get("use_liger_kernel"))
    try:
        trainer.train()
    finally:
        set_mode(0)
    n_rows = timed * p["batch"]
    real, sq = n_rows * rows["real"], n_rows * rows["sq"]
    trained = real - n_rows * rows["records"]  # each record's first token predicts nothing
    seconds = clock["seconds"]
    flops = T.model_flops(model, int(real), int(trained), int(sq), lora=method != "full")
    result.update(steps=timed, rows=rows, seconds=seconds, real_tokens=real, tokens_per_s=real / seconds,
                  flops_per_s=flops / seconds, profile=clock.get("profile"))
    if gpu:  # the GPU's idle gap after a step that logs and after one that does not (ms)
        gaps = {k: clock["ends"][k].elapsed_time(clock["begins"][k + 1]) for k in clock["ends"]
                if k + 1 in clock["begins"]}
        logged = [g for k, g in gaps.items() if k % every == 0]
        quiet = [g for k, g in gaps.items() if k % every]
        result["gap_ms"] = {"logging": statistics.mean(logged) if logged else None,
                            "quiet": statistics.mean(quiet) if quiet else None}
        if logged and quiet:
            from finetune.config.training import GPU_DEFAULTS

            # What logging every GPU_DEFAULTS["logging_steps"] steps costs: its extra idle gap per step interval.
            interval = GPU_DEFAULTS["logging_steps"]
            result["log_cost_at_default"] = (result["gap_ms"]["logging"] - result["gap_ms"]["quiet"]) / 1000 / (
                interval * seconds / timed)
    if gpu:
        result.update(peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                      reserved_gib=torch.cuda.max_memory_reserved() / 2**30)
    return result


def section_rows(ctx) -> dict:
    """The issue's rows: each (model, method) as ours then TRL. Ours runs its timed steps under
    set_sync_debug_mode("error"); if a sync stops it, the error is kept and the row runs again with the checks off."""
    s, gpu, info = ctx["settings"], ctx["gpu"], ctx["info"]
    out = {"settings": {"seq": s["seq_rows"], "batches": s["batches"], "warmup": s["warmup_rows"],
                        "timed": s["timed_rows"], "logging_steps": s["logging_steps"]}, "rows": [], "notes": [],
           "matmul_peak": None}
    ctx["sections_out"]["rows"] = out
    status, res, _ = run_child("matmul-peak", matmul_peak_child, gpu, timeout=min(120, ctx["budget"].left()))
    if status == "ok":
        out["matmul_peak"] = res["peak"]
        log(f"rows: measured matmul peak {res['peak'] / 1e12:.1f} TFLOP/s ({res['sizes']})")
    liger = bool(info.get("liger")) and gpu
    if gpu and liger:
        out["notes"].append("ours runs its own chunked loss, Liger hidden: Liger's fused linear cross-entropy reads "
                            "its token count with .item() (liger_kernel/ops/fused_linear_cross_entropy.py), a sync "
                            "in every micro-batch; TRL runs with use_liger_kernel=True")
    for model, method in s["table_rows"]:
        if model not in ctx["models"]:
            out["rows"].append({"model": model, "method": method, "error": "model not built"})
            continue
        batch = s["batches"][model]
        p = dict(seq=s["seq_rows"], batch=batch, warmup=s["warmup_rows"], timed=s["timed_rows"],
                 logging_steps=s["logging_steps"], dtype="bfloat16" if gpu else "float32", liger=liger)
        row = {"model": model, "method": method, "batch": batch}
        for side in ("ours", "trl"):
            guess = s["row_guess"].get(f"{model}-{method}", 60)
            if not ctx["budget"].fits(f"{model}-{method}-{side}", guess):
                row[f"{side}_error"] = "skipped, over the time budget"
                log(f"rows {model} {method} {side}: skipped (time budget: {ctx['budget'].left():.0f} s left)")
                continue
            args = (side, ctx["models"][model]["dir"], ctx["rows_data"], str(Path(ctx["work"]) / "rows"), p, gpu,
                    method)
            if side == "trl":  # with Liger where it runs (once more without it if a kernel fails)
                status, res, secs = run_guarded(ctx, f"row-{model}-{method}-trl", "trl_rows", bench_row_child, *args, 0)
            else:  # ours without Liger (its loss kernel syncs), under the sync checks
                status, res, secs = run_child(f"row-{model}-{method}-ours", bench_row_child, True, *args, "error",
                                              timeout=ctx["budget"].left())
            if status != "ok" and side == "ours" and gpu and ctx["budget"].fits(f"{model}-{method}-{side}", secs):
                key = "ours_sync_error" if "synchroniz" in str(res).lower() else "ours_first_error"
                row[key] = _first_line(str(res).split("--- last lines")[0])
                row[key + "_detail"] = str(res)[-2500:]
                log(f"rows {model} {method} ours: FAILED under sync checks ({row['ours_sync_error']}); once more "
                    "with them off")
                status, res, secs = run_child(f"row-{model}-{method}-{side}-nochecks", bench_row_child, True, *args,
                                              0, timeout=ctx["budget"].left())
            ctx["budget"].took(f"{model}-{method}-{side}", secs)
            if status != "ok":
                row[f"{side}_error"] = str(res)[-2500:]
                log(f"rows {model} {method} {side}: FAILED: {_first_line(res)}")
                continue
            row[side] = res
            log(f"rows {model} {method} {side}: {res['tokens_per_s']:,.0f} tok/s"
                + (f", peak {res['peak_gib']:.1f} GiB (reserved {res['reserved_gib']:.1f})" if gpu else "")
                + (f", planned {res['planned_gib']:.1f} GiB" if "planned_gib" in res else "")
                + (f"; profiled step: {res['profile']['launches']} launches, {res['profile']['syncs']} syncs"
                   if res.get("profile") else "") + f" ({secs:.0f} s)")
        ours, trl = row.get("ours"), row.get("trl")
        row["ours_tokens_per_s"] = ours["tokens_per_s"] if ours else None
        row["trl_tokens_per_s"] = trl["tokens_per_s"] if trl else None
        row["ratio"] = ours["tokens_per_s"] / trl["tokens_per_s"] if ours and trl else None
        row["mfu"] = ours["flops_per_s"] / ctx["peak"] if ours and ctx["peak"] else None
        row["mfu_measured_peak"] = ours["flops_per_s"] / out["matmul_peak"] if ours and out["matmul_peak"] else None
        row["peak_gib"] = ours.get("peak_gib") if ours else None
        row["planned_gib"] = ours.get("planned_gib") if ours else None
        out["rows"].append(row)
        ctx["save"]()
    return out


def results_json(data: dict) -> dict:
    """bench/results/gpu.json: {"gpu": NAME, "rows": [{model, method, ours_tokens_per_s, trl_tokens_per_s, mfu,
    peak_gib, planned_gib}]} from a run's rows section."""
    rows = data.get("sections", {}).get("rows", {}).get("rows", [])
    keys = ("model", "method", "ours_tokens_per_s", "trl_tokens_per_s", "mfu", "peak_gib", "planned_gib")
    return {"gpu": data.get("info", {}).get("device", "?"), "rows": [{k: r.get(k) for k in keys} for r in rows]}


def render_rows(sec: dict, peak: float | None) -> list[str]:
    lines = ["### Ours against TRL (the issue's rows)", ""]
    if "error" in sec:
        return lines + [f"Section failed: {_first_line(sec['error'])}", ""]
    st = sec["settings"]
    mm = sec.get("matmul_peak")
    lines += [f"Random weights, bf16, packed {st['seq']:,}-token rows ({', '.join(f'{k}: {v} a step' for k, v in st['batches'].items())}), "
              f"{st['warmup']} warm-up steps, {st['timed']} timed steps (logging every {st['logging_steps']}), then one "
              "profiled step. Ours: finetune's packed path through its HF Trainer, timed steps under "
              "torch.cuda.set_sync_debug_mode(\"error\") (off while a step logs); TRL: SFTTrainer, packing and "
              "padding_free, Liger where it runs, the same attention for packed rows. MFU: model FLOPs over the card's "
              "dense bf16 peak" + (f" ({peak / 1e12:.0f} TFLOP/s)" if peak else "") + " and over the measured matmul peak"
              + (f" ({mm / 1e12:.0f} TFLOP/s)" if mm else "") + ".", "",
              "| model | method | ours tok/s | TRL tok/s | ours / TRL | MFU (card) | MFU (measured) | peak alloc / reserved GiB | planned GiB | launches ours / TRL | syncs ours / TRL |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, f: "-" if v is None else format(v, f)
    for r in sec.get("rows", []):
        o, t = r.get("ours") or {}, r.get("trl") or {}
        po, pt = o.get("profile") or {}, t.get("profile") or {}
        lines.append(f"| {r['model']} | {r['method']} | {fmt(r.get('ours_tokens_per_s'), ',.0f')} | "
                     f"{fmt(r.get('trl_tokens_per_s'), ',.0f')} | {fmt(r.get('ratio'), '.2f')} | {fmt(r.get('mfu'), '.1%')} | "
                     f"{fmt(r.get('mfu_measured_peak'), '.1%')} | {fmt(o.get('peak_gib'), '.1f')} / "
                     f"{fmt(o.get('reserved_gib'), '.1f')} | {fmt(r.get('planned_gib'), '.1f')} | "
                     f"{po.get('launches', '-')} / {pt.get('launches', '-')} | {po.get('syncs', '-')} / {pt.get('syncs', '-')} |")
    for r in sec.get("rows", []):
        o = r.get("ours") or {}
        if o.get("log_cost_at_default") is not None:
            lines.append(f"- {r['model']} {r['method']}: a step that logs leaves the GPU idle {o['gap_ms']['logging']:.1f} ms "
                         f"between steps, one that does not {o['gap_ms']['quiet']:.2f} ms: logging at the GPU default "
                         f"interval costs {o['log_cost_at_default']:.2%} of the throughput")
    for r in sec.get("rows", []):
        for key in ("ours_sync_error", "ours_first_error", "ours_error", "trl_error", "error"):
            if r.get(key):
                lines.append(f"- {r['model']} {r['method']} {key.replace('_', ' ')}: {_first_line(r[key])[:300]}")
    lines += [f"- {n}" for n in sec.get("notes", [])]
    return lines + [""]


def throughput_summary(tp: dict) -> list[dict]:
    """Per (model, method): each row's tokens/s and MFU, and the ratio ft/TRL within repeats, median and spread."""
    ok = [r for r in tp["results"] if "error" not in r]
    table = T.summarize(ok, tp.get("peak"))
    out = []
    for (model, method, _), rows in table.items():
        entry = {"model": model, "method": method, "rows": {}}
        for name, r in rows.items():
            entry["rows"][name] = {"tokens_per_s": r["tokens_per_s"], "mfu": r["mfu"], "repeats": r["repeats"],
                                   "peak_mb": r["peak_mb"], "steps": r["steps"], "real_tokens": r["real_tokens"],
                                   "efficiency": r["efficiency"], "trl_layout": r.get("trl_layout")}
        ft = rows.get("ft_packed", {}).get("ratios", {})
        entry["ratio"] = ft.get("best")  # against the fastest TRL row of the same repeat
        entry["ratios"] = {k: v for k, v in ft.items() if k != "best"}
        out.append(entry)
    return out


# ----------------------------------------------------------------------------------------------
# Report.


def _pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def render(data: dict) -> str:
    info = data.get("info", {})
    v = info.get("versions", {})
    device = info.get("device", "?")
    lines = [f"## GPU: {device} (bench/gpu.py)", ""]
    lines.append(f"**Command**: `{data.get('command', '?')}` ({data.get('date', '?')}; {data.get('wall', 0):.0f} s "
                 f"of a {data.get('budget', 0):.0f} s budget, {data.get('mode', '?')}).  ")
    lines.append(f"**Stack**: torch {info.get('torch')} (CUDA {info.get('cuda_runtime')}), transformers "
                 f"{v.get('transformers')}, TRL {v.get('trl')}, peft {v.get('peft')}, accelerate {v.get('accelerate')}, "
                 f"datasets {v.get('datasets')}, liger-kernel {v.get('liger-kernel') or 'not installed'}, triton "
                 f"{v.get('triton') or '-'}, flash-attn {v.get('flash-attn') or 'not installed'}; Python "
                 f"{info.get('python')}; {info.get('cores')} CPU cores"
                 + (f"; {info.get('memory_gib')} GiB, capability {info.get('capability')}" if info.get("cuda") else "")
                 + ".  ")
    if info.get("liger_note"):
        lines.append(f"**Liger**: {info['liger_note']}.  ")
    peak = data.get("peak")
    lines.append("**MFU peak**: " + (f"{peak / 1e12:.0f} TFLOP/s dense bf16 ({data.get('peak_key')} in the device "
                                     f"name, bench/throughput.py's PEAK_BF16)." if peak else "none (no known peak for "
                                     "this device: MFU not given)."))
    for name, m in data.get("models", {}).items():
        lines.append(f"**{name}**: random weights, {m['description']}.  ")
    lines.append("")
    secs = data.get("sections", {})
    if secs.get("rows") is not None:
        lines += render_rows(secs["rows"], peak)

    tp = secs.get("throughput")
    if tp is not None:
        lines += ["### Throughput", ""]
        if "error" in tp:
            lines += [f"Section failed: {_first_line(tp['error'])}", ""]
        else:
            st = tp["settings"]
            lines.append(f"bench/throughput.py's rows, {st['dtype']} weights"
                         + (" under bf16 autocast (`--bf16`)" if st.get("gpu") else " (CPU: fp32, one thread)")
                         + f", attention {st['attn']}, {st['batch']} x {st['seq']}-token rows a step, {st['warmup']} "
                         f"warm-up steps, then >= {st['min_tokens']:,} real tokens timed (about {st['timed']} steps; "
                         + ("wall time, CUDA synchronized at each step end" if st.get("gpu") else "CPU time")
                         + f"); the rows take turns, {st['repeats']} repeats, order flipped every repeat. "
                         f"ft_packed: this project's packed path; trl_packing: TRL's SFTTrainer with "
                         f"{tp.get('trl_setting')}. Medians over repeats, ± half the spread; the ratio is "
                         f"ft_packed / trl_packing within each repeat, then its median and spread (max - min over "
                         "the median).")
            lines += ["", "| model | method | ft_packed tok/s | TRL tok/s | ft / TRL | spread | MFU ft | MFU TRL | "
                          "peak GiB ft / TRL | repeats |", "|---|---|---|---|---|---|---|---|---|---|"]
            for e in tp.get("summary", []):
                ft, trl = e["rows"].get("ft_packed"), e["rows"].get("trl_packing")

                def cell(r, key="tokens_per_s"):
                    return "-" if not r else f"{r[key][0]:,.0f} ±{50 * r[key][1]:.1f}%"

                ratio = e.get("ratio")
                lines.append(
                    f"| {e['model']} | {e['method']} | {cell(ft)} | {cell(trl)} | "
                    f"{'-' if not ratio else f'{ratio[0]:.2f}x'} | {'-' if not ratio else _pct(ratio[1])} | "
                    f"{_pct(ft['mfu'][0]) if ft and ft['mfu'] else '-'} | "
                    f"{_pct(trl['mfu'][0]) if trl and trl['mfu'] else '-'} | "
                    f"{ft['peak_mb'] / 1024 if ft else 0:.1f} / {trl['peak_mb'] / 1024 if trl else 0:.1f} | "
                    f"{ft['repeats'] if ft else 0} / {trl['repeats'] if trl else 0} |")
            for note in tp.get("notes", []):
                lines.append(f"- {note}")
            failed = [r for r in tp.get("results", []) if "error" in r]
            for r in failed:
                lines.append(f"- FAILED {r['model']} {r['method']} {r['config']} (repeat {r['repeat'] + 1}): "
                             f"{_first_line(r['error'])}")
        lines.append("")

    bf = secs.get("bf16")
    if bf is not None:
        lines += ["### bf16 against fp32, and bf16 saves", ""]
        if "error" in bf:
            lines += [f"Section failed: {_first_line(bf['error'])}", ""]
        else:
            lines.append(f"finetune/train.py's pipeline on {bf['model']}, {bf['steps']} steps of {bf['batch']} x "
                         f"{bf['seq']} tokens (packed), AdamW lr 1e-4, seed 0, the same data and order; relative "
                         f"per-step loss difference against the fp32 run (bounds: {bf.get('step1_bound', 0):g} at "
                         f"step 1, {bf.get('bound', 0):g} at every step). Every final save is verified (reload, "
                         f"logits on a fixed input, limit {bf.get('save_atol', 0):g}).")
            tf32 = {r.get("tf32") for r in bf.get("runs", {}).values() if "tf32" in r}
            if tf32:
                lines.append(f"TF32 matmuls in these runs: {', '.join(map(str, sorted(tf32)))}.")
            lines += ["", "| run | loss step 1 -> last | rel. diff step 1 | max rel. diff | bound | loss check | "
                          "save: logits max diff | save check |", "|---|---|---|---|---|---|---|---|"]
            for name, r in bf.get("runs", {}).items():
                if "error" in r:
                    lines.append(f"| {name} | FAILED: {_first_line(r['error'])[:120]} | | | | | | |")
                    continue
                row = f"| {name} | {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} | "
                if "bound" in r:
                    row += (f"{r['first_rel_diff']:.2e} | {r['max_rel_diff']:.2e} | {r['bound']:g} | "
                            f"{'PASS' if r['loss_pass'] else 'FAIL'} | ")
                elif "max_rel_diff" in r:
                    row += f"{r['first_rel_diff']:.2e} | {r['max_rel_diff']:.2e} | - | (reported) | "
                elif name == "fp32":
                    row += "| | | (the reference) | "
                else:
                    row += "| | | (not compared) | "
                ver = r.get("verify")
                row += (f"{ver['max_logit_diff']:.3g} ({ver['kind']}) | {'PASS' if r.get('save_pass') else 'FAIL'} |"
                        if ver else "- | FAIL (no verified save) |")
                lines.append(row)
            for note in bf.get("notes", []):
                lines.append(f"- {note}")
        lines.append("")

    pf = secs.get("padfree")
    if pf is not None:
        lines += ["### Padding-free and packed rows against padded, on this device's kernels", ""]
        if "error" in pf:
            lines += [f"Section failed: {_first_line(pf['error'])}", ""]
        else:
            for run in pf.get("runs", []):
                if "error" in run:
                    lines.append(f"- {run['attn']}: FAILED: {_first_line(run['error'])}")
                    continue
                lines.append(f"{run['attn']}: {run['records']} records ({run['tokens']:,} tokens, lengths "
                             f"{run['lengths'][0]}-{run['lengths'][-1]}), bf16 weights under bf16 autocast, forward "
                             f"and backward; bound {pf['bound']:g} relative to the padded batch's loss: "
                             f"**{'PASS' if run['pass'] else 'FAIL'}**. "
                             + {"loss": "The control (records attending to each other) is outside the bound.",
                                "gradient": "The control (records attending to each other) stays within the loss "
                                            "bound (a random model's loss hardly depends on context) but its gradient "
                                            "norm moves 10x more than any checked layout's.",
                                None: "The control (records attending to each other) is not told apart here: this "
                                      "batch cannot show a wrong mask."}[run.get("control_detected")])
                lines += ["", "| layout | batch shape | loss | rel. diff | grad-norm rel. diff | trained tokens |",
                          "|---|---|---|---|---|---|"]
                for name, r in run["layouts"].items():
                    lines.append(f"| {name} | {r['shape']} | {r['loss']:.5f} | {r['rel_diff']:.2e} | "
                                 f"{r['grad_rel_diff']:.2e} | {r['trained']:,} |")
                lines.append("")
            for note in pf.get("notes", []):
                lines.append(f"- {note}")
        lines.append("")

    mem = secs.get("memory")
    if mem is not None:
        lines += ["### Memory planner: chunked loss and DPO", ""]
        if "error" in mem:
            lines += [f"Section failed: {_first_line(mem['error'])}", ""]
        else:
            lines.append(f"bench/memory_gpu.py's cells on {mem['model']} (bench/memory.py's worker, 3 steps, "
                         "liger-kernel hidden from it): `finetune plan`'s device total less its CUDA-context allowance "
                         f"against torch.cuda.max_memory_allocated; within {mem['bound']:.0%} marked ok.")
            lines += ["", "| cell | measured | planned | error | saved for backward measured | planned | "
                          "peak moment |", "|---|---|---|---|---|---|---|"]
            for r in mem.get("rows", []):
                if "error" in r:
                    lines.append(f"| {r['cell']} | FAILED: {_first_line(r['error'])[:150]} | | | | | |")
                    continue
                meas = f"{r['cuda'] / 2**30:.2f} GiB" if r.get("cuda") else "- (no CUDA)"
                err = f"{r['rel_error']:+.1%} {'ok' if r['within'] else 'OFF'}" if "rel_error" in r else "-"
                saved = f"{r['saved_measured'] / 2**20:,.0f} MiB" if r.get("saved_measured") else "-"
                lines.append(f"| {r['cell']} | {meas} | {r['device'] / 2**30:.2f} GiB | {err} | {saved} | "
                             f"{r['saved_planned'] / 2**20:,.0f} MiB | {r.get('moment', '')} |")
            for note in mem.get("notes", []):
                lines.append(f"- {note}")
        lines.append("")

    if secs.get("long") is not None:
        lines += render_long(secs["long"])

    prof = secs.get("profile")
    if prof is not None:
        lines += ["### Profile: the packed step taken apart", ""]
        if "error" in prof:
            lines += [f"Section failed: {_first_line(prof['error'])}", ""]
        else:
            lines += [f"{prof['model']}, full fine-tuning, the throughput rows' settings; one step of ft_packed and of "
                      "trl_packing under torch.profiler after the timed ones.", "",
                      "| variant | tok/s | step | profiled step: self CPU | self device | top op by self CPU |",
                      "|---|---|---|---|---|---|"]
            for name, r in prof["variants"].items():
                if "error" in r:
                    lines.append(f"| {name} | {_first_line(r['error'])[:150]} | | | | |")
                    continue
                p = r.get("profile") or {}
                top = p.get("top", [{}])[0] if p.get("top") else {}
                lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {1000 * r['step_s']:,.0f} ms | "
                             + (f"{p['total_self_cpu_ms']:,.0f} ms | {p.get('total_self_device_ms', 0):,.0f} ms | "
                                f"{top.get('op', '')[:50]} ({top.get('self_cpu_ms', 0):,.0f} ms, {top.get('calls', 0)} "
                                "calls) |" if p else "| | |"))
        lines.append("")
    for note in data.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines).rstrip("\n") + "\n"


RESULTS_DIR = REPO / "bench" / "results"


def record(json_path: str, results: Path = REPO / "bench" / "RESULTS.md") -> str:
    """Put the run's section into RESULTS.md: replaces the section of the same device (same heading), else appends;
    a run with the rows section writes bench/results/gpu.json (beside RESULTS.md) too."""
    data = json.loads(Path(json_path).read_text())
    section = render(data)
    if "rows" in data.get("sections", {}):
        folder = results.parent / "results"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "gpu.json").write_text(json.dumps(results_json(data), indent=1))
    heading = section.splitlines()[0]
    text = results.read_text() if results.exists() else "# Benchmarks\n"
    start = text.find(heading + "\n")
    if start >= 0:
        end = text.find("\n## ", start + 1)
        text = text[:start] + section.rstrip("\n") + "\n" + (text[end:] if end >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    results.write_text(text)
    return section


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    return obj


# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    global CTX, LOGS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="every section on CPU with tiny shapes (no GPU needed)")
    ap.add_argument("--budget", type=float, default=None, help="seconds from the start (GPU default 450)")
    ap.add_argument("--write", default=None, metavar="DIR", help="write gpu.json, gpu.md and logs/ there")
    ap.add_argument("--work", default=None, help="models, data, run folders (default: a folder under /tmp)")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=None,
                    help="default on a GPU: long (at most 90 s) then rows (the issue's table, 7 minutes); every "
                         "section with --cpu-smoke")
    ap.add_argument("--models", nargs="+", default=None, help="build and use only these models (default: all)")
    ap.add_argument("--repeats", type=int, default=None, help="throughput repeats (default 3)")
    ap.add_argument("--long-seq", type=int, default=None,
                    help="the long section's record length (default 32,768 on a GPU; 65,536 shows the offload "
                         "better, at about twice the time)")
    ap.add_argument("--start-method", choices=["fork", "spawn"], default="fork",
                    help="how children start (fork: modules already imported; spawn: what a parent that initialized "
                         "CUDA falls back to, by itself)")
    ap.add_argument("--record", default=None, metavar="JSON", help="put a run's section into bench/RESULTS.md, exit")
    ap.add_argument("--results", default=str(REPO / "bench" / "RESULTS.md"), help="the file --record writes")
    args = ap.parse_args(argv)
    if args.record:
        print(record(args.record, Path(args.results)))
        return 0

    mode = "cpu-smoke" if args.cpu_smoke else "gpu"
    s = dict(SETTINGS[mode])
    args.sections = args.sections or list(DEFAULT_SECTIONS[mode])
    if args.repeats:
        s["repeats"] = args.repeats
    if args.long_seq:
        s["long_seq"] = args.long_seq
    if args.models:
        s["models"] = {k: v for k, v in s["models"].items() if k in args.models}
    gpu = not args.cpu_smoke
    budget = Budget(args.budget or s["budget"])
    work = Path(args.work or f"/tmp/finetune-bench-gpu-{mode}")
    work.mkdir(parents=True, exist_ok=True)
    out_dir = Path(args.write) if args.write else None
    LOGS = (out_dir or work) / "logs"
    LOGS.mkdir(parents=True, exist_ok=True)
    cmd = os.environ.get("FINETUNE_GPU_COMMAND") or " ".join(["python3" if gpu else ".venv/bin/python",
                                                              "bench/gpu.py", *(argv if argv is not None else sys.argv[1:])])
    data: dict = {"mode": mode, "command": cmd, "argv": sys.argv, "budget": budget.seconds, "notes": [],
                  "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", "sections": {}}
    log(f"bench/gpu.py {mode}: budget {budget.seconds:.0f} s, sections {' '.join(args.sections)}, work {work}")

    import multiprocessing as mp

    # Everything heavy is imported once here; every child is forked with it loaded.
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import finetune.training.hf_trainer  # noqa: F401
    import finetune.training.trainer  # noqa: F401
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError as e:
        data["notes"].append(f"TRL or datasets does not import ({e}): its rows fail")
    CTX = mp.get_context(args.start_method)
    log(f"imported torch {torch.__version__}, transformers {transformers.__version__}; CUDA initialized in this "
        f"process: {torch.cuda.is_initialized()}")
    if torch.cuda.is_initialized() and args.start_method == "fork":
        CTX = mp.get_context("spawn")
        data["notes"].append("CUDA was initialized in the parent by an import: children spawned, not forked (slower)")

    status, info, secs = run_child("device", device_child, gpu, timeout=min(180, budget.left()))
    if status != "ok" and gpu and args.start_method == "fork" and "no result within" not in str(info):
        log(f"device check in a forked child failed ({_first_line(info)}); trying spawned children")
        CTX = mp.get_context("spawn")
        data["notes"].append("a forked child could not use CUDA: children spawned, not forked (slower)")
        status, info, secs = run_child("device", device_child, gpu, timeout=min(180, budget.left()))
    if status != "ok":
        log(f"device check FAILED: {info}")
        data["error"] = f"device check failed: {info}"
        data["info"] = {}
        return _finish(data, out_dir, work, 1)
    data["info"] = info
    peak, key = peak_for(info["device"]) if gpu else (None, "")
    data["peak"], data["peak_key"] = peak, key
    where = (f" ({info['memory_gib']} GiB, capability {info['capability']}, {info['device_count']} visible)"
             if gpu else "")
    log(f"device {info['device']}{where}; " + (f"MFU peak {peak / 1e12:.0f} TFLOP/s dense bf16 ({key} in the name)"
                                               if peak else "no known bf16 peak: MFU not given"))
    log(f"liger: {info.get('liger_note')}; flash-attn: {info.get('flash_attn')}; versions {info['versions']}")
    if gpu and info.get("device_count", 1) > 1:
        data["notes"].append(f"{info['device_count']} GPUs visible: every child uses cuda:0")

    # Models and data (a child: the 1B model is built on the GPU). Only those the sections asked for use.
    wanted = {m for section, ms in (("padfree", [s["padfree_model"]]), ("bf16", [s["bf16_model"]]),
                                    ("memory", [s["memory_model"]]), ("throughput", list(s["models"])),
                                    ("profile", [s["bf16_model"]]), ("rows", [m for m, _ in s["table_rows"]]),
                                    ("long", [s["long_model"]]))
              if section in args.sections for m in ms}
    shapes = {**s["models"], **{k: globals()[v] for k, v in s["row_models"].items()}}
    models = {}
    for name, dims in shapes.items():
        if name not in wanted:
            continue
        folder = work / "models" / name
        st, res, secs = run_child(f"build-{name}", build_child, str(folder), dims, gpu, timeout=max(60, budget.left()))
        if st != "ok":
            log(f"model {name}: FAILED to build: {_first_line(res)}")
            data["notes"].append(f"model {name} not built: {_first_line(res)}")
            continue
        models[name] = {"dir": str(folder), **res}
        log(f"model {name}: {res['description']} ({secs:.0f} s)")
    data["models"] = models
    from finetune.models import tiny

    data_file = tiny.write_jsonl(work / "mixed.jsonl", T.mixed_records(s["records"], s["seq"], seed=0))
    rows_data = tiny.write_jsonl(work / "rows.jsonl", T.mixed_records(s["row_records"], s["seq_rows"], seed=0))
    ctx = {"settings": s, "info": info, "gpu": gpu, "budget": budget, "models": models, "data": str(data_file),
           "rows_data": str(rows_data),
           "work": str(work), "peak": peak, "peak_key": key, "no_liger": bool(gpu and info.get("liger") is False),
           "sections": args.sections, "liger_failed": {}, "save": lambda: _save(data, out_dir, work),
           "sections_out": data["sections"]}
    for section, fn in (("long", section_long), ("rows", section_rows), ("padfree", section_padfree),
                        ("bf16", section_bf16), ("memory", section_memory), ("throughput", section_throughput),
                        ("profile", section_profile)):
        if section not in args.sections:
            continue
        needed = {"padfree": [s["padfree_model"]], "bf16": [s["bf16_model"]], "memory": [s["memory_model"]],
                  "throughput": list(s["models"]), "profile": [s["bf16_model"]], "rows": [],
                  "long": [s["long_model"]]}[section]
        if not all(m in models for m in needed) and not (section == "throughput" and models):
            data["sections"][section] = {"error": f"model(s) {', '.join(m for m in needed if m not in models)} "
                                                  "were not built"}
            continue
        log(f"== {section} ({budget.left():.0f} s left)")
        try:
            data["sections"][section] = fn(ctx)
        except Exception as e:  # noqa: BLE001 - one section's failure must not cost the others
            log(f"section {section} FAILED: {type(e).__name__}: {e}")
            data["sections"][section] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"}
        if section == "throughput" and "error" not in data["sections"][section]:
            try:
                data["sections"][section]["summary"] = throughput_summary(data["sections"][section])
            except Exception as e:  # noqa: BLE001
                data["sections"][section]["summary_error"] = f"{type(e).__name__}: {e}"
        _save(data, out_dir, work)
    if ctx["liger_failed"]:
        data["notes"].append("liger-kernel hidden after a failure with it, for: " + "; ".join(
            f"{k} ({v})" for k, v in ctx["liger_failed"].items()))
    return _finish(data, out_dir, work, 0)


def _save(data: dict, out_dir: Path | None, work: Path) -> None:
    """The JSON so far (a run killed from outside still leaves every finished section)."""
    data["wall"] = time.time() - T0
    text = json.dumps(_jsonable(data), indent=1)
    for folder in filter(None, (work, out_dir)):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "gpu.json").write_text(text)


def _finish(data: dict, out_dir: Path | None, work: Path, code: int) -> int:
    data["wall"] = time.time() - T0
    data = _jsonable(data)
    (work / "gpu.json").write_text(json.dumps(data, indent=1))
    try:
        report = render(data)
    except Exception as e:  # noqa: BLE001 - the JSON is written; the report can be made later with --record
        report = f"(report failed: {type(e).__name__}: {e}; the JSON has every number)\n"
    print("\n" + report, flush=True)
    verdicts = verdict_lines(data)
    for line in verdicts:
        print(line, flush=True)
    if "rows" in data.get("sections", {}):
        # bench/results/gpu.json: the rows' summary (the GPU run's in this checkout too; --record writes it later).
        table = json.dumps(results_json(data), indent=1)
        for folder in filter(None, (out_dir / "results" if out_dir else None,
                                    RESULTS_DIR if data.get("mode") == "gpu" else None)):
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "gpu.json").write_text(table)
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "gpu.json").write_text(json.dumps(data, indent=1))
        (out_dir / "gpu.md").write_text(report)
        log(f"wrote {out_dir / 'gpu.json'} and {out_dir / 'gpu.md'}; record later with "
            f"`python bench/gpu.py --record gpu.json`")
    log(f"done in {data['wall']:.0f} s")
    return code


def verdict_lines(data: dict) -> list[str]:
    """One line per check: PASS / FAIL / not run."""
    out = []
    secs = data.get("sections", {})
    for r in secs.get("rows", {}).get("rows", []):
        ratio = r.get("ratio")
        out.append(f"CHECK rows {r['model']} {r['method']}: " + (
            f"ours / TRL {ratio:.2f}x ({'PASS' if ratio >= 1.2 else 'FAIL'} against 1.2x)" if ratio else "no ratio")
            + (f"; MFU {r['mfu']:.1%}" if r.get("mfu") else "")
            + (f"; peak {r['peak_gib']:.1f} GiB, planned {r['planned_gib']:.1f} GiB "
               f"({(r['planned_gib'] - r['peak_gib']) / r['peak_gib']:+.1%})" if r.get("peak_gib") and
               r.get("planned_gib") else "")
            + ("; a sync stopped ours under set_sync_debug_mode('error')" if r.get("ours_sync_error") else "")
            + (f"; logging at the default interval costs {r['ours']['log_cost_at_default']:.2%} "
               f"({'PASS' if r['ours']['log_cost_at_default'] <= 0.01 else 'FAIL'} against 1%)"
               if (r.get("ours") or {}).get("log_cost_at_default") is not None else ""))
    pf = secs.get("padfree", {})
    for run in pf.get("runs", []):
        out.append(f"CHECK padfree {run['attn']}: " + ("FAILED to run" if "error" in run else
                                                       ("PASS" if run["pass"] else "FAIL")))
    for name, r in secs.get("bf16", {}).get("runs", {}).items():
        if "error" in r:
            out.append(f"CHECK bf16 {name}: FAILED to run")
            continue
        if "loss_pass" in r:
            out.append(f"CHECK bf16 {name} loss vs fp32: {'PASS' if r['loss_pass'] else 'FAIL'} "
                       f"(max rel diff {r['max_rel_diff']:.2e}, bound {r['bound']:g})")
        out.append(f"CHECK bf16 {name} save reload: {'PASS' if r.get('save_pass') else 'FAIL'}")
    for r in secs.get("memory", {}).get("rows", []):
        if "error" in r:
            out.append(f"CHECK memory {r['cell']}: FAILED to run")
        elif "rel_error" in r:
            out.append(f"CHECK memory {r['cell']}: planner {r['rel_error']:+.1%} "
                       f"({'within' if r['within'] else 'OUTSIDE'} {MEMORY_RTOL:.0%})")
    lg = secs.get("long", {})
    for r in lg.get("modes", []):
        if "refused" in r:
            out.append(f"CHECK long {r['mode']}: needs CUDA (not run)")
        elif "skipped" in r or "error" in r:
            out.append(f"CHECK long {r['mode']}: " + ("skipped (time)" if "skipped" in r else "FAILED to run"))
        elif "rel_error" in r:
            out.append(f"CHECK long {r['mode']}: planner {r['rel_error']:+.1%} ({'within' if r['within'] else 'OUTSIDE'} "
                       f"{MEMORY_RTOL:.0%}), peak {_bytes(r['cuda'])}, step {r['step_s']:.2f} s")
    if "loss_pass" in lg:
        out.append(f"CHECK long step-1 losses equal across modes: {'PASS' if lg['loss_pass'] else 'FAIL'} "
                   f"(max rel diff {lg['max_loss_rel_diff']:.1e}, bound {LONG_LOSS_RTOL:g})")
    for e in secs.get("throughput", {}).get("summary", []):
        ratio = e.get("ratio")
        out.append(f"CHECK throughput {e['model']} {e['method']}: " + (
            f"ft_packed / trl_packing {ratio[0]:.2f}x (spread {100 * ratio[1]:.1f}%)" if ratio else "no ratio"))
    for name, sec in secs.items():
        if "error" in sec:
            out.append(f"CHECK section {name}: FAILED ({_first_line(sec['error'])})")
    return out


if __name__ == "__main__":
    sys.exit(main())
