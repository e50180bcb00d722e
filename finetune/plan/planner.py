"""`finetune plan`: predict per-device and per-host memory before training, and pick the preset that fits.

    finetune plan --model_name_or_path ./llama-70b --devices_per_node 8 --device_memory 80GB --host_memory 2TB
    finetune plan --recipe recipe.yaml --config zero2 --per_device_train_batch_size 4 --json

The same model/method/preset/batch/sequence flags (and recipe keys) as `finetune train`, plus the plan-only
flags --devices_per_node, --num_nodes, --device_memory, --host_memory, --accelerator and --json. Only the
model's config.json is read: no weights are loaded, so a 70B config plans in seconds on any machine.

The arithmetic (docs/plan.md has the derivation and what was measured):

- model states (parameters, gradients, optimizer states) follow the ZeRO paper: mixed-precision Adam keeps
  2 + 2 + 12 bytes per parameter; ZeRO-1 divides the 12 by the number of data-parallel ranks, ZeRO-2 also
  the gradients, ZeRO-3 everything. On CPU the run is fp32 and this module reproduces what DeepSpeed
  0.19 and torch actually allocate, byte for byte (bench/memory.py counts the tensors): flat buffers padded to
  2 x ranks elements (ZeRO-1/2), per-parameter padding to the number of ranks (ZeRO-3), DeepSpeed's separate
  fp32 master partition even when the weights are fp32, and one 4-byte `step` tensor per AdamW parameter.
- activations are counted tensor by tensor from what autograd saves in a Hugging Face Llama layer (SDPA
  attention, SwiGLU MLP, RMSNorm), for full fine-tuning and LoRA, with and without gradient checkpointing; a
  vision-language model's image records add what its tower and projector save (the family's, per image or tile,
  nothing when frozen), the pictures taken from the processor's saved settings (--images_per_record, --image_size).
- framework overhead is a measured constant (CPU) or a stated allowance (GPU).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from types import SimpleNamespace

from finetune import methods
from finetune.config.parser import ConfigError
from finetune.models import attention, families
from finetune.models.families import Images, ModelShape, Saving, Tensor
from finetune.models.hub import looks_like_repo_id

LSE_ROWS = 32  # finetune.training.loss.LSE_ROWS (that module imports torch; this one must not)

# ----------------------------------------------------------------------------------------------
# Sizes.

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


# Sanity bounds on the machine flags: past them a plan's advice ("use more devices") would be nonsense.
MAX_DEVICES_PER_NODE = 1024
MAX_DEVICES = 1_000_000


def parse_size(text: str | int | float) -> int:
    """'80GB' -> 80e9 bytes (decimal units, as GPU and RAM sizes are sold); 'GiB' units are binary."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 80GB, 2TB, 24GiB, 512MB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n: float) -> str:
    n = float(n)
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


# ----------------------------------------------------------------------------------------------
# The model, from config.json only.


def model_shape(d: dict[str, Any]) -> ModelShape:
    """The sizes in a config.json dict, read by the model's family; an unknown family is refused by name."""
    return families.family_of(d).shape(d)


_NO_DECAY = [re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")]


def is_decay(name: str) -> bool:
    """transformers.Trainer.get_decay_parameter_names: biases and norm weights get no weight decay."""
    return not any(p.search(name.lower()) for p in _NO_DECAY)


def lora_tensors(shape: ModelShape, r: int, targets: list[str]) -> list[Tensor]:
    """peft's trainable tensors for rank r, as the model's family lays them out (finetune.models.families)."""
    out = shape.family.lora_tensors(shape, r, targets)
    if shape.head_outputs:  # a reward model's score head trains whole beside the adapters (peft's modules_to_save)
        out.append(Tensor("base_model.model.score.modules_to_save.default.weight", (shape.head_outputs,
                                                                                     shape.hidden_size), "head"))
    return out


# ----------------------------------------------------------------------------------------------
# The parallelism strategy, from a preset name or a DeepSpeed JSON.

# DeepSpeed's defaults for keys a JSON leaves out (deepspeed/runtime/zero/config.py).
_DS_DEFAULTS = {
    "reduce_bucket_size": 500_000_000, "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000, "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "sub_group_size": 1_000_000_000, "contiguous_gradients": True,
}
# Relative step throughput, only to order candidates that fit (communication and offload cost); not measured.
_SPEED = {"ddp": 1.0, "zero1": 0.97, "zero2": 0.93, "fsdp2": 0.85, "zero3_no_offload": 0.8, "zero3": 0.4,
          "fsdp2_offload": 0.3, "zero3_nvme": 0.15}


@dataclass(frozen=True)
class Strategy:
    name: str  # the --config value
    stage: int  # 0 = DDP
    offload_optimizer: bool = False
    offload_param: bool = False
    ds_optimizer: bool = False  # the JSON has an "optimizer" section: DeepSpeed builds it (one param group)
    raw: dict = field(default_factory=dict, compare=False, hash=False)
    nvme: tuple[str, ...] = ()  # what is offloaded to NVMe rather than host memory: "optimizer", "parameters"
    fsdp: bool = False  # FSDP2 (fully_shard): stage 0 here, every model state sharded per parameter

    @classmethod
    def from_preset(cls, preset) -> "Strategy":
        """The strategy of a finetune.config.Preset (the run's own, read once)."""
        if getattr(preset, "is_fsdp", False):
            offload = preset.offload_param is not None
            return cls(preset.name, 0, offload, offload, fsdp=True)
        if not preset.is_deepspeed:
            return cls(preset.name, 0)
        nvme = tuple(w for w, where in (("optimizer", preset.offload_optimizer), ("parameters", preset.offload_param))
                     if where == "nvme")
        return cls(preset.name, preset.stage, preset.offload_optimizer is not None, preset.offload_param is not None,
                   preset.own_optimizer, preset.ds_config.get("zero_optimization") or {}, nvme)

    @classmethod
    def from_config(cls, name: str) -> "Strategy":
        """The strategy of a preset name or DeepSpeed JSON path (read here); ConfigError if it is neither."""
        from finetune import config as C

        return cls.from_preset(C.Preset.named(name))

    def setting(self, key: str, hidden: int) -> int:
        """A zero_optimization value with transformers' 'auto' rules (hidden-size based) and DeepSpeed's defaults."""
        value = self.raw.get(key, _DS_DEFAULTS.get(key))
        if value == "auto":
            value = {"reduce_bucket_size": hidden * hidden, "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
                     "stage3_param_persistence_threshold": 10 * hidden}.get(key, _DS_DEFAULTS.get(key))
        return int(value)

    @property
    def shards_parameters(self) -> bool:
        """Parameters live sharded and are gathered per layer for compute (ZeRO-3, FSDP2)."""
        return self.stage == 3 or self.fsdp

    def describe(self) -> str:
        if self.fsdp:
            return ("FSDP2 (parameters, gradients and optimizer states sharded per parameter"
                    + ("; parameters, gradients and the optimizer step offloaded to CPU" if self.offload_param else "")
                    + ")")
        if self.stage == 0:
            return "DDP (full model, gradients and optimizer on every device)"
        what = {1: "optimizer states partitioned", 2: "optimizer states and gradients partitioned",
                3: "parameters, gradients and optimizer states partitioned"}[self.stage]
        off = [w for w, on in (("optimizer", self.offload_optimizer), ("parameters", self.offload_param)) if on]
        where = "NVMe" if self.nvme else "CPU"
        return f"ZeRO-{self.stage} ({what}" + (f"; {' and '.join(off)} offloaded to {where}" if off else "") + ")"


# ----------------------------------------------------------------------------------------------
# What is planned.


@dataclass
class Workload:
    """What the planner predicts memory for: a model's shape under a parallelism strategy, with the batch, sequence
    length, precision, LoRA, quantization and the method's terms of one training run."""

    shape: ModelShape
    strategy: Strategy
    world_size: int = 1
    devices_per_node: int = 1
    micro_batch: int = 1
    seq_len: int = 1024
    grad_accum: int = 1
    grad_ckpt: bool = False
    accelerator: str = "cpu"  # cpu | gpu
    weight_dtype: str = "float32"  # what the weights are loaded as
    mixed_precision: str | None = None  # "bf16" / "fp16" (--bf16/--fp16) or None
    use_peft: bool = False
    lora_r: int = 16
    lora_targets: tuple[str, ...] = ("all-linear",)
    lora_dropout: float = 0.05
    quant: str | None = None  # "8bit" | "4bit"
    bnb_nested: bool = False
    padding_mask: bool = True  # batches padded to the longest record carry an attention mask (worst case)
    # Packed rows under per-record sdpa (finetune.models.attention): no mask, position ids (so rotary cos/sin) per
    # row, and the records' attention outputs joined into a copy that o_proj takes as its input.
    per_record_attention: bool = False
    loss_chunk: int = 0  # --loss_chunk_size: tokens per chunk of the chunked cross-entropy (0: transformers' loss)
    # The method's terms (finetune.methods.base.PlannerTerms): examples as pairs, two rows (chosen, rejected) scored
    # by log-probabilities (DPO); a frozen copy of the weights beside the trained ones (DPO full fine-tuning).
    pairs: bool = False
    reference_copy: bool = False
    method_note: str = ""  # the method's words for the plan's method line
    # A method that generates (GRPO, RLOO): completions per prompt (each micro-batch of prompts trains this many rows
    # per prompt, seq_len then counting prompt and completion), and the completion's longest length.
    generations: int = 0
    completion_length: int = 0
    # A vision-language model's image records: the pictures of one record (each row of a micro-batch has them) as its
    # tower takes them (None: text records), and whether the tower and projector train (--freeze_vision_tower false).
    images: Images | None = None
    tower_trains: bool = False
    processor_bytes: int = 0  # the model's processor in each training process (image records: the collator's)
    # --sequence_parallel_size: each row's tokens split over this many ranks (DeepSpeed Ulysses), which hold a slice
    # of every activation over the sequence, and exchange the attention's inputs and output by all-to-all.
    sequence_parallel: int = 1
    # --tiled_mlp (finetune.models.tiled): each layer's MLP a tile of `tile` positions at a time, recomputed in
    # backward; --offload_activations: the checkpointed layer inputs in host memory (a GPU run).
    tiled_mlp: bool = False
    offload_activations: bool = False

    @property
    def tile(self) -> int:
        """Positions per tile of the tiled MLP (finetune.models.tiled.tile_tokens: the hidden size)."""
        return min(self.seq_len, self.shape.hidden_size)

    @property
    def rows(self) -> int:
        """Sequences per micro-batch."""
        return self.micro_batch * (2 if self.pairs else 1) * max(1, self.generations)

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.devices_per_node))

    def replace(self, **kw) -> "Workload":
        return dataclasses.replace(self, **kw)


@dataclass(frozen=True)
class Precision:
    name: str
    weight: int  # bytes per working weight
    grad: int  # bytes per gradient element
    master: int  # bytes of a separate fp32 master copy (0: none)
    optim: int  # bytes of optimizer state per trainable parameter (Adam m + v)
    act: int  # bytes per activation element
    note: str


def fp32_adapters(job: Workload) -> bool:
    """peft keeps the LoRA adapters in fp32 on a 16-bit base (autocast_adapter_dtype) and casts each target's input
    to fp32: their states and what the LoRA branch saves are fp32 (measured on a GPU, bench/memory_gpu.py)."""
    return job.use_peft and precision_of(job).name == "bf16"


def precision_of(job: Workload) -> Precision:
    """The bytes per element of each model state, for this job.

    - CPU / fp32 (validated byte for byte): 4 weights + 4 grads + 8 Adam. DeepSpeed ZeRO still clones a
      separate fp32 master partition (another 4 bytes, divided by the ranks); plain DDP keeps none.
    - GPU, DeepSpeed: mixed-precision Adam as in the ZeRO paper, 2 + 2 + 12 (4 fp32 master + 8 Adam).
    - GPU, DDP with 16-bit weights (torch_dtype auto on a bf16 GPU): the HF Trainer's AdamW keeps its states in
      the parameter dtype, no fp32 master: 2 + 2 + 4.
    - GPU, DDP with fp32 weights and --bf16/--fp16 (autocast): 4 + 4 + 8, activations in 16 bits.
    """
    wbytes = {"float32": 4, "bfloat16": 2, "float16": 2}[job.weight_dtype]
    if job.strategy.fsdp and job.mixed_precision:
        return Precision("fsdp-mixed", 2, 4, 0, 8, 2, "FSDP2 mixed precision: fp32 sharded weights, gradients and Adam "
                                                      "states (4 + 4 + 8, accelerate upcasts them), 16-bit gathered "
                                                      "weights and activations")
    if job.strategy.stage > 0 and (job.mixed_precision or wbytes == 2):
        return Precision("mixed", 2, 2, 4, 8, 2, "mixed-precision Adam (ZeRO paper): 2 weights + 2 grads + 12 optimizer (4 fp32 master + 8 Adam)")
    if wbytes == 2:
        return Precision("bf16", 2, 2, 0, 4, 2, "16-bit weights, AdamW states in the weight dtype: 2 + 2 + 4")
    if job.mixed_precision:
        return Precision("fp32+autocast", 4, 4, 0, 8, 2, "fp32 weights with 16-bit autocast: 4 + 4 + 8, 16-bit activations")
    master = 4 if job.strategy.stage > 0 else 0
    note = "fp32: 4 weights + 4 grads + 8 Adam" + (" + 4 fp32 master partition (DeepSpeed clones one)" if master else "")
    return Precision("fp32", 4, 4, master, 8, 4, note)


# ----------------------------------------------------------------------------------------------
# Model states, per rank.


def _quant_bytes(t: Tensor, quant: str | None, nested: bool) -> int | None:
    """bitsandbytes storage of a frozen linear weight; None for tensors that stay unquantized."""
    if quant is None or t.kind != "linear":
        return None
    out_features = t.shape[0]
    if quant == "8bit":
        return t.numel + 4 * out_features  # int8 weights + one fp32 scale per output row (SCB)
    blocks = math.ceil(t.numel / 64)  # 4-bit: two values a byte, one absmax per 64-value block
    absmax = blocks + 4 * math.ceil(blocks / 256) if nested else 4 * blocks
    return math.ceil(t.numel / 2) + absmax


@dataclass
class StateBytes:
    """Bytes of one rank's model states, split by where they live."""

    params: int = 0
    grads: int = 0
    optim: int = 0
    host_params: int = 0
    host_grads: int = 0
    host_optim: int = 0
    buffers: int = 0  # DeepSpeed reduce buckets, DDP gradient buckets: alive through training
    backward_buffers: int = 0  # alive during backward only (ZeRO-1/2 reduce bucket)
    step_transient: int = 0  # extra while the optimizer steps (DeepSpeed's flattened fp32 gradient of a group)
    gathered: int = 0  # ZeRO-3: parameters gathered for the layer being computed (plus prefetch)
    persistent: int = 0  # ZeRO-3: small parameters kept whole on every rank
    other: int = 0
    disk: int = 0  # ZeRO-Infinity: swapped to NVMe
    notes: list[str] = field(default_factory=list)

    @property
    def device_total(self) -> int:
        return self.params + self.grads + self.optim + self.buffers + self.persistent + self.other

    @property
    def host_total(self) -> int:
        return self.host_params + self.host_grads + self.host_optim


def _groups(job: Workload, trainable: list[Tensor]) -> list[list[Tensor]]:
    """The optimizer's param groups: the Trainer's (decay, no-decay), or one group if DeepSpeed builds the optimizer."""
    if job.strategy.ds_optimizer:
        return [trainable]
    return [[t for t in trainable if is_decay(t.name)], [t for t in trainable if not is_decay(t.name)]]


def _overlap(group: list[Tensor], lo: int, hi: int, ends: list[int] | None = None) -> int:
    """Elements of the tensors that touch [lo, hi) of the group's flat buffer (DeepSpeed's params_in_partition).
    `ends`: the group's cumulative tensor ends, when the caller has them."""
    import bisect
    import itertools

    ends = ends if ends is not None else list(itertools.accumulate(t.numel for t in group))
    first = bisect.bisect_right(ends, lo)  # the first tensor ending after lo
    last = bisect.bisect_left(ends, hi)  # the last tensor starting before hi (its end is >= hi, or it is the last)
    last = min(last, len(group) - 1)
    if first > last:
        return 0
    return ends[last] - (ends[first - 1] if first else 0)


def _worst_zero12_rank(job: Workload, groups: list[list[Tensor]]) -> int:
    """The rank holding the most gradient elements under ZeRO-1/2 (tensors cut by its partition's edges).

    A rank's count changes only next to a rank whose partition holds a tensor boundary or the group's end (in
    between, every rank lies inside the same tensors), so only those ranks are compared: the work grows with the
    number of tensors, not with the world size (a plan for 10**15 devices takes as long as one for 8)."""
    import itertools

    n = job.world_size
    sizes, candidates = [], {0, n - 1}
    for g in groups:
        ends = list(itertools.accumulate(t.numel for t in g))
        numel = ends[-1] if ends else 0
        part = math.ceil(numel / (2 * n)) * 2 * n // n
        sizes.append((ends, numel, part))
        for e in (0, *ends):
            r = e // max(part, 1)
            candidates.update(x for x in (r - 1, r, r + 1) if 0 <= x < n)
    best, worst = -1, 0
    for r in sorted(candidates):
        held = sum(_overlap(g, r * part, (r + 1) * part, ends) + max(0, min(part, (r + 1) * part - numel))
                   for g, (ends, numel, part) in zip(groups, sizes))
        if held > best:
            best, worst = held, r
    return worst


def model_states(job: Workload, rank: int | None = None) -> StateBytes:
    """Per-rank bytes of parameters, gradients and optimizer states; `rank` None = the largest rank."""
    n = job.world_size
    if rank is None:
        # Ranks differ only under ZeRO-1/2 (tensors cut by a partition edge) and by the last rank's padding.
        candidates = {0, n - 1}
        if job.strategy.stage in (1, 2) and n > 2:
            trainable = trained_and_frozen(job)[0]
            candidates.add(_worst_zero12_rank(job, [g for g in _groups(job, trainable) if g]))
        return max((model_states(job, r) for r in candidates), key=lambda s: s.device_total + s.host_total + s.step_transient)
    prec = precision_of(job)
    strat = job.strategy
    h = job.shape.hidden_size
    base = job.shape.tensors()
    trainable, frozen = trained_and_frozen(job)
    tensors_in_optimizer = [g for g in _groups(job, trainable) if g]
    s = StateBytes()
    # Frozen base weights (LoRA): bitsandbytes-quantized linears, the rest as loaded (finetune.models.quant's
    # prepare_for_training keeps embeddings, norms and lm_head in the load dtype; peft's would make them fp32).
    frozen_elt = prec.weight
    frozen_bytes = [(_quant_bytes(t, job.quant, job.bnb_nested) or frozen_elt * t.numel) for t in frozen]
    # torch's (fused) AdamW keeps a 4-byte `step` tensor per parameter it optimizes; DeepSpeed's CPU Adam keeps an int.
    step_bytes_per_tensor = 0 if (strat.ds_optimizer and strat.offload_optimizer) else 4

    if strat.fsdp:
        return _fsdp_states(job, s, prec, trainable, frozen, frozen_bytes, rank)
    if strat.stage == 0:
        numel = sum(t.numel for t in trainable)
        w, g, o = prec.weight, prec.grad, prec.optim
        if fp32_adapters(job):
            w, g, o = 4, 4, 8
        s.params = w * numel + sum(frozen_bytes)
        s.grads = g * numel
        s.optim = o * numel + step_bytes_per_tensor * len(trainable)
        if n > 1 and job.sequence_parallel == 1:
            # DistributedDataParallel's reducer keeps gradient buckets as large as all gradients
            # (gradient_as_bucket_view=False, accelerate's default): a second gradient copy. With sequence parallelism
            # --config ddp runs on the engine path only (the loop refuses it), whose DeepSpeed stage 0 keeps none
            # (measured: bench/longest.py's split probes, 7-10% over with the copy counted, 1.6-3.0% under without).
            s.buffers = prec.grad * numel
            s.notes.append("DDP gradient buckets: a second copy of the gradients (gradient_as_bucket_view=False)")
        return s

    if strat.stage in (1, 2):
        # stage_1_and_2.py: each group is flattened into one buffer padded to a multiple of 2 x ranks elements
        # (4-byte alignment of 16-bit partitions) and split into equal partitions; the model's weights become
        # views into the full flat buffer. Each rank clones its partition as the fp32 master.
        partitions = []
        for group in tensors_in_optimizer:
            numel = sum(t.numel for t in group)
            padded = math.ceil(numel / (2 * n)) * 2 * n
            partitions.append((group, padded, padded // n))
        s.params = prec.weight * sum(p for _, p, _ in partitions) + sum(frozen_bytes)
        master = sum(part for _, _, part in partitions)
        # Gradients: the tensors touching this rank's partition are copied whole into one contiguous buffer
        # (grads_in_partition, in the weight dtype), so a tensor cut by a partition boundary counts on both ranks.
        in_partition = sum(_overlap(g, rank * part, (rank + 1) * part) for g, _, part in partitions)
        # The rank whose partition runs past the group's end gets a zero tensor for that padding in its gradient list.
        in_partition += sum(max(0, min(part, (rank + 1) * part - sum(t.numel for t in g))) for g, _, part in partitions)
        grad_elt = prec.weight
        # The fp32 master partition is counted with the optimizer states, as in the ZeRO paper (K = 12 = 4 + 8).
        if strat.offload_optimizer:
            s.host_params = prec.weight * master  # a 16-bit staging copy of the partition for the way back
            s.host_grads = 4 * master
            s.host_optim = (4 + 8) * master + step_bytes_per_tensor * len(partitions)
            s.notes.append("optimizer offload: fp32 master, fp32 gradient partition and Adam states live in host memory")
        else:
            s.grads = grad_elt * in_partition
            s.optim = (4 + prec.optim) * master + step_bytes_per_tensor * len(partitions)
            # At each group's step DeepSpeed flattens that group's gradient into a new fp32 tensor while the
            # contiguous buffer still exists; the first group is the largest here.
            s.step_transient = 4 * (partitions[0][2] if partitions else 0)
        # The reduce bucket, alive during backward. (Stage 1 also keeps every gradient whole until the end of
        # backward, as DDP does: the backward walk in predict() counts those.)
        bucket = strat.setting("reduce_bucket_size", h)
        s.backward_buffers = prec.grad * min(bucket, max((sum(t.numel for t in g) for g in tensors_in_optimizer), default=0))
        return s

    # ZeRO-3 (stage3.py, partition_parameters.py): every parameter is padded to a multiple of the ranks and
    # each rank keeps ceil(numel / ranks) elements of it.
    def part(t: Tensor) -> int:
        return math.ceil(t.numel / n)

    trainable_part = sum(part(t) for t in trainable)
    frozen_part = sum(part(t) for t in frozen)
    threshold = strat.setting("stage3_param_persistence_threshold", h)
    persistent = [t for t in base + (trainable if job.use_peft else []) if t.numel <= threshold]
    lp = prec.weight * trainable_part + prec.weight * frozen_part
    if strat.offload_param:
        s.host_params = lp
    else:
        s.params = lp
    # A gathered parameter lives in a buffer of its padded size (numel rounded up to a multiple of the ranks).
    # With one rank the partition is the whole tensor: nothing is gathered into a second buffer (measured).
    s.persistent = prec.weight * sum(part(t) * n for t in persistent) if n > 1 else 0
    # DeepSpeed clones an fp32 master partition (with fp32 weights too: measured), on the host when offloading;
    # counted with the optimizer states (the ZeRO paper's K = 12 = 4 master + 8 Adam).
    master = 4 * trainable_part if (prec.master or strat.offload_optimizer) else 0
    # Gradients: one contiguous partition buffer (grad_partitions_flat_buffer).
    grad_part = (4 if prec.name == "fp32" else prec.grad) * trainable_part
    if strat.offload_optimizer:
        s.host_grads = grad_part + 4 * trainable_part  # the partition buffer + the fp32 gradient the CPU optimizer reads
        s.host_optim = master + 8 * trainable_part + step_bytes_per_tensor * len(tensors_in_optimizer)
        s.other = 8 * len(trainable)  # one float64 norm per parameter
    else:
        s.grads = grad_part
        s.optim = master + prec.optim * trainable_part + step_bytes_per_tensor * len(tensors_in_optimizer)
        first = tensors_in_optimizer[0] if tensors_in_optimizer else []
        s.step_transient = 4 * sum(part(t) for t in first)
    s.buffers = (4 if prec.name == "fp32" else prec.grad) * strat.setting("reduce_bucket_size", h)
    # Gathered for compute. DeepSpeed releases a gathered parameter after use only if its next use (in backward)
    # is more than stage3_max_reuse_distance elements away, so the last max_reuse_distance / 2 elements of the
    # forward stay gathered, plus the module in use and the prefetch bucket; at most stage3_max_live_parameters.
    # A model smaller than that is gathered whole (measured: the 56M bench model under ZeRO-3).
    total = sum(t.numel for t in base) + (sum(t.numel for t in trainable) if job.use_peft else 0)
    layer = sum(t.numel for t in base if ".layers.0." in t.name)
    largest = max((t.numel for t in base), default=0)
    reuse = strat.setting("stage3_max_reuse_distance", h)
    live = max(layer, largest) + reuse // 2 + strat.setting("stage3_prefetch_bucket_size", h)
    live = min(total, max(largest, min(live, strat.setting("stage3_max_live_parameters", h))))
    s.gathered = prec.weight * live if n > 1 else 0
    if strat.nvme:
        _to_nvme(s, strat, prec, trainable_part)
    return s


def _fsdp_shard(t: Tensor, n: int, rank: int) -> tuple[int, int]:
    """(elements this rank holds of `t`, elements of its padded shard): fully_shard splits dim 0 into n chunks of
    ceil(rows / n) rows, the last ranks' shorter or empty, each shard kept in a buffer padded to the full chunk."""
    rows = t.shape[0] if t.shape else 1
    per_row = t.numel // max(rows, 1)
    chunk = math.ceil(rows / n)
    held = max(0, min(chunk, rows - rank * chunk))
    return held * per_row, chunk * per_row


def _fsdp_units(job: Workload, tensors: list[Tensor]) -> list[list[Tensor]]:
    """accelerate's FSDP2 units (fsdp2_prepare_model): each decoder layer, the input embeddings (when not tied), and
    the tail (final norm and LM head); the root holds the rest."""
    layers: dict[str, list[Tensor]] = {}
    embed, tail, root = [], [], []
    for t in tensors:
        m = re.search(r"\.layers\.(\d+)\.", t.name)
        if m:
            layers.setdefault(m.group(1), []).append(t)
        elif "embed_tokens" in t.name:
            embed.append(t)
        elif "lm_head" in t.name or t.name.endswith("norm.weight"):
            tail.append(t)
        else:
            root.append(t)
    return [u for u in (embed, *layers.values(), tail, root) if u]


def _fsdp_states(job: Workload, s: StateBytes, prec: Precision, trainable: list[Tensor], frozen: list[Tensor],
                 frozen_bytes: list[int], rank: int) -> StateBytes:
    """FSDP2 (torch's fully_shard through accelerate): every parameter, gradient and optimizer state sharded on dim
    0 (padded shards); each unit's weights gathered whole for its forward and backward (the current unit and the
    one prefetched), its gradients reduce-scattered from a whole-unit buffer. A QLoRA base's packed 4-bit weights
    are sharded too (stored in the compute dtype)."""
    n = job.world_size
    held = {t.name: _fsdp_shard(t, n, rank) for t in trainable + frozen}
    w = 4 if prec.name == "fsdp-mixed" else prec.weight  # sharded weights: fp32 under mixed precision
    s.params = w * sum(held[t.name][1] for t in trainable)
    s.params += sum(math.ceil(b / n) for b in frozen_bytes)
    grad_elt = 4 if prec.name == "fsdp-mixed" else prec.grad
    s.grads = grad_elt * sum(held[t.name][1] for t in trainable)
    # torch's AdamW: exp_avg and exp_avg_sq like the local (unpadded) shard, and a 4-byte step per parameter.
    s.optim = prec.optim * sum(held[t.name][0] for t in trainable) + 4 * len(trainable)
    if job.strategy.offload_param and job.accelerator != "cpu":  # on a CPU run the shards stay where they are
        s.host_params, s.host_grads, s.host_optim, s.params, s.grads, s.optim = s.params, s.grads, s.optim, 0, 0, 0
        s.notes.append("FSDP2 CPU offload: sharded parameters, gradients and Adam states live in host memory; "
                       "the optimizer steps on the CPU")
    if n > 1:
        gathered_elt = prec.weight if prec.name != "fsdp-mixed" else 2
        trainable_names = {t.name for t in trainable}
        quant = {t.name: b for t, b in zip(frozen, frozen_bytes)}

        def unit_bytes(unit: list[Tensor]) -> int:
            return sum(quant.get(t.name, gathered_elt * t.numel) if t.name not in trainable_names
                       else gathered_elt * t.numel for t in unit)

        units = _fsdp_units(job, trainable + frozen)
        layers = [unit_bytes(u) for u in units if any(".layers." in t.name for t in u)]
        # Whole at once: the largest unit (the tail, kept gathered from the end of the forward into the backward,
        # or the embeddings) and the decoder layer prefetched beside it. In backward the unit's whole gradients
        # (counted with the gradients) are copied into the reduce-scatter's input buffer: one more of the largest.
        s.gathered = max(map(unit_bytes, units)) + max(layers, default=0)
        s.backward_buffers = max((grad_elt * sum(t.numel for t in u) for u in _fsdp_units(job, trainable)), default=0)
        if job.use_peft:
            # LoRA: peft's wrap policy (transformers' update_fsdp_plugin_peft, which both paths apply) makes each
            # adapter a unit of its own, so a decoder layer's unit holds only frozen weights; gathered again for the
            # backward, it gets no gradient hook to reshard it, and stays whole until the backward ends. Counted at
            # the backward's peak as every layer whole (measured: -1.3% of the peak RSS, 2 ranks, bench model).
            s.backward_buffers += sum(layers) - max(layers, default=0)
    return s


def _to_nvme(s: StateBytes, strat: Strategy, prec: Precision, partition: int) -> None:
    """ZeRO-Infinity: what is offloaded to NVMe leaves host memory but for DeepSpeed's pinned swap buffers
    (an estimate from the JSON's buffer settings; not measured)."""
    opt = strat.raw.get("offload_optimizer") or {}
    par = strat.raw.get("offload_param") or {}
    if "parameters" in strat.nvme:
        s.disk += s.host_params
        in_cpu = min(int(par.get("max_in_cpu", 1_000_000_000)), partition)
        buffers = int(par.get("buffer_count", 5)) * int(par.get("buffer_size", 100_000_000))
        s.host_params = prec.weight * (in_cpu + buffers)
    if "optimizer" in strat.nvme:
        s.disk += s.host_optim + 4 * partition  # with the fp32 gradient the optimizer reads per swapped sub-group
        s.host_grads = max(0, s.host_grads - 4 * partition)
        # swap buffers: buffer_count fp32 buffers, each one state (master, m or v) of the largest sub-group
        sub = min(strat.setting("sub_group_size", 0), partition)
        s.host_optim = int(opt.get("buffer_count", 4)) * 4 * sub
    s.notes.append(f"{' and '.join(strat.nvme)} on NVMe: {fmt_bytes(s.disk)} of swap files per rank; host memory "
                   "keeps DeepSpeed's pinned swap buffers (estimated, not measured)")


# ----------------------------------------------------------------------------------------------
# Activations, per rank and micro-batch.


@dataclass
class Stage:
    """One step of the backward pass: what it frees, the gradients it produces, its temporaries."""

    name: str
    freed: int  # saved activations released when the stage is done
    grad_numel: int  # trainable parameter elements whose gradients this stage produces
    largest_grad: int  # the largest single parameter among them (elements)
    transient: int  # activation gradients and recomputed activations alive during the stage


@dataclass
class Activations:
    saved: int  # what autograd keeps for backward at the end of the forward
    forward_peak: int  # saved + the transients at the end of the forward (logits)
    per_layer: int  # one decoder layer without checkpointing
    detail: dict[str, int]
    stages: list[Stage]
    inputs: int = 0  # the batch's pixel values (image records): alive through the step, not saved by autograd
    offloaded: int = 0  # --offload_activations: the checkpointed layer inputs, in host memory


def _dropout_saved(job: Workload, features: int, elt: int) -> int:
    """Bytes one LoRA dropout keeps per token: its output (for lora_A) and, on CPU, a float noise mask
    (torch's composite dropout); on GPU the fused kernel keeps a 1-byte mask."""
    mask = elt if job.accelerator == "cpu" else 1
    return (elt + mask) * features


def saving(job: Workload, micro_batch: int | None = None) -> Saving:
    """The run as the model's family reads it when it counts what its layers save (finetune.models.families)."""
    b = (job.micro_batch if micro_batch is None else micro_batch) * (2 if job.pairs else 1) * max(1, job.generations)
    full = not job.use_peft
    # o_proj's input is saved where o_proj trains, under ZeRO-3's linear, or by LoRA's lora_A without dropout.
    o_lora = any(lin.reads == "attn_out" for lin in _lora_linears(job)) and job.lora_dropout == 0 if job.use_peft else False
    chunk = 0 if job.pairs else min(job.loss_chunk, b * job.seq_len)
    # Image records of a family whose image tokens attend both ways: a mask in every layer, as a padded batch has.
    image_mask = bool(job.images) and job.shape.family.image_mask
    return Saving(a=precision_of(job).act, rows=b, seq_len=job.seq_len, trains_weights=full,
                  adapted_experts=job.use_peft and job.shape.family.adapts_experts(job.lora_targets),
                  padding_mask=job.padding_mask or image_mask, o_input_kept=full or job.strategy.stage == 3 or o_lora,
                  logit_rows=0 if chunk else (b * job.seq_len - b if job.pairs else b * job.seq_len))


def layer_saved(job: Workload, run: Saving, layer: int, first: bool = False) -> int:
    """Bytes decoder layer LAYER saves for backward (no dropout in attention): the Llama layout, with the attention
    and what its layer keeps beyond Llama's from the model's family.

    `first`: layer 0 under LoRA without checkpointing, whose input does not require grad.
    """
    sh = job.shape
    family = sh.family
    per_record = job.per_record_attention and run.o_input_kept
    if per_record:  # the records' outputs joined are o_proj's input: the family's own copy of it is that one
        run = dataclasses.replace(run, o_input_kept=False)
    attention = family.attention_saved(sh, run, layer)
    # Per-record attention: o_proj's input is the records' outputs joined (a copy), kept where o_proj saves its
    # input: trained, under ZeRO-3's linear, or LoRA's lora_A without dropout in front of it.
    if per_record:
        attention += run.tokens * run.a * sh.q_dim
    once = family.layer_saved_per_batch(sh, run, first)
    return attention + once + run.tokens * (layer_saved_per_token(job, run, first) + family.layer_saved_extra(sh, run))


def layer_saved_per_token(job: Workload, run: Saving, first: bool = False) -> int:  # noqa: C901 - one branch per tensor class
    """Bytes per token one Llama decoder layer saves for backward beside its attention (the family's)."""
    sh = job.shape
    h, i = sh.hidden_size, sh.intermediate_size
    a = run.a
    f32 = 4
    if not job.use_peft:
        # RMSNorm (x2): the fp32 input (x itself in fp32), 1/rms, the normalized value (weight grad),
        # the output (saved by the next linear); MLP: gate, up, silu(gate) and their product (down's input).
        # Tiled, the MLP keeps none of its own (its input, norm2's output, is kept by the tiles' checkpoint).
        norms = 2 * (f32 * h + f32 + a * h + a * h)
        return norms + (0 if job.tiled_mlp else 4 * a * i)
    targets = _lora_linears(job)
    r = job.lora_r
    dropout = job.lora_dropout > 0
    per = f32 * h + f32  # norm1 input (fp32) + 1/rms: frozen norm weight, so not the normalized value
    per += f32 * h + f32  # norm2 input: the residual sum
    per += 3 * a * i  # gate, up, silu(gate): the MLP's own backward
    lora_elt = f32 if fp32_adapters(job) else a  # a bf16-counted branch was 2.5 GB low for a 1B model (GPU)
    per += lora_elt * r * len(targets)  # lora_A outputs, saved by lora_B
    # Inputs of the frozen base linears that something keeps: y1 (q/k/v: attn_in), y2 (gate/up: mlp_in), down's
    # input (mlp_act). o_proj's input is the attention output, saved already.
    kept = {"y1": False, "y2": False, "p": False}
    if dropout:
        per += sum(_dropout_saved(job, lin.inp, lora_elt) for lin in targets)
    elif lora_elt != a:
        per += lora_elt * sum(lin.inp for lin in targets)  # lora_A saves its own fp32 copy of its input
    else:
        # Without dropout lora_A saves its input itself: each norm output once, down's input.
        reads = {lin.reads for lin in targets}
        kept = {"y1": "attn_in" in reads, "y2": "mlp_in" in reads, "p": "mlp_act" in reads}
    if job.strategy.stage == 3:
        # ZeRO-3 replaces F.linear with its own autograd function that saves the input even when the weight is
        # frozen (measured): the base linears' inputs are kept whatever LoRA does, wherever the input needs a
        # gradient (not layer 0's q/k/v input, without checkpointing).
        kept = {k: v or not (first and k == "y1") for k, v in kept.items()}
    per += a * (h * kept["y1"] + h * kept["y2"] + i * kept["p"])
    if job.tiled_mlp:
        # Tiled (finetune.models.tiled): the MLP's interior is recomputed a tile at a time in backward; what it
        # saved (gate, up, act, the MLP adapters' outputs, dropouts and kept inputs) is replaced by its input,
        # norm2's output, which the tiles' checkpoint keeps (measured: tests/test_tiled.py).
        mlp = [lin for lin in targets if lin.reads in ("mlp_in", "mlp_act")]
        per -= 3 * a * i + lora_elt * r * len(mlp) + a * (h * kept["y2"] + i * kept["p"])
        if dropout:
            per -= sum(_dropout_saved(job, lin.inp, lora_elt) for lin in mlp)
        elif lora_elt != a:
            per -= lora_elt * sum(lin.inp for lin in mlp)
        per += a * h
    if first:
        per -= f32 * h + f32  # the embedding output needs no grad: norm1 saves nothing
        if dropout:  # and q/k/v's dropouts keep no mask
            mask = a if job.accelerator == "cpu" else 1
            per -= mask * h * sum(lin.reads == "attn_in" for lin in targets)
    return per


def tower_tensors(job: Workload) -> list[Tensor]:
    """A vision-language model's tower and projector tensors (its family's vision_prefixes); [] for a text model."""
    prefixes = job.shape.family.vision_prefixes(job.shape.config) if job.shape.family.vision else ()
    return [t for t in job.shape.tensors() if any(t.name == p or t.name.startswith(p + ".") for p in prefixes)]


def trained_and_frozen(job: Workload) -> tuple[list[Tensor], list[Tensor]]:
    """(the tensors the optimizer trains, the frozen ones): LoRA's adapters beside a frozen base; a full fine-tune's
    every tensor but a vision tower and projector left frozen (--freeze_vision_tower, the default)."""
    base = job.shape.tensors()
    if job.use_peft:
        return lora_tensors(job.shape, job.lora_r, list(job.lora_targets)), base
    if job.shape.family.vision and not job.tower_trains:
        tower = {t.name for t in tower_tensors(job)}
        return [t for t in base if t.name not in tower], [t for t in base if t.name in tower]
    return base, []


def _lora_linears(job: Workload) -> list:
    """The layer's linears that get LoRA adapters."""
    chosen = job.shape.family.lora_targets(list(job.lora_targets))
    return [lin for lin in job.shape.linears() if lin.name in chosen]


def chunked_loss_peak(a: int, weight: int, grad: int, v: int, h: int, trained: int, chunk: int,
                      trains_head: bool, capped: bool = False) -> int:
    """Bytes the chunked loss (finetune.training.loss) holds at its peak, in the head (a, weight, grad: bytes per
    activation, head weight and gradient element; `capped`: the model soft-caps its logits). Checked against CUDA's
    allocator on a GPU: tests/test_cuda.py."""
    f32 = 4
    # The trained rows' hidden states (a gathered copy) and their gradient; one chunk's fp32 logits, the logsumexp
    # block over LSE_ROWS of them, and the chunk's 16-bit copy; soft-capped, tanh(logits / cap) beside the capped
    # logits (measured on CPU, tests/test_families_plan.py: Gemma-2 was 3% low without it).
    total = 2 * a * trained * h + f32 * (chunk + min(LSE_ROWS, chunk) + (chunk if capped else 0)) * v
    total += a * chunk * v if a != f32 else 0
    if weight != a:
        total += a * v * h  # fp32 weights under 16-bit autocast: the head weight cast for the chunks' GEMMs
    if trains_head:
        total += grad * v * h  # the head weight's gradient, kept for backward
        if a != f32:
            # Summed over the chunks in fp32: an fp32 accumulator beside a 16-bit kept gradient, or, where the kept
            # gradient is that fp32 sum (autocast), the 16-bit buffer each chunk's product goes through.
            total += f32 * v * h if grad != f32 else a * v * h
    return total


def activations(job: Workload, micro_batch: int | None = None, grad_ckpt: bool | None = None) -> Activations:
    """Saved activations of one micro-batch, tensor class by tensor class, and the backward pass as stages."""
    b = (job.micro_batch if micro_batch is None else micro_batch) * (2 if job.pairs else 1) * max(1, job.generations)
    ckpt = job.grad_ckpt if grad_ckpt is None else grad_ckpt
    sh = job.shape
    s_len = job.seq_len
    t = b * s_len
    h, v, i = sh.hidden_size, sh.vocab_size, sh.intermediate_size
    o = sh.head_outputs or v  # the head's outputs per position: the vocabulary's logits, or a reward model's score
    prec = precision_of(job)
    a = prec.act
    f32 = 4
    detail: dict[str, int] = {}
    # Each layer as its family counts it (a mask reaching SDPA, padded or sliding, is a [b, 1, s, s] tensor in the
    # activation dtype, one copy per layer: measured on CPU).
    run = saving(job, micro_batch)
    full_layers = [layer_saved(job, run, k) for k in range(sh.num_layers)]
    per_layer = max(full_layers, default=0)
    layer_saved_bytes = full_layers
    if ckpt and job.offload_activations:
        # --offload_activations: the layer inputs wait in host memory; each comes back for its layer's recompute.
        layer_saved_bytes = [0] * sh.num_layers
        detail["layer inputs (checkpointed)"] = 0
    elif ckpt:
        # Checkpointing keeps each layer's input; the layer is recomputed (all of it saved) in its backward.
        layer_saved_bytes = [a * t * h] * sh.num_layers
        detail["layer inputs (checkpointed)"] = sum(layer_saved_bytes)
    else:
        if job.use_peft and layer_saved_bytes:
            layer_saved_bytes[0] = layer_saved(job, run, 0, first=True)
        detail["decoder layers"] = sum(layer_saved_bytes)
        # Shared by the layers; one per row where position ids are per row (packed rows).
        detail["rotary cos/sin"] = 2 * a * s_len * sh.head_dim * (b if job.per_record_attention else 1)
    if prec.name == "fp32+autocast":
        # Autocast casts each linear's fp32 weight to 16 bits for its GEMM, and the GEMM keeps that copy for backward
        # (measured on a GPU, bench/memory_gpu.py; the rest of autocast's difference is not modelled, see RESULTS.md).
        # Checkpointed, only the layer being recomputed holds them.
        detail["autocast: 16-bit weight copies"] = (a * sum(o * n for o, n in sh.linear_shapes().values())
                                                    * (1 if ckpt else sh.num_layers))
    full = not job.use_peft
    # The final norm: its fp32 input and 1/rms; with a trainable norm its normalized value; the lm_head's input
    # (when lm_head trains, or under ZeRO-3, whose F.linear saves it anyway; the chunked loss saves none).
    # DPO (finetune.methods.dpo) never chunks; it asks for logits only at the scored positions (logits_to_keep), at
    # worst every one but a row's first (a prompt of one token), and the lm_head saves those rows, gathered (a copy).
    chunk = 0 if job.pairs else min(job.loss_chunk, t)
    logit_rows = t - b if job.pairs else t
    lm_head_input = a * logit_rows * h if (full or job.strategy.stage == 3) and not chunk else 0
    detail["final norm"] = f32 * t * h + f32 * t + (a * t * h if full else 0) + lm_head_input
    if full:
        detail["token ids (embedding)"] = 8 * t
    head_grad = prec.grad * v * h if full else 0
    trained = t - b  # every position but each row's last, which has no next token: the worst case
    if chunk:
        # The chunked loss (finetune.training.loss) computes its gradients in forward and keeps them: the hidden
        # states' (trained positions only) and, when the head trains, the head weight's; no logits survive a chunk.
        detail["chunked loss: hidden-state gradient"] = a * trained * h
        detail["chunked loss: head weight gradient"] = head_grad
        detail["labels"] = 8 * trained  # the trained positions' index (gathered rows scatter back in backward)
    elif job.pairs:
        # completion_logps: logsumexp keeps its fp32 input (the scored rows of the logits, a copy); besides, small:
        # the positions (int64), the flat indices of the scored targets that index_select, gather and index_add
        # keep (int64, 3 per token: the collator's, the targets', the rows'), each token's logsumexp and
        # log-probability (fp32); the sigmoid loss' four per-pair values and num_items_in_batch. No boolean mask is
        # kept: the indices come from the host (finetune.data.preference.scored).
        positions = s_len - 1
        detail["log-probabilities: scored logits (fp32)"] = f32 * logit_rows * o
        detail["log-probabilities: indices and per-token values"] = (8 * positions + 24 * logit_rows
                                                                     + 2 * f32 * logit_rows)
        detail["DPO loss"] = 4 * f32 * (b // 2) + 8
    else:
        # The loss upcasts logits to fp32 and log_softmax keeps its fp32 output; labels (int64) and a scalar.
        detail["log-softmax output"] = f32 * t * v
        detail["labels"] = 8 * t + 8  # the shifted labels, the loss' total weight and num_items_in_batch
    # What the family's model keeps outside its layers beyond Llama's (Gemma: the embedding scale, the final soft-cap).
    detail.update(sh.family.model_saved_extra(sh, run))
    # Image records: what the vision tower and projector save (nothing when frozen), and the image tokens' merge into
    # the embeddings; the image tokens themselves are positions of seq_len, counted with the decoder's.
    images = job.images.times(b) if job.images else None
    vision = sh.family.vision_saved(sh, run, images, job.tower_trains) if images and sh.family.vision else {}
    detail.update(vision)
    saved = sum(detail.values())
    if chunk:
        in_head = chunked_loss_peak(a, prec.weight, prec.grad, v, h, trained, chunk, trains_head=full,
                                    capped=sh.family.logit_softcap(sh) is not None)
        forward_peak = (saved - detail["chunked loss: hidden-state gradient"]
                        - detail["chunked loss: head weight gradient"] + in_head)
    elif job.pairs:
        # In logsumexp: the logits (16-bit: their fp32 copy is the saved input) and its fp32 exp temporary.
        forward_peak = saved + a * logit_rows * o + f32 * logit_rows * o
    else:
        # End of the forward: the logits (and their fp32 copy when 16-bit) beside the log-softmax output.
        forward_peak = saved + a * t * v + (f32 * t * v if a != f32 else 0)

    # Backward, stage by stage (what each frees, which gradients it makes, its temporaries).
    linear = sum(o * n for o, n in sh.linear_shapes().values())
    layer_params = linear + len(sh.family.layer_norms(sh)) * h if full else sum(x.numel for x in lora_tensors(sh, job.lora_r, list(job.lora_targets))) // max(1, sh.num_layers)
    layer_largest = max(o * n for o, n in sh.linear_shapes().values()) if full else job.lora_r * max(i, h)
    head_numel = o * h if (full and (sh.head_outputs or not sh.tie_word_embeddings)) else 0
    if chunk:
        # Backward only scales the kept gradients; the head's goes to its parameter (a tied head's stays in
        # autograd until the embedding's adds to it); the trained rows scatter back into [tokens, hidden].
        tied_head = head_grad if sh.tie_word_embeddings else 0
        kept = detail["chunked loss: hidden-state gradient"] + head_grad + detail["labels"]
        stages = [Stage("loss", kept - tied_head, head_numel, head_numel, a * t * h)]
    else:
        loss_saved = saved - sum(x for k, x in detail.items() if k in (
            "layer inputs (checkpointed)", "decoder layers", "rotary cos/sin", "final norm", "token ids (embedding)"))
        # In the loss' backward: log_softmax's and nll's gradients (SFT); logsumexp's, gather's and their sum, each
        # over the fp32 scored logits (DPO: measured, bench/memory.py --dpo).
        stages = [
            Stage("loss", loss_saved, 0, 0, (3 if job.pairs else 2) * f32 * logit_rows * o),
            Stage("lm_head", lm_head_input, head_numel, head_numel, f32 * logit_rows * o + a * logit_rows * h),
        ]
    stages.append(Stage("final norm", detail["final norm"] - lm_head_input, h if full else 0, h if full else 0,
                        2 * a * t * h))
    layer_tmp = 2 * a * t * (h + i)  # gradients flowing through a layer (approximate)
    if job.tiled_mlp:
        # The MLP's backward one tile at a time: its recomputed interior and its gradients for one tile only.
        layer_tmp = 2 * a * t * h + 2 * a * job.rows * job.tile * (h + i) + 4 * a * job.rows * job.tile * i
    if ckpt and job.offload_activations:
        layer_tmp += a * t * h  # the layer's input, copied back for its recompute
    for k in reversed(range(sh.num_layers)):
        stages.append(Stage(f"layer {k}", layer_saved_bytes[k], layer_params, layer_largest,
                            layer_tmp + (full_layers[k] if ckpt else 0)))
    emb = v * h if full else 0
    tower = sum(vision.values())
    rest = saved - tower - sum(st.freed for st in stages)  # ids, rotary, mask: freed at the end
    stages.append(Stage("embedding", rest, emb, emb, a * t * h))
    if tower:
        # The tower's backward after the decoder's: its saved tensors go, its gradients come (when it trains), its
        # largest activation gradients alive (the widest of its layers' outputs: counted as its patch embedding's input).
        params = [x.numel for x in tower_tensors(job)] if job.tower_trains else [0]
        stages.append(Stage("vision tower", tower, sum(params), max(params),
                            vision.get("vision tower: patch embedding input", 0)))
    # The batch's pixel values live through the step (the tower's patch embedding keeps them, or a copy, when it trains).
    pixels = a * images.pixels if images else 0
    offloaded = a * t * h * sh.num_layers if ckpt and job.offload_activations else 0
    return Activations(saved, forward_peak + pixels, per_layer, detail, stages, inputs=pixels, offloaded=offloaded)



def backward_peak(act: Activations, grad_elt: int, keep_grads: bool, partition: int = 0) -> tuple[int, int, int]:
    """Walk the backward stages: -> (peak bytes, of which gradients, of which activations) above the static part.

    keep_grads: DDP and ZeRO-1 keep every parameter gradient until the step; ZeRO-2/3 hand each one to a bucket
    and free it (only the largest single gradient of a stage is then alive at once). `partition`: ZeRO-2's
    gradient partition buffer, allocated when the first gradient is reduced.
    Each stage is looked at twice: while it computes (its activation gradients and the parameter gradient it
    produces, beside the saved activations not yet freed) and after (its activations freed, gradients handed on).
    """
    remaining = act.saved + act.inputs
    grads = 0
    standing = 0
    best = (0, 0, 0)

    def consider(g: int, a: int) -> None:
        nonlocal best
        if g + a > best[0]:
            best = (g + a, g, a)

    for st in act.stages:
        produced = grad_elt * (st.grad_numel if keep_grads else st.largest_grad)
        consider(grads + standing + produced, remaining + st.transient)
        remaining -= st.freed
        if st.grad_numel:
            standing = partition
        if keep_grads:
            grads += grad_elt * st.grad_numel
            consider(grads + standing, remaining)
        else:
            consider(standing + produced, remaining)
    return best


# ----------------------------------------------------------------------------------------------
# Framework overhead (stated, not derived).

# Measured on this project's CPU stack (torch 2.13, transformers 5.23, accelerate 1.15, deepspeed 0.19.8):
# RSS of a training process after imports, the process group and the model's (lazily mapped) load,
# before the weights are touched. bench/memory.py re-measures it. 555 MB until DeepSpeed's import stopped loading
# mlflow (finetune.compat): 44 MB less in every process (measured on Gemma-2, Phi-3 and Qwen3-MoE's tiny models,
# whose planned peaks went from +0.4..+0.8% to +5.9..+7.5% of the measured RSS).
CPU_PROCESS_OVERHEAD = 511 * 10**6
# A vision-language model's process (Family.vision) on top: its modeling module and the image-processing stack
# transformers imports with AutoModelForImageTextToText. Measured 42-46 MB with bench/memory.py on the tiny LLaVA,
# SmolVLM, Qwen2.5-VL and Gemma-3 models (2026-11-28, text records; images add their pixels, not counted here).
CPU_VISION_OVERHEAD = 2 * 10**6
# SciPy, where it is installed (the eval extra's scikit-learn brings it): transformers' modeling_utils imports
# scipy.optimize through its object-detection losses in every training process, 41 MB (bench/memory.py on the tiny
# Llama, Gemma-2 and Qwen3-MoE: +41 MB against the same run with scipy hidden). The vision figure above was measured
# with it installed and read 43 MB; its own share is the 2 MB left.
CPU_SCIPY_OVERHEAD = 41 * 10**6


# A vision-language model's processor in the training process (the collator runs it on every batch of image records):
# its tokenizer, about 9 bytes of memory per byte of tokenizer.json, measured on this stack after the model is loaded
# (the tiny families' real tokenizers: LLaVA's and SmolVLM's 3.5 MB files 36 MB, Qwen's 11.4 MB 118 MB, Gemma-3's
# 33.4 MB 288 MB), the image processor's share is small.
PROCESSOR_BYTES_PER_TOKENIZER_BYTE = 9


def processor_memory(folder: str | Path) -> int:
    """The memory a vision-language model folder's processor takes in a process, estimated from its tokenizer.json's
    size (not read); 0 where the folder has none."""
    path = Path(folder) / "tokenizer.json"
    return PROCESSOR_BYTES_PER_TOKENIZER_BYTE * path.stat().st_size if path.is_file() else 0


def cpu_process_overhead(vision: bool) -> int:
    """A CPU training process's RSS before its model states and activations, on this environment."""
    import importlib.util

    scipy = importlib.util.find_spec("scipy") is not None  # found, not imported
    return CPU_PROCESS_OVERHEAD + (CPU_SCIPY_OVERHEAD if scipy else 0) + (CPU_VISION_OVERHEAD if vision else 0)
# GPU: CUDA context, cuBLAS/NCCL workspaces and allocator slack on the device (not in max_memory_allocated);
# and what each training process holds in host memory (CUDA and torch libraries). Allowances, not measured here.
GPU_DEVICE_OVERHEAD = 2 * 10**9
GPU_PROCESS_HOST_OVERHEAD = 5 * 10**9


# ----------------------------------------------------------------------------------------------
# The prediction.


@dataclass
class Prediction:
    job: Workload
    device: dict[str, int]  # per device (rank), at the peak
    host: dict[str, int]  # per host (node)
    notes: list[str]
    peak_moment: str
    states: StateBytes
    act: Activations

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


def predict(job: Workload) -> Prediction:
    """Per-device and per-host memory at the predicted peak of training.

    Three moments are compared: the end of the forward, the backward pass (stage by stage) and the optimizer
    step (all gradients, plus DeepSpeed's flattened gradient copy); the largest is the peak and the breakdown
    is given at that moment.
    """
    st = model_states(job)
    sliced = sequence_slice(job)
    act = activations(sliced)
    prec = precision_of(job)
    cpu = job.accelerator == "cpu"
    notes = list(st.notes)
    stage = job.strategy.stage
    overhead = cpu_process_overhead(job.shape.family.vision) + job.processor_bytes if cpu else GPU_DEVICE_OVERHEAD
    # DPO's frozen reference (full fine-tuning): the whole model again, in the dtype the engine gives the policy, on
    # every rank; under ZeRO-3 partitioned like the policy (kept in memory even when the policy's are swapped to
    # NVMe), each layer gathered for its forward as the policy's are. Its no-grad forward runs before the policy's
    # and frees its logits first.
    reference = reference_model_bytes(job)
    if reference:
        notes.append("reference (DPO, GRPO --beta): a frozen copy of the model " + (
            f"partitioned over the {job.world_size} ranks" if stage == 3 else "on every device")
            + " (LoRA, or --precompute_ref_log_probs, keeps none)")
    if job.generations:
        notes.append(f"generation: a KV cache of {job.rows} rows ({job.micro_batch} prompts x {job.generations}) x "
                     f"{job.seq_len} positions, {fmt_bytes(generation_kv_bytes(job))}, before each training forward")
    static = {
        "parameters": st.params + st.persistent,
        "optimizer states": st.optim,
        "buffers": st.buffers + st.other,
        "framework overhead": overhead,
    }
    # Gradients that exist between steps: ZeRO-3's partition buffer; DDP/ZeRO-1/2 free theirs after each step.
    standing_grads = st.grads if stage == 3 else 0
    fsdp = job.strategy.fsdp
    # FSDP2 reduce-scatters each unit's gradients as its backward ends: the shards accumulate in place of a partition.
    keep = stage in (0, 1) and not fsdp
    grad_elt = prec.grad
    _, bw_grads, bw_acts = backward_peak(act, grad_elt, keep, st.grads if stage == 2 or fsdp else 0)
    if stage == 3:
        bw_grads += st.grads  # ZeRO-3 keeps its gradient partition buffer between steps
    forward = act.forward_peak
    if stage == 0 and not fsdp and job.world_size > 1 and not job.loss_chunk:
        # DDP's _DDPSink clones the logits (DPO's: the scored positions only)
        forward += (prec.act * job.rows * (sliced.seq_len - (1 if job.pairs else 0))
                    * (job.shape.head_outputs or job.shape.vocab_size))
    exchange = all_to_all_bytes(job)
    if exchange:
        notes.append(f"sequence parallel over {job.sequence_parallel} ranks: activations of a {sliced.seq_len}-token "
                     f"slice of each row, plus {fmt_bytes(exchange)} of all-to-all buffers in a layer's attention")
        forward += exchange
        bw_acts += exchange
    moments = {
        "forward": {"gradients": standing_grads, "activations": forward + st.gathered},
        **({"generation": {"gradients": standing_grads, "activations": generation_kv_bytes(job) + st.gathered}}
           if job.generations else {}),
        "backward": {"gradients": bw_grads, "activations": bw_acts + st.gathered + st.backward_buffers},
        "optimizer step": {"gradients": st.grads, "activations": st.step_transient},
    }
    peak_name = max(moments, key=lambda k: sum(moments[k].values()))
    device = {"parameters": static["parameters"], "gradients": moments[peak_name]["gradients"],
              "optimizer states": static["optimizer states"], "activations": moments[peak_name]["activations"],
              "buffers": static["buffers"], "framework overhead": overhead}
    if reference:
        device["reference model"] = reference
    if cpu and (st.host_params or st.host_grads or st.host_optim):
        # On a CPU run "offloaded to CPU" is the same memory: count it in the process.
        device["parameters"] += st.host_params
        device["gradients"] += st.host_grads
        device["optimizer states"] += st.host_optim
        notes.append("offload to CPU on a CPU run moves nothing out of the process: offloaded states are counted in it")
    if act.offloaded:
        if cpu:  # a CPU run's host memory is its memory (training refuses the flag without CUDA)
            device["activations"] += act.offloaded
        notes.append(f"--offload_activations: the {job.shape.num_layers} checkpointed layer inputs "
                     f"({fmt_bytes(act.offloaded)}) wait in pinned host memory; one at a time comes back for its "
                     "layer's recompute")
    if peak_name != "optimizer step" and stage in (0, 1, 2):
        notes.append(f"the peak is in the {peak_name}: gradients are freed after each step and rebuilt in backward, "
                     "so the breakdown shows the gradients alive at that moment")
    host: dict[str, int] = {}
    per_node = min(job.devices_per_node, job.world_size)
    offloaded = {"offloaded parameters": st.host_params, "offloaded gradients": st.host_grads,
                 "offloaded optimizer states": st.host_optim, "offloaded activations": act.offloaded}
    if cpu:
        for key, value in device.items():  # every rank's memory is host memory
            host[key] = value * per_node
    else:
        for key, value in offloaded.items():
            host[key] = value * per_node
        host["process overhead"] = (GPU_PROCESS_HOST_OVERHEAD + job.processor_bytes) * per_node
        # The checkpoint is memory-mapped at load: page cache shared by the node's processes (reclaimable,
        # counted to be safe).
        host["checkpoint in page cache"] = _checkpoint_bytes(job)
    host = {k: v for k, v in host.items() if v}
    return Prediction(job, device, host, notes, peak_name, st, act)


def sequence_slice(job: Workload) -> Workload:
    """The workload one rank of a sequence-parallel group runs through its layers: a 1/N slice of each row (padded
    to a multiple of N)."""
    n = max(1, job.sequence_parallel)
    # No mask reaches the attention: the slices carry a prepared one that Ulysses drops (causal, or by the row's
    # record boundaries).
    return job if n == 1 else job.replace(seq_len=-(-job.seq_len // n), padding_mask=False)


def all_to_all_bytes(job: Workload) -> int:
    """The Ulysses attention's transient buffers in one layer (none without sequence parallelism): DeepSpeed's
    exchange copies a slice's queries, keys and values (key/value heads replicated up to N) twice, contiguous
    before and gathered after the all-to-all; what the attention kernel saves of them is its own (counted as the
    slice's). Its output comes back through the same two copies, freed before the next layer."""
    n = job.sequence_parallel
    if n <= 1:
        return 0
    sh = job.shape
    kv = max(sh.num_kv_heads, n) * sh.head_dim
    return 2 * precision_of(job).act * job.rows * sequence_slice(job).seq_len * (sh.q_dim + 2 * kv)


def longest_record(job: Workload, limits: Limits, cap: int = 1 << 24) -> int:
    """The longest row (tokens) this job fits at its micro-batch (0: not even one token), by bisection on
    predict: everything else about the job as given."""
    def ok(n: int) -> bool:
        return fits(predict(job.replace(seq_len=n)), limits)[0]

    step = max(1, job.sequence_parallel)
    lo, hi = 0, cap // step  # in slices of `step` tokens
    if not ok(step):
        return 0
    if ok(hi * step):
        return hi * step
    lo = 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid * step) else (lo, mid)
    return lo * step


def generation_kv_bytes(job: Workload) -> int:
    """The KV cache of a method that generates (GRPO): keys and values of every layer for each of the micro-batch's
    prompts x generations rows over prompt + completion (seq_len), in the activation dtype, plus one position's
    fp32 logits per row. No gradients are kept while it exists (the training forward comes after)."""
    sh, a = job.shape, precision_of(job).act
    return 2 * sh.num_layers * sh.kv_dim * job.rows * job.seq_len * a + 4 * job.rows * sh.vocab_size


def reference_model_bytes(job: Workload) -> int:
    """DPO's frozen reference (full fine-tuning) on one rank: the weights again, or under ZeRO-3 this rank's
    partition of them, padded per parameter as the policy's are, plus the small parameters the reference's engine
    keeps whole (its persistence threshold is the policy's; held unpadded, unlike the policy's: counted on odd
    sizes). bench/memory.py counts it byte for byte."""
    if not job.reference_copy:
        return 0
    weight, tensors, n = precision_of(job).weight, job.shape.tensors(), job.world_size
    if job.strategy.stage != 3:
        return weight * sum(t.numel for t in tensors)
    threshold = job.strategy.setting("stage3_param_persistence_threshold", job.shape.hidden_size)
    held = sum(math.ceil(t.numel / n) for t in tensors)
    if n > 1:
        held += sum(t.numel for t in tensors if t.numel <= threshold)
    return weight * held


def _checkpoint_bytes(job: Workload) -> int:
    elt = {"float32": 4, "bfloat16": 2, "float16": 2}[job.weight_dtype]
    return elt * job.shape.num_params


def rank_state_bytes(job: Workload, rank: int) -> dict[str, int]:
    """Model-state bytes one rank holds when the optimizer step starts (what bench/memory.py counts)."""
    st = model_states(job, rank)
    return {
        "params": st.params + st.host_params + st.persistent,
        "grads": st.grads + st.host_grads,
        "optimizer": st.optim + st.host_optim,
    }


# ----------------------------------------------------------------------------------------------
# Recommendation.

# FSDP2 shards as ZeRO-3 does, torch-native with less overhead: tried before ZeRO-3; its CPU offload steps the
# optimizer with torch's AdamW on the CPU (slower than DeepSpeed's CPU Adam): after zero3.
PRESET_ORDER = ("ddp", "zero1", "zero2", "fsdp2", "zero3_no_offload", "zero3", "fsdp2_offload", "zero3_nvme")


def candidate_presets() -> tuple[str, ...]:
    """The presets finetune.config knows, cheapest communication first (unknown new ones last)."""
    from finetune import config as C

    known = [p for p in PRESET_ORDER if p in C.PRESETS]
    return tuple(known + [p for p in C.PRESETS if p not in known])


@dataclass
class Limits:
    device_memory: int
    host_memory: int


def fits(pred: Prediction, limits: Limits) -> tuple[bool, str]:
    problems = []
    if pred.job.accelerator != "cpu" and pred.device_total > limits.device_memory:
        top = max(pred.device, key=pred.device.get)
        problems.append(f"needs {fmt_bytes(pred.device_total)} per device > {fmt_bytes(limits.device_memory)} "
                        f"(largest: {top} {fmt_bytes(pred.device[top])})")
    if pred.job.accelerator == "cpu" and pred.device_total > limits.device_memory:
        problems.append(f"needs {fmt_bytes(pred.device_total)} per process > {fmt_bytes(limits.device_memory)}")
    if pred.host_total > limits.host_memory:
        top = max(pred.host, key=pred.host.get)
        problems.append(f"needs {fmt_bytes(pred.host_total)} per host > {fmt_bytes(limits.host_memory)} "
                        f"(largest: {top} {fmt_bytes(pred.host[top])})")
    return (not problems), "; ".join(problems)


def _throughput(job: Workload, micro: int, ckpt: bool) -> float:
    """A proxy for tokens/s, only to rank settings that fit: preset cost, recompute (~1/3 more), and
    small micro-batches' lower device efficiency."""
    tokens = micro * job.seq_len
    return _SPEED.get(job.strategy.name, 0.8) * (0.75 if ckpt else 1.0) * tokens / (tokens + 1024)


def _halvings(n: int) -> list[int]:
    out = []
    while n >= 1:
        out.append(n)
        n //= 2
    return out


@dataclass
class Recommendation:
    config: str | None
    micro_batch: int | None
    grad_accum: int | None
    grad_ckpt: bool | None
    prediction: Prediction | None
    reason: str
    rejected: dict[str, str]

    def flags(self) -> str:
        if self.config is None:
            return ""
        out = f"--config {self.config} --per_device_train_batch_size {self.micro_batch} --gradient_accumulation_steps {self.grad_accum}"
        out += " --gradient_checkpointing" if self.grad_ckpt else " --gradient_checkpointing false"
        job = self.prediction.job if self.prediction is not None else None
        if job is not None and job.strategy.nvme:
            out += " --nvme_path FOLDER"
        if job is not None and job.tiled_mlp:
            out += " --tiled_mlp"
        if job is not None and job.offload_activations:  # it needs the checkpointing (finetune.config refuses it alone)
            out += " --offload_activations" if self.grad_ckpt else " --offload_activations false"
        return out


def recommend(job: Workload, limits: Limits, candidates: tuple[str, ...] | None = None) -> Recommendation:
    """The preset, micro-batch and checkpointing setting that fit with the best throughput proxy.

    Presets are tried from cheapest communication to most offload; the first that fits at some micro-batch
    (powers of two up to the requested one; gradient accumulation keeps the global batch) wins; within it the
    best throughput proxy. Every rejected preset comes with the reason.
    """
    candidates = candidates or candidate_presets()
    global_micro = job.micro_batch * job.grad_accum
    rejected: dict[str, str] = {}
    for name in candidates:
        try:  # the job's own preset as it was read; the others read here
            strategy = job.strategy if name == job.strategy.name else Strategy.from_config(name)
        except (OSError, ValueError, ConfigError) as e:
            rejected[name] = f"cannot read: {e}"
            continue
        if job.quant and strategy.stage == 3:
            rejected[name] = "a bitsandbytes-quantized base cannot be partitioned by ZeRO-3"
            continue
        if job.quant == "8bit" and strategy.fsdp:
            rejected[name] = "bitsandbytes' 8-bit weights cannot be sharded by FSDP2 (4-bit can)"
            continue
        base = job.replace(strategy=strategy)
        options = []
        for micro in _halvings(job.micro_batch):
            for ckpt in (False, True):
                j = base.replace(micro_batch=micro, grad_ckpt=ckpt, grad_accum=max(1, global_micro // micro))
                pred = predict(j)
                ok, why = fits(pred, limits)
                options.append((ok, _throughput(j, micro, ckpt), j, pred, why))
        good = [o for o in options if o[0]]
        if not good:
            smallest = next(o for o in options if o[2].micro_batch == 1 and o[2].grad_ckpt)
            rejected[name] = f"does not fit even at micro-batch 1 with gradient checkpointing: {smallest[4]}"
            continue
        _, _, j, pred, _ = max(good, key=lambda o: o[1])
        requested = next(o for o in options if o[2].micro_batch == job.micro_batch and o[2].grad_ckpt == job.grad_ckpt)
        if requested[0]:
            reason = f"{strategy.describe()}: fits as requested"
        else:
            reason = f"{strategy.describe()}: the requested setting {requested[4]}"
        if (j.micro_batch, j.grad_ckpt) != (job.micro_batch, job.grad_ckpt) and not requested[0]:
            reason += f"; micro-batch {j.micro_batch}" + (" with" if j.grad_ckpt else " without") + " gradient checkpointing fits"
        reason += f" ({fmt_bytes(pred.device_total)} per device, {fmt_bytes(pred.host_total)} per host)"
        for later in candidates[candidates.index(name) + 1:]:
            rejected.setdefault(later, f"not needed: {name} fits and communicates or offloads less")
        return Recommendation(name, j.micro_batch, j.grad_accum, j.grad_ckpt, pred, reason, rejected)
    return Recommendation(None, None, None, None, None, "no preset fits: use more devices, LoRA/QLoRA or a shorter sequence", rejected)


# ----------------------------------------------------------------------------------------------
# Flags: the training flags (finetune.config) plus the plan-only ones.

@dataclass
class PlanArgs:
    """The machine to plan for (plan-only flags)"""

    devices_per_node: int | None = field(
        default=None, metadata={"help": "Devices (GPUs, or CPU processes) per node (default: the GPUs here, else 1)."})
    num_nodes: int = field(default=1, metadata={"help": "Nodes."})
    device_memory: str | None = field(
        default=None, metadata={"help": "Memory per device, e.g. 80GB (default: this GPU's; on CPU the host memory / devices)."})
    host_memory: str | None = field(default=None, metadata={"help": "Memory per host, e.g. 2TB (default: this machine's)."})
    accelerator: str | None = field(
        default=None,
        metadata={"help": "gpu or cpu (default: gpu when --device_memory is given or a GPU is present, else cpu)."})
    images_per_record: int | None = field(
        default=None, metadata={"help": "A vision-language model: the images each record holds (default 1, or 0 where "
                                        "one image's tokens exceed --max_seq_length; 0 plans text records)."})
    image_size: str | None = field(
        default=None, metadata={"help": "A vision-language model: the images' size in pixels, HEIGHTxWIDTH, as the "
                                        "processor resizes and tiles such an image (default: the largest input it "
                                        "makes that fits --max_seq_length)."})
    json: bool = field(default=False, metadata={"help": "Print the plan as JSON."})


PLAN_FLAGS = {f.name: f.metadata["help"] for f in dataclasses.fields(PlanArgs)}
DESCRIPTION = (
    "Predict per-device and per-host memory from the model's config.json (no weights are loaded) and recommend the "
    "preset, micro-batch and checkpointing that fit. The training flags and recipe keys are those of `finetune train`."
)


class PlanError(ConfigError):
    """A plan that cannot be made: the problems, each naming its flag (a ConfigError, reported the same way)."""

    def __init__(self, problems: list[str] | str):
        super().__init__(problems, prog="finetune plan")


def command():
    from finetune import config as C

    return C.command("finetune plan", {"plan": PlanArgs}, description=DESCRIPTION)


def parse_plan_args(argv: list[str]):
    """-> (FinetuneConfig, PlanArgs). Training flags are parsed by finetune.config, as `finetune train` does; the
    DeepSpeed preset is validated there too but TrainingArguments is built without it (no process group)."""
    from finetune import config as C

    model, data, launch, values, sources, problems, extra = C.parse_sections(argv, "finetune plan", {"plan": PlanArgs})
    flags: PlanArgs = extra["plan"]
    # No launcher to agree with: a plan may be for another machine or launch.
    preset, more = C.resolve_preset(launch, environ=None)
    problems += more + _preset_problems(model, data, launch, values, preset)
    # The method's own flag checks, as `finetune train` runs them: a plan of a line train would refuse is no plan.
    problems += C.validate_method(extra["objective"], data, values, extra["evaluation"])
    if not model.model_name_or_path:
        problems.append("model_name_or_path: required (a folder with config.json)")
    elif looks_like_repo_id(model.model_name_or_path):
        # A Hub model: only its config.json is fetched (hf_hub_download), which is all a plan reads.
        problems += C.training.resolve_model_or_problems(model, config_only=True)
    if model.model_name_or_path and not problems:
        problems += C.training.family_problems(model)  # train's checks of the family (attention, LoRA targets)
    if model.use_peft and model.model_name_or_path and not problems:
        try:  # a module train adapts but the plan cannot count (the LM head, the embeddings): said before torch loads
            families.family_of(read_config(model.model_name_or_path)).lora_targets(list(model.lora_target_modules))
        except (ValueError, families.FamilyError) as e:
            problems.append(str(e))
    if flags.accelerator not in (None, "gpu", "cpu"):
        problems.append(f"--accelerator: '{flags.accelerator}' is not gpu or cpu")
    for key in ("devices_per_node", "num_nodes"):
        value = getattr(flags, key)
        if value is not None and value < 1:
            problems.append(f"--{key}: must be at least 1, got {value}")
    if (flags.devices_per_node or 1) > MAX_DEVICES_PER_NODE:
        problems.append(f"--devices_per_node: {flags.devices_per_node} is more than any machine holds (at most "
                        f"{MAX_DEVICES_PER_NODE}); give the accelerators of one node, e.g. 8")
    if (flags.devices_per_node or 1) * (flags.num_nodes or 1) > MAX_DEVICES:
        problems.append(f"--num_nodes x --devices_per_node: {(flags.devices_per_node or 1) * flags.num_nodes:,} "
                        f"devices is beyond any cluster (at most {MAX_DEVICES:,}); check both flags")
    for key in ("host_memory", "device_memory"):
        if getattr(flags, key) is not None:
            try:
                setattr(flags, key, parse_size(getattr(flags, key)))
            except ValueError as e:
                problems.append(f"--{key}: {e}")
            else:
                if getattr(flags, key) <= 0:
                    problems.append(f"--{key}: must be a positive size (e.g. 80GB), got {getattr(flags, key)} bytes")
    training = None
    if not problems:
        # The preset is checked on its own (a DeepSpeed preset in TrainingArguments would start a process group).
        training, more = C.build_training_arguments(values, None)
        problems += more
    if problems:
        raise PlanError(problems)
    return C.FinetuneConfig(model, data, launch, training, preset, sources,
                            objective=extra["objective"]), flags


def _preset_problems(model, data, launch, training_values: dict[str, Any], preset) -> list[str]:
    """finetune.config's checks (quantized base under ZeRO-3, bad values; the preset's own are resolve_preset's),
    without the ones about running it here (an NVMe folder, DeepSpeed's async I/O): a plan may be for another
    machine."""
    from finetune import config as C

    problems = C.validate(model, data, launch, training_values, check_paths=False, preset=preset)
    skip = set(C.nvme_problems(preset, launch.nvme_path)) if preset is not None else set()
    return [p for p in problems if p not in skip]


def read_config(folder: str | Path) -> dict:
    """A model folder's config.json; errors name the file."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"model_name_or_path: {folder}: no config.json (finetune plan reads only the config)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not valid JSON: {e.msg}") from None


def parse_image_size(text: str | None) -> tuple[int, int] | None:
    """'448x336' -> (448, 336); ValueError naming the flag."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", str(text))
    if not m or not int(m.group(1)) or not int(m.group(2)):
        raise ValueError(f"--image_size: '{text}' is not HEIGHTxWIDTH in pixels (e.g. 448x336)")
    return int(m.group(1)), int(m.group(2))


def processor_settings(folder: str | Path) -> dict:
    """The image processor's saved settings in a model folder: processor_config.json's image_processor (transformers
    5), else preprocessor_config.json; {} when neither is there (the family's defaults)."""
    for name, key in (("processor_config.json", "image_processor"), ("preprocessor_config.json", None)):
        path = Path(folder) / name
        if path.is_file():
            try:
                d = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{e.lineno}: not valid JSON: {e.msg}") from None
            d = d.get(key) or {} if key else d
            if d:
                return d
    return {}


def record_images(shape: ModelShape, folder: str | Path, seq_len: int, images_per_record: int | None,
                  image_size: str | None) -> tuple[Images | None, str]:
    """One record's pictures as the model's tower takes them (None: text records) and the plan's words for them, from
    the processor's saved settings; ValueError naming the flag when they cannot be planned."""
    family = shape.family
    if not family.vision:
        if images_per_record:
            raise ValueError(f"--images_per_record: {folder} is a text model ({family.name}); it takes no images")
        return None, ""
    if images_per_record is not None and images_per_record < 0:
        raise ValueError(f"--images_per_record: must be 0 or more, got {images_per_record}")
    size = parse_image_size(image_size)
    n = 1 if images_per_record is None else images_per_record
    if n == 0:
        return None, "text records (--images_per_record 0)"
    one, tokens = family.image_input(shape.config, processor_settings(folder), size, max_tokens=seq_len // n)
    if n * tokens > seq_len:
        if images_per_record is None and size is None:
            return None, (f"text records: one image is {tokens} tokens, more than --max_seq_length {seq_len} "
                          "(such records are dropped)")
        raise ValueError(f"--images_per_record {n} x {tokens} tokens per image"
                         + (f" of {size[0]}x{size[1]} pixels" if size else "") + f" exceed --max_seq_length {seq_len}: "
                         "such records are dropped, not trained; give fewer or smaller images, or a longer sequence")
    what = f"{size[0]}x{size[1]} pixels" if size else "the largest the processor makes"
    return one.times(n), (f"{n} image(s) per record ({what}): {one.tiles} tile(s), {one.patches} tower positions and "
                          f"{tokens} tokens each")


def workload_from_config(cfg, *, world_size: int, devices_per_node: int, accelerator: str,
                         images_per_record: int | None = None, image_size: str | None = None) -> Workload:
    args = cfg.training
    model = cfg.model
    config = read_config(model.model_name_or_path)
    shape = model_shape(config)
    dtype = model.torch_dtype
    if dtype == "auto":
        dtype = "bfloat16" if accelerator == "gpu" else "float32"
    mixed = "bf16" if getattr(args, "bf16", False) else ("fp16" if getattr(args, "fp16", False) else None)
    strategy = Strategy.from_preset(cfg.preset)
    if accelerator == "gpu" and strategy.stage > 0 and mixed is None:
        mixed = "bf16"  # DeepSpeed on GPU: planned as mixed precision (pass --bf16)
    quant = "8bit" if model.load_in_8bit else ("4bit" if model.load_in_4bit else None)
    objective = getattr(cfg, "objective", None)
    terms = methods.get(getattr(objective, "method", methods.DEFAULT)).planner_terms(objective, use_peft=model.use_peft)
    if terms.head_outputs:  # the method's model has another head than the LM head (a reward model's score)
        shape = dataclasses.replace(shape, head_outputs=terms.head_outputs)
    per_record = attention.applies(cfg, SimpleNamespace(**config))
    if model.use_peft:
        shape.family.lora_targets(list(model.lora_target_modules))  # ValueError: a target the plan cannot count
    images, images_note = record_images(shape, model.model_name_or_path, cfg.data.max_seq_length, images_per_record,
                                        image_size)
    tower_trains = shape.family.vision and not getattr(model, "freeze_vision_tower", True)
    return Workload(
        shape=shape, strategy=strategy, world_size=world_size, devices_per_node=devices_per_node,
        micro_batch=args.per_device_train_batch_size, seq_len=cfg.data.max_seq_length + terms.completion_length,
        grad_accum=args.gradient_accumulation_steps, grad_ckpt=bool(args.gradient_checkpointing),
        accelerator=accelerator, weight_dtype=dtype, mixed_precision=mixed, use_peft=model.use_peft,
        lora_r=model.lora_r, lora_targets=tuple(model.lora_target_modules), lora_dropout=model.lora_dropout,
        quant=quant, bnb_nested=model.use_bnb_nested_quant,
        # Pairs are scored by log-probabilities from the logits, not with the chunked cross-entropy.
        # (and a method that generates scores its completions' log-probabilities the same way).
        loss_chunk=0 if terms.pairs or terms.generations or getattr(args, "use_liger_kernel", False)
        else getattr(model, "loss_chunk_size", 0),
        pairs=terms.pairs, reference_copy=terms.reference_copy,
        generations=terms.generations, completion_length=terms.completion_length,
        # Packed rows under per-record sdpa (finetune.models.attention): no mask reaches the kernel, whose GQA path
        # then keeps the key/value heads unrepeated.
        padding_mask=not per_record, per_record_attention=per_record,
        images=images, tower_trains=tower_trains,
        processor_bytes=processor_memory(model.model_name_or_path) if images else 0,
        method_note=terms.note + (f"; {images_note}" if images_note else "")
        + ("; the vision tower and projector trained" if tower_trains else ""),
        sequence_parallel=cfg.launch.sequence_parallel_size,
        tiled_mlp=getattr(model, "tiled_mlp", False), offload_activations=getattr(model, "offload_activations", False),
    )


def _local_gpus() -> tuple[int, int]:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count(), torch.cuda.get_device_properties(0).total_memory
    except Exception:  # noqa: BLE001 - planning must work without a usable torch.cuda
        pass
    return 0, 0


def _host_memory() -> int:
    import psutil

    return psutil.virtual_memory().total


def make_plan(argv: list[str]) -> dict[str, Any]:
    return _make_plan(argv)[0]


def _make_plan(argv: list[str]) -> tuple[dict[str, Any], PlanArgs]:
    cfg, flags = parse_plan_args(argv)
    gpus, gpu_mem = _local_gpus()
    accelerator = flags.accelerator or ("gpu" if (flags.device_memory is not None or gpus) else "cpu")
    per_node = flags.devices_per_node or (gpus if accelerator == "gpu" and gpus else 1)
    nodes = flags.num_nodes
    host = flags.host_memory or _host_memory()
    if flags.device_memory is not None:
        device = flags.device_memory
    elif accelerator == "gpu":
        if not gpu_mem:
            raise PlanError("--device_memory: required when planning for GPUs on a machine without one")
        device = gpu_mem
    else:
        device = host // per_node
    try:
        job = workload_from_config(cfg, world_size=per_node * nodes, devices_per_node=per_node, accelerator=accelerator,
                                   images_per_record=flags.images_per_record, image_size=flags.image_size)
    except ValueError as e:
        raise PlanError(str(e)) from None
    if job.world_size % job.sequence_parallel:
        raise PlanError(f"sequence_parallel_size: {job.sequence_parallel} does not divide the {job.world_size} "
                        "devices planned for (--devices_per_node x --num_nodes)")
    limits = Limits(device, host)
    pred = predict(job)
    ok, why = fits(pred, limits)
    # Sequence parallelism runs on DeepSpeed's presets only (finetune.config refuses FSDP2 with it).
    rec = recommend(job, limits, tuple(p for p in candidate_presets() if not p.startswith("fsdp"))
                    if job.sequence_parallel > 1 else None)
    plan = _as_data(job, pred, ok, why, rec, limits)
    plan["longest_record"] = {"tokens": longest_record(job, limits), "sequence_parallel_size": job.sequence_parallel}
    return plan, flags


def _as_data(job: Workload, pred: Prediction, ok: bool, why: str, rec: Recommendation, limits: Limits) -> dict[str, Any]:
    sh = job.shape
    prec = precision_of(job)
    trainable = sum(t.numel for t in trained_and_frozen(job)[0])
    act = pred.act
    states = rank_state_bytes(job, 0)
    states = {"parameters": states["params"], "gradients": states["grads"], "optimizer states": states["optimizer"]}
    return {
        "model": {
            "family": sh.family.name, "model_type": sh.model_type, "parameters": sh.num_params,
            "trainable_parameters": trainable, "experts": sh.num_experts, "experts_per_token": sh.experts_per_tok,
            "hidden_size": sh.hidden_size, "layers": sh.num_layers, "heads": sh.num_heads, "kv_heads": sh.num_kv_heads,
            "intermediate_size": sh.intermediate_size,
            "vocab_size": sh.vocab_size, "tie_word_embeddings": sh.tie_word_embeddings,
        },
        "job": {
            "config": job.strategy.name, "strategy": job.strategy.describe(), "accelerator": job.accelerator,
            "world_size": job.world_size, "devices_per_node": job.devices_per_node, "num_nodes": job.num_nodes,
            "per_device_train_batch_size": job.micro_batch, "max_seq_length": job.seq_len,
            "gradient_accumulation_steps": job.grad_accum, "gradient_checkpointing": job.grad_ckpt,
            "tiled_mlp": job.tiled_mlp, "offload_activations": job.offload_activations,
            "method": (("QLoRA (" + job.quant + " base)" if job.quant else "LoRA") + f" r={job.lora_r}" if job.use_peft
                       else "full") + job.method_note,
            "precision": prec.note + ("; LoRA adapters in fp32: 4 + 4 + 8" if job.use_peft and prec.name == "bf16" else ""),
        },
        "limits": {"device_memory": limits.device_memory, "host_memory": limits.host_memory},
        "per_device": dict(pred.device), "per_device_total": pred.device_total,
        "per_host": dict(pred.host), "per_host_total": pred.host_total,
        "model_states_at_step": states,
        "activations_saved": act.saved, "activations_detail": act.detail, "peak_moment": pred.peak_moment,
        "fits": ok, "does_not_fit_because": why or None,
        "recommendation": {
            "config": rec.config, "per_device_train_batch_size": rec.micro_batch,
            "gradient_accumulation_steps": rec.grad_accum, "gradient_checkpointing": rec.grad_ckpt,
            "flags": rec.flags(), "reason": rec.reason,
            "per_device_total": rec.prediction.device_total if rec.prediction else None,
            "per_host_total": rec.prediction.host_total if rec.prediction else None,
        },
        "rejected": rec.rejected,
        "notes": pred.notes,
    }


def render(plan: dict[str, Any]) -> str:
    m, j, lim = plan["model"], plan["job"], plan["limits"]
    lines = [
        f"model: {m['model_type']} (family {m['family']}), {fmt_count(m['parameters'])} parameters "
        f"({fmt_count(m['trainable_parameters'])} trainable); "
        f"hidden {m['hidden_size']}, {m['layers']} layers, {m['heads']}/{m['kv_heads']} heads, "
        f"intermediate {m['intermediate_size']}, vocab {m['vocab_size']}"
        + (f", {m['experts']} experts ({m['experts_per_token']} per token)" if m.get("experts") else ""),
        f"method: {j['method']}; precision: {j['precision']}",
        f"job: --config {j['config']} = {j['strategy']}; {j['world_size']} {j['accelerator'].upper()} device(s) "
        f"({j['num_nodes']} node(s) x {j['devices_per_node']}); micro-batch {j['per_device_train_batch_size']} x "
        f"{j['max_seq_length']} tokens, accumulation {j['gradient_accumulation_steps']}, gradient checkpointing "
        f"{'on' if j['gradient_checkpointing'] else 'off'}"
        + (", tiled MLP" if j.get("tiled_mlp") else "") + (", activations offloaded" if j.get("offload_activations") else ""),
        "",
        "model states per device when the optimizer steps (offloaded ones included): " + ", ".join(
            f"{k} {fmt_bytes(v)}" for k, v in plan["model_states_at_step"].items()),
        "",
        f"per device ({fmt_bytes(lim['device_memory'])}), at the predicted peak ({plan['peak_moment']}):",
    ]
    for key, value in plan["per_device"].items():
        lines.append(f"  {key:<28}{fmt_bytes(value):>12}")
    lines.append(f"  {'total':<28}{fmt_bytes(plan['per_device_total']):>12}")
    lines.append(f"per host ({fmt_bytes(lim['host_memory'])}):")
    for key, value in plan["per_host"].items():
        lines.append(f"  {key:<28}{fmt_bytes(value):>12}")
    lines.append(f"  {'total':<28}{fmt_bytes(plan['per_host_total']):>12}")
    lines.append("")
    lines.append("fits" if plan["fits"] else f"does NOT fit: {plan['does_not_fit_because']}")
    rec = plan["recommendation"]
    if rec["config"]:
        lines.append(f"recommendation: {rec['flags']}")
        lines.append(f"  why: {rec['reason']}")
    else:
        lines.append(f"recommendation: none. {rec['reason']}")
    if plan["rejected"]:
        lines.append("rejected:")
        for name, why in plan["rejected"].items():
            lines.append(f"  {name}: {why}")
    if "longest_record" in plan:
        longest = plan["longest_record"]
        split = longest["sequence_parallel_size"]
        lines.append(f"longest record that fits: {longest['tokens']:,} tokens (this job's preset, micro-batch and "
                     "checkpointing" + (f", each record split over {split} ranks)" if split > 1 else
                                        "; --sequence_parallel_size N on the engine path divides activations by about N)"))
    for note in plan["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def help_text() -> str:
    return command().help()


def main(argv: list[str] | None = None) -> None:
    from finetune.config.parser import exit_with_problems, wants_help

    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print(help_text())
        return
    try:
        plan, flags = _make_plan(argv)
    except ConfigError as e:
        exit_with_problems(e)
    print(json.dumps(plan, indent=2) if flags.json else render(plan))


# ----------------------------------------------------------------------------------------------
# --plan_check: called by a training run before it loads anything.


def plan_check(cfg) -> str | None:
    """An error message when the predicted memory of this run exceeds the device (or host) memory, else None.

    Uses the run's own config (cfg from finetune.config.parse) and its world size; device memory is this GPU's,
    or on CPU the host's memory shared by the node's processes.
    """
    args = cfg.training
    world = int(getattr(args, "world_size", 0) or os.environ.get("WORLD_SIZE", "1"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    gpus, gpu_mem = _local_gpus()
    accelerator = "gpu" if gpus and not getattr(args, "use_cpu", False) else "cpu"
    host = _host_memory()
    device = gpu_mem if accelerator == "gpu" else host // max(1, per_node)
    try:
        job = workload_from_config(cfg, world_size=world, devices_per_node=per_node, accelerator=accelerator)
    except ValueError as e:
        return f"--plan_check: cannot plan this run: {e}"
    pred = predict(job)
    ok, why = fits(pred, Limits(device, host))
    if ok:
        return None
    rec = recommend(job, Limits(device, host))
    hint = f"; `finetune plan` suggests: {rec.flags()}" if rec.config else f"; {rec.reason}"
    return (f"--plan_check: predicted memory does not fit: {why}{hint}. "
            "Run `finetune plan` with the same flags for the breakdown, or pass --force to start anyway")


if __name__ == "__main__":
    main()
