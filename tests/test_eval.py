"""`finetune eval`: lm-evaluation-harness on a loaded model with a LoRA adapter off and on, offline: a local YAML task
whose answers are the base's own greedy completions for three records and the adapter's for the fourth scores exact
match 0.75 for the base and 0.25 fine-tuned (the harness ran each model, through the chat template, as transformers'
generate does); the bundled finetune_quickstart task runs from the quickstart's held-out records; the results are
written as markdown and JSON side by side."""

from __future__ import annotations

import json

import pytest

from finetune.models import tiny

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["count: red blue green", "reverse: the cat sat", "hi", "copy: one two three"]
TOKENS = 8


def greedy(model, tok, prompt: str) -> str:
    import torch

    ids = tok(tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True),
              add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=TOKENS, do_sample=False, eos_token_id=[tok.eos_token_id],
                             pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def test_local_task_base_and_adapter_side_by_side(tmp_path, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.inference import eval as E

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    model_dir = tiny.build(tmp_path / "model", style="chatml", hidden=64, layers=2)
    adapter = tiny.save_random_adapter(model_dir, tmp_path / "adapter", r=4, seed=5)
    tok = AutoTokenizer.from_pretrained(model_dir)
    base = [greedy(AutoModelForCausalLM.from_pretrained(model_dir).eval(), tok, p) for p in PROMPTS]
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(adapter)).eval()
    tuned = [greedy(peft, tok, p) for p in PROMPTS]
    assert all(b != t for b, t in zip(base, tuned))  # the adapter changes every answer
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    answers = base[:3] + tuned[3:]
    tiny.write_jsonl(tasks / "words.jsonl", [{"q": p, "a": a} for p, a in zip(PROMPTS, answers)])
    (tasks / "words.yaml").write_text(f"""task: words
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(tasks / "words.jsonl"))}
test_split: test
output_type: generate_until
doc_to_text: "{{{{q}}}}"
doc_to_target: "{{{{a}}}}"
target_delimiter: ""
generation_kwargs: {{until: [], do_sample: false, max_gen_toks: {TOKENS}}}
metric_list:
  - {{metric: exact_match, aggregation: mean, higher_is_better: true, regexes_to_ignore: ["^\\\\s+", "\\\\s+$"]}}
""")
    out = tmp_path / "out"
    E.main(["--model_name_or_path", str(model_dir), "--adapter", str(adapter), "--tasks", "words,finetune_quickstart",
            "--include_path", str(tasks), "--limit", "4", "--output_dir", str(out), "--batch_size", "4"])
    results = json.loads((out / "results.json").read_text())["results"]
    assert results["base"]["words"]["exact_match"] == pytest.approx(0.75)
    assert results["fine-tuned"]["words"]["exact_match"] == pytest.approx(0.25)
    assert results["base"]["words"]["samples"] == 4
    # the bundled task: the quickstart's held-out records (the first 4), scored for both models
    assert results["base"]["finetune_quickstart"]["samples"] == 4
    assert 0 <= results["fine-tuned"]["finetune_quickstart"]["exact_match"] <= 1
    quickstart_data = (out / "tasks" / "finetune_quickstart.jsonl").read_text().splitlines()
    assert len(quickstart_data) == 80 and json.loads(quickstart_data[0])["answer"].startswith("{")
    table = (out / "results.md").read_text()
    assert "| words | exact_match | 0.7500 ± 0.2500 | 0.2500 ± 0.2500 | -0.5000 |" in table, table



QA = [("Which is a colour?", ["red", "stone", "seven"]), ("Which one flies?", ["bird", "rock", "table", "spoon"]),
      ("Pick the number.", ["three", "blue", "cat"]), ("What is cold?", ["ice", "fire", "sun"])]
ARC = [("Which of these is a liquid at room temperature?", ["water", "iron", "salt", "wood"]),
       ("What do plants need to make food?", ["sunlight", "sand", "plastic", "noise"]),
       ("Which planet is closest to the Sun?", ["Mercury", "Mars", "Jupiter", "Neptune"]),
       ("What force pulls objects toward Earth?", ["gravity", "magnetism", "friction"]),
       ("Which is a mammal?", ["whale", "shark", "trout", "eel"]),
       ("What is the boiling point of water at sea level?", ["100 C", "50 C", "0 C", "10 C"])]


def loglikelihoods(model, tok, context: str, choices: list[str]) -> list[float]:
    """log p(" " + choice | context) for each choice, in float64: the continuation's tokens are those of the whole
    text after the context's, as a causal model's harness splits them."""
    import torch

    out = []
    for choice in choices:
        whole, ctx = tok.encode(context + " " + choice), tok.encode(context)
        with torch.no_grad():
            logp = model(torch.tensor([whole])).logits[0].double().log_softmax(-1)
        out.append(sum(logp[len(ctx) - 1 + i, t].item() for i, t in enumerate(whole[len(ctx):])))
    return out


def scores(lls: list[list[float]], choices: list[list[str]], gold: list[int]) -> dict[str, float]:
    """acc (the most likely choice is the gold one) and acc_norm (likelihood per character of the choice)."""
    import numpy as np

    acc = [int(np.argmax(ll)) == g for ll, g in zip(lls, gold)]
    norm = [int(np.argmax(np.array(ll) / [len(c) for c in cs])) == g for ll, cs, g in zip(lls, choices, gold)]
    return {"acc": sum(acc) / len(acc), "acc_norm": sum(norm) / len(norm)}


@pytest.mark.slow
def test_hub_tasks_offline_score_as_computed_from_the_records(tmp_path, capsys):
    """Tasks whose data is a Hugging Face Hub data set, read offline (HF_HUB_OFFLINE=1) by the harness through datasets'
    real cache code from an HF cache the test writes as an online run leaves it: a task of our own
    (`dataset_path: tinyorg/tiny-qa`) and the harness' own registry task `arc_easy` (allenai/ai2_arc, config ARC-Easy,
    its test split), in one `finetune eval` process. Each score equals the one computed here from the same records with
    transformers: the gold answer is the model's own most likely choice for 2 of 4 and 4 of 6 records, so acc is 0.5
    and 4/6 by construction; acc_norm is computed likewise."""
    import numpy as np
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.launch import BIN, run
    from tests.test_hub import cache_dataset, hf_env

    model_dir = tiny.build(tmp_path / "model", style="chatml", hidden=64, layers=2)
    tok, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir).eval()

    def gold_for(contexts, choices, right: int) -> tuple[list[int], list[list[float]]]:
        """the model's own choice for the first `right` records, another choice for the rest"""
        lls = [loglikelihoods(model, tok, c, cs) for c, cs in zip(contexts, choices)]
        best = [int(np.argmax(ll)) for ll in lls]
        return [b if i < right else (b + 1) % len(cs) for i, (b, cs) in enumerate(zip(best, choices))], lls

    qa_gold, qa_lls = gold_for([f"Q: {q}\nA:" for q, _ in QA], [cs for _, cs in QA], 2)
    arc_gold, arc_lls = gold_for([f"Question: {q}\nAnswer:" for q, _ in ARC], [cs for _, cs in ARC], 4)
    want = {"tiny_qa": scores(qa_lls, [cs for _, cs in QA], qa_gold),
            "arc_easy": scores(arc_lls, [cs for _, cs in ARC], arc_gold)}
    assert want["tiny_qa"]["acc"] == 0.5 and want["arc_easy"]["acc"] == pytest.approx(4 / 6)

    hf_home, data = tmp_path / "hf_home", tmp_path / "data"
    data.mkdir()
    tiny.write_jsonl(data / "qa.jsonl", [{"q": q, "options": cs, "answer": g} for (q, cs), g in zip(QA, qa_gold)])
    labels = lambda n, i: [str(k + 1) for k in range(n)] if i == 3 else list("ABCD"[:n])  # ARC has both kinds
    arc = [{"id": f"Mercury_{i}", "question": q, "choices": {"text": cs, "label": labels(len(cs), i)},
            "answerKey": labels(len(cs), i)[g]} for i, ((q, cs), g) in enumerate(zip(ARC, arc_gold))]
    tiny.write_jsonl(data / "arc_test.jsonl", arc)
    # other splits with other records: scoring one of them instead would not give these numbers
    tiny.write_jsonl(data / "arc_other.jsonl", [{**arc[0], "id": "other", "answerKey": "D"}])
    cache_dataset(hf_home, "tinyorg/tiny-qa", {"test": data / "qa.jsonl"}, "1" * 40)
    cache_dataset(hf_home, "allenai/ai2_arc", {"train": data / "arc_other.jsonl", "validation": data / "arc_other.jsonl",
                                               "test": data / "arc_test.jsonl"}, "2" * 40, config="ARC-Easy")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_qa.yaml").write_text("""task: tiny_qa
dataset_path: tinyorg/tiny-qa
test_split: test
output_type: multiple_choice
doc_to_text: "Q: {{q}}\\nA:"
doc_to_choice: "{{options}}"
doc_to_target: "{{answer}}"
metric_list:
  - {metric: acc, aggregation: mean, higher_is_better: true}
  - {metric: acc_norm, aggregation: mean, higher_is_better: true}
""")
    out = tmp_path / "out"
    result = run([str(BIN / "finetune"), "eval", "--model_name_or_path", str(model_dir), "--tasks", "tiny_qa,arc_easy",
                  "--include_path", str(tasks), "--apply_chat_template", "false", "--output_dir", str(out),
                  "--batch_size", "4"], timeout=400, HF_HUB_OFFLINE="1", **hf_env(hf_home))
    result.check()
    got = json.loads((out / "results.json").read_text())["results"]["base"]
    for task, metrics in want.items():
        assert got[task]["samples"] == len(QA if task == "tiny_qa" else ARC), got[task]
        assert {k: got[task][k] for k in metrics} == pytest.approx(metrics), (task, got[task], metrics)
    with capsys.disabled():
        print(f"\nfinetune eval, Hub tasks offline: {', '.join(f'{t} {m}' for t, m in want.items())} (harness = here)")


def test_a_hub_task_whose_data_is_not_cached_offline_is_one_message(tmp_path, capsys):
    """HF_HUB_OFFLINE=1 (the tests' environment) and a task on a Hub data set the cache lacks: one line naming the
    data set, the cache and the fix, exit 2, no results written."""
    from huggingface_hub import constants

    from finetune.inference import eval as E

    assert constants.HF_HUB_OFFLINE
    model_dir = tiny.build(tmp_path / "model", style="chatml", hidden=64, layers=2)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "absent.yaml").write_text("""task: absent
dataset_path: tinyorg/never-cached
test_split: test
output_type: generate_until
doc_to_text: "{{q}}"
doc_to_target: "{{a}}"
metric_list:
  - {metric: exact_match, aggregation: mean, higher_is_better: true}
""")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        E.main(["--model_name_or_path", str(model_dir), "--tasks", "absent", "--include_path", str(tasks),
                "--output_dir", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "finetune eval: --tasks absent: a task's data set could not be read (Couldn't reach 'tinyorg/never-cached'" \
        in err and "HF_HUB_OFFLINE=1 forbids downloading" in err, err
    assert "Traceback" not in err and not (out / "results.json").exists()
