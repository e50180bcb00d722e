"""Configs of every model family finetune covers, for the tests: a tiny random model of each family's real config
shape (the keys that change its computation: Gemma's soft-caps, sliding windows and head_dim, Qwen3's head_dim,
the MoE routers), and the published config.json numbers of real checkpoints."""

from __future__ import annotations

import torch

TINY_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)


def tiny_config(name: str, vocab_size: int = 96, tied: bool = False, **dims):
    """DIMS: other sizes than TINY_COMMON's (hidden_size, num_hidden_layers, ...) for every family."""
    import transformers as T

    c = dict(TINY_COMMON, vocab_size=vocab_size, tie_word_embeddings=tied, **dims)
    if name == "llama":
        return T.LlamaConfig(**c)
    if name == "qwen2":
        return T.Qwen2Config(rope_theta=1000000.0, **c)
    if name == "qwen3":
        return T.Qwen3Config(head_dim=32, rope_theta=1000000.0, **c)  # head_dim != 64 / 4, as in Qwen3's sizes
    if name == "mistral":
        return T.MistralConfig(sliding_window=4096, **c)
    if name == "gemma2":  # gemma-2-2b's keys: both soft-caps, a sliding window on every other layer, head_dim 256
        return T.Gemma2Config(head_dim=32, query_pre_attn_scalar=32, final_logit_softcapping=30.0,
                              attn_logit_softcapping=50.0, sliding_window=16, hidden_activation="gelu_pytorch_tanh",
                              pad_token_id=0, eos_token_id=1, bos_token_id=2,
                              **dict(c, tie_word_embeddings=True))
    if name == "gemma3":  # gemma-3-1b's keys (Gemma3ForCausalLM): no logit soft-caps, 5 sliding layers : 1 global
        return T.Gemma3TextConfig(head_dim=32, query_pre_attn_scalar=32, sliding_window=16,
                                  pad_token_id=0, eos_token_id=1, bos_token_id=2,
                                  **dict(c, num_hidden_layers=dims.get("num_hidden_layers", 3),
                                         tie_word_embeddings=True))
    if name == "gemma3_mm":  # gemma-3-4b and up: Gemma3ForConditionalGeneration, a SigLIP vision tower
        text = tiny_config("gemma3", vocab_size).to_dict()
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      image_size=28, patch_size=14)
        return T.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                              image_token_index=vocab_size - 1, boi_token_index=vocab_size - 2,
                              eoi_token_index=vocab_size - 3, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    if name == "phi3":  # Phi-3's fused qkv_proj and gate_up_proj
        return T.Phi3Config(pad_token_id=0, bos_token_id=1, eos_token_id=2, **c)
    if name == "qwen3_moe":  # Qwen3-30B-A3B's keys: every layer sparse, top-k renormalised, router logits out
        return T.Qwen3MoeConfig(head_dim=32, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                                output_router_logits=True, router_aux_loss_coef=0.001, **c)
    if name == "mixtral":
        return T.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                               router_aux_loss_coef=0.02, **c)
    raise KeyError(name)


TINY = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "gemma3_mm", "phi3", "qwen3_moe", "mixtral")
ATTENTION = {"gemma2": "eager"}  # Gemma-2 has no sdpa kernel in transformers (soft-capped attention)


def tiny_model(name: str, vocab_size: int = 96, tied: bool = False, seed: int = 0, **dims):
    """A random model of the family, with random norms and biases (so a wrong name or layout shows in logits)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    config = tiny_config(name, vocab_size, tied, **dims)
    auto = AutoModelForImageTextToText if name == "gemma3_mm" else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32, attn_implementation=ATTENTION.get(name, "sdpa"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.normal_(1.0 if "norm" in n and "gemma" not in name else 0.0, 0.1)
    return model
