"""Variable-length attention over packed rows and padding-free batches: one kernel call per layer.

A packed row (finetune.data.packing, layout "rows") holds several records; a padding-free batch (layout "flat") is
one row of records. The collator states where the records are, on the host, in the names transformers' flash path
and TRL's collator use: `cu_seq_lens_q/k` (int32 offsets into the batch flattened row after row, a row's tail
padding a segment of its own) and `max_length_q/k` (Python ints), plus `seq_bounds`, the offsets as a tuple of ints.
The model's forward hands them to this attention function as keyword arguments, so nothing here reads device values
(no host-device sync) to find the records.

Each layer makes ONE call of the first kernel in PREFERENCE[device type] that can run it:
- "varlen": torch's `torch.nn.attention.varlen.varlen_attn` where this torch has it (CUDA flash kernels, bf16/fp16;
  causal, grouped-query, a sliding window; no soft-capping, no dropout);
- "flash": transformers' flash-attention-2 varlen path where the flash-attn package is installed (soft-capping too);
- "flex": FlexAttention with a document mask (records, causality and the window in a BlockMask built once per
  forward; soft-capping as a score_mod; compiled on CUDA, where its eager form would hold the whole score matrix);
- "loop": sdpa one record at a time (`is_causal`, the kernel's grouped-query path; a band mask for records longer
  than the window; soft-capped records computed as eager attention does), host bounds from `seq_bounds`. First on
  the CPU, where it measured fastest and FlexAttention has no backward (bench/attention.py, bench/RESULTS.md).
Soft-capped families (Gemma-2's attn_logit_softcapping) never take "varlen": on CUDA they go to "flash", else
"flex". A batch without boundaries (padded records, evaluation on unpacked data, generation) takes transformers'
sdpa unchanged (eager for a soft-capped family, which sdpa cannot soft-cap), with its mask.

Used for training with `--packing` or `--padding_free` and `--attn_implementation sdpa` (the default; `eager` for a
soft-capped family, whose sdpa transformers refuses), without `--torch_compile`.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, Callable

VARLEN = "finetune_varlen"
PACKED_SDPA = VARLEN  # its name when it was per-record sdpa alone (bench/gpu.py's)

# Per device type, the kernels in order of preference (bench/attention.py measured the CPU's; RESULTS.md).
PREFERENCE: dict[str, tuple[str, ...]] = {"cuda": ("varlen", "flash", "flex", "loop"), "cpu": ("loop", "flex")}
OTHER_DEVICES = ("flex", "loop")

FLASH_DTYPES = ("float16", "bfloat16")  # what the CUDA flash kernels take


def register() -> None:
    """Make VARLEN a name transformers knows: this attention function, and a mask function for the batches that fall
    back to transformers' sdpa or eager (which need their padding mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN, _fallback_mask)


def softcapped(config) -> bool:
    return getattr(config, "attn_logit_softcapping", None) is not None


def unsupported(config) -> str | None:
    """Why a model's attention is not causal attention over records that the kernels here compute (None: it is)."""
    if not getattr(config, "is_causal", True):
        return "bidirectional attention"
    if getattr(config, "attention_dropout", 0.0):
        return "attention dropout"
    return None


def applies(cfg, model_config) -> bool:
    """Whether a run of `cfg` on a model of `model_config` (a transformers config, or any object with its
    attributes) trains with VARLEN: packed rows or padding-free batches (the collator states their boundaries),
    --attn_implementation sdpa (eager for a soft-capped family), no --torch_compile (kept on transformers' own
    kernels), causal attention without dropout."""
    data, margs, args = cfg.data, cfg.model, cfg.training
    name = margs.attn_implementation
    kernel = name == "sdpa" or (name == "eager" and softcapped(model_config))
    return (kernel and not getattr(args, "torch_compile", False) and bool(data.packing or data.padding_free)
            and unsupported(model_config) is None)


def enable(model, cfg) -> bool:
    """Switch the model's attention to VARLEN where `applies` (True if it did)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not applies(cfg, base.config):
        return False
    register()
    base.set_attn_implementation(VARLEN)
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else base
    if not getattr(decoder, "_finetune_no_mask_hook", None):
        decoder._finetune_no_mask_hook = decoder.register_forward_pre_hook(no_mask_for_boundaries, with_kwargs=True)
    return True


def no_mask_for_boundaries(module, args, kwargs):
    """Forward pre-hook of the decoder: a batch that carries the collator's host bounds (`seq_bounds`, covering the
    batch) gets no attention mask built. Its attention reads the boundaries, and a mask would cost a [batch, 1,
    length, length] tensor per forward and, before it, transformers' packed-sequence detection, which reads the
    position ids back from the device (masking_utils.find_packed_sequence_indices: a sync). Handed a prepared
    (4-D) mask, transformers builds none: this one is a single value expanded, that no kernel here reads."""
    import torch

    bounds, ids = kwargs.get("seq_bounds"), kwargs.get("input_ids")
    embeds = kwargs.get("inputs_embeds")
    shaped = ids if ids is not None else embeds
    if (bounds is None or kwargs.get("attention_mask") is not None or kwargs.get("past_key_values") is not None
            or shaped is None or bounds[-1] != shaped.shape[0] * shaped.shape[1]):
        return None
    batch, length = shaped.shape[:2]
    kwargs["attention_mask"] = torch.ones((), dtype=torch.bool, device=shaped.device).expand(batch, 1, length, length)
    return args, kwargs


def describe(device_type: str, config, dtype) -> str:
    """The start line: the kernel a packed training batch of this model takes on this device."""
    heads = getattr(config, "num_attention_heads", 1)
    probe = Call(batch=1, length=2, heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                 head_dim=getattr(config, "head_dim", None) or 1, scaling=None, window=None,
                 softcap=getattr(config, "attn_logit_softcapping", None), dropout=0.0, dtype=dtype,
                 device_type=device_type, grad=True, cu=None, longest=2, bounds=(0, 2))
    return (f"attention: packed records through one variable-length kernel call per layer "
            f"({choose(probe, device_type) or 'loop'}; records never attend to each other)")


def preference(device_type: str) -> tuple[str, ...]:
    return PREFERENCE.get(device_type, OTHER_DEVICES)


# ---- the kernels -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """What one layer's attention asks for, all of it known on the host."""

    batch: int
    length: int
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float | None
    window: int | None  # the number of positions a query sees, itself included (transformers' sliding_window)
    softcap: float | None
    dropout: float
    dtype: Any
    device_type: str
    grad: bool  # whether autograd records this call (FlexAttention has no backward on CPU)
    cu: Any  # cu_seq_lens, on the device
    longest: int
    bounds: tuple[int, ...] | None  # the same offsets as host ints (seq_bounds), where the collator gave them

    @property
    def gqa(self) -> bool:
        return self.heads != self.kv_heads


def torch_varlen() -> Callable | None:
    """torch's varlen_attn where this torch has it (a feature test: torch 2.13 has it; older ones may not)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


# name -> the function a kernel calls; a test registers a stand-in here, where the real one is looked up.
KERNELS: dict[str, Callable | None] = {}


def kernel_fn(name: str) -> Callable | None:
    if name not in KERNELS:
        KERNELS[name] = _find(name)
    return KERNELS[name]


def _find(name: str) -> Callable | None:
    if name == "varlen":
        return torch_varlen()
    if name == "flash":
        from transformers.utils import is_flash_attn_2_available

        if not is_flash_attn_2_available():
            return None
        from transformers.modeling_flash_attention_utils import _flash_attention_forward

        return _flash_attention_forward
    if name == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention
    if name == "loop":
        import torch

        return torch.nn.functional.scaled_dot_product_attention
    raise KeyError(name)


@functools.lru_cache(maxsize=16)
def _params(fn) -> frozenset[str]:
    """The keyword names a kernel takes (read once: every layer asks)."""
    import inspect

    return frozenset(inspect.signature(fn).parameters)


def _kernel_can(name: str, call: Call) -> bool:
    """Whether kernel NAME runs CALL (all of it known on the host)."""
    fn = kernel_fn(name)
    if fn is None or (name == "varlen" and call.softcap is not None):
        return False
    if name in ("varlen", "flash") and str(call.dtype).removeprefix("torch.") not in FLASH_DTYPES:
        return False
    if name == "varlen":  # torch 2.10's takes is_causal and no scale; 2.11's a window; 2.12's grouped-query heads
        params = _params(fn)
        if call.dropout or (call.window is not None and "window_size" not in params) or (
                "scale" not in params and call.scaling is not None and call.scaling != call.head_dim ** -0.5):
            return False
    if name == "flex" and (call.dropout or (call.grad and call.device_type in ("cpu", "mps"))):
        return False
    if name == "loop" and call.bounds is None:
        return False
    return True


def _run_varlen(fn, q, k, v, call: Call):
    """torch's varlen_attn on the batch flattened to [tokens, heads, dim]."""
    params = _params(fn)
    if call.gqa and "enable_gqa" not in params:  # an older varlen_attn: the key/value heads repeated for it
        k, v = (t.repeat_interleave(call.heads // call.kv_heads, dim=1) for t in (k, v))
    flat = [t.transpose(1, 2).reshape(call.batch * call.length, t.shape[1], t.shape[3]) for t in (q, k, v)]
    kw: dict[str, Any] = {"scale": call.scaling} if "scale" in params else {}
    if "window_size" in params:
        kw["window_size"] = (call.window - 1, 0) if call.window is not None else (-1, 0)
    else:  # a torch whose varlen_attn takes is_causal instead (its calls with a window are not routed here)
        kw["is_causal"] = True
    if call.gqa and "enable_gqa" in params:
        kw["enable_gqa"] = True
    out = fn(*flat, call.cu, call.cu, call.longest, call.longest, **kw)
    return out.view(call.batch, call.length, call.heads, -1)


def _run_flash(fn, q, k, v, call: Call):
    """transformers' flash-attention-2 varlen path: it flattens the batch itself when given the boundaries."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return fn(q, k, v, None, query_length=call.length, is_causal=True, dropout=call.dropout,
              softmax_scale=call.scaling, sliding_window=call.window, softcap=call.softcap,
              cu_seq_lens_q=call.cu, cu_seq_lens_k=call.cu, max_length_q=call.longest, max_length_k=call.longest,
              attn_implementation="flash_attention_2")


_masks: dict = {"cu": None, "masks": {}}  # the BlockMasks of the forward in flight, by window


def _block_mask(call: Call, device):
    """The document mask of this batch (records, causality, the window), built once per forward: every layer gets
    the same cu_seq_lens tensor."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    ref = _masks["cu"]
    if ref is None or ref() is not call.cu:
        _masks["cu"], _masks["masks"] = weakref.ref(call.cu), {}
    key = (call.window, call.batch, call.length)
    if key not in _masks["masks"]:
        tokens = torch.arange(call.batch * call.length, device=device, dtype=call.cu.dtype)
        # A token's record: the number of record ends at or before it (no host value needed).
        doc = torch.searchsorted(call.cu[1:].contiguous(), tokens, right=True).view(call.batch, call.length)
        window = call.window

        def records(b, h, q_idx, kv_idx):
            same = (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)
            return same & (q_idx - kv_idx < window) if window is not None else same

        _masks["masks"][key] = create_block_mask(records, call.batch, None, call.length, call.length, device=device)
    return _masks["masks"][key]


_compiled_flex: dict = {}


def _run_flex(fn, q, k, v, call: Call):
    import torch

    if q.device.type == "cuda":  # eager FlexAttention materializes the scores; compiled, it is a fused kernel
        if "fn" not in _compiled_flex:
            _compiled_flex["fn"] = torch.compile(fn)
        fn = _compiled_flex["fn"]
    score_mod = None
    if call.softcap is not None:
        cap = call.softcap

        def score_mod(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)

    out = fn(q, k, v, score_mod=score_mod, block_mask=_block_mask(call, q.device), scale=call.scaling,
             enable_gqa=call.gqa)
    return out.transpose(1, 2)


def _run_loop(fn, q, k, v, call: Call):
    """sdpa per record, the records' offsets read from host ints; soft-capped logits by the eager computation, per
    record (sdpa cannot soft-cap)."""
    import torch

    parts = []
    b = call.bounds
    for s, e in zip(b[:-1], b[1:]):
        row, at, n = s // call.length, s % call.length, e - s
        mask = None
        if (call.window is not None and n > call.window) or call.softcap is not None:
            i = torch.arange(n, device=q.device)
            mask = i[:, None] >= i[None, :]
            if call.window is not None:
                mask = mask & (i[:, None] - i[None, :] < call.window)
        qr, kr, vr = (t[row:row + 1, :, at:at + n] for t in (q, k, v))
        if call.softcap is not None:
            parts.append(_softcapped(qr, kr, vr, mask, call))
            continue
        with _not_cudnn(q):
            parts.append(fn(qr, kr, vr, attn_mask=mask, dropout_p=call.dropout, is_causal=mask is None,
                            scale=call.scaling, enable_gqa=call.gqa))
    out = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]  # [1, heads, batch * length, dim]
    return out[0].transpose(0, 1).reshape(call.batch, call.length, call.heads, -1)


def _not_cudnn(query):
    """sdpa's kernels for per-record calls. On CUDA, not cuDNN's: it builds an execution plan for every new sequence
    length (measured on an H100, torch 2.11: 1.8 ms of CPU per call for 6 us on the GPU)."""
    import contextlib

    if query.device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _softcapped(q, k, v, mask, call: Call):
    """Soft-capped attention of one record as transformers' eager Gemma-2 computes it (softmax in fp32)."""
    import torch

    if call.gqa:
        k, v = (t.repeat_interleave(call.heads // call.kv_heads, dim=1) for t in (k, v))
    scale = call.scaling if call.scaling is not None else q.shape[-1] ** -0.5
    scores = torch.tanh(q @ k.transpose(-1, -2) * scale / call.softcap) * call.softcap
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    weights = torch.nn.functional.dropout(weights, p=call.dropout, training=call.dropout > 0)
    return weights @ v


RUN = {"varlen": _run_varlen, "flash": _run_flash, "flex": _run_flex, "loop": _run_loop}


def choose(call: Call, device_type: str) -> str | None:
    return next((name for name in preference(device_type) if _kernel_can(name, call)), None)


def varlen_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                             is_causal=None, **kwargs):
    """transformers' attention-function signature; query [B, heads, L, d], key/value [B, kv heads, L, d]; returns
    [B, L, heads, d]."""
    import torch

    cu = kwargs.get("cu_seq_lens_q")
    call = None
    if (cu is not None and kwargs.get("cu_seq_lens_k") is not None and key.shape[2] == query.shape[2]
            and kwargs.get("position_bias") is None and not kwargs.get("output_attentions")
            and getattr(module, "is_causal", True) and is_causal is not False):
        bounds, longest = kwargs.get("seq_bounds"), kwargs.get("max_length_q")
        batch, heads, length, _ = query.shape
        call = Call(batch=batch, length=length, heads=heads, kv_heads=key.shape[1], head_dim=query.shape[3],
                    scaling=scaling,
                    window=kwargs.get("sliding_window"), softcap=kwargs.get("softcap"), dropout=dropout,
                    dtype=query.dtype, device_type=query.device.type,
                    grad=any(t.requires_grad for t in (query, key, value)), cu=cu, longest=longest if isinstance(longest, int) else length,
                    bounds=tuple(bounds) if bounds is not None and bounds[-1] == batch * length else None)
    name = choose(call, query.device.type) if call is not None else None
    if name is None and call is not None and call.bounds is not None:
        name = "loop"  # runs any call given host bounds; no_mask_for_boundaries left the fallback no mask
    if name is None:
        return _fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                         is_causal=is_causal, **kwargs)
    return RUN[name](kernel_fn(name), query, key, value, call).contiguous(), None


def _fallback(module, query, key, value, attention_mask, **kwargs):
    """A batch without record boundaries: transformers' sdpa, or the model's eager attention where it soft-caps."""
    if kwargs.get("softcap") is not None:
        import sys

        return sys.modules[type(module).__module__].eager_attention_forward(module, query, key, value,
                                                                           attention_mask, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _fallback_mask(*args, config=None, **kwargs):
    """The mask of the fallback's kernel: eager's (a float mask, never skipped) for a soft-capped model, else sdpa's."""
    from transformers.masking_utils import eager_mask, sdpa_mask

    return (eager_mask if softcapped(config) else sdpa_mask)(*args, config=config, **kwargs)
