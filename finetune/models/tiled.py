"""Tiled MLP (--tiled_mlp): each decoder layer's MLP computed a tile of positions at a time, as ALST does.

At long sequences the MLP's intermediates dominate a layer's activations: gate, up, act(gate) and their product,
four [tokens x intermediate] tensors, where the rest of the layer keeps a few [tokens x hidden] ones. Tiled, each
tile of `hidden_size` positions (ALST's rule: ceil(sequence / hidden) tiles) runs under torch's non-reentrant
checkpoint: the forward keeps no intermediate, and the backward recomputes one tile's, takes its gradients and drops
it before the next. The MLP acts on each position alone, so the loss and gradients are the untiled ones (the GEMMs
over fewer rows may sum in another order: ~1e-7). It costs one more MLP forward per step.

DeepSpeed's own `TiledMLP` (deepspeed.runtime.sequence_parallel.ulysses_sp) runs a nested backward per tile, each
accumulating into the parameters' .grad; its docstring leaves DDP and FSDP to be done, so the checkpoint (which DDP,
FSDP2 and ZeRO-3 already take for gradient checkpointing) is used instead.

Dense MLPs only: a mixture-of-experts block routes each token and records its router logits for the load-balancing
loss, which tiles would split; those families refuse the flag (Family.moe, finetune.config).
"""

from __future__ import annotations

import functools

_TILED = "_finetune_tiled_mlp"


def tile_tokens(hidden_size: int) -> int:
    """Positions per tile: ALST's ceil(sequence / hidden) tiles, each of about `hidden_size` positions."""
    return hidden_size


def _mlps(model):
    """The decoder layers' MLP modules (a layer with `self_attn` and `mlp`)."""
    for module in model.modules():
        mlp = getattr(module, "mlp", None)
        if mlp is not None and hasattr(module, "self_attn"):
            yield mlp


def _forward(original, tile: int, x, *args, **kwargs):
    import torch
    from torch.utils.checkpoint import checkpoint

    if not torch.is_grad_enabled() or args or kwargs or x.shape[-2] <= tile:
        return original(x, *args, **kwargs)
    return torch.cat([checkpoint(original, part, use_reentrant=False) for part in x.split(tile, dim=-2)], dim=-2)


def enable(model, hidden_size: int) -> int:
    """Tile every decoder layer's MLP of `model` (a causal LM, or a peft model around one); returns how many."""
    count = 0
    for mlp in _mlps(model):
        if not mlp.__dict__.get(_TILED):
            mlp.forward = functools.partial(_forward, mlp.forward, tile_tokens(hidden_size))
            mlp.__dict__[_TILED] = True
        count += 1
    return count
