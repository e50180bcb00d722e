"""Chunked cross-entropy (--loss_chunk_size): the LM head's [tokens x vocabulary] logits are never held whole.

The hidden states of the trained tokens (labels != -100) go through the LM head a chunk of rows at a time. For a
plain linear head (every Llama with or without LoRA on the body, tied or not) one autograd Function computes each
chunk's loss and, in the same pass, its gradients for the hidden states and the head weight, then drops the
chunk's logits: backward only scales those gradients, so nothing is recomputed and the step does the GEMMs the
unchunked loss does (fewer: positions without a label get no logits at all). Any other head (LoRA on lm_head, a
peft modules_to_save wrapper) runs its own forward per chunk under torch.utils.checkpoint, which recomputes the
chunk's logits in backward.

It is installed on the model, not on a path: a forward pre-hook on the causal LM takes `labels` (and
`num_items_in_batch`, `shift_labels`) before transformers computes logits and hands them to the LM head, whose
forward then returns the loss itself (the model's `.loss`; `.logits` is None). The loss is computed inside the
head's module call, so DeepSpeed ZeRO-3 has the head weight gathered while it is used, in forward and in backward,
exactly as for the stock head; DDP, DeepSpeed and the Trainer see an ordinary model returning its loss. The
normalization is transformers' ForCausalLMLoss: the token-loss sum over num_items_in_batch (the trained tokens of
the whole global batch) when given, else the mean. Only training forwards with grad are chunked; eval and
generate get ordinary logits.

Two things a model does after its LM head are done here instead, exactly as transformers does them. A final-logit
soft-cap (config.final_logit_softcapping: Gemma-2's 30.0) is applied to each chunk's logits inside the loss
(cap * tanh(logits / cap), and its derivative 1 - tanh^2 in the gradients); the model's own soft-cap is switched off
for the forward, since it would otherwise be applied to the loss value the head hands back. A mixture-of-experts
model run with output_router_logits adds router_aux_loss_coef * aux_loss (its load-balancing loss) to the loss when
it has labels: the hook adds it, since the model never sees the labels.

No host-device sync: the trained positions' flat indices come from the collator, computed on the host
(`TRAINED_ROWS`, finetune.data.prepare), so the number of rows and of chunks is a tensor shape the host knows; without
them (a collator of another method) they are found on the device, which waits for it (`nonzero`).

On CUDA with liger-kernel installed, its fused linear cross-entropy kernel replaces the chunk loop for a plain head
(`pip install finetune[liger]`; checked on a GPU by tests/test_cuda.py, which CI, without one, does not run).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from finetune.constants import IGNORE_INDEX, TRAINED_ROWS

_PENDING = "_finetune_loss_pending"
_ACTIVE = "_finetune_loss_active"
_INSTALLED = "_finetune_loss_installed"
_classes: dict[type, type] = {}


class _LinearCrossEntropy(torch.autograd.Function):
    """sum over rows of CE(hidden @ weight.T, targets) / denom, a chunk of rows at a time; grads computed in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, denom, chunk: int, dtype, cap=None):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w = weight.to(dtype)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty(hidden.shape, dtype=dtype, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        # A 16-bit chunk's head gradient goes through one reused buffer and is added in place: `(g.t() @ h).float()`
        # made a [vocab x hidden] 16-bit product and its fp32 copy per chunk (on an H200, bf16 weights, a 128k x 2048
        # head: 3,355 MiB at the peak before, 2,321 after; tests/test_cuda.py).
        part = torch.empty(weight.shape, dtype=dtype, device=weight.device) if need_w and dtype != torch.float32 else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk):
                # The previous chunk's logits (probs and g are views or copies of them) go before this chunk's come:
                # held over the next F.linear, they made the peak two chunks of logits.
                logits = probs = g = squashed = None
                h, y = hidden[start:start + chunk].to(dtype), targets[start:start + chunk]
                logits = F.linear(h, w).float()
                if cap is not None:  # soft-capped logits cap * tanh(z / cap), as the model computes them
                    squashed = logits.div_(cap).tanh_()
                    logits = squashed * cap
                lse = _logsumexp(logits)
                total += (lse - logits.gather(1, y[:, None]).squeeze(1)).sum()
                if not (need_h or need_w):
                    continue
                probs = logits.sub_(lse[:, None]).exp_()  # d(sum CE)/d(logits) = softmax - one_hot
                probs[torch.arange(len(y), device=y.device), y] -= 1.0
                probs.div_(denom)
                if squashed is not None:  # through the soft-cap: d(cap * tanh(z / cap))/dz = 1 - tanh^2
                    probs.mul_(squashed.square_().neg_().add_(1.0))
                g = probs.to(dtype)
                if need_h:
                    torch.mm(g, w, out=grad_h[start:start + chunk])
                if need_w and part is None:
                    grad_w.addmm_(g.t(), h)
                elif need_w:
                    grad_w.add_(torch.mm(g.t(), h, out=part))  # cast to fp32 element by element, no copy
        # Saved as tensors autograd keeps for backward (so saved-tensor hooks, offload and memory counts see them).
        ctx.has = (need_h, need_w)
        if grad_w is not None and weight.dtype != torch.float32:  # rounded into the buffer, not a new tensor
            grad_w = part.copy_(grad_w) if part is not None and part.dtype == weight.dtype else grad_w.to(weight.dtype)
        ctx.save_for_backward(*[g for g in (grad_h, grad_w) if g is not None])
        return total / denom

    @staticmethod
    def backward(ctx, grad_output):
        saved = iter(ctx.saved_tensors)
        grad_h, grad_w = (next(saved) if has else None for has in ctx.has)
        # Scaled in place, never compared with 1 first (that compare is a host-device sync): the buffers are this
        # Function's own; a second backward through the same graph finds them modified and raises, as autograd does.
        scale = lambda g: None if g is None else g.mul_(grad_output.to(g.dtype))
        return scale(grad_h), scale(grad_w), None, None, None, None, None


LSE_ROWS = 32


def _logsumexp(logits):
    """torch.logsumexp over the last dimension, LSE_ROWS rows at a time: over the whole chunk it allocates a second
    [chunk x vocab] temporary (exp of the shifted logits), which set the chunk loop's peak."""
    out = torch.empty(logits.shape[0], dtype=logits.dtype, device=logits.device)
    for start in range(0, logits.shape[0], LSE_ROWS):
        torch.logsumexp(logits[start:start + LSE_ROWS], dim=-1, out=out[start:start + LSE_ROWS])
    return out


def _chunk_sum(forward, hidden, targets, cap=None):
    logits = forward(hidden).float()
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return F.cross_entropy(logits, targets, reduction="sum")


def _trained_rows(hidden, labels, shift_labels, rows=None):
    """(hidden states of the trained positions [n, H], their next-token targets [n]), as ForCausalLMLoss shifts.
    `rows`: those positions' flat indices from the host (the collator's); else found here (a device sync)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    targets = shift_labels.reshape(-1).to(hidden.device)
    if rows is None:
        rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    rows = rows.to(hidden.device, non_blocking=True)
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows), targets.index_select(0, rows)


@torch.compiler.disable  # data-dependent row selection and a Python chunk loop: left out of a compiled graph
def chunked_loss(head, head_forward, hidden, labels, shift_labels=None, num_items_in_batch=None, chunk: int = 1024,
                 softcap=None, trained_rows=None):
    """The causal-LM loss of `hidden` through `head` ([B, T, H] -> scalar), never holding [B*T, vocab] logits;
    `softcap`: the model's final-logit soft-cap, applied to the logits before the loss; `trained_rows`: the flat
    indices of the trained positions (of the shifted labels), from the host."""
    rows, targets = _trained_rows(hidden, labels, shift_labels, trained_rows)
    if num_items_in_batch is None:  # the mean over this batch's trained tokens (nan for none, as F.cross_entropy)
        denom = torch.tensor(float(len(targets)), device=hidden.device)
    else:
        denom = torch.as_tensor(num_items_in_batch, device=hidden.device).float()
    if _plain_linear(head) and head.bias is None:
        weight = head.weight
        if weight.is_cuda and softcap is None and (liger := _liger()) is not None:
            out = liger(weight, rows, targets)
            return (out[0] if isinstance(out, tuple) else out) / denom  # some releases return (loss, z_loss)
        dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) \
            else weight.dtype
        return _LinearCrossEntropy.apply(rows, weight, targets, denom, chunk, dtype, softcap)
    from torch.utils.checkpoint import checkpoint

    total = rows.sum().float() * 0.0  # part of the graph even when no row is trained
    for i in range(_chunks(head, rows, chunk)):
        total = total + checkpoint(_chunk_sum, head_forward, rows[i * chunk:(i + 1) * chunk],
                                   targets[i * chunk:(i + 1) * chunk], softcap, use_reentrant=False)
    return total / denom


def _plain_linear(head) -> bool:
    """Whether the class behind the chunked head is torch's Linear itself (not peft's LoRA layer or another
    subclass). Read from the MRO, not the bases: FSDP2's fully_shard puts a class of its own in front of the head's
    (FSDPChunkedLinear), and a bases check then sent every FSDP2 run to the recomputing path (a chunk's logits and
    their gradients again in backward: measured +80 MB at the peak on a 2.6M-parameter model, 4 x 512 tokens)."""
    mro = type(head).__mro__
    return mro[mro.index(_ChunkedHead) + 1] is torch.nn.Linear


def _chunks(head, rows, chunk: int) -> int:
    """How many chunks to run the head's forward on. Under ZeRO-3 every call gathers the head's partitioned weights
    collectively, in forward and again in the backward recompute, so every rank makes as many calls as the rank with
    the most trained tokens (the others' extra chunks are empty)."""
    n = -(-rows.shape[0] // chunk)
    import torch.distributed as dist

    if any(hasattr(p, "ds_id") for p in head.parameters()) and dist.is_available() and dist.is_initialized():
        count = torch.tensor([n], device=rows.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        n = int(count.item())
    return n


def _liger():
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")


class _ChunkedHead:
    """Mixed in front of the LM head's own class: with labels pending, forward returns the loss."""

    def forward(self, hidden, *args, **kwargs):
        pending = self.__dict__.pop(_PENDING, None)
        if pending is None:
            return super().forward(hidden, *args, **kwargs)
        return chunked_loss(self, super().forward, hidden, **pending)


def _head_class(cls: type) -> type:
    if cls not in _classes:
        _classes[cls] = type(f"Chunked{cls.__name__}", (_ChunkedHead, cls), {"__module__": cls.__module__})
    return _classes[cls]


_SOFTCAP = "final_logit_softcapping"


def _aux_coef(lm) -> float:
    """The router auxiliary loss' weight, where the MoE causal LM keeps it (self.router_aux_loss_coef, from config)."""
    coef = getattr(lm, "router_aux_loss_coef", None)
    return coef if coef is not None else lm.config.router_aux_loss_coef


def _restore(lm):
    cap = lm.__dict__.pop(_ACTIVE)
    if cap is not None:
        setattr(lm.config, _SOFTCAP, cap)
    lm.get_output_embeddings().__dict__.pop(_PENDING, None)


def _causal_lm(model):
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    return model


def install(model, chunk: int) -> bool:
    """Chunk the training loss of `model` (a causal LM, or a peft model around one) by `chunk` tokens; 0: leave the
    model as it is. Returns whether it was installed."""
    if chunk <= 0:
        return False
    lm = _causal_lm(model)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if head is None or lm.__dict__.get(_INSTALLED):
        return False
    if not isinstance(head, _ChunkedHead):
        head.__class__ = _head_class(type(head))

    def before(module, args, kwargs):
        if _ACTIVE in module.__dict__:  # the last forward raised before `after`: give the model its soft-cap back
            _restore(module)
        # The collator's host-side indices are the loss' alone: never passed on to the model's forward.
        trained_rows = kwargs.pop(TRAINED_ROWS, None)
        labels = kwargs.get("labels")
        if labels is None or not (module.training and torch.is_grad_enabled()) or kwargs.get("logits_to_keep", 0):
            return args, kwargs
        head = module.get_output_embeddings()
        # The soft-cap the model would apply to what its head returns (read where the model reads it), applied in
        # the loss instead and switched off on the model until `after`.
        cap = getattr(module.config, _SOFTCAP, None)
        head.__dict__[_PENDING] = {"labels": kwargs.pop("labels"), "shift_labels": kwargs.pop("shift_labels", None),
                                   "num_items_in_batch": kwargs.get("num_items_in_batch"), "chunk": chunk,
                                   "softcap": cap, "trained_rows": trained_rows}
        if cap is not None:
            setattr(module.config, _SOFTCAP, None)
        module.__dict__[_ACTIVE] = cap
        return args, kwargs

    def after(module, args, output):
        if _ACTIVE not in module.__dict__:
            return None
        _restore(module)
        loss = output["logits"]
        aux = output.get("aux_loss")
        if aux is not None:  # transformers' MoE causal LMs: loss += router_aux_loss_coef * aux_loss, given labels
            loss = loss + _aux_coef(module) * aux.to(loss.device)
        fields = {k: v for k, v in output.items() if k not in ("loss", "logits")}
        return type(output)(loss=loss, **fields)

    lm.register_forward_pre_hook(before, with_kwargs=True)
    lm.register_forward_hook(after)
    lm.__dict__[_INSTALLED] = True
    return True
