"""What the mixture-of-experts families (Qwen3-MoE, Mixtral) share: a sparse MLP of `num_experts` experts held as
two 3-d parameters (mlp.experts.gate_up_proj [experts, 2 x width, hidden] and mlp.experts.down_proj [experts,
hidden, width], transformers 5's fused layout) and a router (mlp.gate.weight [experts, hidden]).

LoRA: the attention projections by name, and the experts through peft's target_parameters (lora.ParamWrapper, one
lora_A [r x experts, in] and lora_B [out, r x experts] per expert parameter). ParamWrapper cannot apply dropout
(x cannot be factored out of lora_B(lora_A(dropout(x))) per expert), so finetune.models.load gives the experts'
adapters no dropout and the attention projections' adapters --lora_dropout.

GGUF: llama.cpp stacks the experts one tensor per projection, so the fused gate_up_proj is written as ffn_gate_exps
and ffn_up_exps (gate first); down_proj and the router are one tensor each, under the table's names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.models.families.base import Linear, ModelShape, Saving, Tensor
from finetune.models.families.llama import LlamaFamily

EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
GATE_UP = EXPERTS[0]


@dataclass(frozen=True)
class MoeFamily(LlamaFamily):
    router_first: bool = False  # mlp.gate registered before mlp.experts (Mixtral) or after (Qwen3-MoE)

    def expert_parameters(self) -> tuple[str, ...]:
        return EXPERTS

    def sparse_mlp(self, sh: ModelShape, p: str) -> list[Tensor]:
        e, h, w = sh.num_experts, sh.hidden_size, sh.moe_intermediate_size
        experts = [Tensor(p + "mlp.experts.gate_up_proj", (e, 2 * w, h), "linear"),
                   Tensor(p + "mlp.experts.down_proj", (e, h, w), "linear")]
        router = [Tensor(p + "mlp.gate.weight", (e, h), "linear")]
        return router + experts if self.router_first else experts + router

    def linears(self, sh: ModelShape) -> tuple[Linear, ...]:
        """The attention projections: the linears of every layer (a dense layer's MLP is added by layer_tensors;
        the published configs have none)."""
        return tuple(lin for lin in super().linears(sh) if lin.block == "self_attn")

    def layer_tensors(self, sh: ModelShape, layer: int, p: str) -> list[Tensor]:
        out = super().layer_tensors(sh, layer, p)
        at = len(self.linears(sh))  # after the attention's projections
        if sh.is_sparse(layer):
            mlp = self.sparse_mlp(sh, p)
        else:
            mlp = [Tensor(f"{p}mlp.{lin.name}.weight", (lin.out, lin.inp), "linear")
                   for lin in LlamaFamily.linears(self, sh) if lin.block == "mlp"]
        return out[:at] + mlp + out[at:]

    def layer_saved_extra(self, sh: ModelShape, run: Saving) -> int:
        """The sparse MLP in place of Llama's dense one (4 x intermediate_size values per token trained, 3 frozen),
        measured on CPU (transformers 5's grouped experts, output_router_logits off): the router's fp32 logits, the
        top-k indices (int64) and weights, their sum, two int64 sort orders of the token x expert slots, the routing
        weight per slot; per slot, the gathered input (when the expert weights train or carry LoRA), the gate_up
        output, silu(gate), the product (idem) and the expert output."""
        f32, e, k, h, w = 4, sh.num_experts, sh.experts_per_tok, sh.hidden_size, sh.moe_intermediate_size
        a, trains_weights = run.a, run.trains_weights
        router = f32 * (e + 1 + 2 * k) + 32 * k
        weights_grad = trains_weights or run.adapted_experts
        experts = a * k * (2 * h + 4 * w) if weights_grad else a * k * (h + 3 * w)
        return router + experts - (4 if trains_weights else 3) * a * sh.intermediate_size

    def layer_saved_per_batch(self, sh: ModelShape, run: Saving, first: bool = False) -> int:
        """The tokens routed to each expert (int32); with LoRA on the experts, peft's ParamWrapper keeps each expert
        parameter's adapted copy (base + B @ A) for backward."""
        experts = sum(t.numel for t in self.sparse_mlp(sh, "") if "experts" in t.name)
        adapted = run.a * experts if run.adapted_experts else 0
        return 4 * sh.num_experts + adapted

    def model_saved_extra(self, sh: ModelShape, run: Saving) -> dict[str, int]:
        """With output_router_logits, transformers' load_balancing_loss_func after the layers: each sparse layer's
        softmax over its router logits (activation dtype), the tokens-per-expert fractions, and, the batch carrying an
        attention mask (the collator always passes one), that mask in fp32 and its sum. Its top-k indices are let go
        at once (nothing downstream keeps the top-k node): not counted."""
        if not sh.text_config.get("output_router_logits"):
            return {}
        sparse = sum(sh.is_sparse(k) for k in range(sh.num_layers))
        e = sh.num_experts
        return {"router load-balancing loss": sparse * run.a * run.tokens * e + 4 * e + 4 * run.tokens + 4}

    def expert_lora(self, sh: ModelShape, r: int, experts: tuple[str, ...], p: str) -> list[Tensor]:
        # ParamWrapper's in/out of a [experts, a, b] parameter (not transposed): in = b, out = a. peft nests one
        # wrapper per parameter, the first innermost: its tensors are under mlp.experts.base_layer, the last's
        # under mlp.experts.
        shapes = {t.name[len(p):]: t.shape for t in self.sparse_mlp(sh, p)}
        chosen = [name for name in EXPERTS if name in experts]
        out = []
        for k, name in enumerate(chosen):
            e, a, b = shapes[name]
            module = f"{p}{name.rsplit('.', 1)[0]}" + ".base_layer" * (len(chosen) - 1 - k)
            out += [Tensor(f"{module}.lora_A.default.weight", (r * e, b), "lora"),
                    Tensor(f"{module}.lora_B.default.weight", (a, r * e), "lora")]
        return out


    # ---- GGUF ----

    def gguf_parts(self, hf_name: str, array, sh: ModelShape, names: dict[str, str]) -> list[tuple[str, Any]]:
        if not hf_name.endswith(GATE_UP):
            return super().gguf_parts(hf_name, array, sh, names)
        import gguf

        layer = int(hf_name.split(".layers.", 1)[1].split(".", 1)[0])
        w = array.shape[1] // 2
        return [(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_GATE_EXP].format(bid=layer) + ".weight", array[:, :w]),
                (gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_UP_EXP].format(bid=layer) + ".weight", array[:, w:])]

    def from_gguf_parts(self, hf_name: str, parts: list, sh: ModelShape):
        if not hf_name.endswith(GATE_UP):
            return super().from_gguf_parts(hf_name, parts, sh)
        gate, up = parts
        import numpy as np

        if isinstance(gate, np.ndarray):
            return np.concatenate([gate, up], axis=1)
        import torch

        return torch.cat([gate, up], dim=1)
