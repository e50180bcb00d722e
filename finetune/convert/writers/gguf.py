"""The GGUF export type (`finetune export --to gguf`): an HF folder of a model family finetune writes as GGUF -> one
GGUF file for llama.cpp and Ollama, with an Ollama Modelfile beside it.

    finetune export --to gguf --model_name_or_path merged out/model.gguf --gguf_type q8_0    # or q4_0, q4_1, q5_0, q5_1
    finetune export --to gguf --model_name_or_path merged out/model.gguf --gguf_type q4_K_M  # or q5_K_M, q6_K: llama.cpp's
    finetune export --to gguf --adapter OUT out/model.gguf              # merged into its base first
    finetune export --to gguf --zero_checkpoint OUT/checkpoint-500 out/model.gguf

Written with the `gguf` package (llama.cpp's own writer; the K-quant presets then by llama.cpp's quantizer from
llama-cpp-python, gguf_kquant.py): the family's metadata (finetune.models.families), the
byte-level BPE tokenizer (tokens, token types, merges, pre-tokenizer name), special token ids and the chat template;
tensor names and layouts are the family's as llama.cpp's convert_hf_to_gguf.py writes them (Llama's Q and K rows
permuted); a checkpoint holding more than the architecture (Gemma-3's multimodal one) is written as the causal LM its
family's gguf_model gives, with one line saying what is left out, and where llama.cpp's multimodal tool reads the
vision tower (SmolVLM, Gemma-3, Qwen2.5-VL: MmprojTower) its mmproj file is written beside it (write_mmproj; Qwen2.5-VL's
language model is llama.cpp's "qwen2vl", which finetune reads back itself: lm_family). The file is written under a temporary name in the output folder, verified
(transformers loads it, its logits match the HF model's within the bound of its type, and its weights are the HF
weights rounded to that type), then renamed into place; an Ollama `Modelfile` is written next to it. An adapter or a ZeRO checkpoint becomes an HF
folder first (the HF export type's `hf_folder`, verified as for --to hf).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from finetune.convert.messages import ExportError, log
from finetune.convert.writers import gguf_kquant
from finetune.convert.writers.base import ExportArgs, Writer
from finetune.convert.writers.hf import hf_folder
from finetune.errors import did_you_mean
from finetune.models import families
from finetune.models.verify import VerificationError, fixed_input, logits_of

# --gguf_type values. Written here with the gguf package's own encoders and quantizers (no compiler):
PLAIN_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
# llama.cpp's K-quant presets: made by llama.cpp's own quantizer (llama_model_quantize of llama-cpp-python, the
# optional extra finetune[llamacpp]; gguf_kquant.py), which mixes types per tensor; the gguf package only dequantizes
# them. Without llama-cpp-python, asking for one gets the way to install it, in one line.
LLAMACPP_TYPES = tuple(gguf_kquant.PRESETS)
GGUF_TYPES = PLAIN_TYPES + LLAMACPP_TYPES
# The 4- and 5-bit block types: their output head (or the tied token embedding that serves as one) is written Q8_0,
# the most precise type the gguf package quantizes (llama.cpp's presets put it in Q6_K), as llama.cpp keeps it
# above the rest.
LOW_BIT_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1")
# Largest logit difference (GGUF-loaded vs HF, fp32 compute, verify.fixed_input) accepted per type. f32 is the
# project's 1e-5; the others are relative to the largest |logit| of the HF model, set with 2x or more headroom over
# the largest of the measurements on SmolLM2-135M and the tests' tiny models (docs/export.md has them).
LOGIT_BOUNDS = {"f32": 1e-5, "f16": 0.01, "bf16": 0.08, "q8_0": 0.08,
                "q4_0": 0.75, "q4_1": 0.75, "q5_0": 0.75, "q5_1": 0.75,
                "q4_K_M": 0.5, "q5_K_M": 0.3, "q6_K": 0.15}


def gguf_type_name(value: str) -> str | None:
    """The --gguf_type VALUE names (any case: Q4_0, q4_k_m), or None."""
    return next((t for t in GGUF_TYPES if t.lower() == str(value).lower()), None)


def gguf_type_problem(value: str) -> str | None:
    """The one-line refusal of a --gguf_type value, or None: an unknown name, or a K-quant preset (llama.cpp's)."""
    name = gguf_type_name(value)
    if name is None:
        return (f"--gguf_type: '{value}' is not one of {', '.join(GGUF_TYPES)}"
                f"{did_you_mean(str(value), list(GGUF_TYPES))}")
    if name in LLAMACPP_TYPES:
        return gguf_kquant.refusal(name, PLAIN_TYPES)
    return None


# Pre-tokenizers recognised from tokenizer.json, named as llama.cpp names them (tokenizer.ggml.pre).
LLAMA3_SPLIT = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
# Qwen2's and Qwen3's: Llama-3's with single digits (transformers 5 builds it for every Qwen2Tokenizer).
QWEN2_SPLIT = LLAMA3_SPLIT.replace("\\p{N}{1,3}", "\\p{N}")


@dataclass
class GGUFReport:
    path: str
    gguf_type: str
    size_bytes: int
    logit_diff: float
    logit_bound: float
    weight_diff: float
    seconds: float
    types: dict[str, int] = field(default_factory=dict)  # GGML type name -> number of tensors stored in it

    def __str__(self) -> str:
        mix = ", ".join(f"{n} {t}" for t, n in self.types.items())
        return (f"wrote {self.path} ({self.gguf_type}, {self.size_bytes / 2**20:.1f} MiB, {self.seconds:.1f}s; "
                f"tensors: {mix}): "
                f"transformers-loaded logits vs HF max diff {self.logit_diff:.3g} (limit {self.logit_bound:g}); "
                f"weights vs HF max diff {self.weight_diff:.3g} (rounding to {self.gguf_type}; they load back exactly as stored)")


# ----------------------------------------------------------------------------------------------
# Model metadata and tensors


def _writable_family(config, model_dir: Path):
    """The model's family, if it is one finetune writes as GGUF; ExportError names what it is not."""
    family = families.find(config)
    if family is None or family.gguf_arch is None:
        supported = ", ".join(t for f in families.FAMILIES if f.gguf_arch for t in f.model_types)
        arch = getattr(config, "model_type", None)
        raise ExportError(f"{model_dir}: model_type '{arch}' cannot be written as GGUF by finetune "
                          f"(supported: {supported})")
    if why := family.gguf_refusal(config):
        raise ExportError(f"{model_dir}: {why}")
    from finetune.models.load import TASKS, saved_task

    task = saved_task(model_dir)[0]
    if task != "CAUSAL_LM":  # loaded as a causal LM its head would be missing, drawn at random, and written
        raise ExportError(f"{model_dir}: a {TASKS[task][0].replace('AutoModelFor', '')} model (a reward model's score "
                          "head) cannot be written as GGUF: llama.cpp's architectures have a language-model head only; "
                          "export it as an HF folder (--to hf) and score with finetune score")
    return family


def _tensor_type(gguf_type: str, array, name: str = "", head: bool = False):
    """The GGML type a tensor is stored in, as llama.cpp's quantizer picks it (llama_tensor_get_type): 1-D tensors
    (norms, biases) and a mixture-of-experts router (ffn_gate_inp) stay F32; under a 4- or 5-bit type the output head
    (HEAD: output.weight, or token_embd when it is tied) is Q8_0; a row whose length is not a multiple of the type's
    block (32 values) is F16 (llama.cpp's fallback)."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q

    if array.ndim < 2 or gguf_type == "f32" or name.startswith("blk.") and ".ffn_gate_inp." in name:
        return Q.F32
    if gguf_type in LOW_BIT_TYPES and head:
        gguf_type = "q8_0"
    qtype = {"f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q5_0": Q.Q5_0,
             "q5_1": Q.Q5_1}[gguf_type]
    return qtype if array.shape[-1] % GGML_QUANT_SIZES[qtype][0] == 0 else Q.F16


def _encode(array, qtype):
    """The data GGUFWriter.add_tensor takes for an fp32 array stored as `qtype`."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    array = np.ascontiguousarray(array, dtype=np.float32)
    if qtype == Q.F32:
        return array
    if qtype == Q.F16:
        return array.astype(np.float16)
    return quants.quantize(array, qtype)


def _decode(data, qtype, shape):
    """The fp32 values stored data stands for (what a reader must get back)."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    if qtype in (Q.F32, Q.F16):
        return data.astype(np.float32).reshape(shape)
    return quants.dequantize(data, qtype).reshape(shape)


def lm_family(model):
    """The family a causal LM (as its family's gguf_model gave it) is written and read back as: the one it names
    (`gguf_family`: a language model llama.cpp keeps under an architecture of its own, Qwen2.5-VL's "qwen2vl"), else
    its config's."""
    return getattr(model, "gguf_family", None) or families.family_of(model.config)


def gguf_tensors(model, gguf_type: str):
    """[(gguf name, data, qtype, HF name, stored shape)] for every weight of MODEL, named and laid out as its
    family's (a weight llama.cpp keeps in parts, as a MoE's fused gate/up experts, is one row per part)."""
    import torch

    family = lm_family(model)
    shape = family.shape(model.config.to_dict())
    names = family.gguf_names(shape)
    tied = shape.tie_word_embeddings
    out = []
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # no output.weight: llama.cpp and transformers use token_embd for the head
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        parts = family.gguf_parts(hf_name, tensor.detach().to("cpu", dtype=torch.float32).numpy(), shape, names)
        if not parts:
            raise ExportError(f"weight {hf_name} has no GGUF name for the {family.gguf_arch} architecture")
        for name, array in parts:
            head = name == "output.weight" or (tied and name == "token_embd.weight")
            qtype = _tensor_type(gguf_type, array, name, head)
            out.append((name, _encode(array, qtype), qtype, hf_name, tuple(array.shape)))
    return out


# ----------------------------------------------------------------------------------------------
# Tokenizer


def pre_tokenizer_name(tokenizer_json: dict, where: Path) -> str:
    """llama.cpp's name for the pre-tokenizer of a byte-level BPE tokenizer.json, recognised by its structure
    (llama.cpp hashes a sample's encoding; the four here are the ones finetune's model families ship)."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    types = [p.get("type") for p in parts]
    if types == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if types == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and parts[1].get("use_regex", True):
        return "smollm"
    if types == ["Split", "ByteLevel"] and not parts[1].get("use_regex", True):
        if parts[0].get("pattern", {}).get("Regex") == LLAMA3_SPLIT:
            return "llama-bpe"
        if parts[0].get("pattern", {}).get("Regex") == QWEN2_SPLIT:
            return "qwen2"
    raise ExportError(
        f"{where}/tokenizer.json: pre-tokenizer {json.dumps(pre)[:160]} is not one finetune can name for llama.cpp "
        "(known: GPT-2 byte-level, SmolLM digits + byte-level, Llama-3 split, Qwen2 split)"
    )


def _pre_parts(tj: dict) -> list[dict]:
    pre = tj.get("pre_tokenizer") or {}
    return list(pre.get("pretokenizers", [])) if pre.get("type") == "Sequence" else [pre]


def sentencepiece_space_prefix(tj: dict, where: Path) -> bool:
    """Whether a SentencePiece-style tokenizer.json puts "\u2581" before the text (llama.cpp's add_space_prefix):
    the legacy normalizer (Prepend "\u2581", Replace " ") or a Metaspace pre-tokenizer."""
    norm = tj.get("normalizer") or {}
    norms = norm.get("normalizers", []) if norm.get("type") == "Sequence" else ([norm] if norm else [])
    kinds = [n.get("type") for n in norms]
    parts = [p for p in _pre_parts(tj) if p]
    if kinds == ["Prepend", "Replace"] and norms[0].get("prepend") == "\u2581" and not parts:
        return True
    if kinds == ["Replace"] and not parts:
        return False
    # Gemma's (as transformers 5 builds it): the Replace normalizer, then a split on " " that finds none (the
    # normalizer has made every space "\u2581"): no prefix, as llama.cpp's Gemma files say.
    if (kinds == ["Replace"] and norms[0].get("content") == "\u2581" and len(parts) == 1
            and parts[0].get("type") == "Split" and parts[0].get("pattern") == {"String": " "}):
        return False
    if not norms and [p.get("type") for p in parts] == ["Metaspace"] and parts[0].get("replacement") == "\u2581":
        scheme = parts[0].get("prepend_scheme", "always" if parts[0].get("add_prefix_space", True) else "never")
        if scheme in ("always", "never"):
            return scheme == "always"
    raise ExportError(
        f"{where}/tokenizer.json: a SentencePiece-style vocabulary whose normalizer {json.dumps(norm)[:120]} and "
        f"pre-tokenizer {json.dumps(tj.get('pre_tokenizer'))[:120]} finetune cannot express for llama.cpp "
        "(known: Llama-2/Mistral's Prepend + Replace normalizer, or a Metaspace pre-tokenizer prepending always or never)"
    )


def load_tokenizer(model_dir: Path):
    """(HF tokenizer, its backend as tokenizer.json data): what the tokenizer does once transformers built it
    (transformers 5 rebuilds a LlamaTokenizer's pre-tokenizer from tokenizer_config.json, not from the file)."""
    from transformers import AutoTokenizer

    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer.model").is_file():
        raise ExportError(f"{model_dir}: no tokenizer.json (or tokenizer.model); the GGUF file needs the tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        return tokenizer, json.loads(tokenizer.backend_tokenizer.to_str())
    except Exception as e:  # a slow-only tokenizer, or a tokenizer.model without sentencepiece installed
        raise ExportError(f"{model_dir}: no fast tokenizer could be built ({type(e).__name__}: {e}); "
                          "finetune's GGUF export reads the tokenizer.json form") from None


def check_tokenizer(model_dir: Path, tj: dict) -> tuple[str, str | bool]:
    """("gpt2", pre-tokenizer name) for a byte-level BPE tokenizer, ("llama", add_space_prefix) for a
    SentencePiece-style one (BPE with byte fallback over "\u2581"-spelled pieces, as Llama-2 and Mistral ship);
    ExportError for a vocabulary finetune cannot write."""
    model = tj.get("model") or {}
    byte_level = any(p.get("type") == "ByteLevel" for p in _pre_parts(tj))
    if model.get("type") == "BPE" and byte_level:
        return "gpt2", pre_tokenizer_name(tj, model_dir)
    if model.get("type") == "BPE" and model.get("byte_fallback") and not byte_level:
        return "llama", sentencepiece_space_prefix(tj, model_dir)
    raise ExportError(
        f"{model_dir}/tokenizer.json: a {model.get('type')!r} vocabulary"
        + (" without byte fallback" if model.get("type") == "BPE" else "")
        + "; finetune's GGUF export writes byte-level BPE (\"gpt2\") and SentencePiece-style BPE with byte fallback "
        "(\"llama\") vocabularies"
    )


def sentencepiece_scores(tj: dict, vocab_size: int) -> list[float]:
    """One score per id, as llama.cpp's SentencePiece tokenizer reads them: it merges the adjacent pair whose joined
    text is the best-scored token. A token's score is minus the rank of the first merge that makes it, so it merges
    in tokenizer.json's order; tokens no merge makes (characters, bytes, control tokens) score 0 (characters) or
    below every merge, so they are never preferred."""
    vocab = tj["model"]["vocab"]
    merges = tj["model"].get("merges") or []
    scores = [0.0] * vocab_size
    made: dict[str, int] = {}
    for rank, merge in enumerate(merges):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        made.setdefault(left + right, rank)
    floor = -float(len(merges) + 1)
    for token, i in vocab.items():
        if i < vocab_size:
            scores[i] = -float(made[token]) if token in made else (0.0 if len(token) == 1 else floor)
    return scores


def looks_special(token: str) -> bool:
    """An added token llama.cpp's converter writes as a control token though the tokenizer does not mark it special
    (its TextModel.does_token_look_special, for BPE vocabularies): <|...|> (Qwen's <|fim_prefix|>, ...), <｜...｜>,
    <unused...>, and a few names."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or token.startswith("<|") and token.endswith("|>")
            or token.startswith("<\uff5c") and token.endswith("\uff5c>") or token.startswith("<unused") and token.endswith(">"))


def add_tokenizer(writer, model_dir: Path, vocab_size: int, tokenizer, tj: dict) -> dict:
    """Write the vocabulary (BPE: merges; SentencePiece: scores), special ids and chat template; return what the
    Modelfile needs."""
    import re

    import gguf

    kind, detail = check_tokenizer(model_dir, tj)
    vocab = tokenizer.get_vocab()
    if len(vocab) > vocab_size:
        raise ExportError(f"{model_dir}: the tokenizer has {len(vocab)} tokens but the model only {vocab_size} embeddings")
    reverse = {i: t for t, i in vocab.items()}
    added = tokenizer.added_tokens_decoder
    byte_token = re.compile(r"<0x[0-9A-Fa-f]{2}>")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif kind == "llama" and i == tokenizer.unk_token_id:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.UNKNOWN)
        elif i in added:
            tokens.append(added[i].content)
            control = added[i].special or kind == "gpt2" and looks_special(added[i].content)
            types.append(gguf.TokenType.CONTROL if control else gguf.TokenType.USER_DEFINED)
        elif kind == "llama" and byte_token.fullmatch(reverse[i]):
            tokens.append(reverse[i])
            types.append(gguf.TokenType.BYTE)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model(kind)
    if kind == "gpt2":
        writer.add_tokenizer_pre(detail)
    else:
        writer.add_tokenizer_pre("default")
        writer.add_add_space_prefix(detail)
        writer.add_token_scores(sentencepiece_scores(tj, vocab_size))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # SentencePiece files carry scores, not merges (as llama.cpp's converter writes them; its tokenizer reads scores).
    special = gguf.SpecialVocab(model_dir, load_merges=kind == "gpt2", n_vocab=vocab_size)
    if kind == "gpt2" and not special.merges:
        raise ExportError(f"{model_dir}/tokenizer.json: no merges in the BPE model")
    if special.chat_template is None and getattr(tokenizer, "chat_template", None):
        special.chat_template = tokenizer.chat_template
    special.add_to_gguf(writer, quiet=True)
    return {"tokenizer": tokenizer, "kind": kind, "chat_template": special.chat_template}


# ----------------------------------------------------------------------------------------------
# Ollama Modelfile


OLLAMA_CHATML = (
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"
)
OLLAMA_LLAMA3 = (
    "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>\n"
    "{{- end }}<|start_header_id|>assistant<|end_header_id|>\n\n"
)
# Mistral-7B-Instruct's [INST] format (its template refuses a system turn); EOS is the tokenizer's end of sequence.
OLLAMA_MISTRAL = (
    '{{- range .Messages }}{{- if eq .Role "user" }}[INST] {{ .Content }} [/INST]'
    '{{- else if eq .Role "assistant" }}{{ .Content }}EOS{{- end }}{{- end }}'
)
# Gemma's turns (its template folds a system turn into the first user turn; the model's turn is "model").
OLLAMA_GEMMA = (
    '{{- $system := "" }}{{- range .Messages }}{{ if eq .Role "system" }}{{ $system = .Content }}'
    '{{ else if eq .Role "user" }}<start_of_turn>user\n{{ if $system }}{{ $system }}\n\n{{ $system = "" }}{{ end }}'
    '{{ .Content }}<end_of_turn>\n{{ else if eq .Role "assistant" }}<start_of_turn>model\n{{ .Content }}<end_of_turn>\n'
    '{{ end }}{{ end }}<start_of_turn>model\n'
)
# Phi-3's turns: <|role|> lines ended by <|end|>.
OLLAMA_PHI3 = "{{- range .Messages }}<|{{ .Role }}|>\n{{ .Content }}<|end|>\n{{ end }}<|assistant|>\n"
PROBE = [{"role": "system", "content": "S1"}, {"role": "user", "content": "U1"},
         {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}]


def chat_style(tokenizer) -> tuple[str | None, str | None]:
    """('chatml' | 'llama3' | 'mistral' | 'gemma' | 'phi3' | None, default system prompt or None), by rendering the template on a probe
    conversation and comparing it with what each style writes."""
    if not getattr(tokenizer, "chat_template", None):
        return None, None
    render = lambda msgs: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)  # noqa: E731
    try:
        text = render(PROBE)
        bare = render(PROBE[1:])
    except Exception:  # a template that refuses a system turn (Mistral's raises) or fails on the probe otherwise
        try:
            text = render(PROBE[1:])
        except Exception:
            return None, None
        bos = tokenizer.bos_token or ""
        mistral = f"[INST] U1 [/INST]A1{tokenizer.eos_token}[INST] U2 [/INST]"
        gemma = ("<start_of_turn>user\nU1<end_of_turn>\n<start_of_turn>model\nA1<end_of_turn>\n"
                 "<start_of_turn>user\nU2<end_of_turn>\n<start_of_turn>model\n")  # Gemma-2's refuses a system turn
        if text in (gemma, bos + gemma):
            return "gemma", None
        return ("mistral", None) if text in (mistral, bos + mistral) else (None, None)
    chatml = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in PROBE) + "<|im_start|>assistant\n"
    llama3 = "".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>" for m in PROBE)
    llama3 += "<|start_header_id|>assistant<|end_header_id|>\n\n"
    bos = tokenizer.bos_token or ""
    gemma = ("<start_of_turn>user\nS1\n\nU1<end_of_turn>\n<start_of_turn>model\nA1<end_of_turn>\n"
             "<start_of_turn>user\nU2<end_of_turn>\n<start_of_turn>model\n")
    phi3 = "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in PROBE) + "<|assistant|>\n"
    if text in (gemma, bos + gemma):
        return "gemma", None
    if text in (phi3, bos + phi3):
        return "phi3", None
    if text == chatml:
        style, head, tail = "chatml", "<|im_start|>system\n", "<|im_end|>\n"
    elif text in (llama3, bos + llama3):
        style, head, tail = "llama3", "<|start_header_id|>system<|end_header_id|>\n\n", "<|eot_id|>"
        bare = bare[len(bos):] if bos and bare.startswith(bos) else bare
    else:
        return None, None
    # A template that adds a system turn when the conversation has none (SmolLM2): the Modelfile's SYSTEM.
    system = None
    if bare.startswith(head):
        system = bare[len(head):bare.index(tail)]
    return style, system


def modelfile_text(gguf_name: str, tokenizer, styles: tuple[str, ...]) -> tuple[str, str | None]:
    """The Modelfile's text and the chat style its TEMPLATE is for (STYLES: those the model's family ships)."""
    style, system = chat_style(tokenizer)
    lines = [f"FROM ./{gguf_name}"]
    if style not in styles:
        return "\n".join(lines) + "\n", None
    template = {"chatml": OLLAMA_CHATML, "llama3": OLLAMA_LLAMA3, "gemma": OLLAMA_GEMMA, "phi3": OLLAMA_PHI3,
                "mistral": OLLAMA_MISTRAL.replace("EOS", tokenizer.eos_token or "")}[style]
    lines.append(f'TEMPLATE """{template}"""')
    if system:
        lines.append(f'SYSTEM """{system}"""')
    vocab = tokenizer.get_vocab()
    # The end-of-turn tokens; Mistral's turns end in EOS (a stop of its own in llama.cpp), and Ollama also stops on
    # the text of a next turn, as its own mistral Modelfile does.
    stops = {"chatml": ["<|im_end|>"], "llama3": ["<|eot_id|>", "<|end_of_text|>"], "gemma": ["<end_of_turn>"],
             "phi3": ["<|end|>", "<|endoftext|>"]}.get(style, [])
    lines += [f'PARAMETER stop "{s}"' for s in stops if s in vocab]
    if style == "mistral":
        lines += ['PARAMETER stop "[INST]"', 'PARAMETER stop "[/INST]"']
    return "\n".join(lines) + "\n", style


# ----------------------------------------------------------------------------------------------
# Writing and verifying


FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
              "q4_0": "MOSTLY_Q4_0", "q4_1": "MOSTLY_Q4_1", "q5_0": "MOSTLY_Q5_0", "q5_1": "MOSTLY_Q5_1"}


def write_gguf(model, model_dir: Path, path: Path, gguf_type: str, name: str, tokenizer=None) -> tuple[list, dict]:
    """Write MODEL (its tokenizer from MODEL_DIR, or the (tokenizer, tokenizer.json data) given) to PATH, unverified:
    the causal LM its family's gguf_model gives (a multimodal checkpoint's language model)."""
    import gguf

    tokenizer, tj = tokenizer or load_tokenizer(model_dir)

    model, _ = lm_family(model).gguf_model(model)
    config = model.config
    family = lm_family(model)
    writer = gguf.GGUFWriter(str(path), family.gguf_arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    for adder, value in family.gguf_metadata(config):
        getattr(writer, adder)(value)
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[gguf_type]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    try:
        tok = add_tokenizer(writer, model_dir, config.vocab_size, tokenizer, tj)
        tensors = gguf_tensors(model, gguf_type)
        plain = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)  # numpy dtype says it
        for tensor_name, data, qtype, *_ in tensors:
            writer.add_tensor(tensor_name, data, raw_dtype=None if qtype in plain else qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return tensors, tok


def write_unverified(model, model_dir: Path, path: Path, gguf_type: str, name: str, tokenizer=None) -> tuple[list, dict]:
    """MODEL as a GGUF file of any --gguf_type at PATH, unverified: (its tensors as stored, the tokenizer's part).
    The gguf package writes the plain types; a K-quant preset is llama.cpp's quantization of the f32 file."""
    if gguf_type not in LLAMACPP_TYPES:
        return write_gguf(model, model_dir, path, gguf_type, name, tokenizer)
    f32 = path.with_name(path.name + ".f32")  # beside PATH, in the output folder: removed whatever happens
    try:
        written, tok = write_gguf(model, model_dir, f32, "f32", name, tokenizer)
        gguf_kquant.quantize(f32, path, gguf_type)
    finally:
        f32.unlink(missing_ok=True)
    return gguf_kquant.read_back(path, model, gguf_type, written), tok


def tensor_types(tensors: list) -> dict[str, int]:
    """{GGML type name: number of tensors}: what a file's tensors are stored as."""
    counts: dict[str, int] = {}
    for _, _, qtype, *_ in tensors:
        counts[qtype.name] = counts.get(qtype.name, 0) + 1
    return dict(sorted(counts.items()))


def verify_gguf(path: Path, model, tokenizer, tensors: list, gguf_type: str, source=None) -> tuple[float, float, float]:
    """(max logit diff, its bound, max weight diff) of the file as transformers loads it; raise on a mismatch. The
    logits are compared with SOURCE's (the checkpoint MODEL was taken from by its family's gguf_model), else MODEL's."""
    import torch

    from finetune.convert.gguf_import import load_gguf

    try:
        loaded, gguf_tok = load_gguf(path)
    except Exception as e:
        raise VerificationError(f"transformers cannot load the written GGUF file: {type(e).__name__}: {e}") from None
    state = loaded.state_dict()
    # Every weight must be exactly what we meant to store (the HF weight rounded to the file's type): this is what
    # proves the Q/K permutation and the name mapping, whatever the type.
    weight_diff = 0.0
    hf_state = model.state_dict()
    family = lm_family(model)
    shape = family.shape(model.config.to_dict())
    stored: dict[str, list] = {}
    for name, data, qtype, hf_name, part_shape in tensors:
        stored.setdefault(hf_name, []).append((name, torch.from_numpy(_decode(data, qtype, part_shape))))
    for hf_name, parts in stored.items():
        name = "+".join(n for n, _ in parts)
        expected = family.from_gguf_parts(hf_name, [a for _, a in parts], shape)
        got = state.get(hf_name)
        if got is None or got.shape != expected.shape:
            raise VerificationError(f"{name} does not load back as {hf_name} {tuple(expected.shape)}")
        weight_diff = max(weight_diff, (got.float() - expected).abs().max().item())
    if weight_diff != 0.0:
        raise VerificationError(f"weights load back changed by {weight_diff:.3g} (must be exact)")
    ids = fixed_input(model.config.vocab_size)
    ref = logits_of(model if source is None else source, ids)
    got = logits_of(loaded, ids)
    diff = (got - ref).abs().max().item()
    bound = LOGIT_BOUNDS[gguf_type] * (1.0 if gguf_type == "f32" else ref.abs().max().item())
    if not diff <= bound:
        raise VerificationError(f"GGUF-loaded logits differ from the HF model's by {diff:.3g} (limit {bound:.3g} for {gguf_type})")
    sample = "Hello world! 123 45678 the quick brown fox\n  jumped <|im_end|> äöü 日本 🦙"
    if gguf_tok(sample)["input_ids"] != tokenizer(sample)["input_ids"]:
        raise VerificationError("the GGUF tokenizer (as transformers builds it) encodes a sample differently from the HF one")
    weight_diff_vs_hf = max((state[hf].float() - hf_state[hf].float()).abs().max().item() for hf in stored)
    return diff, bound, weight_diff_vs_hf


def processor_settings(model_dir: Path) -> dict:
    """The image processor's settings as llama.cpp's converter reads them: preprocessor_config.json, then
    processor_config.json with its image_processor's keys at the top level."""
    settings: dict = {}
    if (model_dir / "preprocessor_config.json").is_file():
        settings.update(json.loads((model_dir / "preprocessor_config.json").read_text()))
    if (model_dir / "processor_config.json").is_file():
        cfg = json.loads((model_dir / "processor_config.json").read_text())
        settings.update({**cfg, **(cfg.get("image_processor") or {})})
    return settings


def write_mmproj(family, model_dir: Path, path: Path, name: str, f16: bool) -> list[tuple[str, object, str]]:
    """The vision tower and projector of MODEL_DIR as llama.cpp's mmproj file at PATH (f16 or f32), from the
    checkpoint's safetensors as llama.cpp's converter reads them: the family's tensors (MmprojTower) under the gguf
    package's MMPROJ names, typed by the converter's rules. [(GGUF name, stored array, checkpoint name)]."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    preprocessor = processor_settings(model_dir)
    if "image_mean" not in preprocessor:
        raise ExportError(f"{model_dir}: no image processor settings (processor_config.json or "
                          "preprocessor_config.json): the mmproj file needs its image mean and std")
    # At least 3 blocks: the table numbers a projector's layers as blocks too (Qwen2.5-VL's merger.mlp.2 is mm.2).
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ,
                                     max(3, int(family.mmproj_vision(config)["num_hidden_layers"])))
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_name(name)
    for adder, value in family.mmproj_metadata(config, preprocessor, f16):
        getattr(writer, adder)(value)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    position = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_ENC_EMBD_POS]
    written = []
    try:
        for file in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                for key in f.keys():
                    source = family.mmproj_source(key)
                    if source is None:
                        continue
                    for part, array in family.mmproj_parts(source, f.get_tensor(key).float().numpy()):
                        gguf_name = table.get_name(part, try_suffixes=(".weight", ".bias"))
                        stem, _, number = part.rpartition(".")
                        if gguf_name is None and number.isdigit():  # a tensor's numbered part (".weight.1")
                            gguf_name = table.get_name(stem, try_suffixes=(".weight", ".bias"))
                            gguf_name = gguf_name and f"{gguf_name}.{number}"
                        if gguf_name is None:
                            raise ExportError(f"{file}: {key} has no name in llama.cpp's mmproj table (as {part})")
                        force = family.mmproj_force(source, gguf_name, f16)
                        if array.ndim <= 1 or gguf_name.endswith("_norm.weight"):
                            kind = "F32"
                        elif force:
                            kind = force
                        elif gguf_name.startswith(position) or not gguf_name.endswith(".weight"):
                            kind = "F32"
                        else:
                            kind = "F16" if f16 else "F32"
                        data = np.ascontiguousarray(array, dtype=np.float16 if kind == "F16" else np.float32)
                        writer.add_tensor(gguf_name, data)
                        written.append((gguf_name, data, key))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return written


def verify_mmproj(path: Path, written: list, family, source_model) -> int:
    """Read the mmproj file back with the gguf package: a "clip" file of type mmproj with the family's projector,
    every tensor under its name with its shape, type and values as written, and as many values as the model's vision
    tower and projector hold (nothing left out). The number of tensors."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(path))
    fields = {f.name: f for f in reader.fields.values()}

    def text(key: str) -> str | None:
        field = fields.get(key)
        return None if field is None else bytes(field.parts[field.data[0]]).decode()

    kinds = (text("general.architecture"), text("general.type"), text("clip.projector_type"))
    if kinds != ("clip", "mmproj", family.projector):
        raise VerificationError(f"{path}: architecture, type and projector {kinds}, expected "
                                f"('clip', 'mmproj', '{family.projector}')")
    stored = {t.name: t for t in reader.tensors}
    if sorted(stored) != sorted(n for n, _, _ in written):
        raise VerificationError(f"{path}: holds {len(stored)} tensors, {len(written)} were written")
    for gguf_name, data, key in written:
        t = stored[gguf_name]
        got = np.asarray(t.data).reshape(tuple(reversed(t.shape.tolist())))
        want_type = gguf.GGMLQuantizationType.F16 if data.dtype == np.float16 else gguf.GGMLQuantizationType.F32
        if t.tensor_type != want_type or got.shape != data.shape or not np.array_equal(got, data):
            raise VerificationError(f"{path}: {gguf_name} ({key}) does not read back as written")
    prefixes = family.vision_prefixes(source_model.config)
    tower = sum(p.numel() for n, p in source_model.named_parameters()
                if any(n == q or n.startswith(q + ".") for q in prefixes))
    if tower != sum(int(d.size) for _, d, _ in written):
        raise VerificationError(f"{path}: holds {sum(int(d.size) for _, d, _ in written):,} values, the vision tower "
                                f"and projector {tower:,}")
    return len(written)


def check_output(output: Path, overwrite: bool) -> None:
    if output.suffix != ".gguf":
        raise ExportError(f"{output}: a GGUF output file name must end in .gguf")
    if output.exists() and not overwrite:
        raise ExportError(f"{output} already exists; pass --overwrite to replace it")
    if output.is_dir():
        raise ExportError(f"{output} is a folder; give a file name ending in .gguf")


def write_folder(model_dir: str | Path, output: str | Path, *, gguf_type: str = "f32", overwrite: bool = False,
                 modelfile: bool = True) -> GGUFReport:
    """Write, verify and rename into place MODEL_DIR as OUTPUT (.gguf), with an Ollama Modelfile beside it."""
    import torch
    from transformers import AutoConfig

    from finetune.models.families.vision import MmprojTower
    from finetune.models.load import WeightsError, check_loading_info, model_class

    start = time.perf_counter()
    model_dir, output = Path(model_dir), Path(output).absolute()
    if problem := gguf_type_problem(gguf_type):
        raise ExportError(problem)
    gguf_type = gguf_type_name(gguf_type)
    if not (model_dir / "config.json").is_file():
        raise ExportError(f"{model_dir}: no config.json (not a model folder)")
    check_output(output, overwrite)
    config = AutoConfig.from_pretrained(str(model_dir))
    family = _writable_family(config, model_dir)
    tokenizer = load_tokenizer(model_dir)
    check_tokenizer(model_dir, tokenizer[1])
    model, info = model_class(config).from_pretrained(str(model_dir), dtype=torch.float32, output_loading_info=True)
    try:  # weights from_pretrained did not find would be written as random values, and verified against themselves
        check_loading_info(info, model_dir, flag="finetune export")
    except WeightsError as e:
        raise ExportError(str(e)) from None
    model.eval()
    source = model
    model, left_out = family.gguf_model(source)
    if left_out:
        log(f"{model_dir}: {left_out}")
    made_parent = not output.parent.exists()
    output.parent.mkdir(parents=True, exist_ok=True)
    done = False
    tmp = output.parent / f".{output.stem}.partial-{os.getpid()}.gguf"
    mf_tmp = output.parent / f".Modelfile.partial-{os.getpid()}"
    # A vision tower llama.cpp's multimodal tool reads: its mmproj file beside the language model's (f16 unless the
    # language model is f32, as llama.cpp's converter is usually run for it).
    mmproj = output.parent / f"mmproj-{output.name}" if isinstance(family, MmprojTower) else None
    if mmproj is not None and "image_mean" not in processor_settings(model_dir):
        log(f"no mmproj file: {model_dir} holds no image processor settings (processor_config.json or "
            "preprocessor_config.json); copy the processor files of the model it was trained from to write one")
        mmproj = None
    mm_tmp = output.parent / f".mmproj-{output.stem}.partial-{os.getpid()}.gguf"
    try:
        tensors, tok = write_unverified(model, model_dir, tmp, gguf_type, output.stem, tokenizer)
        logit_diff, bound, weight_diff = GGUF().verify(tmp, model, tokenizer=tok["tokenizer"], tensors=tensors,
                                                       gguf_type=gguf_type, source=source)
        if mmproj is not None:
            if mmproj.exists() and not overwrite:
                raise ExportError(f"{mmproj} already exists; pass --overwrite to replace it")
            f16 = gguf_type != "f32"
            written = write_mmproj(family, model_dir, mm_tmp, f"mmproj-{output.stem}", f16)
            count = verify_mmproj(mm_tmp, written, family, source)
        style = None
        if modelfile:
            text, style = modelfile_text(output.name, tok["tokenizer"], family.chat_templates)
            mf_tmp.write_text(text)
        os.replace(tmp, output)
        if mmproj is not None:
            os.replace(mm_tmp, mmproj)
            log(f"wrote {mmproj}: the vision tower and projector for llama.cpp's multimodal tool (projector "
                f"{family.projector}, {count} tensors, {'f16' if f16 else 'f32'}), read back as written")
        if modelfile:
            os.replace(mf_tmp, output.parent / "Modelfile")
        done = True
    finally:
        tmp.unlink(missing_ok=True)
        mm_tmp.unlink(missing_ok=True)
        mf_tmp.unlink(missing_ok=True)
        if made_parent and not done and not any(output.parent.iterdir()):
            output.parent.rmdir()
    report = GGUFReport(str(output), gguf_type, output.stat().st_size, logit_diff, bound, weight_diff,
                        time.perf_counter() - start, tensor_types(tensors))
    log(str(report))
    if modelfile:
        log(f"wrote {output.parent / 'Modelfile'}"
            + (f" (TEMPLATE for the {style} chat format)" if style else
               " without TEMPLATE: the chat template is not one of the family's formats (ChatML, Llama-3, Mistral [INST], "
                 "Gemma, Phi-3); write one by hand"))
    return report


def write_source(args: ExportArgs, gguf_type: str) -> GGUFReport:
    """The export's source (a model folder as it is; an adapter merged or a ZeRO checkpoint consolidated into a
    temporary HF folder first) written as a verified GGUF file at args.output_dir."""
    output = Path(args.output_dir).absolute()
    check_output(output, args.overwrite)
    with hf_folder(args, near=output) as folder:
        return write_folder(folder, output, gguf_type=gguf_type, overwrite=args.overwrite)


# ----------------------------------------------------------------------------------------------
# The export type


@dataclass
class GGUFFlags:
    """With --to gguf"""

    gguf_type: str = field(default="f32", metadata={"help": (
        "Tensor type: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0 or q5_1 (the gguf package's; norms stay f32, the 4/5-bit "
        "types keep the output head in q8_0), or llama.cpp's presets q4_K_M, q5_K_M, q6_K (made by llama.cpp's "
        f"quantizer: {gguf_kquant.INSTALL}).")})


class GGUF(Writer):
    name = "gguf"
    summary = "one file for llama.cpp and Ollama, with a Modelfile beside it"
    flags = GGUFFlags
    sources = ("model", "adapter", "zero_checkpoint")
    suffix = ".gguf"

    def check(self, args: ExportArgs, flags: GGUFFlags) -> list[str]:
        problems = []
        if problem := gguf_type_problem(flags.gguf_type):
            problems.append(problem)
        if args.torch_dtype != "float32":
            problems.append("--torch_dtype: goes with --to hf; with --to gguf the tensor type is --gguf_type")
        out = args.output or args.output_dir
        if out and not out.endswith(self.suffix):
            problems.append(f"OUTPUT: '{out}' must be a file name ending in {self.suffix} (with --to gguf)")
        return problems

    def write(self, args: ExportArgs, flags: GGUFFlags) -> Path:
        write_source(args, flags.gguf_type)
        return Path(args.output_dir)

    def verify(self, written: Path, reference, *, tokenizer, tensors: list, gguf_type: str,
               source=None) -> tuple[float, float, float]:
        """The file as transformers loads it: its weights exactly the stored ones, its logits within the type's
        bound of REFERENCE's (or SOURCE's, the checkpoint REFERENCE is the language model of), its tokenizer
        encoding as the HF one (verify_gguf)."""
        return verify_gguf(written, reference, tokenizer, tensors, gguf_type, source)
