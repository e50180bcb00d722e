"""What the rest of finetune reads about one architecture: a model family.

A family turns a config.json into shapes (every parameter tensor, in named_parameters() order, for the planner),
names its linear projections (LoRA's default targets, and what each one reads, for the planner's activations),
and says how its weights are written to and read from GGUF (llama.cpp's architecture name, tensor names, any
change of layout such as Llama's Q/K permutation, the metadata keys). One module per family holds its facts;
`finetune.models.families` is the registry.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# What a linear projection's input is, for the planner's activation model: the normed residual before attention,
# the attention output, the normed residual before the MLP, the MLP's activation product.
READS = ("attn_in", "attn_out", "mlp_in", "mlp_act")


@dataclass(frozen=True)
class Tensor:
    """One parameter tensor, in the family's named_parameters() order."""

    name: str
    shape: tuple[int, ...]
    kind: str  # embed | linear | bias | norm | head | lora

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Linear:
    """One linear projection of a decoder layer: `{block}.{name}` under the layer, weight (out, inp)."""

    name: str  # the module's own name, as --lora_target_modules and peft's target_modules give it
    block: str  # its parent module in the layer (self_attn, mlp)
    out: int
    inp: int
    bias: bool
    reads: str  # one of READS

    @property
    def numel(self) -> int:
        return self.out * self.inp


@dataclass(frozen=True)
class Saving:
    """What the planner tells a family about a run's forward, for the bytes its layers save for backward."""

    a: int  # bytes per activation element (4 fp32, 2 bf16)
    rows: int  # sequences per micro-batch
    seq_len: int
    trains_weights: bool  # a full fine-tune: the layers' own weights get gradients
    adapted_experts: bool = False  # LoRA on a MoE's experts
    padding_mask: bool = True  # the batch carries a padding mask (the planner's worst case)
    # o_proj's input is saved by something (o_proj trained, ZeRO-3's linear, LoRA's lora_A without dropout)
    o_input_kept: bool = False
    logit_rows: int = 0  # positions whose logits exist at once (0: the chunked loss keeps none)

    @property
    def tokens(self) -> int:
        return self.rows * self.seq_len


@dataclass(frozen=True)
class Images:
    """The pictures of one micro-batch as a vision tower takes them, for the planner: `tiles`, what the tower encodes
    one at a time (an image; SmolVLM's and LLaVA-NeXT's tiles of an image and its global view each count); `patches`,
    the tower's positions over all of them (a class position per tile included where the tower has one; Qwen's
    patches before their merge); `pixels`, the elements of the batch's pixel_values (padding tiles included)."""

    tiles: int
    patches: int
    pixels: int

    def __add__(self, other: "Images") -> "Images":
        return Images(self.tiles + other.tiles, self.patches + other.patches, self.pixels + other.pixels)

    def times(self, n: int) -> "Images":
        return Images(self.tiles * n, self.patches * n, self.pixels * n)


@dataclass(frozen=True)
class ModelShape:
    """The sizes of one model, read from its config.json by its family (no weights)."""

    family: "Family" = field(repr=False, compare=False)
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    # A head of this many outputs in place of the LM head (a reward model's score head: 1); 0: the LM head.
    head_outputs: int = 0
    # Mixture of experts (0: a dense model): experts per layer, routed per token, each expert's MLP width, and the
    # layers whose MLP is dense (intermediate_size) all the same.
    num_experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()
    # Where the decoder's tensors are (a multimodal checkpoint's language model is model.language_model.), and the
    # config.json dict the family read (for what only it knows: a vision tower's sizes).
    prefix: str = "model."
    config: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linears(self) -> tuple[Linear, ...]:
        return self.family.linears(self)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """Module name -> (out_features, in_features)."""
        return {lin.name: (lin.out, lin.inp) for lin in self.linears()}

    def tensors(self) -> list[Tensor]:
        """Every parameter tensor in named_parameters() order (a tied lm_head is not listed, as in torch)."""
        return self.family.tensors(self)

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer LAYER's MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def num_params(self) -> int:
        return sum(t.numel for t in self.tensors())

    @property
    def text_config(self) -> dict:
        """The decoder's config.json keys (a multimodal config's text_config)."""
        return self.config.get("text_config", self.config) if "hidden_size" not in self.config else self.config


def rope_parameters(config) -> dict:
    """rope_theta and the scaling of a transformers config: transformers 5 keeps them in config.rope_parameters,
    older configs have rope_theta and rope_scaling."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None)
    if scaling and "rope_type" not in rope:
        rope.update(scaling)
    rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return rope


@dataclass(frozen=True)
class Family(ABC):
    """One architecture. The data are fields; the layout is methods, so a family that differs from the standard
    pre-norm decoder (biases on q/k/v only, q/k norms, fused projections, experts) overrides only what differs."""

    name: str
    model_types: tuple[str, ...]  # config.json's model_type values this family reads
    hf_classes: tuple[str, ...]  # transformers' classes of those configs (the first is the causal LM)
    gguf_arch: str | None = None  # llama.cpp's general.architecture; None: not written as GGUF
    # HF tensor names every GGUF file of the family holds (their GGUF names checked on import): a file without
    # them only claims the architecture.
    gguf_required: tuple[str, ...] = ()
    # The chat formats this family's checkpoints ship with, as finetune.convert.writers.gguf names them (the
    # Ollama Modelfile's TEMPLATE); a template of any other format gets a Modelfile without one.
    chat_templates: tuple[str, ...] = ()
    # tie_word_embeddings when config.json leaves it out (transformers' config class default).
    tied_default: bool = False

    # A vision-language family (finetune.models.families.vision.VisionFamily): its checkpoints hold a vision tower and
    # a projector beside the language model, load with AutoModelForImageTextToText and an AutoProcessor. A class
    # attribute, not a field: what a family is, not a value of one instance.
    vision = False
    # On image records a mask reaches every decoder layer's attention (a vision family's; Gemma-3's): none here.
    image_mask = False

    def vision_prefixes(self, config) -> tuple[str, ...]:
        """The module-name prefixes (as in named_modules() of the model AutoModelForImageTextToText builds) of the
        vision tower and the projector: what stays frozen by default. None for a text family."""
        return ()

    # ---- shapes, for the planner ----

    def shape(self, d: dict[str, Any]) -> ModelShape:
        """The sizes in a config.json dict (a multimodal config's text_config when the top level has none)."""
        d = d.get("text_config", d) if "hidden_size" not in d else d
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                               "intermediate_size") if k not in d]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}: not a {self.name} decoder config")
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        return ModelShape(
            family=self,
            model_type=str(d.get("model_type") or self.model_types[0]),
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            intermediate_size=int(d["intermediate_size"]),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", self.tied_default)),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            config=d,
        )

    @abstractmethod
    def linears(self, sh: ModelShape) -> tuple[Linear, ...]:
        """A decoder layer's linear projections, in registration order."""

    @abstractmethod
    def layer_norms(self, sh: ModelShape) -> tuple[str, ...]:
        """A decoder layer's norm modules (each a weight of hidden_size), in registration order."""

    def layer_extras(self, sh: ModelShape, prefix: str) -> list[Tensor]:
        """Parameters of a layer beyond its linears and norms (router, experts, q/k norms): none here."""
        return []

    def tensors(self, sh: ModelShape) -> list[Tensor]:
        """The standard decoder: what comes before it (front), embeddings, each layer's tensors, the final norm, the
        LM head unless tied."""
        h = sh.hidden_size
        out = self.front(sh) + [Tensor(f"{sh.prefix}embed_tokens.weight", (sh.vocab_size, h), "embed")]
        for layer in range(sh.num_layers):
            out += self.layer_tensors(sh, layer, f"{sh.prefix}layers.{layer}.")
        out.append(Tensor(f"{sh.prefix}norm.weight", (h,), "norm"))
        if sh.head_outputs:  # *ForSequenceClassification: its score head, never tied
            out.append(Tensor("score.weight", (sh.head_outputs, h), "head"))
        elif not sh.tie_word_embeddings:
            out.append(Tensor("lm_head.weight", (sh.vocab_size, h), "head"))
        return out

    def front(self, sh: ModelShape) -> list[Tensor]:
        """Parameters registered before the decoder's embeddings (a multimodal checkpoint's vision tower): none."""
        return []

    def layer_tensors(self, sh: ModelShape, layer: int, p: str) -> list[Tensor]:
        """One decoder layer's parameters: its linears (with biases) then norms then extras."""
        out = []
        for lin in self.linears(sh):
            module = f"{p}{lin.block}.{lin.name}"
            out.append(Tensor(module + ".weight", (lin.out, lin.inp), "linear"))
            if lin.bias:
                out.append(Tensor(module + ".bias", (lin.out,), "bias"))
        out += [Tensor(f"{p}{norm}.weight", (sh.hidden_size,), "norm") for norm in self.layer_norms(sh)]
        return out + self.layer_extras(sh, p)

    # ---- activations, for the planner ----

    def sliding_window(self, sh: ModelShape, layer: int) -> int | None:
        """The attention window of decoder layer LAYER (None: it attends to every earlier position), as transformers
        reads the config: config.layer_types where the config lists them (Gemma, Qwen2/3 with use_sliding_window),
        else config.sliding_window for every layer (Mistral, Mixtral, Phi-3, Qwen3-MoE)."""
        d = sh.text_config
        window, types = d.get("sliding_window"), d.get("layer_types")
        if types:
            return window if types[layer] == "sliding_attention" else None
        return window if d.get("use_sliding_window", True) else None

    def logit_softcap(self, sh: ModelShape) -> float | None:
        """The final-logit soft-cap (cap * tanh(logits / cap)) the model applies, as transformers reads it
        (config.final_logit_softcapping: Gemma-2's 30.0); None: none."""
        cap = sh.text_config.get("final_logit_softcapping")
        return None if cap is None else float(cap)

    def attention_masked(self, sh: ModelShape, run: Saving, layer: int) -> bool:
        """Whether a [rows, 1, s, s] mask reaches LAYER's attention kernel: a padded batch, or a sliding window no longer
        than the sequence (transformers skips the mask only below the window, masking_utils._ignore_causal_mask_sdpa)."""
        window = self.sliding_window(sh, layer)
        return run.padding_mask or (window is not None and run.seq_len >= window)

    def attention_saved(self, sh: ModelShape, run: Saving, layer: int) -> int:
        """Bytes LAYER's attention (SDPA, no dropout) saves for backward, all tokens: the rotated q, k and v (k and v
        repeated to all heads when a mask disables SDPA's GQA path, the kernel's own copy of the mask), the output (also
        o_proj's input, a view) and the fp32 log-sum-exp per head."""
        a, f32, q, kv = run.a, 4, sh.q_dim, sh.kv_dim
        masked = self.attention_masked(sh, run, layer)
        kv_saved = 2 * (q if masked and sh.num_kv_heads != sh.num_heads else kv)
        mask = a * run.rows * run.seq_len ** 2 if masked else 0
        return run.tokens * (a * (q + kv_saved + q) + f32 * sh.num_heads) + mask

    def layer_saved_extra(self, sh: ModelShape, run: Saving) -> int:
        """Bytes per token a decoder layer saves for backward beyond what the planner counts for Llama's layer (its
        attention, two RMSNorms, a SwiGLU MLP of intermediate_size): none here."""
        return 0

    def layer_saved_per_batch(self, sh: ModelShape, run: Saving, first: bool = False) -> int:
        """Bytes a decoder layer saves once per forward whatever the tokens (a MoE's tokens-per-expert counts); `first`:
        layer 0 under LoRA, whose input needs no gradient."""
        return 0

    def model_saved_extra(self, sh: ModelShape, run: Saving) -> dict[str, int]:
        """What the model saves outside its decoder layers beyond Llama's (embeddings, final norm, LM head, loss),
        by name: none here."""
        return {}

    def adapts_experts(self, targets) -> bool:
        """Whether LoRA on TARGETS puts adapters on the experts (all-linear, for a MoE family)."""
        return bool(self.expert_parameters()) and list(targets) == ["all-linear"]

    # ---- what a run needs ----

    def attention_problem(self, attn_implementation: str) -> str | None:
        """Why this family cannot train or generate with ATTN_IMPLEMENTATION (one line naming the fix), or None."""
        return None

    # ---- LoRA ----

    def expert_parameters(self) -> tuple[str, ...]:
        """The experts' 3-d parameters (mlp.experts.gate_up_proj, ...) LoRA adapts by default through peft's
        target_parameters (ParamWrapper); none for a dense family."""
        return ()

    def peft_target_modules(self, config, names: list[str]) -> list[str] | str:
        """peft's target_modules for the chosen projection names: the names themselves, matched anywhere in the
        model (a family with another tower of the same names narrows this to the language model)."""
        return names

    def lora_tensors(self, sh: ModelShape, r: int, targets: list[str] | str) -> list[Tensor]:
        """peft's trainable tensors for rank r: lora_A (r x in) and lora_B (out x r) per targeted linear, in order
        (and the experts' when the targets are all-linear: ParamWrapper's lora_A (r * experts x in) and lora_B
        (out x r * experts) on each expert parameter)."""
        chosen = self.lora_targets(targets)
        experts = self.expert_parameters() if targets in (["all-linear"], "all-linear") else ()
        out = []
        for layer in range(sh.num_layers):
            p = f"base_model.model.{sh.prefix}layers.{layer}."
            for lin in self.linears(sh):
                if lin.name not in chosen:
                    continue
                out.append(Tensor(f"{p}{lin.block}.{lin.name}.lora_A.default.weight", (r, lin.inp), "lora"))
                out.append(Tensor(f"{p}{lin.block}.{lin.name}.lora_B.default.weight", (lin.out, r), "lora"))
            if sh.is_sparse(layer):
                out += self.expert_lora(sh, r, experts, p)
        return out

    def expert_lora(self, sh: ModelShape, r: int, experts: tuple[str, ...], p: str) -> list[Tensor]:
        """ParamWrapper's tensors on a sparse layer's expert parameters (none for a dense family)."""
        return []


    def linear_names(self) -> tuple[str, ...]:
        """The names of a layer's linear projections (the same for every size of the family)."""
        return tuple(lin.name for lin in self.linears(self.shape(_PROBE)))

    def lora_targets(self, targets: list[str] | str) -> list[str]:
        """LoRA's target module names, in layer order; 'all-linear' = every linear projection of a layer (peft's
        rule: all but the LM head)."""
        names = self.linear_names()
        if targets == ["all-linear"] or targets == "all-linear":
            return list(names)
        chosen = []
        for t in targets:
            base = t.split(".")[-1]
            if base not in names:
                raise ValueError(f"lora_target_modules: '{t}' is not a linear projection of a {self.name} model "
                                 f"({', '.join(names)}, or all-linear)")
            chosen.append(base)
        return [n for n in names if n in chosen]

    # ---- GGUF ----

    def gguf_refusal(self, config) -> str | None:
        """Why this model (a transformers config) cannot be written as GGUF, or None."""
        return None

    def gguf_model(self, model) -> tuple[Any, str | None]:
        """(the causal LM the GGUF file holds, a line naming what of MODEL it leaves out, or None): MODEL as
        AutoModelForCausalLM loaded it; a family whose checkpoint holds more than llama.cpp's architecture (a
        multimodal checkpoint's vision tower) gives its language model. MODEL itself here."""
        return model, None

    @abstractmethod
    def gguf_metadata(self, config) -> list[tuple[str, Any]]:
        """[(GGUFWriter adder, value)]: the model metadata llama.cpp needs (add_context_length, ...)."""

    def gguf_size_metadata(self, config) -> list[tuple[str, Any]]:
        """The sizes and counts every architecture here writes alike, from the config; a family's gguf_metadata
        adds its rope, attention and other keys."""
        return [("add_context_length", config.max_position_embeddings), ("add_embedding_length", config.hidden_size),
                ("add_block_count", config.num_hidden_layers), ("add_feed_forward_length", config.intermediate_size),
                ("add_head_count", config.num_attention_heads), ("add_head_count_kv", config.num_key_value_heads),
                ("add_layer_norm_rms_eps", config.rms_norm_eps), ("add_vocab_size", config.vocab_size)]

    def gguf_names(self, sh: ModelShape) -> dict[str, str]:
        """HF tensor name -> GGUF tensor name for every tensor of SH, by llama.cpp's own table (the gguf
        package); a tensor the table does not name is left out (the exporter refuses it by name)."""
        import gguf

        arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[self.gguf_arch]
        table = gguf.get_tensor_name_map(arch, sh.num_layers)
        names = {}
        for t in sh.tensors():
            name = table.get_name(t.name, try_suffixes=(".weight", ".bias"))
            if name is not None:
                # A bare parameter (a MoE's stacked experts) is a ".weight" in the file, as llama.cpp names it.
                names[t.name] = name if name.endswith((".weight", ".bias")) else name + ".weight"
        return names

    def gguf_required_names(self) -> tuple[str, ...]:
        """The GGUF names of gguf_required."""
        names = self.gguf_names(self.shape(_PROBE))
        return tuple(names[n] for n in self.gguf_required)

    def to_gguf(self, hf_name: str, array, sh: ModelShape):
        """A weight as the GGUF file stores it (a change of layout, if the family's llama.cpp code wants one)."""
        return array

    def from_gguf(self, hf_name: str, array, sh: ModelShape):
        """The inverse of to_gguf: the HF layout of a weight read from a GGUF file."""
        return array

    def gguf_parts(self, hf_name: str, array, sh: ModelShape, names: dict[str, str]) -> list[tuple[str, Any]]:
        """[(GGUF name, array)]: how one HF weight is stored: one tensor under its table name (gguf_names), laid out by
        to_gguf; a fused weight llama.cpp keeps apart (a MoE's experts.gate_up_proj) is several. [] when the table
        does not name it (the exporter refuses it by name)."""
        name = names.get(hf_name)
        return [] if name is None else [(name, self.to_gguf(hf_name, array, sh))]

    def from_gguf_parts(self, hf_name: str, parts: list, sh: ModelShape):
        """The inverse of gguf_parts: the HF weight of the arrays it stored, in its order."""
        (array,) = parts
        return self.from_gguf(hf_name, array, sh)

    def gguf_config(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Config values a GGUF file of this family carries (META: its metadata, key -> value) that transformers' GGUF
        loader does not read into the config, or computes the way llama.cpp does not (a soft-cap, an expert width):
        finetune's loader (finetune.convert.gguf_import.load_gguf) sets them, so the loaded model computes what
        llama.cpp computes. None here."""
        return {}

    def gguf_claim(self, meta: dict[str, Any]) -> int:
        """How surely a GGUF file of this family's architecture (META: its metadata) holds this family: 0 not at all,
        1 as any file of the architecture, more when its metadata says so (a "llama" file with experts is Mixtral).
        The highest claim imports the file; the first family of FAMILIES among equals."""
        return 1

    def load_gguf(self, path, meta: dict[str, Any]):
        """The causal LM in float32 of the GGUF file PATH (META: its metadata): transformers' own loader, with the
        config values it does not read set from the file (gguf_config). A family transformers' loader cannot read
        builds the model itself (gguf_state_dict)."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        folder, name = str(Path(path).parent), Path(path).name
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        for key, value in self.gguf_config(meta).items():
            setattr(config, key, value)
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=config, dtype=torch.float32)

    def load_gguf_tokenizer(self, path):
        """The tokenizer of the GGUF file PATH: transformers' own GGUF tokenizer."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name)

    def gguf_state_dict(self, path, sh: ModelShape) -> dict[str, Any]:
        """The HF state dict (float32 torch tensors) of SH's tensors in the GGUF file PATH, dequantized and mapped back
        by this family (gguf_names, gguf_parts, from_gguf_parts): the inverse of what the exporter writes."""
        import gguf
        import numpy as np
        import torch

        reader = gguf.GGUFReader(str(path))  # finetune.compat.shared_gguf_reader's, when the caller holds one
        stored = {t.name: t for t in reader.tensors}
        names = self.gguf_names(sh)
        state = {}
        for t in sh.tensors():
            # The parts' names only: a zero-sized view of the tensor's shape goes through gguf_parts.
            parts = self.gguf_parts(t.name, np.broadcast_to(np.float32(0), t.shape), sh, names)
            if not parts or any(n not in stored for n, _ in parts):
                raise ValueError(f"the GGUF file lacks {' + '.join(n for n, _ in parts) or t.name}")
            arrays = []
            for n, _ in parts:
                r = stored[n]
                data = gguf.dequantize(np.asarray(r.data), r.tensor_type)
                arrays.append(torch.from_numpy(np.array(data, dtype=np.float32)  # a copy: the map is read-only
                                               .reshape(tuple(reversed(r.shape.tolist())))))
            state[t.name] = self.from_gguf_parts(t.name, arrays, sh).contiguous()
        return state


# A shape for what does not depend on sizes (module names).
_PROBE = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
