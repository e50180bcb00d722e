"""The export types' registry (finetune/convert/writers/): no code outside a writer's module and the registry
branches on an export type's name, and a type registered at test time (a .npz of the state dict, verified by
reading it back) runs through `finetune export --to NAME` with no other code change: its flags, its checks, the
refusal of another type's flags, did-you-mean, the verification before the file is moved into place."""

from __future__ import annotations

import ast
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from finetune.cli import main as cli
from finetune.convert import writers
from finetune.convert.messages import ExportError
from finetune.convert.writers.base import ExportArgs, Writer
from finetune.convert.writers.hf import hf_folder
from finetune.models.verify import VerificationError

from registry_check import comparisons_outside, name_comparisons


def test_the_check_finds_a_branch():
    tree = ast.parse('if args.to == "gguf": pass\nok = t in ("hf", "x")\nmatch t:\n    case "gguf": pass\n')
    assert name_comparisons(tree, set(writers.WRITERS)) == [(1, "gguf"), (2, "hf"), (4, "gguf")]


def test_the_registry_is_the_one_list_of_export_types():
    """What differs between export types lives in their modules: no other module compares with a type's name (it asks
    the writer: its flags, its sources, its checks, write)."""
    offenders = comparisons_outside(set(writers.WRITERS), "convert/writers")
    assert not offenders, "\n".join(offenders)


def test_writer_flags_are_their_own():
    """A writer's flag names no shared flag and no other writer's (the parser gives a name to its first section)."""
    seen = {f.name for f in dataclasses.fields(ExportArgs)} | {f.name for f in dataclasses.fields(writers.ExportType)}
    for writer in writers.WRITERS.values():
        own = {f.name for f in dataclasses.fields(writer.flags)} if writer.flags else set()
        assert not own & seen, (writer.name, own & seen)
        seen |= own


# ----------------------------------------------------------------------------------------------
# A toy export type, registered at test time


@dataclass
class NPZFlags:
    """With --to npz"""

    npz_compressed: bool = field(default=False, metadata={"help": "Write np.savez_compressed."})


class NPZ(Writer):
    name = "npz"
    summary = "the state dict as one .npz file"
    flags = NPZFlags
    sources = ("model", "adapter", "zero_checkpoint")
    corrupt = False  # a test's switch: write a wrong value, which verify must catch

    def check(self, args: ExportArgs, flags: NPZFlags) -> list[str]:
        out = args.output or args.output_dir
        return [f"OUTPUT: '{out}' must end in .npz"] if out and not out.endswith(".npz") else []

    def write(self, args: ExportArgs, flags: NPZFlags) -> Path:
        from safetensors.numpy import load_file

        output = Path(args.output_dir)
        if output.exists() and not args.overwrite:
            raise ExportError(f"{output} already exists; pass --overwrite to replace it")
        with hf_folder(args, near=output) as folder:
            state = {}
            for shard in sorted(Path(folder).glob("*.safetensors")):
                state.update(load_file(str(shard)))
        written = dict(state)
        if self.corrupt:
            name = sorted(written)[0]
            written[name] = written[name] + 1e-3
        tmp = output.parent / f".{output.name}.partial-{os.getpid()}.npz"
        output.parent.mkdir(parents=True, exist_ok=True)
        try:
            (np.savez_compressed if flags.npz_compressed else np.savez)(tmp, **written)
            self.verify(tmp, state)
            os.replace(tmp, output)
        finally:
            tmp.unlink(missing_ok=True)
        return output

    def verify(self, written: Path, reference: dict, **limits) -> float:
        with np.load(written) as back:
            if sorted(back.files) != sorted(reference):
                raise VerificationError(f"{written}: the tensors read back are not the model's")
            diff = max(float(np.abs(back[k] - reference[k]).max()) for k in reference)
        if diff != 0.0:
            raise VerificationError(f"{written}: the tensors read back differ by {diff:.3g}")
        return diff


@pytest.fixture
def npz(monkeypatch):
    monkeypatch.setitem(writers.WRITERS, NPZ.name, NPZ())
    return writers.WRITERS[NPZ.name]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from finetune.models import tiny

    return tiny.build(tmp_path_factory.mktemp("export_types") / "model", "chatml", seed=4)


def run(capsys, *argv) -> tuple[int, str, str]:
    try:
        cli(["export", *argv])
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_a_new_export_type_runs_through_the_command(npz, model, tmp_path, capsys):
    from safetensors.numpy import load_file

    out = tmp_path / "o" / "model.npz"
    code, stdout, err = run(capsys, "--to", "npz", "--model_name_or_path", str(model), str(out), "--npz_compressed")
    assert code == 0, err
    assert stdout.strip() == str(out)
    state = load_file(str(model / "model.safetensors"))
    with np.load(out) as back:
        assert sorted(back.files) == sorted(state) and len(state) > 10
        assert all(np.array_equal(back[k], state[k]) for k in state)
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.npz"]  # no partial file left

    # Its flags belong to it; another type's flags are refused by name, and its own with another type.
    code, _, err = run(capsys, "--to", "npz", "--model_name_or_path", str(model), str(tmp_path / "x.bin"),
                       "--gguf_type", "f16")
    assert code == 2
    assert "--gguf_type: goes with --to gguf" in err and "OUTPUT: '" + str(tmp_path / "x.bin") + "' must end in .npz" in err
    code, _, err = run(capsys, "--to", "gguf", "--model_name_or_path", str(model), str(tmp_path / "x.gguf"),
                       "--npz_compressed")
    assert code == 2 and "--npz_compressed: goes with --to npz" in err, err
    code, _, err = run(capsys, "--to", "nzp", str(out))
    assert code == 2 and "--to: 'nzp' is not one of hf, gguf, npz; did you mean 'npz'?" in err, err
    code, _, err = run(capsys, "--to", "npz", str(out))
    assert code == 2 and ("--model_name_or_path, --adapter and --zero_checkpoint: give exactly one (a model folder, "
                          "a LoRA adapter to merge, or a ZeRO or FSDP2 checkpoint)") in err, err
    code, stdout, _ = run(capsys, "--help")
    assert code == 0 and "--npz_compressed" in stdout and "NPZFlags flags: With --to npz:" in stdout


def test_a_new_export_type_is_verified_before_it_is_moved_into_place(npz, model, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(npz, "corrupt", True)
    out = tmp_path / "bad.npz"
    code, _, err = run(capsys, "--to", "npz", "--model_name_or_path", str(model), str(out))
    assert code == 1 and "finetune export: verification failed:" in err and "differ by 0.001" in err, err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_old_model_flags_are_aliases(capsys, monkeypatch):
    """--model_dir and --base_model (and --base_model_revision) still set the model flag, each saying its new name."""
    from finetune.config import parser
    from finetune.convert import export

    monkeypatch.setattr(parser, "_NOTED", set())
    for old in ("model_dir", "base_model"):
        parsed = export.command().parse([f"--{old}", "m", "--adapter", "a", "--base_model_revision", "r", "--output_dir", "o"],
                                        export.check_args)
        assert (parsed.args.model_name_or_path, parsed.args.model_revision, parsed.args.source) == ("m", "r", "adapter")
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "finetune export: --model_dir is now --model_name_or_path (the old spelling still works)",
        "finetune export: --base_model_revision is now --model_revision (the old spelling still works)",
        "finetune export: --base_model is now --model_name_or_path (the old spelling still works)",
    ]
