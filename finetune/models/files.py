"""A model folder's files, checked before anything loads: each problem names the file and the fix, where
transformers would otherwise stop deep inside a load with a traceback (or, for a missing tokenizer, suggest
installing sentencepiece)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

# Any one of these is a tokenizer's vocabulary (fast tokenizer, SentencePiece, BPE/WordPiece, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.tiktoken")
# JSON files that transformers reads while loading a model or tokenizer.
JSON_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json",
              "generation_config.json", "model.safetensors.index.json", "adapter_config.json")


def read_json(path: Path) -> tuple[object, str | None]:
    """(the parsed JSON, None) or (None, a problem naming the file, line and what is wrong)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        return None, f"{path}: not UTF-8 text (byte {e.start}); it is damaged or not this file: replace it"
    except OSError as e:
        return None, f"{path}: cannot be read ({e.strerror})"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, (f"{path}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno}); restore the file from the "
                      "model's source (it was cut off or edited by hand)")


def safetensors_problem(path: Path) -> str | None:
    """Why `path` is not a whole safetensors file (empty, cut off, header unreadable), or None. Reads the header
    only: 8 bytes of header length, the JSON header, then the tensors, whose last byte must end the file."""
    size = path.stat().st_size
    fix = "copy it again from the model's source"
    if size < 8:
        return f"{path}: {'empty' if size == 0 else 'cut off'} ({size} bytes), not a safetensors file; {fix}"
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            return f"{path}: cut off ({size} bytes, shorter than its own header of {n}); {fix}"
        try:
            header = json.loads(f.read(n))
            end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return f"{path}: the safetensors header is unreadable (the file is damaged or not safetensors); {fix}"
    if 8 + n + end != size:
        return (f"{path}: cut off or padded ({size} bytes; its header describes {8 + n + end}), so its weights are "
                f"incomplete; {fix}")
    return None


def folder_problems(folder: str | Path, *, weights: bool = True, tokenizer: bool = True,
                    trust_remote_code: bool = False) -> list[str]:
    """Problems with a local model folder's config, weight files and tokenizer files, each naming the file."""
    p = Path(folder)
    problems = []
    for name in JSON_FILES:
        if (p / name).is_file():
            data, problem = read_json(p / name)
            if problem:
                problems.append(problem)
            elif not isinstance(data, dict):
                problems.append(f"{p / name}: expected a JSON object, got {type(data).__name__}")
    config, _ = read_json(p / "config.json") if (p / "config.json").is_file() else (None, None)
    if isinstance(config, dict):
        problems += _model_type_problems(p, config, trust_remote_code)
    if weights:
        for f in sorted(p.glob("*.safetensors")):
            if problem := safetensors_problem(f):
                problems.append(problem)
        index, _ = read_json(p / "model.safetensors.index.json") if (p / "model.safetensors.index.json").is_file() \
            else (None, None)
        if isinstance(index, dict):
            missing = sorted({s for s in (index.get("weight_map") or {}).values() if not (p / s).is_file()})
            if missing:
                problems.append(f"{p / 'model.safetensors.index.json'} names shard(s) not in the folder: "
                                f"{', '.join(missing[:3])}; copy every shard of the model")
    if tokenizer and not any((p / n).is_file() for n in TOKENIZER_FILES):
        problems.append(f"{p}: no tokenizer (none of {', '.join(TOKENIZER_FILES[:2])}, ...); copy the tokenizer files "
                        "of the model it was trained from (tokenizer.json, tokenizer_config.json) into this folder")
    return problems


def _model_type_problems(folder: Path, config: dict, trust_remote_code: bool = False) -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    where = folder / "config.json"
    if not model_type:
        return [f"{where}: no model_type; is it a Hugging Face model config? (a Llama model says \"model_type\": "
                "\"llama\")"]
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return []
    from finetune.models import families

    family = families.find(config)
    if family is not None and family.vision:  # a vision-language family's (AutoModelForImageTextToText)
        return []
    if config.get("auto_map"):
        if trust_remote_code:
            return []
        code = sorted({str(v).split(".")[0] + ".py" for v in config["auto_map"].values() if isinstance(v, str)})
        return [f"{where}: model_type '{model_type}' is defined by Python code shipped with the model "
                f"({', '.join(code) or 'auto_map'}), which finetune does not run unless asked; read it, then add "
                "--trust_remote_code true if you trust it"]
    if model_type not in CONFIG_MAPPING_NAMES:
        return [f"{where}: model_type '{model_type}' is unknown to transformers; check the name (e.g. llama)"]
    return [f"{where}: model_type '{model_type}' is not a causal (decoder-only) language model; finetune trains "
            "Llama-style causal LMs (llama, mistral, qwen2, ...), not encoder or encoder-decoder models such as T5"]


def vocabulary_problem(folder: str | Path, tokenizer, config) -> str | None:
    """The tokenizer can produce ids the model has no embedding for: training would index past the table."""
    size = getattr(config, "vocab_size", None) if not isinstance(config, dict) else config.get("vocab_size")
    if size is None or len(tokenizer) <= size:
        return None
    return (f"{Path(folder) / 'config.json'}: vocab_size {size} is smaller than the tokenizer's {len(tokenizer)} "
            "tokens, so some token ids have no embedding; use the tokenizer that belongs to these weights, or "
            "resize the embeddings (model.resize_token_embeddings) and save the model again")
