"""Write data/vision/: a tiny image data set for docs/vision.md's worked example. 12 pictures of 32x32 pixels (a red,
green or blue square, circle, triangle or cross on white), train.jsonl in TRL's conversational vision format:
one-image questions, two-image comparisons over two turns, and text-only records in the same file; and pairs.jsonl,
preference pairs in TRL's vision preference format (DPO: the right description chosen, a wrong one rejected).

Drawn here with Pillow, no third-party images: the files are under the repository's Apache-2.0 license.
"""

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220)}
SHAPES = ("square", "circle", "triangle", "cross")


def draw(shape: str, colour: tuple[int, int, int]) -> Image.Image:
    image = Image.new("RGB", (32, 32), "white")
    d = ImageDraw.Draw(image)
    if shape == "square":
        d.rectangle((7, 7, 24, 24), fill=colour)
    elif shape == "circle":
        d.ellipse((6, 6, 25, 25), fill=colour)
    elif shape == "triangle":
        d.polygon([(16, 5), (27, 26), (5, 26)], fill=colour)
    else:
        d.rectangle((13, 5, 18, 26), fill=colour)
        d.rectangle((5, 13, 26, 18), fill=colour)
    return image


def user(text: str, images: int = 0) -> dict:
    return {"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}


def records(pictures: list[tuple[str, str, str]], rng: random.Random) -> list[dict]:
    out = []
    for path, colour, shape in pictures:
        out.append({"messages": [user("What is in this picture?", 1),
                                 {"role": "assistant", "content": f"A {colour} {shape}."}], "images": [path]})
    for _ in range(12):
        (a, ca, sa), (b, cb, sb) = rng.sample(pictures, 2)
        answer = f"Yes: both are {ca}." if ca == cb else f"No: one is {ca}, the other {cb}."
        out.append({"messages": [user("Are these two the same colour?", 2), {"role": "assistant", "content": answer},
                                 user("And their shapes?"),
                                 {"role": "assistant", "content": f"A {sa} and a {sb}."}], "images": [a, b]})
    for colour in COLOURS:
        out.append({"messages": [{"role": "user", "content": f"Name a {colour} fruit."},
                                 {"role": "assistant", "content": {"red": "A cherry.", "green": "A lime.",
                                                                   "blue": "A blueberry."}[colour]}]})
    rng.shuffle(out)
    return out


def pairs(pictures: list[tuple[str, str, str]], rng: random.Random) -> list[dict]:
    out = []
    for path, colour, shape in pictures:
        wrong_colour = rng.choice([c for c in COLOURS if c != colour])
        wrong_shape = rng.choice([s for s in SHAPES if s != shape])
        out.append({"images": [path], "prompt": [user("What is in this picture?", 1)],
                    "chosen": [{"role": "assistant", "content": f"A {colour} {shape}."}],
                    "rejected": [{"role": "assistant", "content": f"A {wrong_colour} {wrong_shape}."}]})
    for _ in range(6):
        (a, ca, _), (b, cb, _) = rng.sample(pictures, 2)
        right = f"Yes: both are {ca}." if ca == cb else f"No: one is {ca}, the other {cb}."
        wrong = f"No: one is {ca}, the other {rng.choice([c for c in COLOURS if c != ca])}." if ca == cb else \
            f"Yes: both are {ca}."
        out.append({"images": [a, b], "prompt": [user("Are these two the same colour?", 2)],
                    "chosen": [{"role": "assistant", "content": right}],
                    "rejected": [{"role": "assistant", "content": wrong}]})
    rng.shuffle(out)
    return out


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent / "data" / "vision"
    (root / "images").mkdir(parents=True, exist_ok=True)
    pictures = []
    for k, (colour, shape) in enumerate((c, s) for c in COLOURS for s in SHAPES):
        path = f"images/{colour}-{shape}.png"
        draw(shape, COLOURS[colour]).save(root / path, optimize=True)
        pictures.append((path, colour, shape))
    rows = records(pictures, random.Random(0))
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    preference = pairs(pictures, random.Random(1))
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in preference))
    print(f"{root}: {len(rows)} records, {len(preference)} preference pairs, {len(pictures)} images")
