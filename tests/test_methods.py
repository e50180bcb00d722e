"""finetune.methods: one module per training method behind one interface, found through one registry."""

from __future__ import annotations

import ast
import dataclasses
import re

import pytest

from finetune import methods
from finetune.methods.base import Method, MethodConfig, own_flags

from registry_check import PACKAGE, comparisons_outside, name_comparisons


def test_no_code_outside_the_methods_branches_on_a_method_name():
    """After the move, what differs between methods lives in their modules: no other module compares with a method's
    name (it asks the method: its paths, its count, its planner terms, ...)."""
    offenders = comparisons_outside(set(methods.METHODS), "methods")
    assert not offenders, "\n".join(offenders)


def test_the_check_finds_a_branch():
    tree = ast.parse('if cfg.method == "dpo": pass\nok = m in ("sft", "x")\nmatch m:\n    case "dpo": pass\n')
    assert name_comparisons(tree, set(methods.METHODS)) == [(1, "dpo"), (2, "sft"), (4, "dpo")]


def test_methods_do_not_import_the_layers_above():
    """finetune.methods sits below config, plan and training (docs/layout.md): it imports none of them, even inside a
    function (what a method needs of a training path comes in its Context)."""
    above = ("finetune.config", "finetune.plan", "finetune.training", "finetune.apps", "finetune.inference",
             "finetune.convert", "finetune.cli", "finetune.loop", "finetune.train", "finetune.testing")
    for path in sorted((PACKAGE / "methods").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            bad = [m for m in modules if m.startswith(above)]
            assert not bad, f"{path.name}:{node.lineno} imports {bad}"


@pytest.mark.parametrize("name", list(methods.METHODS))
def test_every_method_is_complete(name):
    method = methods.get(name)
    assert isinstance(method, Method) and method.name == name and method.title and method.summary
    assert issubclass(method.config, MethodConfig) and method.config().method  # constructible with its defaults
    assert set(method.paths) <= {"trainer", "loop", "engine"} and "trainer" in method.paths
    assert method.eval_metrics(None)[0] == "loss"
    for f in dataclasses.fields(method.config):
        assert f.name == "method" or f.metadata.get("help"), f"--{f.name} of {name} has no help"


def test_each_method_flag_reaches_the_parser_with_help_and_did_you_mean():
    from finetune import config as C

    text = C.help_text()
    for method in methods.METHODS.values():
        # argparse wraps at spaces and after hyphens ("sequence-" / "classification").
        assert f"{method.name}: {method.summary}" in re.sub(r"- ", "-", " ".join(text.split()))
        for flag in own_flags(method):
            assert f"--{flag}" in text
    with pytest.raises(C.ConfigError) as e:
        C.parse(["--model_name_or_path", "m", "--dataset", "d", "--method", "dpo", "--bta", "0.2"], check_paths=False)
    assert "--bta: unknown key 'bta'; did you mean 'beta'?" in e.value.problems


def test_a_recipe_sets_a_method_flag(tmp_path):
    from finetune import config as C

    recipe = tmp_path / "r.yaml"
    recipe.write_text("method: dpo\nbeta: 0.25\nprecompute_ref_log_probs: true\n")
    cfg = C.parse(["--model_name_or_path", "m", "--dataset", "d", "--recipe", str(recipe)], check_paths=False)
    assert (cfg.objective.method, cfg.objective.beta, cfg.objective.precompute_ref_log_probs) == ("dpo", 0.25, True)
    assert type(cfg.objective) is methods.get("dpo").config
    # The method's flags are recipe keys again (a run's saved recipe reruns it), after --method.
    keys = list(cfg.resolved())
    assert keys.index("method") < keys.index("beta") < keys.index("precompute_ref_log_probs")


def test_the_engine_path_refusal_comes_from_the_method():
    from types import SimpleNamespace

    from finetune.training import core

    from finetune.config.preset import Preset

    cfg = SimpleNamespace(training=SimpleNamespace(), sources={}, preset=Preset.named("ddp"),
                          objective=methods.get("dpo").config(method="dpo"))
    assert "engine" not in methods.get("dpo").paths
    assert core.refused_flags(cfg, "scripts/sft.py") == ["method dpo: not supported by scripts/sft.py "
                                                         "(finetune/train.py supports it)"]
    assert core.refused_flags(cfg, "finetune/loop.py") == []
    cfg.objective = MethodConfig(method="sft")
    assert core.refused_flags(cfg, "scripts/sft.py") == []


def test_planner_terms():
    dpo = methods.get("dpo")
    assert methods.get("sft").planner_terms(MethodConfig(), use_peft=False) == methods.base.PlannerTerms()
    full = dpo.planner_terms(dpo.config(method="dpo"), use_peft=False)
    assert full.pairs and full.reference_copy and "frozen copy" in full.note
    assert not dpo.planner_terms(dpo.config(method="dpo"), use_peft=True).reference_copy
    assert not dpo.planner_terms(dpo.config(method="dpo", precompute_ref_log_probs=True), use_peft=False).reference_copy


def test_the_report_draws_the_method_metrics(tmp_path):
    """`finetune report` asks the run's method what it logs: a DPO run gets its rewards and log-prob curves."""
    import json

    from finetune.apps import report

    names = methods.get("dpo").metrics
    history = [{"loss": 0.7 - 0.1 * s, "step": s, **{n: 0.1 * s for n in names}} for s in (1, 2)]
    history.append({"eval_loss": 0.6, "step": 2, **{f"eval_{n}": 0.3 for n in names}})
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history, "global_step": 2}))
    (tmp_path / "finetune_config.yaml").write_text("method: dpo\nbeta: 0.1\n")
    folder = report.write_report(tmp_path)
    assert (folder / "rewards.png").is_file() and (folder / "logps.png").is_file()
    assert json.loads((folder / "metrics.json").read_text())["train"]["rewards/accuracies"] == pytest.approx(0.2)
    (tmp_path / "finetune_config.yaml").unlink()  # an SFT run (no method key): no method curves
    folder = report.write_report(tmp_path)
    assert not (folder / "rewards.png").exists()


def test_a_flag_methods_share_is_one_flag():
    """A flag two methods share (TRL's --beta of DPO, KTO, ORPO) is parsed once, so it must mean one type; each
    method keeps its own default, and the run's method gets the value."""
    from finetune.config.parser import field_types

    seen: dict[str, tuple[str, object]] = {}
    for method in methods.METHODS.values():
        types = field_types(method.config)
        for flag in own_flags(method):
            if flag in seen:
                assert seen[flag][1] == types[flag], f"--{flag}: {seen[flag][0]} and {method.name} disagree on its type"
            seen.setdefault(flag, (method.name, types[flag]))
    assert not set(seen) & {f.name for f in dataclasses.fields(MethodConfig)}
