"""Write data/quickstart/{train,heldout}.jsonl and {train,heldout}_pairs.jsonl: the quickstart's instruction data
and its preference pairs (Apache-2.0, like the repository).

    python scripts/make_quickstart_data.py [--out data/quickstart]

The skill: read one order written as a free-form English sentence (a dozen phrasings, the fields in any order)
and answer with exactly one JSON object of a fixed shape, {"name", "city", "item", "quantity"}, nothing else.
SmolLM2-135M-Instruct does not do this out of the box (it answers in prose, reorders or renames keys, or adds
fields), and the answer can be scored exactly: the completion equals the reference string or it does not.

The pairs (`finetune quickstart --dpo`, docs/preference.md's strings form): one per record of the same split, the
prompt being the record's user turn, `chosen` its reference answer and `rejected` a plausible near miss: the same
JSON with one thing wrong as a model gets it wrong (a quantity off by one or its digits swapped, the quantity as
a string or with its unit, another adjective or noun in the item, another city, the name's last name changed or
its two parts swapped, a field left out, a key renamed). `near_miss` names the mistake. In a third of the pairs the
prompt also carries a distractor, one more sentence naming a second city, number or person (`distractor_*`: the
warehouse it ships from, the billing address, an order reference, the clerk who took it), and the rejected answer
takes the distractor: the SFT records never show such a sentence, so the SFT model is unsure which value is meant
and DPO has something to teach. The held-out pairs come from the held-out records only.

Deterministic: the same seed writes the same bytes (tests/test_quickstart.py re-runs this script and compares
with the committed files). Names, cities and items are invented combinations; nothing is copied from anywhere.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
INSTRUCTION = "Extract the order as JSON with keys name, city, item, quantity."

FIRST = ("Ana", "Ben", "Chloe", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemal", "Lucia",
         "Mateo", "Nadia", "Oscar", "Priya", "Quentin", "Rosa", "Sami", "Tomas", "Uma", "Viktor", "Wen", "Yara", "Zoe")
LAST = ("Almeida", "Brandt", "Costa", "Dubois", "Eriksen", "Fischer", "Garcia", "Haddad", "Ito", "Jensen", "Kowalski",
        "Larsen", "Moreau", "Novak", "Okafor", "Petrov", "Quinn", "Rossi", "Silva", "Tanaka", "Urban", "Varga", "Weber")
CITIES = ("Lisbon", "Lyon", "Porto", "Graz", "Leeds", "Turin", "Ghent", "Bergen", "Krakow", "Malmo", "Bilbao", "Utrecht",
          "Nantes", "Aarhus", "Brno", "Cork", "Dresden", "Geneva", "Seville", "Tampere", "Split", "Riga", "Bologna")
ADJECTIVES = ("blue", "steel", "wool", "oak", "glass", "copper", "linen", "red", "ceramic", "leather", "bamboo", "green")
NOUNS = ("kettle", "scarf", "lamp", "chair", "teapot", "notebook", "backpack", "mug", "blanket", "clock", "vase", "jacket")
# {n} name, {c} city, {i} item, {q} quantity: the same fields, phrased and ordered a dozen ways.
TEMPLATES = (
    "{n} ordered {q} x {i} for delivery to {c}.",
    "Please ship {q} units of {i} to {n} in {c}.",
    "From {c}, {n} wants {q} of the {i}.",
    "Customer {n} ({c}) requested {q} pieces: {i}.",
    "Deliver to {c}: {q} x {i}, customer {n}.",
    "New order - item: {i}; quantity: {q}; buyer: {n}; ship to {c}.",
    "{n} would like {q} units of {i} sent to {c}.",
    "Send {i} (qty {q}) to {c} for {n}.",
    "Order from {n}: {q} x {i}. Destination: {c}.",
    "In {c}, {n} just bought {q} units of {i}.",
    "{q} units of {i} go to {n}, who lives in {c}.",
    "Ship to: {n}, {c}. Contents: {i}, quantity {q}.",
)


def example(rng: random.Random) -> tuple[dict, tuple]:
    name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    city = rng.choice(CITIES)
    item = f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"
    quantity = rng.randint(1, 40)
    sentence = rng.choice(TEMPLATES).format(n=name, c=city, i=item, q=quantity)
    answer = json.dumps({"name": name, "city": city, "item": item, "quantity": quantity})
    record = {"messages": [
        {"role": "user", "content": f"{INSTRUCTION}\n{sentence}"},
        {"role": "assistant", "content": answer},
    ]}
    return record, (name, city, item, quantity)


def build(n_train: int = 800, n_heldout: int = 80, seed: int = 5) -> tuple[list[dict], list[dict]]:
    """Held-out orders never share all four fields with a training order."""
    rng = random.Random(seed)
    seen: set[tuple] = set()
    train: list[dict] = []
    heldout: list[dict] = []
    while len(train) < n_train:
        record, key = example(rng)
        if key not in seen:
            seen.add(key)
            train.append(record)
    while len(heldout) < n_heldout:
        record, key = example(rng)
        if key not in seen:
            seen.add(key)
            heldout.append(record)
    return train, heldout


NEAR_MISSES = ("quantity", "quantity_type", "item", "city", "name", "missing_field", "renamed_key")
# The sentence added to the prompt, and the field whose value the rejected answer takes from it.
DISTRACTORS = {
    "distractor_warehouse": ("It ships from our {c} warehouse.", "city"),
    "distractor_billing": ("Billing address: {c}.", "city"),
    "distractor_reference": ("Order reference: {q}.", "quantity"),
    "distractor_clerk": ("Taken by {n} at the front desk.", "name"),
}
KINDS = NEAR_MISSES + tuple(DISTRACTORS)
RENAMED = {"name": ("customer", "buyer"), "city": ("destination", "ship_to"), "item": ("product", "article"),
           "quantity": ("qty", "count")}


def near_miss(answer: dict, kind: str, rng: random.Random) -> dict:
    """The answer with one realistic mistake of the given kind (never equal to the answer)."""
    out = dict(answer)
    q = answer["quantity"]
    if kind == "quantity":
        swapped = int(str(q)[::-1]) if q >= 10 and str(q)[0] != str(q)[1] and q % 10 else None
        out["quantity"] = swapped if swapped and rng.random() < 0.5 else (q + 1 if q == 1 or rng.random() < 0.5 else q - 1)
    elif kind == "quantity_type":
        out["quantity"] = rng.choice((str(q), f"{q} units", f"{q} x"))
    elif kind == "item":
        adjective, noun = answer["item"].split(" ")
        if rng.random() < 0.5:
            adjective = rng.choice([a for a in ADJECTIVES if a != adjective])
        else:
            noun = rng.choice([n for n in NOUNS if n != noun])
        out["item"] = f"{adjective} {noun}"
    elif kind == "city":
        out["city"] = rng.choice([c for c in CITIES if c != answer["city"]])
    elif kind == "name":
        first, last = answer["name"].split(" ")
        out["name"] = f"{last} {first}" if rng.random() < 0.5 else f"{first} {rng.choice([x for x in LAST if x != last])}"
    elif kind == "missing_field":
        del out[rng.choice(list(answer))]
    elif kind == "renamed_key":
        key = rng.choice(list(answer))
        new = rng.choice(RENAMED[key])
        out = {new if k == key else k: v for k, v in answer.items()}
    else:
        raise ValueError(kind)
    assert out != answer
    return out


def distractor(answer: dict, kind: str, rng: random.Random) -> tuple[str, dict]:
    """(the sentence to add to the prompt, the answer with the field taken from that sentence instead)."""
    sentence, field = DISTRACTORS[kind]
    if field == "city":
        value = rng.choice([c for c in CITIES if c != answer["city"]])
    elif field == "quantity":
        value = rng.randint(41, 99)  # above every real quantity (1-40), so never equal to it
    else:
        value = next(n for n in iter(lambda: f"{rng.choice(FIRST)} {rng.choice(LAST)}", None) if n != answer["name"])
    return sentence.format(c=value, q=value, n=value), {**answer, field: value}


def pairs(records: list[dict], rng: random.Random) -> list[dict]:
    """One preference pair per 'messages' record: its answer against a near miss, the kinds in turn, shuffled."""
    kinds = [KINDS[i % len(KINDS)] for i in range(len(records))]
    rng.shuffle(kinds)
    out = []
    for record, kind in zip(records, kinds):
        user, assistant = record["messages"]
        answer = json.loads(assistant["content"])
        prompt = user["content"]
        if kind in DISTRACTORS:
            sentence, wrong = distractor(answer, kind, rng)
            prompt = f"{prompt} {sentence}"
        else:
            wrong = near_miss(answer, kind, rng)
        out.append({"prompt": prompt, "chosen": assistant["content"], "rejected": json.dumps(wrong), "near_miss": kind})
    return out


def build_pairs(train: list[dict], heldout: list[dict], seed: int = 5) -> tuple[list[dict], list[dict]]:
    """Training pairs from the training records, held-out pairs from the held-out ones (a generator of their own,
    so the SFT files do not depend on it)."""
    rng = random.Random(f"pairs-{seed}")
    return pairs(train, rng), pairs(heldout, rng)


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "data" / "quickstart"))
    ap.add_argument("--train", type=int, default=800)
    ap.add_argument("--heldout", type=int, default=80)
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args(argv)
    train, heldout = build(args.train, args.heldout, args.seed)
    out = Path(args.out)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "heldout.jsonl", heldout)
    train_pairs, heldout_pairs = build_pairs(train, heldout, args.seed)
    write_jsonl(out / "train_pairs.jsonl", train_pairs)
    write_jsonl(out / "heldout_pairs.jsonl", heldout_pairs)
    print(f"wrote {len(train)} train and {len(heldout)} held-out records to {out}, and a preference pair for each")


if __name__ == "__main__":
    main()
