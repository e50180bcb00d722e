"""sdpa over packed rows, one record at a time.

A packed row (finetune.data.packing, layout "rows") holds several records told apart by position ids that restart
at 0. transformers' sdpa keeps them apart with a [rows, 1, length, length] block-diagonal mask, so the kernel computes
the row's whole length x length square and masks most of it away (with several records to a 1,024-token row, most
of the attention work), and a mask also makes it repeat the key/value heads of grouped-query attention. Here each
record's queries attend to its own keys with `is_causal` and no mask: the same result (a record never saw another
one), the work of the records' own causal triangles, and the kernel's grouped-query path.

Used for training on packed rows with `--attn_implementation sdpa` (the default); a batch that is not packed rows
(padded records, evaluation on unpacked data) takes transformers' own sdpa unchanged.
"""

from __future__ import annotations

PACKED_SDPA = "finetune_sdpa_packed"


def register() -> None:
    """Make PACKED_SDPA a name transformers knows: this attention function, and sdpa's masks (for the unpacked
    batches that fall back to sdpa, which need their padding mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_SDPA, sdpa_mask)


def unsupported(config) -> str | None:
    """Why a model's attention is not plain causal attention that per-record sdpa reproduces (None: it is)."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping"
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return "sliding-window layers"
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return "a sliding window"
    if not getattr(config, "is_causal", True):
        return "bidirectional attention"
    return None


def applies(cfg, model_config) -> bool:
    """Whether a run of `cfg` on a model of `model_config` (a transformers config, or any object with its
    attributes) trains with PACKED_SDPA: packed rows, --attn_implementation sdpa, no --torch_compile (a loop over
    records whose lengths change every batch would recompile or break the graph), plain causal attention."""
    data, margs, args = cfg.data, cfg.model, cfg.training
    # Packed rows: sdpa is none of the kernels that need one flattened row, so --packing without --padding_free
    # (finetune.data.packing.collator_layout says "rows" exactly then; tests/test_packing.py holds the two together).
    return (margs.attn_implementation == "sdpa" and not getattr(args, "torch_compile", False)
            and data.packing and not data.padding_free and unsupported(model_config) is None)


def enable(model, cfg) -> bool:
    """Switch the model's sdpa to PACKED_SDPA where `applies` (True if it did)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not applies(cfg, base.config):
        return False
    register()
    base.set_attn_implementation(PACKED_SDPA)
    return True


def segments(position_ids, length: int) -> list[list[tuple[int, int]]] | None:
    """Per row, the (start, end) of each record: where the position ids restart at 0 and count up by one.

    None when the ids are not packed rows of `length` (no restart anywhere, or a run that does not start at 0, as
    the left padding of generation gives): such a batch is not split."""
    import torch

    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[1] != length or length < 2:
        return None
    ids = position_ids.detach()
    step = torch.diff(ids, dim=-1)
    breaks = step != 1
    if not bool(breaks.any()):
        return None
    # Every run (the first, and each one after a break) must start at 0: a record, or the tail padding.
    starts = torch.cat([torch.ones_like(breaks[:, :1]), breaks], dim=-1)
    if bool((ids[starts] != 0).any()):
        return None
    out = []
    for row in starts.cpu():
        at = row.nonzero().flatten().tolist() + [length]
        out.append(list(zip(at[:-1], at[1:])))
    return out


_last: tuple = (None, -1, None)  # (weak reference to position_ids, its version, their segments)


def _segments_once(position_ids, length: int):
    """segments() computed once per forward: every layer gets the same position_ids tensor (on a GPU each
    computation would wait for the device)."""
    import weakref

    global _last
    ref, version, runs = _last
    if position_ids is not None and ref is not None and ref() is position_ids and version == position_ids._version:
        return runs
    runs = segments(position_ids, length)
    if position_ids is not None:
        _last = (weakref.ref(position_ids), position_ids._version, runs)
    return runs


def _kernels(query):
    """The sdpa kernels for per-record calls. On CUDA, not cuDNN's: it builds an execution plan for every new
    sequence length (measured on an H100, torch 2.11: 1.8 ms of CPU per call for 6 us on the GPU, so a SmolLM2-shape
    step of 8 packed 1,024-token rows took 3.3 s instead of 0.17 s); flash attention takes any length as it comes."""
    import contextlib

    if query.device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def packed_sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                        is_causal=None, **kwargs):
    """transformers' attention-function signature; query [B, heads, L, d], key/value [B, kv heads, L, d]."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    runs = None
    if key.shape[2] == query.shape[2] and kwargs.get("position_bias") is None and not kwargs.get("output_attentions"):
        runs = _segments_once(kwargs.get("position_ids"), query.shape[2])
    if runs is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    gqa = query.shape[1] != key.shape[1]
    rows = []
    with _kernels(query):
        for b, row in enumerate(runs):
            parts = [torch.nn.functional.scaled_dot_product_attention(
                query[b:b + 1, :, s:e], key[b:b + 1, :, s:e], value[b:b + 1, :, s:e], dropout_p=dropout,
                is_causal=True, scale=scaling, enable_gqa=gqa) for s, e in row]
            rows.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
    out = torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]
    return out.transpose(1, 2).contiguous(), None
