"""llama.cpp's K-quant presets for `--to gguf` (q4_K_M, q5_K_M, q6_K), made by llama.cpp's own quantizer
(`llama_model_quantize` of llama-cpp-python, the optional extra `finetune[llamacpp]`): gguf.py writes the model as an
f32 GGUF file with the gguf package, llama.cpp quantizes it into a staging file, and gguf.py verifies that file like
any other before it is renamed into place. Here: the presets, the quantizer call and
the per-tensor types the preset must have given (what the verification reads back).

The gguf package only dequantizes K-quants (transformers reads them through it), so without llama-cpp-python these
types are refused in one line that says how to get it (`refusal`).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
from pathlib import Path

from finetune.convert.messages import ExportError

# --gguf_type -> (llama_ftype, the preset's base GGML type name): llama.h's LLAMA_FTYPE_MOSTLY_Q4_K_M = 15,
# Q5_K_M = 17, Q6_K = 18; llama_ftype_get_default_type maps them to Q4_K, Q5_K, Q6_K.
PRESETS = {"q4_K_M": (15, "Q4_K"), "q5_K_M": (17, "Q5_K"), "q6_K": (18, "Q6_K")}
INSTALL = "pip install 'finetune[llamacpp]'"


def available() -> bool:
    """Whether llama-cpp-python is installed (found without importing it: that loads llama.cpp's libraries)."""
    return importlib.util.find_spec("llama_cpp") is not None


def refusal(name: str, plain_types: tuple[str, ...]) -> str | None:
    """The one-line refusal of preset NAME where llama-cpp-python is missing, or None where it is installed."""
    if available():
        return None
    return (f"--gguf_type {name}: made by llama.cpp's quantizer, from llama-cpp-python, which is not installed: "
            f"{INSTALL} (builds llama.cpp from source, minutes), or pick a type finetune writes without it "
            f"({', '.join(plain_types)})")


def quantize(src: Path, dst: Path, gguf_type: str, threads: int | None = None) -> None:
    """llama.cpp's quantizer: the f32 GGUF file SRC -> DST in preset GGUF_TYPE (llama-quantize SRC DST TYPE)."""
    import logging

    import llama_cpp

    # llama-cpp-python prints llama.cpp's log at or above its logger's level: a line per tensor, and a warning per
    # fallback (which read_back checks); its errors (why a quantization failed) still print.
    logger = logging.getLogger("llama-cpp-python")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = PRESETS[gguf_type][0]
        params.nthread = threads or len(os.sched_getaffinity(0))
        failed = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    finally:
        logger.setLevel(level)
    if failed:  # llama.cpp printed its reason on stderr (an exception it caught inside llama_model_quantize)
        raise ExportError(f"llama.cpp's quantizer failed to write {gguf_type} from {src.name} (its message is above)")


def _block(type_name: str) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]


def _more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third one between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


# The tensors whose preset type expected_type models: Llama's dense layout. llama.cpp has rules of its own for the
# others (a fused attn_qkv, stacked experts *_exps): their type is the quantizer's, checked through the weights and
# logits the file loads back to.
MODELLED = re.compile(r"(token_embd|output|blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down))"
                      r"\.weight$")


def expected_type(gguf_type: str, name: str, shape: tuple[int, ...], stored: str, n_layers: int,
                  tied: bool) -> str | None:
    """The GGML type llama.cpp's preset GGUF_TYPE gives tensor NAME (numpy SHAPE, rows last; STORED: its type in
    the f32 source) of a dense model with N_LAYERS layers (llama_tensor_get_type in llama.cpp's src/llama-quant.cpp,
    for the architectures finetune writes: no experts, not a 70B):

    - not quantized: 1-D tensors, norms, anything not named *weight, a MoE router (ffn_gate_inp): as stored;
    - the output head (output.weight, or token_embd when the embeddings are tied): Q6_K, or Q8_0 when its rows are
      not a multiple of 256;
    - attn_v and ffn_down under q4_K_M / q5_K_M: Q6_K in the layers use_more_bits picks, the base type elsewhere;
    - everything else: the preset's base type (Q4_K, Q5_K, Q6_K);
    - a row length the type's block does not divide falls back: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, and F16
      when even that block does not divide it;
    - None for a tensor outside MODELLED."""
    base = PRESETS[gguf_type][1]
    cols = shape[-1]
    if len(shape) < 2 or not name.endswith("weight") or "_norm.weight" in name or "ffn_gate_inp.weight" in name:
        return stored
    if not MODELLED.match(name):
        return None
    layer = re.match(r"blk\.(\d+)\.", name)
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        new = "Q8_0" if cols % _block(base) else "Q6_K"
    elif layer and name.endswith((".attn_v.weight", ".ffn_down.weight")) and gguf_type != "q6_K" \
            and _more_bits(int(layer.group(1)), n_layers):
        new = "Q6_K"
    else:
        new = base
    if cols % _block(new):
        new = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}.get(new, new)
        if cols % _block(new):
            new = "F16"
    return new


def read_back(path: Path, model, gguf_type: str, written: list) -> list:
    """[(gguf name, stored data, qtype, HF name, shape)] of the file llama.cpp wrote (the form gguf.py's verify_gguf
    checks), after checking its file type, that it holds the tensors of the f32 file it quantized (WRITTEN: that
    file's list, in the same form) and that every tensor expected_type models is stored in the type the preset gives
    it; VerificationError names the first that is not."""
    from gguf import GGUFReader

    from finetune.models import families
    from finetune.models.verify import VerificationError

    shape = families.family_of(model.config).shape(model.config.to_dict())
    parts = {name: (hf_name, part_shape) for name, _, _, hf_name, part_shape in written}
    reader = GGUFReader(str(path))
    file_type = int(reader.fields["general.file_type"].contents())
    if file_type != PRESETS[gguf_type][0]:
        raise VerificationError(f"llama.cpp wrote file type {file_type}, not {PRESETS[gguf_type][0]} ({gguf_type})")
    tied = "output.weight" not in {t.name for t in reader.tensors}
    out = []
    for t in reader.tensors:
        numpy_shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        want = expected_type(gguf_type, t.name, numpy_shape, "F32", shape.num_layers, tied)
        if want is not None and t.tensor_type.name != want:
            raise VerificationError(f"{t.name} {numpy_shape} is stored as {t.tensor_type.name}; llama.cpp's "
                                    f"{gguf_type} preset gives it {want}")
        if t.name not in parts or parts[t.name][1] != numpy_shape:
            raise VerificationError(f"llama.cpp wrote a tensor {t.name} {numpy_shape} the f32 file does not hold")
        out.append((t.name, t.data, t.tensor_type, *parts[t.name]))
    if len(out) != len(parts):
        missing = sorted(set(parts) - {name for name, *_ in out})
        raise VerificationError(f"llama.cpp's file lacks {', '.join(missing[:3])}")
    return out

