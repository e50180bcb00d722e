"""Variable-length attention (finetune.models.attention): one kernel call per layer from the collator's host-side
record boundaries, each record attending to itself only.

The CUDA kernels cannot run here: a pure-torch stand-in with the exact signature of torch's varlen_attn is registered
where the real one is looked up, and the dispatcher must call it ONCE per layer with the batch's boundaries, window
and grouped-query flag, the model's logits and loss equal to each record run alone. A Hub flash kernel (`org/repo`)
is stood in for the same way, at the place transformers keeps a loaded kernel's functions. FlexAttention (forward
only on CPU: torch has no CPU backward for it) must equal the per-record loop; the loop trains on CPU.
"""

from __future__ import annotations

import inspect
import math
import sys

import pytest
import torch

from finetune.constants import IGNORE_INDEX
from finetune.data.packing import PackedCollator, boundaries, collator_layout
from finetune.models import attention

VOCAB = 101


def config(family: str, **extra):
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, pad_token_id=0)
    if family == "llama":  # grouped-query attention
        return LlamaConfig(**common, **extra)
    if family == "mistral":  # GQA and a sliding window on every layer, shorter than most records
        return MistralConfig(**common, sliding_window=6, **extra)
    if family == "qwen3":  # sliding-window layers mixed with full ones
        return Qwen3Config(**common, use_sliding_window=True, sliding_window=5, max_window_layers=1,
                           layer_types=["full_attention", "sliding_attention", "sliding_attention"], **extra)
    if family == "gemma2":  # soft-capped attention logits, alternating sliding window
        return Gemma2Config(**common, sliding_window=6, **extra)
    raise KeyError(family)


def models(family: str, dtype=torch.float32):
    """(the reference with transformers' own kernel, the same weights under VARLEN)."""
    from transformers import AutoModelForCausalLM

    attention.register()
    cfg = config(family)
    own = "eager" if attention.softcapped(cfg) else "sdpa"
    out = []
    for impl in (own, attention.VARLEN):
        torch.manual_seed(0)
        out.append(AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=dtype).eval())
    return out


ROWS = [[7, 3, 11, 2], [13, 9]]  # records per packed row; rows of 23 and 22 tokens (the second padded by one)


def features(rows=ROWS, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for lens in rows:
        recs = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lens]
        out.append({"input_ids": sum(recs, []), "labels": sum(recs, []), "seq_lens": list(lens), "records": recs})
    return out


def check_equals_alone(ref, out_logits, loss, batch, feats, layout, atol=1e-5):
    """Every record's logits in the packed batch equal the record run alone; the loss equals the records' mean."""
    total, items = torch.zeros((), dtype=torch.float64), 0
    flat = 0
    for r, f in enumerate(feats):
        at = flat if layout == "flat" else 0
        row = 0 if layout == "flat" else r
        for rec in f["records"]:
            n = len(rec)
            alone = ref(input_ids=torch.tensor([rec]), use_cache=False).logits[0]
            torch.testing.assert_close(out_logits[row, at:at + n], alone, rtol=0, atol=atol)
            # Each record's first label is -100 in the pack (never predicted from the record before): its own
            # positions predict its tokens 2..n.
            total += torch.nn.functional.cross_entropy(alone[:-1].double(), torch.tensor(rec[1:]), reduction="sum")
            items += n - 1
            at += n
        flat = at
    assert items == int((batch["labels"][..., 1:] != IGNORE_INDEX).sum())
    torch.testing.assert_close(loss.double(), total / items, rtol=0, atol=atol)


# ----------------------------------------------------------------------------------------------
# The collator's boundaries.


def test_collator_states_boundaries_on_the_host():
    feats = features()
    rows = PackedCollator(0, layout="rows")(feats)
    # Rows of 23 and 22 tokens, padded to 23: the padding of the second row is a segment of its own.
    assert rows["input_ids"].shape == (2, 23)
    assert rows["cu_seq_lens_q"].dtype == torch.int32 and rows["cu_seq_lens_k"] is rows["cu_seq_lens_q"]
    assert rows["seq_bounds"] == (0, 7, 10, 21, 23, 36, 45, 46) == tuple(rows["cu_seq_lens_q"].tolist())
    assert rows["max_length_q"] == rows["max_length_k"] == 13 and type(rows["max_length_q"]) is int
    flat = PackedCollator(0, layout="flat")(feats)
    assert flat["seq_bounds"] == (0, 7, 10, 21, 23, 36, 45) and flat["input_ids"].shape == (1, 45)
    # Moved to a device, the host values stay host values.
    from finetune.data.packing import to_device

    moved = to_device(rows, "cpu")
    assert moved["seq_bounds"] == rows["seq_bounds"] and moved["max_length_q"] == 13


@pytest.mark.slow  # TRL's import alone: about 20 s on a loaded 2-core machine
def test_flat_boundaries_equal_trl_padding_free():
    """TRL's collator (padding_free) on the same records gives the same cu_seq_lens, max lengths and positions."""
    trl = pytest.importorskip("trl.trainer.sft_trainer")
    feats = features([[5, 8], [3], [12, 1, 4]], seed=4)
    ours = PackedCollator(0, layout="flat")(feats)
    theirs = trl.DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(
        [{"input_ids": r} for f in feats for r in f["records"]])
    for key in ("cu_seq_lens_q", "cu_seq_lens_k", "position_ids", "input_ids"):
        assert torch.equal(ours[key], theirs[key]), key
    assert ours["max_length_q"] == theirs["max_length_q"] == 12
    # TRL masks every record's first label as we do.
    assert torch.equal(ours["labels"], theirs["labels"])


# ----------------------------------------------------------------------------------------------
# Dispatch to torch's varlen_attn, through a stand-in with its exact signature.


class VarlenStandIn:
    """Pure torch, torch's varlen_attn's signature: attention per [cu_seq_q[i], cu_seq_q[i + 1]) of the flattened
    tokens, causal with `window_size` (left, 0) as flash defines it; every call recorded."""

    def __init__(self):
        self.calls = []

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                 cu_seq_k: torch.Tensor | None, max_q: int, max_k: int, *, return_aux=None,
                 scale: float | None = None, window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False,
                 seqused_k: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                 num_splits: int | None = None) -> torch.Tensor:
        return self.attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa)

    def attend(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa,
               softcap=0.0):
        self.calls.append(dict(shape=tuple(query.shape), kv_heads=key.shape[1], cu=cu_seq_q.clone(),
                               cu_k=cu_seq_k.clone(), max_q=max_q, max_k=max_k, scale=scale, window=window_size,
                               gqa=enable_gqa, softcap=softcap))
        if enable_gqa:
            key, value = (t.repeat_interleave(query.shape[1] // key.shape[1], dim=1) for t in (key, value))
        left, right = window_size
        assert right == 0, "causal attention only"
        out = []
        for s, e in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist()):
            q, k, v = (t[s:e].transpose(0, 1) for t in (query, key, value))  # [heads, n, d]
            scores = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            i = torch.arange(e - s)
            allowed = i[:, None] >= i[None, :]
            if left >= 0:
                allowed &= i[:, None] - i[None, :] <= left
            out.append((scores.masked_fill(~allowed, -math.inf).softmax(-1) @ v).transpose(0, 1))
        return torch.cat(out)


def test_stand_in_has_varlen_attns_signature():
    real = attention.torch_varlen()
    if real is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    assert inspect.signature(VarlenStandIn.__call__).parameters.keys() - {"self"} == \
        inspect.signature(real).parameters.keys()
    theirs = inspect.signature(real).parameters
    for name, p in inspect.signature(VarlenStandIn.__call__).parameters.items():
        if name != "self":
            assert (p.kind, p.default) == (theirs[name].kind, theirs[name].default), name


@pytest.fixture
def varlen_stand_in(monkeypatch):
    """The stand-in where torch's varlen_attn is looked up, first for this CPU, in fp32 (the real one takes bf16)."""
    fake = VarlenStandIn()
    monkeypatch.setitem(attention.KERNELS, "varlen", fake)
    monkeypatch.setitem(attention.PREFERENCE, "cpu", ("varlen", "loop"))
    monkeypatch.setattr(attention, "FLASH_DTYPES", ("float32",))
    return fake


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("layout", ["rows", "flat"])
def test_varlen_kernel_called_once_per_layer(varlen_stand_in, family, layout, one_thread):
    ref, model = models(family)
    feats = features()
    batch = PackedCollator(0, layout=layout)(feats)
    out = model(**batch, use_cache=False)
    calls = varlen_stand_in.calls
    assert len(calls) == model.config.num_hidden_layers  # ONE call per layer
    tokens = batch["input_ids"].numel()
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * len(calls)
    for layer, (c, kind) in enumerate(zip(calls, types)):
        assert c["shape"] == (tokens, 4, 8) and c["kv_heads"] == 2 and c["gqa"]
        assert torch.equal(c["cu"], batch["cu_seq_lens_q"]) and torch.equal(c["cu_k"], batch["cu_seq_lens_k"])
        assert c["max_q"] == c["max_k"] == batch["max_length_q"] == 13
        window = model.config.sliding_window if family == "mistral" or kind == "sliding_attention" else None
        assert c["window"] == ((window - 1, 0) if window else (-1, 0)), (layer, c["window"])
        assert c["scale"] == pytest.approx(8 ** -0.5)
    check_equals_alone(ref, out.logits, out.loss, batch, feats, layout)


def test_windows_and_boundaries_matter(varlen_stand_in, one_thread):
    """The equality above can fail: without its window Mistral's records differ, and one long record differs from
    two records."""
    ref, model = models("mistral")
    feats = features()
    batch = PackedCollator(0, layout="flat")(feats)
    out = model(**batch, use_cache=False).logits
    model.config.sliding_window = None
    for layer in model.model.layers:
        layer.self_attn.config.sliding_window = None
    assert (model(**batch, use_cache=False).logits - out).abs().max() > 1e-3
    merged = dict(batch, **boundaries([7 + 3, 11, 2, 13, 9]))
    assert (model(**merged, use_cache=False).logits[0, 7:10] - out[0, 7:10]).abs().max() > 1e-3


class Torch210(VarlenStandIn):
    """torch 2.10's varlen_attn: is_causal, no scale, no window, no grouped-query heads."""

    def __call__(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        assert is_causal and key.shape[1] == query.shape[1]
        return super().__call__(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=(-1, 0))


class Torch211(VarlenStandIn):
    """torch 2.11's: a scale and a window, no grouped-query heads."""

    def __call__(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                 window_size=(-1, -1)):
        assert key.shape[1] == query.shape[1]
        return super().__call__(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                window_size=window_size)


@pytest.mark.parametrize("older", [Torch210, Torch211])
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_older_varlen_signatures(varlen_stand_in, monkeypatch, older, family, one_thread):
    """The GPU machines' torch may be older: its varlen_attn is used by what its signature offers (key/value heads
    repeated where it has no enable_gqa); a window it cannot take goes to the next kernel."""
    fake = older()
    monkeypatch.setitem(attention.KERNELS, "varlen", fake)
    ref, model = models(family)
    feats = features()
    batch = PackedCollator(0, layout="rows")(feats)
    out = model(**batch, use_cache=False)
    check_equals_alone(ref, out.logits, out.loss, batch, feats, "rows")
    takes_it = family == "llama" or older is Torch211
    assert len(fake.calls) == (model.config.num_hidden_layers if takes_it else 0)
    assert all(c["kv_heads"] == 4 for c in fake.calls)


def test_soft_capped_family_never_takes_varlen(varlen_stand_in, one_thread):
    """torch's varlen_attn cannot soft-cap: Gemma-2 goes to the next kernel (the per-record loop on CPU), whose
    soft-capped logits equal eager Gemma-2's on each record alone, window included."""
    ref, model = models("gemma2")
    feats = features()
    for layout in ("rows", "flat"):
        batch = PackedCollator(0, layout=layout)(feats)
        out = model(**batch, use_cache=False)
        check_equals_alone(ref, out.logits, out.loss, batch, feats, layout)
    assert varlen_stand_in.calls == []


def test_cuda_choice():
    """What a CUDA batch takes, decided on the host from shapes and dtypes: torch's varlen_attn where this torch has
    it, unless the logits are soft-capped (then flash-attn where installed, else FlexAttention)."""
    def call(**kw):
        base = dict(batch=2, length=64, heads=4, kv_heads=2, head_dim=16, scaling=None, window=None, softcap=None,
                    dropout=0.0, dtype=torch.bfloat16, device_type="cuda", grad=True, cu=torch.zeros(3, dtype=torch.int32),
                    longest=64, bounds=None)
        return attention.Call(**{**base, **kw})

    flash = attention.kernel_fn("flash") is not None
    if attention.torch_varlen() is not None:
        assert attention.choose(call(), "cuda") == "varlen"
        assert attention.choose(call(window=16), "cuda") == "varlen"
    assert attention.choose(call(softcap=50.0), "cuda") == ("flash" if flash else "flex")
    assert attention.choose(call(dtype=torch.float32), "cuda") == "flex"  # the flash kernels take bf16/fp16
    # On CPU: the loop where it trains (host bounds given), FlexAttention where autograd is off.
    assert attention.choose(call(device_type="cpu", bounds=(0, 64, 128)), "cpu") == "loop"
    assert attention.choose(call(device_type="cpu", grad=False, bounds=None), "cpu") == "flex"
    assert attention.choose(call(device_type="cpu", bounds=None), "cpu") is None  # then transformers' sdpa
    # The start line names the kernel of the model's dtype and device.
    line = "attention: packed records through one variable-length kernel call per layer ({};"
    varlen = "varlen" if attention.torch_varlen() is not None else ("flash" if flash else "flex")
    assert attention.describe("cuda", config("llama"), torch.bfloat16).startswith(line.format(varlen))
    assert attention.describe("cuda", config("llama"), torch.float32).startswith(line.format("flex"))
    assert attention.describe("cuda", config("gemma2"), torch.bfloat16).startswith(
        line.format("flash" if flash else "flex"))
    assert attention.describe("cpu", config("gemma2"), torch.float32).startswith(line.format("loop"))


# ----------------------------------------------------------------------------------------------
# FlexAttention against the per-record loop.


@pytest.mark.parametrize("case", ["gqa", "window", "softcap", "softcap-window"])
@pytest.mark.parametrize("layout", ["rows", "flat"])
def test_flex_equals_per_record_loop(case, layout, one_thread):
    torch.manual_seed(0)
    feats = features([[9, 40, 3], [17, 20, 1]])
    b = PackedCollator(0, layout=layout)(feats)
    batch, length = b["input_ids"].shape
    q = torch.randn(batch, 6, length, 16)
    k, v = torch.randn(2, batch, 2, length, 16)
    call = attention.Call(batch=batch, length=length, heads=6, kv_heads=2, head_dim=16, scaling=0.3,
                          window=8 if "window" in case else None, softcap=5.0 if "softcap" in case else None,
                          dropout=0.0, dtype=q.dtype, device_type="cpu", grad=False, cu=b["cu_seq_lens_q"],
                          longest=b["max_length_q"], bounds=b["seq_bounds"])
    flex = attention._run_flex(attention.kernel_fn("flex"), q, k, v, call)
    loop = attention._run_loop(attention.kernel_fn("loop"), q, k, v, call)
    torch.testing.assert_close(flex, loop, rtol=0, atol=1e-5)
    # ... and both differ from attention without the records (the comparison can fail).
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    assert (whole.transpose(1, 2) - loop).abs().max() > 1e-2


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_flex_through_the_model_equals_alone(family, monkeypatch, one_thread):
    monkeypatch.setitem(attention.PREFERENCE, "cpu", ("flex",))
    ref, model = models(family)
    feats = features()
    for layout in ("rows", "flat"):
        batch = PackedCollator(0, layout=layout)(feats)
        with torch.no_grad():
            out = model(**batch, use_cache=False)
        check_equals_alone(ref, out.logits, out.loss, batch, feats, layout)


# ----------------------------------------------------------------------------------------------
# A Hub flash kernel (org/repo): transformers' flash path, given the boundaries, flattens any batch.

HUB = "kernels-community/stand-in-flash"


FLASH_CALLS = VarlenStandIn()  # every call of the flash stand-ins below


def _flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                  softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                  deterministic=False, return_attn_probs=False, block_table=None):
    """flash_attn_varlen_func's signature; [tokens, heads, dim] in and out."""
    assert causal
    return FLASH_CALLS.attend(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                              (window_size[0], 0), q.shape[1] != k.shape[1], softcap)


def _flash(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
           alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func's signature: each row of [batch, length, heads, dim] one causal sequence."""
    b, n = q.shape[:2]
    cu = torch.arange(0, (b + 1) * n, n, dtype=torch.int32)
    out = _flash_varlen(*(t.reshape(b * n, *t.shape[2:]) for t in (q, k, v)), cu, cu, n, n,
                        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap)
    return out.view(b, n, *out.shape[1:])


def _stand_in_flash(monkeypatch, name: str) -> None:
    """The stand-ins where transformers keeps the flash functions of implementation NAME once it loaded them."""
    import transformers.modeling_flash_attention_utils as fa

    FLASH_CALLS.calls.clear()
    for attr, value in dict(_loaded_implementation=name, _flash_fn=_flash, _flash_varlen_fn=_flash_varlen,
                            _flash_with_kvcache_fn=None, _pad_fn=fa._pad_input, _unpad_fn=fa._unpad_input,
                            _process_flash_kwargs_fn=fa._lazy_define_process_function(_flash_varlen),
                            _process_with_kvcache_kwargs_fn=dict).items():
        monkeypatch.setattr(fa, attr, value, raising=False)


@pytest.mark.parametrize("family", ["gemma2", "mistral"])
def test_flash_kernel_called_once_per_layer(monkeypatch, family, one_thread):
    """transformers' flash-attention-2 path (the "flash" kernel, CUDA's choice for soft-capped families where
    flash-attn is installed), its flash functions stood in: one varlen call per layer with the boundaries, the
    window and the soft-cap, logits equal to each record alone."""
    from transformers.modeling_flash_attention_utils import _flash_attention_forward

    _stand_in_flash(monkeypatch, "flash_attention_2")
    monkeypatch.setitem(attention.KERNELS, "flash", _flash_attention_forward)
    monkeypatch.setitem(attention.PREFERENCE, "cpu", ("flash",))
    monkeypatch.setattr(attention, "FLASH_DTYPES", ("float32",))
    ref, model = models(family)
    feats = features()
    batch = PackedCollator(0, layout="rows")(feats)
    out = model(**batch, use_cache=False)
    check_equals_alone(ref, out.logits, out.loss, batch, feats, "rows")
    calls = FLASH_CALLS.calls
    assert len(calls) == model.config.num_hidden_layers
    for layer, c in enumerate(calls):
        assert torch.equal(c["cu"], batch["cu_seq_lens_q"]) and c["max_q"] == 13 and c["kv_heads"] == 2
        sliding = family == "mistral" or model.config.layer_types[layer] == "sliding_attention"
        assert c["window"] == ((model.config.sliding_window - 1, 0) if sliding else (-1, 0))
        assert c["softcap"] == (model.config.attn_logit_softcapping if family == "gemma2" else 0.0)


@pytest.fixture
def hub_kernel(monkeypatch):
    """Where transformers keeps a Hub kernel once `load_and_register_attn_kernel` fetched it (the Hub cannot be
    reached here): its functions in modeling_flash_attention_utils, its name registered with flash_attention_forward
    and the flash mask."""
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    _stand_in_flash(monkeypatch, HUB)
    AttentionInterface.register(HUB, flash_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(HUB, flash_attention_mask)


def test_hub_flash_kernel_flattens_packed_rows(hub_kernel, one_thread):
    from transformers import AutoModelForCausalLM

    assert collator_layout(True, False, HUB) == "flat"
    cfg = config("llama")
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    model.load_state_dict(ref.state_dict())
    model.config._attn_implementation = HUB
    feats = features()
    for layout in ("flat", "rows"):  # the layout the collator picks for it, and packed rows as well
        batch = PackedCollator(0, layout=layout)(feats)
        out = model(**batch, use_cache=False)
        check_equals_alone(ref, out.logits, out.loss, batch, feats, layout)
    # Without the boundaries (the collator before them) two packed rows go to flash_attn_func whole: the records of
    # a row attend to each other.
    rows = PackedCollator(0, layout="rows")(feats)
    bare = {k: rows[k] for k in ("input_ids", "labels", "position_ids")}
    mixed = model(**bare, use_cache=False).logits
    second = feats[0]["records"][1]
    alone = ref(input_ids=torch.tensor([second]), use_cache=False).logits[0]
    assert (mixed[0, 7:10] - alone).abs().max() > 1e-2


def test_no_mask_built_for_a_batch_with_boundaries(monkeypatch, one_thread):
    """enable()'s hook: with the collator's bounds no mask is built, so transformers' packed-sequence detection (a
    device read) never runs; a batch without them (padded evaluation) still gets its mask and sdpa's logits."""
    import transformers.masking_utils as mu
    from types import SimpleNamespace

    detections = []
    real = mu.find_packed_sequence_indices
    monkeypatch.setattr(mu, "find_packed_sequence_indices", lambda p: detections.append(p) or real(p))
    for family in ("llama", "gemma2"):
        ref, _ = models(family)
        model = ref.__class__(ref.config).eval()
        model.load_state_dict(ref.state_dict())
        kernel = "eager" if family == "gemma2" else "sdpa"
        cfg = SimpleNamespace(data=SimpleNamespace(packing=True, padding_free=False),
                              model=SimpleNamespace(attn_implementation=kernel), training=SimpleNamespace())
        assert attention.enable(model, cfg) and model.config._attn_implementation == attention.VARLEN
        feats = features()
        batch = PackedCollator(0, layout="rows")(feats)
        detections.clear()
        out = model(**batch, use_cache=False)
        assert detections == []
        check_equals_alone(ref, out.logits, out.loss, batch, feats, "rows")
        without = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}  # transformers' mask and kernel
        detections.clear()
        torch.testing.assert_close(model(**without, use_cache=False).logits, out.logits, rtol=0, atol=1e-5)
        assert detections  # one per kind of mask the family builds
        mask = torch.tensor([[1] * 20 + [0] * 3, [1] * 23])
        torch.testing.assert_close(model(input_ids=batch["input_ids"], attention_mask=mask).logits * mask[..., None],
                                   ref(input_ids=batch["input_ids"], attention_mask=mask).logits * mask[..., None],
                                   rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# No host sync in the attention function.

SYNCS = ("item", "tolist", "__bool__", "nonzero", "cpu", "numpy", "__int__", "__float__", "__index__")


def test_attention_reads_no_device_value(monkeypatch, varlen_stand_in, one_thread):
    """A forward and backward through every kernel path calls none of the sync-forcing tensor methods from
    finetune/models/attention.py (the stand-in's own reads are the test's, not the function's)."""
    here = attention.__file__
    seen = []

    def counting(name, original):
        def wrapper(self, *a, **kw):
            frame = sys._getframe(1)
            while frame is not None and "/torch/" in frame.f_code.co_filename:
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename == here:
                seen.append((name, frame.f_lineno))
            return original(self, *a, **kw)
        return wrapper

    for name in SYNCS:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    feats = features()
    for family, kernels, grad in (("mistral", ("varlen",), True), ("gemma2", ("loop",), True),
                                  ("qwen3", ("loop",), True), ("gemma2", ("flex",), False)):
        monkeypatch.setitem(attention.PREFERENCE, "cpu", kernels)
        _, model = models(family)
        for layout in ("rows", "flat"):
            batch = PackedCollator(0, layout=layout)(feats)
            with torch.set_grad_enabled(grad):
                out = model(**batch, use_cache=False)
                if grad:
                    out.loss.backward()
    assert len(varlen_stand_in.calls) == 2 * 3
    assert seen == []
