"""Tiny Llama models, tokenizers and data built locally, for tests and the offline demo job.

Nothing here downloads: the tokenizer is a byte-level BPE trained on the synthetic corpus, and the
model is a randomly initialised LlamaForCausalLM from a LlamaConfig.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# SmolLM2's ChatML template (it injects a default system prompt when the conversation has none).
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama-3-Instruct's template.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
STYLES = {
    "chatml": dict(
        template=CHATML_TEMPLATE, specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos=None, eos="<|im_end|>", unk="<|endoftext|>",
    ),
    "llama3": dict(
        template=LLAMA3_TEMPLATE,
        specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        bos="<|begin_of_text|>", eos="<|eot_id|>", unk=None,
    ),
    # No chat template: alpaca records use the classic Alpaca prompt.
    "plain": dict(template=None, specials=["<s>", "</s>", "<unk>"], bos="<s>", eos="</s>", unk="<unk>"),
}

WORDS = (
    "the a one two three red blue green cat dog bird tree river stone house road city light dark small large "
    "quick slow warm cold open close read write count sort find move give take make list name value number"
).split()


def synthetic_records(n: int, seed: int = 0, fmt: str = "messages", min_words: int = 2, max_words: int = 40) -> list[dict]:
    """Deterministic records with lengths spread over about 20x: copy/reverse/count word tasks."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))]
        task = rng.choice(["reverse", "copy", "count"])
        question = f"{task}: {' '.join(words)}"
        answer = {"reverse": " ".join(reversed(words)), "copy": " ".join(words), "count": str(len(words))}[task]
        if fmt == "text":
            out.append({"text": f"{question} => {answer}"})
        elif fmt == "alpaca":
            rec = {"instruction": f"{task} the words", "output": answer}
            if i % 2 == 0:
                rec["input"] = " ".join(words)
            else:
                rec["instruction"] = question
            out.append(rec)
        else:
            msgs = []
            if i % 3 == 0:
                msgs.append({"role": "system", "content": "You follow word instructions."})
            msgs += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            if i % 2 == 1:  # a second turn
                msgs += [{"role": "user", "content": "again, reversed"}, {"role": "assistant", "content": " ".join(reversed(answer.split()))}]
            out.append({"messages": msgs})
    return out


def build_tokenizer(out_dir: str | Path, style: str = "chatml", vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    spec = STYLES[style]
    corpus = [json.dumps(r) for r in synthetic_records(400, seed=123)] + WORDS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=spec["specials"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=spec["bos"], eos_token=spec["eos"], unk_token=spec["unk"],
        clean_up_tokenization_spaces=False,
    )
    if spec["template"]:
        fast.chat_template = spec["template"]
    if style == "plain":
        # Like Llama-2's tokenizer: prepend BOS to every encoded text.
        from tokenizers import processors

        bos_id = fast.bos_token_id
        fast.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return fast


def build_model(out_dir: str | Path, tokenizer, seed: int = 0, hidden: int = 64, layers: int = 2, tied: bool = False):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=tied,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=None,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir)
    return model


def build(out_dir: str | Path, style: str = "chatml", seed: int = 0, hidden: int = 64, layers: int = 2,
          tied: bool = False) -> Path:
    out = Path(out_dir)
    tok = build_tokenizer(out, style)
    build_model(out, tok, seed=seed, hidden=hidden, layers=layers, tied=tied)
    return out


def write_jsonl(path: str | Path, records: list[dict]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(r) + "\n" for r in records))
    return p


def save_random_adapter(base: str | Path, out: str | Path, *, r: int = 8, seed: int = 0) -> Path:
    """A LoRA adapter on every linear layer of `base` with random (non-zero) A and B, so that it changes the logits."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    peft = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", init_lora_weights=False),
    )
    peft.save_pretrained(out)
    return Path(out)
