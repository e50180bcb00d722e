"""On a CUDA GPU: the chunked loss (finetune.training.loss) against transformers' own loss, in fp32 and bf16 and
through Liger's fused kernel where liger-kernel is installed, and its peak memory: one chunk of logits, never the
[tokens x vocabulary] whole.

Collected only where torch.cuda.is_available() (tests/conftest.py; CI has no GPU, and the CPU tests in
test_loss.py hold the same logic). It needs no fixture of conftest, so it also runs as
`pytest --noconftest tests/test_cuda.py` on a GPU machine without the test extras.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from finetune.training import loss as chunked
from test_loss import differences, lora  # the CPU tests' comparison and LoRA setup

if not torch.cuda.is_available():  # run by hand without a GPU: say so rather than fail on the first .cuda()
    pytest.skip("no CUDA device", allow_module_level=True)

HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
VOCAB, HIDDEN, ROWS, COLS = 32000, 256, 4, 256


@pytest.fixture(autouse=True)
def exact_fp32():
    """fp32 matmuls in fp32 (not TF32), so an fp32 difference is the chunking's alone."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def model(tied: bool, dtype: torch.dtype, targets=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    m = LlamaForCausalLM(config).to("cuda", dtype).train()
    return lora(m, targets) if targets else m


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (ROWS, COLS), generator=g)
    labels = ids.clone()
    labels[:, :20] = -100  # prompts
    labels[ROWS - 1, COLS // 2:] = -100  # padding
    return {"input_ids": ids.cuda(), "labels": labels.cuda()}


def run(m, inputs, autocast: bool):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = m(**inputs, num_items_in_batch=torch.tensor(1000, device="cuda"))
    (out.loss * 3.0).backward()  # an upstream gradient that is not 1 (the paths scale by world and accumulation)
    return out.loss.detach().float(), {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None}


# (weights dtype, autocast, tied, LoRA targets, bound): fp32 differs by summation order only; bf16 by rounding, the
# same arithmetic in another order (the stock loss' log-softmax backward against the chunk's softmax - one-hot).
CASES = {
    "fp32": (torch.float32, False, False, None, 1e-5),
    "fp32_tied": (torch.float32, False, True, None, 1e-5),
    "fp32_lora_lm_head": (torch.float32, False, False, ["q_proj", "lm_head"], 1e-5),  # the checkpointed chunks
    "bf16_autocast": (torch.float32, True, False, None, 3e-2),  # on CPU, test_loss.py's tiny model: 0.85e-2 and 1.09e-2
    "bf16_weights": (torch.bfloat16, False, False, None, 3e-2),
}


# Liger replaces only a plain linear head (a LoRA head runs the checkpointed chunks): its cases are the others.
RUNS = [(case, "chunks") for case in CASES] + [(case, "liger") for case in CASES if HAS_LIGER and "lora" not in case]


@pytest.mark.parametrize("case, engine", RUNS)
def test_same_loss_and_gradients_on_cuda(case, engine, monkeypatch):
    dtype, autocast, tied, targets, bound = CASES[case]
    if engine == "chunks":  # our own autograd Function, also where liger-kernel is installed
        monkeypatch.setattr(chunked, "_liger", lambda: None)
    base = model(tied, dtype, targets)
    other = copy.deepcopy(base)
    assert chunked.install(other, 512)
    used = []
    if engine == "liger":  # the kernel really ran (and not the chunk loop)
        real = chunked._liger
        monkeypatch.setattr(chunked, "_liger", lambda: used.append(1) or real())
    inputs = batch()
    loss_rel, grad_rel = differences(run(base, inputs, autocast), run(other, inputs, autocast))
    print(f"{case}/{engine}: loss {loss_rel:.2e}, worst gradient {max(grad_rel.values()):.2e} "
          f"({max(grad_rel, key=grad_rel.get)})")
    assert loss_rel <= bound, loss_rel
    assert max(grad_rel.values()) <= (bound if engine == "chunks" else 5 * bound), grad_rel
    assert bool(used) == (engine == "liger")


def head_and_rows(dtype, tokens: int, vocab: int, hidden: int):
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False).to("cuda", dtype)
    head.__class__ = chunked._head_class(torch.nn.Linear)
    hidden_states = torch.randn(1, tokens, hidden, device="cuda", dtype=dtype, requires_grad=True)
    targets = torch.randint(0, vocab, (1, tokens), device="cuda")
    return head, hidden_states, targets


def peak_above_start(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


# (weights dtype, autocast): 16-bit weights (their gradient kept in 16 bits, summed in fp32), fp32 weights under bf16
# autocast (the head cast for the GEMMs, the kept gradient fp32), fp32.
PEAK_CASES = {"bf16": (torch.bfloat16, False), "fp32_autocast": (torch.float32, True), "fp32": (torch.float32, False)}


@pytest.mark.parametrize("case", PEAK_CASES)
def test_peak_memory_is_what_the_planner_counts(case, monkeypatch):
    """Llama-3's vocabulary (128,256), 8,192 trained tokens, a trained head: peak CUDA memory of the loss and its
    backward, above what was allocated before, against finetune.plan's count for the chunked loss."""
    from finetune.plan.planner import chunked_loss_peak

    monkeypatch.setattr(chunked, "_liger", lambda: None)
    dtype, autocast = PEAK_CASES[case]
    tokens, vocab, hidden, chunk = 8192, 128256, 2048, 1024
    head, h, y = head_and_rows(dtype, tokens, vocab, hidden)

    def chunked_step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = chunked.chunked_loss(head, head.forward, h, y, shift_labels=y, chunk=chunk)
        out.backward()

    def stock_step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = head(h)
        F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1), reduction="mean").backward()

    got = peak_above_start(chunked_step)
    head.weight.grad = h.grad = None
    stock = peak_above_start(stock_step)
    weight = torch.finfo(dtype).bits // 8
    a = 2 if autocast else weight
    planned = chunked_loss_peak(a, weight, weight, vocab, hidden, tokens, chunk, trains_head=True) + 8 * tokens
    logits = 4 * tokens * vocab
    print(f"{case}: chunked peak {got / 2**20:.0f} MiB, planned {planned / 2**20:.0f} MiB, "
          f"stock {stock / 2**20:.0f} MiB (fp32 logits alone {logits / 2**20:.0f} MiB)")
    assert 0.95 * planned <= got <= 1.05 * planned + 16 * 2**20, (got, planned)
    assert stock >= logits > got, (stock, logits, got)  # the stock loss holds the fp32 logits whole; ours never


@pytest.mark.parametrize("window", [None, 200])
def test_packed_rows_take_one_varlen_call_without_a_sync(window):
    """Variable-length attention (finetune.models.attention) on two packed rows of many lengths, bf16: ONE kernel
    call (torch's varlen_attn where this torch has it), forward and backward run under sync debug mode "error" (no
    host-device sync), no cuDNN attention (an execution plan per new length), and the output equals sdpa over the
    rows' block-diagonal mask (with the window)."""
    from types import SimpleNamespace

    from finetune.data.packing import boundaries
    from finetune.models import attention

    torch.manual_seed(0)
    heads, kv, d, length = 8, 2, 64, 1024
    segments = [37, 263, 1, 399, 324, 500, 300, 224]  # two rows of 1,024: the second row's records, then none
    b = boundaries(segments)
    kwargs = dict(b, cu_seq_lens_q=b["cu_seq_lens_q"].cuda(), cu_seq_lens_k=b["cu_seq_lens_k"].cuda(),
                  sliding_window=window)
    q = torch.randn(2, heads, length, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, kv, length, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, kv, length, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    module = SimpleNamespace(is_causal=True, training=True)
    chosen = attention.choose(attention.Call(batch=2, length=length, heads=heads, kv_heads=kv, head_dim=d,
                                             scaling=None, window=window, softcap=None, dropout=0.0, dtype=q.dtype,
                                             device_type="cuda", grad=True, cu=kwargs["cu_seq_lens_q"],
                                             longest=b["max_length_q"], bounds=b["seq_bounds"]), "cuda")
    if chosen == "flex":  # compiled on first use: outside the counted, sync-checked call
        attention.varlen_attention_forward(module, q, k, v, None, **kwargs)[0].float().sum().backward()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.cuda.set_sync_debug_mode("error")
        try:
            out, _ = attention.varlen_attention_forward(module, q, k, v, None, **kwargs)
            out.float().sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    names = [e.key for e in prof.key_averages()]
    assert not [n for n in names if "cudnn_attention" in n], names
    if chosen == "varlen":
        assert [e.count for e in prof.key_averages() if e.key == "torch_attn::_varlen_attn"] == [1], names
    i = torch.arange(length, device="cuda")
    record = torch.searchsorted(kwargs["cu_seq_lens_q"][1:], torch.arange(2 * length, device="cuda",
                                dtype=torch.int32), right=True).view(2, 1, length)
    allowed = (record[..., :, None] == record[..., None, :]) & (i[:, None] >= i[None, :])
    if window is not None:
        allowed &= i[:, None] - i[None, :] < window
    ref = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), attn_mask=allowed, enable_gqa=True)
    assert (out - ref.transpose(1, 2)).abs().max().item() < 2e-2, chosen
