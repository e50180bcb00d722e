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

