"""Write data/demo.jsonl: deterministic word-task conversations (copy, reverse, count) for the demo job.

Generated here, no third-party text: the file is under the repository's Apache-2.0 license.
"""

from pathlib import Path

from finetune.models.tiny import synthetic_records, write_jsonl

if __name__ == "__main__":
    out = Path(__file__).resolve().parent.parent / "data" / "demo.jsonl"
    write_jsonl(out, synthetic_records(256, seed=0, max_words=24))
    print(out)
