"""LoRA on the mixture-of-experts families (Qwen3-MoE, Mixtral), tiny random models of their real config shape: the
default targets (attention projections by name, the experts through peft's target_parameters) train under the
default --lora_dropout (the linears get it, the experts' ParamWrapper none); the adapter is accepted by
`finetune generate` and `finetune export`, and the merged model's logits equal base + adapter."""

from __future__ import annotations

import json
import types

import pytest
import torch
from family_configs import tiny_model

from finetune.config.training import ModelConfig
from finetune.convert import export as E
from finetune.inference import generate as G
from finetune.models import families, tiny
from finetune.models.load import add_lora
from finetune.plan import planner as plan

DEFAULT_DROPOUT = ModelConfig.__dataclass_fields__["lora_dropout"].default


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny.build_tokenizer(tmp_path_factory.mktemp("tok"), "chatml", vocab_size=256)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("fam", ["qwen3_moe", "mixtral"])
def test_moe_adapter_trains_generates_and_merges(fam, tokenizer, tmp_path, capsys):
    from peft import PeftModel
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.tuners.lora.layer import ParamWrapper
    from transformers import AutoModelForCausalLM

    base = tiny_model(fam, vocab_size=len(tokenizer))
    src = tmp_path / "base"
    base.save_pretrained(src)
    tokenizer.save_pretrained(src)
    assert DEFAULT_DROPOUT > 0
    cfg = types.SimpleNamespace(lora_r=4, lora_alpha=8, lora_dropout=DEFAULT_DROPOUT,
                                lora_target_modules=["all-linear"], _hub=None)
    model = add_lora(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32), cfg, seed=0)
    wrappers = [m for m in model.modules() if isinstance(m, ParamWrapper)]
    linears = [m for m in model.modules() if isinstance(m, LoraLinear)]
    assert wrappers and linears
    assert all(isinstance(m.lora_dropout["default"], torch.nn.Dropout) and m.lora_dropout["default"].p ==
               DEFAULT_DROPOUT for m in linears)
    assert all(isinstance(m.lora_dropout["default"], torch.nn.Identity) for m in wrappers)

    # The planner's LoRA tensors are peft's, name for name and shape for shape.
    shape = families.family_of(base.config.to_dict()).shape(base.config.to_dict())
    expected = [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]
    assert [(t.name, t.shape) for t in plan.lora_tensors(shape, 4, ["all-linear"])] == expected

    # Train a few steps: the loss falls and the experts' adapters move.
    ids = torch.randint(3, len(tokenizer) - 3, (2, 16), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(5):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    assert all(w.lora_B["default"].weight.abs().max() > 0 for w in wrappers)
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)
    acfg = json.loads((adapter / "adapter_config.json").read_text())
    acfg["base_model_name_or_path"] = str(src)
    (adapter / "adapter_config.json").write_text(json.dumps(acfg))

    # Generate with the adapter (checked against the base, then attached) and merge it with export.
    out = tmp_path / "gen.jsonl"
    G.main(["--model_name_or_path", str(src), "--adapter", str(adapter), "--prompt", "hello", "--max_new_tokens", "6",
            "--with_ids", "--output", str(out), "--torch_dtype", "float32"])
    generated = json.loads(out.read_text().splitlines()[0])
    merged = tmp_path / "merged"
    E.main(["--adapter", str(adapter), "--model_name_or_path", str(src), "--output_dir", str(merged)])
    capsys.readouterr()

    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32),
                                             str(adapter)).eval()
    plain = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    assert not any("lora" in n for n, _ in plain.named_parameters())
    with torch.no_grad():
        want, got = with_adapter(input_ids=ids).logits, plain(input_ids=ids).logits
        untouched = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(input_ids=ids).logits
    diff = (want - got).abs().max().item()
    moved = (want - untouched).abs().max().item()
    print(f"{fam}: merged vs base + adapter logits max diff {diff:.2e} (the adapter moves them by {moved:.3f}); "
          f"losses {losses[0]:.4f} -> {losses[-1]:.4f}; generated {generated.get('completion_ids')}")
    assert moved > 1e-3 and diff <= 1e-5
