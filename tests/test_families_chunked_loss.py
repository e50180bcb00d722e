"""The chunked loss (--loss_chunk_size) equals transformers' own loss for every model family, on a tiny random model
of each family's real config shape: Gemma-2's final-logit soft-cap applied inside the chunks (its 30.0, and a cap
of 1.0 where the soft-cap dominates), the MoE router's auxiliary loss added as transformers adds it
(router_aux_loss_coef * aux_loss, with output_router_logits), and the gradients with them."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from family_configs import TINY, tiny_model

from finetune.training import loss as chunked
from tests.test_loss import differences

VOCAB = 96


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB - 3, (3, 24), generator=g)  # no image or special token
    labels = ids.clone()
    labels[:, :5] = -100  # prompts
    labels[2, 17:] = -100  # padding
    mask = torch.ones_like(ids)
    mask[2, 17:] = 0
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def run(model, inputs, num_items=41):
    out = model(**inputs, num_items_in_batch=torch.tensor(num_items))
    (out.loss * 3.0).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, (out.loss.detach(), grads)


def lora_head(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["lm_head"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model


CASES = {name: {} for name in TINY}
CASES["gemma2_cap_1"] = dict(family="gemma2", softcap=1.0)  # the cap dominates: a loss handed to it trained nothing
CASES["gemma2_lora_head"] = dict(family="gemma2", lora_head=True)  # a head of another class: checkpointed chunks


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("case", CASES)
def test_chunked_loss_equals_transformers(case):
    spec = {"family": case, "softcap": None, "lora_head": False, **CASES[case]}
    model = tiny_model(spec["family"], VOCAB).train()
    if spec["softcap"] is not None:
        model.config.final_logit_softcapping = spec["softcap"]
    if spec["lora_head"]:
        model = lora_head(model)
    other = copy.deepcopy(model)
    assert chunked.install(other, 7)
    ref_out, reference = run(model, batch())
    out, got = run(other, batch())
    assert out.logits is None  # the chunked loss really ran
    loss_rel, grad_rel = differences(reference, got)
    aux = getattr(ref_out, "aux_loss", None)
    print(f"{case}: loss {reference[0].item():.6f} vs chunked {got[0].item():.6f}: relative difference "
          f"{loss_rel:.2e}, gradients at most {max(grad_rel.values()):.2e}"
          + (f" (aux_loss {aux.item():.6f} included)" if aux is not None else ""))
    # Gradients: fp32 sums in another order move them by up to ~1e-6 relative (Qwen2's biases: 1.01e-6 measured).
    assert loss_rel <= 1e-6 and max(grad_rel.values()) <= 3e-6, (loss_rel, grad_rel)
    lm = other.get_base_model() if hasattr(other, "get_base_model") else other
    cap = getattr(lm.config, "final_logit_softcapping", None)
    assert cap == (spec["softcap"] or (30.0 if spec["family"] == "gemma2" else None))  # given back to the model
    if aux is not None:  # the auxiliary loss is really in the reference, and so in the chunked loss
        assert out.aux_loss is not None and abs(aux.item() - out.aux_loss.item()) <= 1e-7
        assert spec["family"] in ("qwen3_moe", "mixtral") and aux.item() > 0
        lm.config.output_router_logits = False
        assert abs(run(other, batch())[1][0].item() - reference[0].item()) > 1e-5  # without it: another loss


def test_gemma2_under_sdpa_is_refused_before_any_model_loads(tmp_path):
    """transformers has no sdpa kernel for Gemma-2 (soft-capped attention): the default --attn_implementation is
    refused with one line naming eager, with the configuration problems (before any model loads); eager passes."""
    from test_fast_errors import run_timed_imports

    from finetune.models import families, tiny

    folder = tmp_path / "gemma2"
    tokenizer = tiny.build_tokenizer(folder, "chatml", vocab_size=256)
    tiny_model("gemma2", vocab_size=len(tokenizer)).save_pretrained(folder)
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a b"}\n')
    cmd = [sys.executable, "-m", "finetune", "train", "--model_name_or_path", str(folder), "--dataset", str(data),
           "--output_dir", str(tmp_path / "out")]
    proc, _ = run_timed_imports(cmd, tmp_path)
    assert proc.returncode == 2, proc.stderr
    line = (f"attn_implementation: sdpa: transformers has no sdpa kernel for gemma2 (its attention logits are "
            f"soft-capped); use --attn_implementation eager (or flash_attention_2 on a GPU) ({folder}/config.json: "
            "model_type 'gemma2')")
    assert proc.stderr.splitlines() == ["finetune: 1 configuration problem(s):", f"  - {line}"], proc.stderr
    assert not (tmp_path / "out").exists()
    assert families.family_of("gemma2").attention_problem("eager") is None
    assert all(families.family_of(t).attention_problem("sdpa") is None for t in ("gemma3", "gemma3_text", "phi3",
                                                                                 "qwen3_moe", "mixtral"))


def test_gemma2_generate_under_sdpa_is_refused_too(tmp_path, capsys):
    from finetune.inference import generate as G
    from finetune.models import tiny

    folder = tmp_path / "gemma2"
    tokenizer = tiny.build_tokenizer(folder, "chatml", vocab_size=256)
    tiny_model("gemma2", vocab_size=len(tokenizer)).save_pretrained(folder)
    with pytest.raises(SystemExit) as exit_:
        G.main(["--model_name_or_path", str(folder), "--prompt", "hi"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "use --attn_implementation eager" in err and "Traceback" not in err, err
    out = tmp_path / "gen.jsonl"
    G.main(["--model_name_or_path", str(folder), "--prompt", "hi", "--attn_implementation", "eager",
            "--max_new_tokens", "3", "--output", str(out)])
    assert len(out.read_text().splitlines()) == 1
