"""`finetune quickstart`: scoring, the bundled data, flags, and (slow) a short real run on SmolLM2-135M-Instruct."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.apps import quickstart as Q

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "data" / "quickstart"


def test_exact_match():
    ref = '{"name": "Ana Silva", "city": "Porto", "item": "oak chair", "quantity": 3}'
    assert Q.exact_match(ref, ref)
    assert Q.exact_match(f"  {ref}\n", ref)  # surrounding whitespace only
    assert not Q.exact_match(ref.replace(", ", ","), ref)  # same JSON, other spelling: not the asked-for answer
    assert not Q.exact_match('{"city": "Porto", "name": "Ana Silva", "item": "oak chair", "quantity": 3}', ref)
    assert not Q.exact_match(f"Here is the JSON: {ref}", ref)
    assert not Q.exact_match("", ref)


def test_field_accuracy_metric_hook():
    """The quickstart's partial credit as an --eval_metric hook: the mean over the completions."""
    from finetune.config.training import load_metric

    hook = load_metric("finetune.apps.quickstart:field_accuracy_metric")
    assert hook(['{"a": 1, "b": 2}', "x"], ['{"a": 1, "b": 3}', '{"a": 1}']) == {"field_accuracy": 0.25}


def test_field_accuracy():
    ref = '{"name": "Ana Silva", "city": "Porto", "item": "oak chair", "quantity": 3}'
    assert Q.field_accuracy(ref, ref) == 1.0
    assert Q.field_accuracy('{"name": "Ana Silva", "city": "Lyon", "item": "oak chair", "quantity": "3"}', ref) == 0.5
    assert Q.field_accuracy("Sure! The order is from Ana.", ref) == 0.0
    assert Q.field_accuracy("[1, 2]", ref) == 0.0


def test_data_generator_reproduces_committed_files(tmp_path):
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_quickstart_data.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True)
    for name in ("train.jsonl", "heldout.jsonl", "train_pairs.jsonl", "heldout_pairs.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), f"{name} differs from the generator's output"


def test_bundled_pairs_are_near_misses_of_their_records():
    """One pair per record of the same split (held-out pairs from held-out records only): the prompt is the record's
    user turn (plus one distractor sentence for the `distractor_*` kinds), chosen its answer, rejected the same JSON
    with exactly one mistake of the kind `near_miss` names; a distractor's value is the one the rejected answer took."""
    make = __import__("scripts.make_quickstart_data", fromlist=["x"])
    for split in ("train", "heldout"):
        records = [json.loads(line) for line in (DATA / f"{split}.jsonl").read_text().splitlines()]
        pairs = [json.loads(line) for line in (DATA / f"{split}_pairs.jsonl").read_text().splitlines()]
        assert len(pairs) == len(records)
        kinds = set()
        for record, pair in zip(records, pairs):
            user, answer = record["messages"][0]["content"], record["messages"][1]["content"]
            right, wrong, kind = json.loads(pair["chosen"]), json.loads(pair["rejected"]), pair["near_miss"]
            kinds.add(kind)
            assert pair["chosen"] == answer
            if kind in make.DISTRACTORS:
                sentence, field = make.DISTRACTORS[kind]
                value = wrong[field]
                assert pair["prompt"] == f"{user} {sentence.format(c=value, q=value, n=value)}"
                assert list(wrong) == list(right) and [k for k in right if right[k] != wrong[k]] == [field]
                assert str(value) not in user.split("\n", 1)[1]  # the distractor is not also in the order itself
                continue
            assert pair["prompt"] == user
            if kind == "missing_field":
                assert len(wrong) == 3 and all(right[k] == v for k, v in wrong.items())
            elif kind == "renamed_key":
                assert list(wrong.values()) == list(right.values()) and len(set(wrong) - set(right)) == 1
            else:
                field = "quantity" if kind.startswith("quantity") else kind
                assert list(wrong) == list(right) and [k for k in right if right[k] != wrong[k]] == [field]
                if kind == "quantity_type":
                    assert isinstance(wrong["quantity"], str) and wrong["quantity"].startswith(str(right["quantity"]))
        assert kinds == set(make.KINDS)


def test_bundled_data_shape():
    train = [json.loads(line) for line in (DATA / "train.jsonl").read_text().splitlines()]
    heldout = [json.loads(line) for line in (DATA / "heldout.jsonl").read_text().splitlines()]
    assert (len(train), len(heldout)) == (800, 80)
    answers = lambda recs: {r["messages"][-1]["content"] for r in recs}  # noqa: E731
    assert not answers(train) & answers(heldout), "a held-out answer also appears in training"
    for r in heldout:
        assert list(json.loads(r["messages"][-1]["content"])) == ["name", "city", "item", "quantity"]


def flat(rows) -> list[float]:
    return [x for row in rows for x in row]


def direct_logp(model, tokenizer, prompt: str, answer: str) -> float:
    """log p(answer's assistant turn through <|im_end|> | the prompt rendered for generation), one unpadded forward."""
    import torch

    user = [{"role": "user", "content": prompt}]
    context = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": answer}], tokenize=False)
    turn = full[len(context):full.index("<|im_end|>", len(context)) + len("<|im_end|>")]
    p = tokenizer(context, add_special_tokens=False)["input_ids"]
    c = tokenizer(turn, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logp = model(torch.tensor([p + c])).logits[0].double().log_softmax(-1)
    return float(sum(logp[len(p) - 1 + i, t] for i, t in enumerate(c)))


def test_preference_accuracy_equals_direct_log_probs(tiny_chatml, one_thread):
    """The quickstart's preference accuracy on a tiny random model: each pair's log-probs (padded batches of 4)
    equal a direct one-sequence computation, and the accuracy is the share of pairs with chosen strictly higher:
    with every pair also given mirrored (chosen and rejected swapped), exactly one half, margin mean 0."""
    import torch
    from transformers import AutoModelForCausalLM

    from finetune.config import ModelConfig
    from finetune.models.load import load_tokenizer

    tokenizer = load_tokenizer(ModelConfig(model_name_or_path=str(tiny_chatml)))
    model = AutoModelForCausalLM.from_pretrained(tiny_chatml, dtype=torch.float32).eval()
    pairs = [json.loads(line) for line in (DATA / "heldout_pairs.jsonl").read_text().splitlines()][:3]
    pairs += [{**p, "chosen": p["rejected"], "rejected": p["chosen"], "near_miss": "mirrored"} for p in pairs]
    got = Q.preference_metrics(model, tokenizer, pairs, batch_size=4)
    direct = [(direct_logp(model, tokenizer, p["prompt"], p["chosen"]), direct_logp(model, tokenizer, p["prompt"], p["rejected"]))
              for p in pairs]
    assert flat(got["pair_logps"]) == pytest.approx(flat(direct), abs=2e-3)  # rounded to 4 decimals in the report
    assert all(c != r for c, r in direct)
    assert got["preference_pairs"] == 6 and got["preference_accuracy"] == 0.5
    # a pair and its mirror sit in batches padded to other lengths: float32 sums differ in the 6th digit
    assert got["mean_logp_margin"] == pytest.approx(0.0, abs=1e-4)
    originals = sum(c > r for c, r in direct[:3]) / 3
    assert got["preference_accuracy_by_kind"]["mirrored"] == pytest.approx(1 - originals)
    kinds = {p["near_miss"] for p in pairs[:3]}
    assert set(got["preference_accuracy_by_kind"]) == kinds | {"mirrored"}


@pytest.mark.parametrize("argv, fragment", [
    (["--method", "qlora"], "--method: 'qlora' is not one of sft, dpo, orpo, kto, grpo; did you mean 'lora'?"),
    (["--tuning", "qlora"], "--tuning: 'qlora' is not one of lora, full"),
    (["--method", "simpo"], "--method: 'simpo' is not one of sft, dpo, orpo, kto, grpo (the quickstart does not run simpo yet)"),
    (["--method", "dpo"], "--method dpo: give --model_name_or_path, the SFT result to start from"),
    (["--method", "orpo", "--beta", "0"], "--beta: must be more than 0"),
    (["--beta", "0.3"], "--beta: an option of a preference --method (dpo, orpo, kto)"),
    (["--config", "zero9"], "--config: unknown preset 'zero9'"),
    (["--max_minutes", "0"], "--max_minutes: must be more than 0"),
    (["--max_steps", "0"], "--max_steps: must be at least 1"),
    (["--eval_examples", "0"], "--eval_examples: must be at least 1"),
    (["--learning_rate", "-1"], "--learning_rate: must be more than 0"),
    (["--train_file", "nope.jsonl"], "--train_file: nope.jsonl: no such file"),
    (["--model_name_or_path", "no/such/folder"], "--model_name_or_path: no/such/folder: no such folder"),
    (["--model_name_or_path", ".", "--gguf", "x.gguf"], "--model_name_or_path and --gguf: choose one"),
    (["--dpo"], "--dpo: give --model_name_or_path, the SFT result to start from"),
    (["--dpo", "--model_dir", str(REPO / "tests"), "--beta", "0"], "--beta: must be more than 0"),
])
def test_bad_flags_exit_2(argv, fragment, capsys):
    with pytest.raises(SystemExit) as e:
        Q.main(argv)
    assert e.value.code == 2
    assert fragment in capsys.readouterr().err


def test_method_names_the_training_method(tiny_chatml):
    """--method is finetune train's (sft, dpo, orpo); --dpo and the former --method lora|full (now --tuning) still
    work. ORPO starts from the base model (no --model_name_or_path needed) on the bundled pairs."""
    assert (lambda c: (c.method, c.tuning, c.beta, c.max_steps))(Q.parse(["--method", "full"])) == ("sft", "full", None, 50)
    dpo = Q.parse(["--dpo", "--model_name_or_path", str(tiny_chatml)])
    assert (dpo.method, dpo.beta, dpo.max_steps, Path(dpo.train_file).name) == ("dpo", 0.5, 30, "train_pairs.jsonl")
    orpo = Q.parse(["--method", "orpo", "--tuning", "full"])
    assert (orpo.method, orpo.tuning, orpo.beta, Path(orpo.train_file).name) == ("orpo", "full", 0.1, "train_pairs.jsonl")
    assert Q.stage_labels("orpo") == ("base", "after ORPO") and Q.stage_labels("dpo") == ("SFT model", "after DPO")


def test_every_problem_reported_at_once():
    with pytest.raises(Q.QuickstartError) as e:
        Q.parse(["--method", "x", "--max_steps", "0", "--processes", "0"])
    assert {"--method", "--max_steps", "--processes"} <= {p.split(":")[0] for p in e.value.problems}


def test_report_files(tmp_path):
    """The report writer alone, on made-up numbers: every file, tables consistent with metrics.json."""
    records = [json.loads(line) for line in (DATA / "heldout.jsonl").read_text().splitlines()][:3]
    refs = [r["messages"][-1]["content"] for r in records]
    ev = lambda c, em: {"eval_loss": 0.5, "perplexity": 1.65, "exact_match": em, "field_accuracy": em,  # noqa: E731
                        "examples": 3, "max_new_tokens": 40, "completions": c}
    metrics = {
        "model": {"path": "m"}, "data": {"train_file": "t", "eval_file": "e", "train_records": 800, "eval_examples": 3},
        "base": {**ev(["no", "no", "no"], 0.0), "harness": {"task": "finetune_quickstart", "exact_match": 0.25,
                                                            "examples": 20}},
        "finetuned": {**ev(refs[:2] + ["x"], 2 / 3), "harness": {"task": "finetune_quickstart", "exact_match": 0.5,
                                                                  "examples": 20}},
        "training": {"method": "lora", "preset": "ddp", "processes": 2, "threads_per_process": 1, "device": "cpu",
                     "global_batch": 8, "learning_rate": 1e-3, "steps": 3, "stopped_by": "max_steps", "max_steps": 3,
                     "max_minutes": 1, "first_loss": 0.6, "last_loss": 0.1, "steps_logged": [1, 2, 3], "losses": [0.6, 0.3, 0.1]},
        "timings_s": {"import": 1, "train": 2, "total": 3}, "machine": {"cpu_count": 2, "gpus": 0,
                                                                        "load_average_start": [0], "load_average_end": [0]},
    }
    Q.write_report(tmp_path / "report", metrics, records)
    report = (tmp_path / "report" / "report.md").read_text()
    assert "| exact match | 0.0% | 66.7% |" in report and "rose by 66.7 points" in report
    assert "| lm-evaluation-harness `finetune_quickstart` exact match (first 20 records) | 25.0% | 50.0% |\n| eval loss" \
        in report
    assert (tmp_path / "report" / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.count("| yes / yes |") == 0 and report.count("| no / yes |") == 2
    assert sorted(p.name for p in (tmp_path).iterdir()) == ["report"]  # no staging folder left


@pytest.mark.slow
def test_quickstart_short_run(smollm2_dir, tmp_path):
    """A real run, small: 3 LoRA steps on 2 CPU processes, 8 held-out records. Files exist and agree; loss fell."""
    out = tmp_path / "qs"
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", "quickstart", "--model_name_or_path", str(smollm2_dir), "--max_steps", "3",
         "--eval_examples", "8", "--harness_examples", "8", "--max_minutes", "3", "--output_dir", str(out)],
        capture_output=True, text=True, timeout=400, cwd=tmp_path,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    report = out / "report"
    metrics = json.loads((report / "metrics.json").read_text())
    b, t, tr = metrics["base"], metrics["finetuned"], metrics["training"]
    assert tr["steps"] == 3 and tr["processes"] == 2 and tr["stopped_by"] == "max_steps"
    assert len(tr["losses"]) == 3 and tr["last_loss"] < tr["first_loss"]
    assert t["eval_loss"] < b["eval_loss"] and b["examples"] == t["examples"] == 8
    assert len(b["completions"]) == len(t["completions"]) == 8
    for m in (b, t):
        assert m["perplexity"] == pytest.approx(2.718281828 ** m["eval_loss"], rel=1e-6)
    assert metrics["exact_match_gain_points"] == pytest.approx(100 * (t["exact_match"] - b["exact_match"]))
    assert (report / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (report / "report.md").read_text()
    for number in (f"{b['exact_match']:.1%}", f"{t['exact_match']:.1%}", f"{b['eval_loss']:.4f}", f"{t['eval_loss']:.4f}",
                   f"{tr['first_loss']:.4f}", f"{tr['last_loss']:.4f}", "loss_curve.png"):
        assert number in text, number
    assert (report / "examples.md").is_file() and (out / "model" / "adapter_model.safetensors").is_file()
    assert f"report: {report.resolve()}/report.md" in proc.stdout  # the headline says where the report is
    # lm-evaluation-harness on the same 8 held-out records, through the same chat template, greedy: the same exact
    # match as the quickstart's own generate, before and after
    for m in (b, t):
        assert m["harness"]["examples"] == 8 and m["harness"]["exact_match"] == pytest.approx(m["exact_match"])
    assert (f"| lm-evaluation-harness `finetune_quickstart` exact match (first 8 records) | "
            f"{b['harness']['exact_match']:.1%} | {t['harness']['exact_match']:.1%} |") in text
    # The run's own report (`finetune report`): its curves and final metrics agree with the quickstart's numbers.
    run_report = out / "model" / "report"
    assert (run_report / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((run_report / "metrics.json").read_text())["train"]["last_loss"] == tr["last_loss"]
    assert f"{run_report.resolve()}/README.md" in text


@pytest.mark.slow
def test_quickstart_dpo_stage_on_a_tiny_model(tiny_chatml, tmp_path, one_thread):
    """`quickstart --dpo` after a LoRA SFT (a random adapter on a tiny model): the adapter is merged, DPO trains a new
    adapter whose reference is that merged SFT model (first loss log 2), and the report's preference accuracy is
    the held-out pairs' own: their log-probs equal a direct computation under the SFT model and the DPO model."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from finetune.config import ModelConfig
    from finetune.models import tiny
    from finetune.models.load import load_tokenizer

    sft = tiny.save_random_adapter(tiny_chatml, tmp_path / "sft", r=4)
    lines = lambda name, n: "".join((DATA / name).read_text().splitlines(keepends=True)[:n])  # noqa: E731
    (tmp_path / "pairs.jsonl").write_text(lines("train_pairs.jsonl", 16))
    (tmp_path / "heldout.jsonl").write_text(lines("heldout.jsonl", 5))
    # scored on 5 of the pairs it trains on: 3 steps of a random tiny model widen their margin, not a held-out one's
    (tmp_path / "heldout_pairs.jsonl").write_text(lines("train_pairs.jsonl", 5))
    out = tmp_path / "dpo"
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", "quickstart", "--dpo", "--model_dir", str(sft), "--train_file",
         str(tmp_path / "pairs.jsonl"), "--eval_file", str(tmp_path / "heldout.jsonl"), "--eval_pairs_file",
         str(tmp_path / "heldout_pairs.jsonl"), "--max_steps", "3", "--processes", "1", "--eval_threads", "1",
         "--max_new_tokens", "6", "--learning_rate", "0.05", "--beta", "0.5", "--output_dir", str(out)],
        capture_output=True, text=True, timeout=400, cwd=tmp_path,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    metrics = json.loads((out / "report" / "metrics.json").read_text())
    b, t, tr = metrics["base"], metrics["finetuned"], metrics["training"]
    assert metrics["stage"] == "dpo" and metrics["labels"] == ["SFT model", "after DPO"]
    assert metrics["model"]["source"] == "sft adapter, merged" and metrics["model"]["path"] == str((out / "sft_merged").resolve())
    assert (tr["objective"], tr["beta"], tr["steps"]) == ("dpo", 0.5, 3)
    assert tr["losses"][0] == pytest.approx(0.693147, abs=1e-4)  # the policy starts as its reference, the SFT model
    # The preference accuracy is the 5 scored pairs', from their log-probs under each model.
    pairs = [json.loads(line) for line in (tmp_path / "heldout_pairs.jsonl").read_text().splitlines()]
    tokenizer = load_tokenizer(ModelConfig(model_name_or_path=str(out / "sft_merged")))
    sft_model = AutoModelForCausalLM.from_pretrained(out / "sft_merged", dtype=torch.float32).eval()
    dpo_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "sft_merged", dtype=torch.float32),
                                          str(out / "model")).eval()
    for m, model in ((b, sft_model), (t, dpo_model)):
        direct = [(direct_logp(model, tokenizer, p["prompt"], p["chosen"]), direct_logp(model, tokenizer, p["prompt"], p["rejected"]))
                  for p in pairs]
        assert m["preference_pairs"] == 5 and flat(m["pair_logps"]) == pytest.approx(flat(direct), abs=2e-3)
        assert m["preference_accuracy"] == sum(c > r for c, r in direct) / 5
        assert m["mean_logp_margin"] == pytest.approx(sum(c - r for c, r in direct) / 5, abs=1e-3)
        assert m["examples"] == 5 and len(m["completions"]) == 5
    # The SFT model's held-out numbers are base + the SFT adapter's (the merge is the SFT model).
    unmerged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_chatml, dtype=torch.float32), str(sft)).eval()
    p = pairs[0]
    assert direct_logp(unmerged, tokenizer, p["prompt"], p["chosen"]) == pytest.approx(b["pair_logps"][0][0], abs=2e-3)
    assert t["mean_logp_margin"] > b["mean_logp_margin"]  # DPO widened the margin
    assert metrics["preference_accuracy_gain_points"] == pytest.approx(100 * (t["preference_accuracy"] - b["preference_accuracy"]))
    text = (out / "report" / "report.md").read_text()
    assert f"| preference accuracy (5 held-out pairs) | {b['preference_accuracy']:.1%} | {t['preference_accuracy']:.1%} |" in text
    assert "| SFT model | after DPO |" in text and "DPO (beta 0.5) on the SFT model" in text
    assert f"preference accuracy {b['preference_accuracy']:.1%} -> {t['preference_accuracy']:.1%} on 5 held-out pairs" in proc.stdout


@pytest.mark.slow
@pytest.mark.full_matrix  # CI: the preference stage as --method dpo above; ORPO's training in test_simpo_orpo.py
def test_quickstart_orpo_from_the_base_model(tiny_chatml, tmp_path, one_thread):
    """`quickstart --method orpo` on a tiny base model (no SFT stage): ORPO trains a LoRA adapter on the pairs; the
    report's preference accuracy is the held-out pairs' own (their log-probs equal a direct computation under the
    base model), and the trained adapter moved them."""
    import torch
    from transformers import AutoModelForCausalLM

    from finetune.config import ModelConfig
    from finetune.models.load import load_tokenizer

    lines = lambda name, n: "".join((DATA / name).read_text().splitlines(keepends=True)[:n])  # noqa: E731
    (tmp_path / "pairs.jsonl").write_text(lines("train_pairs.jsonl", 16))
    (tmp_path / "heldout.jsonl").write_text(lines("heldout.jsonl", 5))
    (tmp_path / "heldout_pairs.jsonl").write_text(lines("train_pairs.jsonl", 5))
    out = tmp_path / "orpo"
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", "quickstart", "--method", "orpo", "--model_name_or_path", str(tiny_chatml),
         "--train_file", str(tmp_path / "pairs.jsonl"), "--eval_file", str(tmp_path / "heldout.jsonl"),
         "--eval_pairs_file", str(tmp_path / "heldout_pairs.jsonl"), "--max_steps", "3", "--processes", "1",
         "--eval_threads", "1", "--max_new_tokens", "6", "--learning_rate", "0.05", "--output_dir", str(out)],
        capture_output=True, text=True, timeout=400, cwd=tmp_path,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    metrics = json.loads((out / "report" / "metrics.json").read_text())
    b, t, tr = metrics["base"], metrics["finetuned"], metrics["training"]
    assert metrics["stage"] == "orpo" and metrics["labels"] == ["base", "after ORPO"]
    assert metrics["model"]["source"] == "folder" and (tr["objective"], tr["beta"], tr["steps"]) == ("orpo", 0.1, 3)
    assert len(tr["losses"]) == 3 and all(0 < x < 50 for x in tr["losses"])
    assert flat(t["pair_logps"]) != pytest.approx(flat(b["pair_logps"]), abs=1e-3)
    pairs = [json.loads(line) for line in (tmp_path / "heldout_pairs.jsonl").read_text().splitlines()]
    tokenizer = load_tokenizer(ModelConfig(model_name_or_path=str(tiny_chatml)))
    base = AutoModelForCausalLM.from_pretrained(tiny_chatml, dtype=torch.float32).eval()
    direct = [(direct_logp(base, tokenizer, p["prompt"], p["chosen"]), direct_logp(base, tokenizer, p["prompt"], p["rejected"]))
              for p in pairs]
    assert flat(b["pair_logps"]) == pytest.approx(flat(direct), abs=2e-3)
    assert b["preference_accuracy"] == sum(c > r for c, r in direct) / 5
    text = (out / "report" / "report.md").read_text()
    assert "| base | after ORPO |" in text and "ORPO (beta 0.1) on the base model" in text
    assert f"quickstart orpo: preference accuracy {b['preference_accuracy']:.1%} -> {t['preference_accuracy']:.1%}" in proc.stdout


@pytest.mark.slow
def test_quickstart_grpo_on_a_tiny_model(tiny_chatml, tmp_path, one_thread):
    """`quickstart --method grpo` on a tiny base model: GRPO with the stage's json_fields reward (plus a regex reward
    a random model earns now and then, for a curve that moves) trains a LoRA adapter; the report has the held-out
    field accuracy and exact match before and after (each the mean over the completions it holds), and the reward
    curve: the run's logged rewards, step 2 reusing step 1's completions (--num_iterations 2 after `--`: flags there
    override the stage's)."""
    lines = lambda name, n: "".join((DATA / name).read_text().splitlines(keepends=True)[:n])  # noqa: E731
    (tmp_path / "train.jsonl").write_text(lines("train.jsonl", 8))
    (tmp_path / "heldout.jsonl").write_text(lines("heldout.jsonl", 5))
    out = tmp_path / "grpo"
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", "quickstart", "--method", "grpo", "--model_name_or_path", str(tiny_chatml),
         "--train_file", str(tmp_path / "train.jsonl"), "--eval_file", str(tmp_path / "heldout.jsonl"),
         "--max_steps", "3", "--processes", "1", "--eval_threads", "1", "--max_new_tokens", "6",
         "--learning_rate", "0.05", "--output_dir", str(out), "--",
         "--num_generations", "4", "--reward_funcs", "json_fields", "regex:[0-9]", "--num_iterations", "2",
         "--max_completion_length", "6"],
        capture_output=True, text=True, timeout=400, cwd=tmp_path,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    metrics = json.loads((out / "report" / "metrics.json").read_text())
    b, t, tr = metrics["base"], metrics["finetuned"], metrics["training"]
    assert metrics["stage"] == "grpo" and metrics["labels"] == ["base", "after GRPO"]
    assert (tr["objective"], tr["steps"], tr["curve"], tr["global_batch"]) == ("grpo", 3, "reward", 1)
    refs = [json.loads(line)["messages"][-1]["content"] for line in (tmp_path / "heldout.jsonl").read_text().splitlines()]
    for m in (b, t):
        assert m["examples"] == 5 and len(m["completions"]) == 5 and m["max_new_tokens"] == 6
        assert m["field_accuracy"] == pytest.approx(sum(map(Q.field_accuracy, m["completions"], refs)) / 5)
        assert m["exact_match"] == sum(map(Q.exact_match, m["completions"], refs)) / 5
    assert metrics["field_accuracy_gain_points"] == pytest.approx(100 * (t["field_accuracy"] - b["field_accuracy"]))
    # The reward curve is the run's own log: one reward per step, step 2 on step 1's completions (the same rewards).
    logged = [e for e in json.loads((out / "model" / "trainer_state.json").read_text())["log_history"] if "reward" in e]
    assert tr["rewards"] == [e["reward"] for e in logged] and tr["steps_logged"] == [1, 2, 3]
    assert tr["rewards"][0] == tr["rewards"][1] and len(set(tr["rewards"])) > 1 and 0 < max(tr["rewards"]) <= 2
    assert all(0 < e["completions/mean_length"] <= 6 for e in logged)  # the --max_completion_length given
    # Seconds, rounded to 0.1: a tiny model's loss forwards can round to 0.
    assert tr["generation_s"] >= 0 and tr["loss_forward_s"] >= 0 and tr["generation_s"] + tr["loss_forward_s"] > 0
    assert (out / "report" / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (out / "report" / "report.md").read_text()
    assert f"| exact match | {b['exact_match']:.1%} | {t['exact_match']:.1%} |" in text
    assert f"| field accuracy (JSON fields right) | {b['field_accuracy']:.1%} | {t['field_accuracy']:.1%} |" in text
    assert "| base | after GRPO |" in text and "GRPO on the base model" in text and "![reward](reward_curve.png)" in text
    assert f"{tr['rewards'][0]:.3f} at step 1 -> {tr['rewards'][-1]:.3f} at step 3" in text
    assert (f"quickstart grpo: field accuracy {b['field_accuracy']:.1%} -> {t['field_accuracy']:.1%}; exact match "
            f"{b['exact_match']:.1%} -> {t['exact_match']:.1%}") in proc.stdout
    assert f"training reward {tr['rewards'][0]:.3f} -> {tr['rewards'][-1]:.3f} in 3 steps" in proc.stdout


def test_model_dir_is_the_old_spelling_of_model_name_or_path():
    """The model flag is --model_name_or_path on every command; the quickstart's former --model_dir still works and
    says the new name (once a process: a process of its own here)."""
    proc = subprocess.run([sys.executable, "-m", "finetune", "quickstart", "--model_dir", "no/such/folder"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert "--model_dir is now --model_name_or_path" in proc.stderr
    assert "--model_name_or_path: no/such/folder: no such folder" in proc.stderr
