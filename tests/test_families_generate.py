"""`finetune generate` on each family: a base saved in several safetensors shards, placed by a device_map (`auto`
under a --max_memory that sends layers to disk, and an explicit map), with and without a LoRA adapter, gives the
logits and the greedy tokens of the model in one piece. The MoE models keep their training config
(output_router_logits on), with which transformers' own decoding of a padded batch fails; GRPO's sampler too."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from family_configs import ATTENTION, tiny_model

from finetune.inference import generate as G
from finetune.models import tiny

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ("qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "qwen3_moe", "mixtral")
TIGHT = {"cpu": 150_000, "disk": 1 << 30}  # the embeddings and little more in RAM: later layers go to disk
PROMPTS = ["count: red blue green", "reverse: the cat sat on the long road"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny.build_tokenizer(tmp_path_factory.mktemp("tok"), "chatml")


def _load(src, adapter, device_map, max_memory, attn):
    model, tok, placed = G.load_for_inference(
        G.LoadOptions(str(src), adapter=adapter, device_map=device_map, max_memory=max_memory,
                      attn_implementation=attn), log=lambda *a: None)
    return model, tok, placed


@pytest.mark.parametrize("fam", FAMILIES)
def test_sharded_base_and_adapter_on_a_device_map_equal_one_piece(fam, tokenizer, tmp_path):
    src = tmp_path / fam
    tiny_model(fam, vocab_size=len(tokenizer), tied=fam.startswith("gemma"), seed=3, num_hidden_layers=4) \
        .save_pretrained(src, max_shard_size="100KB")
    tokenizer.save_pretrained(src)
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    assert len(shards) > 1, shards
    adapter = tiny.save_random_adapter(src, tmp_path / "adapter", r=4, seed=1)
    attn = ATTENTION.get(fam, "sdpa")
    explicit = tmp_path / "map.json"
    layers = {f"model.layers.{i}": ("disk" if i % 2 else "cpu") for i in range(4)}
    placement = {"model.embed_tokens": "cpu", **layers, "model.norm": "cpu", "model.rotary_emb": "cpu"}
    if fam.startswith("gemma"):  # a tied head is the embedding's tensor: apart from it, refused by name
        explicit.write_text(json.dumps({**placement, "lm_head": "disk"}))
        with pytest.raises(G.GenerationError, match=r"lm_head.weight and model.embed_tokens.weight are one tensor \(tied weights\) placed apart"):
            _load(src, None, str(explicit), None, ATTENTION.get(fam, "sdpa"))
    explicit.write_text(json.dumps({**placement, "lm_head": "cpu" if fam.startswith("gemma") else "disk"}))
    ids = torch.randint(0, len(tokenizer), (2, 16), generator=torch.Generator().manual_seed(0))
    moe = fam in ("qwen3_moe", "mixtral")
    if moe:  # LoRA on the experts' parameters cannot run offloaded (peft 0.21): refused by name
        with pytest.raises(G.GenerationError, match="cannot run with those layers offloaded"):
            _load(src, str(adapter), "auto", TIGHT, attn)
        explicit.write_text(json.dumps({**placement, **{k: "cpu" for k in layers}, "lm_head": "disk"}))
    for with_adapter in (None, str(adapter)):
        logits, tokens = {}, {}
        tight = ("auto, tight", "auto", TIGHT) if not (moe and with_adapter) else ("auto", "auto", None)
        for name, device_map, max_memory in (("one piece", None, None), tight, ("json map", str(explicit), None)):
            model, tok, placed = _load(src, with_adapter, device_map, max_memory, attn)
            if device_map and max_memory or name == "json map":
                assert "disk" in placed.values(), (fam, name, placed)
            with torch.no_grad():
                logits[name] = model(input_ids=ids).logits
            prompts = G.read_prompts(tok, PROMPTS, None, chat=False)  # two lengths: a left-padded batch
            tokens[name] = [r["completion_ids"] for r in G.generate(model, tok, prompts, batch_size=2,
                                                                      max_new_tokens=8)]
            del model
        for name in [n for n in logits if n != "one piece"]:
            diff = (logits[name] - logits["one piece"]).abs().max().item()
            assert diff == 0.0, f"{fam} {name} (adapter={bool(with_adapter)}): logits differ by {diff}"
            assert tokens[name] == tokens["one piece"], (fam, name, with_adapter)
        if with_adapter:
            assert not torch.equal(logits["one piece"], base_logits), f"{fam}: the adapter changes nothing"
        else:
            base_logits = logits["one piece"]


@pytest.mark.parametrize("fam", ["qwen3_moe", "mixtral"])
def test_grpo_sampler_decodes_a_moe_model_trained_with_router_logits(fam, tokenizer):
    """GRPO samples with its own cached decoding loop: a padded batch of a MoE model whose config asks for router
    logits (the auxiliary loss) decodes, greedily the same tokens as `finetune generate`."""
    from finetune.methods import generation

    model = tiny_model(fam, vocab_size=len(tokenizer), seed=3).eval()
    assert model.config.output_router_logits
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.pad_token = tokenizer.eos_token  # as load_for_inference sets it for a tokenizer without one
    prompts = G.read_prompts(tokenizer, PROMPTS, None, chat=False)
    reference = [r["completion_ids"] for r in G.generate(model, tokenizer, prompts, batch_size=2, max_new_tokens=8)]
    encoded = [tokenizer(p.text)["input_ids"] for p in prompts]
    width = max(map(len, encoded))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
    out, cmask = generation.sample(model, ids, mask, [0, 1], max_new=8, temperature=0.0, top_p=1.0,
                                   stop_ids=G.eos_ids(model, tokenizer), pad_id=pad)
    got = [row[: int(m.sum())].tolist() for row, m in zip(out, cmask)]
    stop = set(G.eos_ids(model, tokenizer))
    assert [[t for t in row if t not in stop] for row in got] == reference, (got, reference)
