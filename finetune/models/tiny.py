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


# ---- tiny vision-language models, with their real processors ----

# The chat templates of the published checkpoints' processors (chat_template.json), for the tokenizers whose own
# template is the text model's: Qwen2-VL's and Qwen2.5-VL's; Qwen3-VL-Instruct's without its tool-call branches;
# SmolVLM's; llava-1.5-7b-hf's; llava-v1.6-mistral-7b-hf's. Gemma-3's tokenizer_config.json carries its own.
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN3_VL_TEMPLATE = (
    "{%- set image_count = namespace(value=0) -%}{%- set video_count = namespace(value=0) -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}{%- else -%}"
    "{%- for content in message['content'] -%}"
    "{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content -%}"
    "{%- set image_count.value = image_count.value + 1 -%}"
    "{%- if add_vision_id -%}{{- 'Picture ' + image_count.value|string + ': ' -}}{%- endif -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif content['type'] == 'video' or 'video' in content -%}{%- set video_count.value = video_count.value + 1 -%}"
    "{%- if add_vision_id -%}{{- 'Video ' + video_count.value|string + ': ' -}}{%- endif -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in content -%}{{- content['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
LLAVA_NEXT_MISTRAL_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<<SYS>>\n' + message['content'][0]['text'] + '\n<</SYS>>\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' }}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] }}{% endfor %}"
    "{{' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'][0]['text'] + '</s> '}}{% endif %}"
    "{% endfor %}"
)

VLMS = ("gemma3", "qwen2_5_vl", "qwen3_vl", "smolvlm", "llava", "llava_next")
# The tiny language models' sizes: grouped-query attention (4 heads, 2 key/value heads), 2 layers.
VLM_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=1024, rms_norm_eps=1e-6)
# The repository's real tokenizers (tests/data/README.md says where each comes from).
DATA = Path(__file__).resolve().parents[2] / "tests" / "data"


def real_tokenizer_files(name: str, out: Path, data: Path | None = None) -> Path:
    """The files of tests/data/NAME (xz- or gzip-compressed or not), unpacked into OUT."""
    import gzip
    import lzma

    src = Path(data or DATA) / name
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: the real tokenizer files of the tiny vision-language models are in the "
                                "repository's tests/data (a source checkout)")
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.name == "README.md":
            continue
        raw = f.read_bytes()
        raw = lzma.decompress(raw) if f.suffix == ".xz" else gzip.decompress(raw) if f.suffix == ".gz" else raw
        (out / f.name.removesuffix(".xz").removesuffix(".gz")).write_bytes(raw)
    return out


def tiny_vlm(name: str, folder: str | Path, seed: int = 0, data: Path | None = None) -> Path:
    """A tiny random vision-language model of family NAME (VLMS) in FOLDER: transformers' config class with the real
    shape features (grouped-query attention, Qwen's mrope sections and merger, Qwen3-VL's deepstack mergers, Gemma-3's
    sliding layers and pooled image tokens, SmolVLM's image splitting and pixel shuffle, LLaVA-NeXT's tiles), random
    weights (norms and biases too), saved as safetensors with a real processor beside it (the family's real tokenizer
    with its image tokens, its image processor and its chat template). Built once per FOLDER: a folder already holding
    the same build is returned as it is."""
    import shutil
    import tempfile

    folder = Path(folder)
    stamp = f"{name} seed={seed} v2"
    if (folder / ".tiny_vlm").is_file() and (folder / ".tiny_vlm").read_text() == stamp:
        return folder
    if name not in VLMS:
        raise ValueError(f"tiny_vlm: '{name}' is not one of {', '.join(VLMS)}")
    from finetune.compat import processors_without_video

    processors_without_video()
    with tempfile.TemporaryDirectory() as tmp:
        processor, config = _VLM_BUILDERS[name](Path(tmp), data)
    _save_vlm(config, processor, folder, seed)
    (folder / ".tiny_vlm").write_text(stamp)
    shutil.rmtree(folder / "__pycache__", ignore_errors=True)
    return folder


def _save_vlm(config, processor, folder: Path, seed: int) -> None:
    import torch
    from transformers import AutoModelForImageTextToText

    tok = processor.tokenizer
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():  # random norms and biases, so that a wrong name or layout shows in the logits
        for module_name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            kind = type(module).__name__
            if isinstance(weight, torch.nn.Parameter) and ("Norm" in kind or "norm" in kind):
                weight.normal_(0.0 if kind.startswith("Gemma") else 1.0, 0.1)
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.nn.Parameter):
                bias.normal_(0.0, 0.1)
    model.generation_config.eos_token_id = config.get_text_config().eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(folder)
    processor.save_pretrained(folder)


def _gemma3(tmp: Path, data):
    from transformers import AutoTokenizer, Gemma3Config, Gemma3ImageProcessorPil, Gemma3Processor

    tok = AutoTokenizer.from_pretrained(real_tokenizer_files("gemma3", tmp / "tok", data))
    tokens = 4  # mm_tokens_per_image: the 2 x 2 patches of a 28-pixel image, pooled 1:1
    processor = Gemma3Processor(Gemma3ImageProcessorPil(size={"height": 28, "width": 28}), tok,
                                chat_template=tok.chat_template, image_seq_length=tokens)
    # Gemma-3's five sliding layers to one global (llama.cpp's gemma3 fixes that pattern).
    text = dict(VLM_TEXT, vocab_size=262208, query_pre_attn_scalar=8, sliding_window=16, num_hidden_layers=6,
                layer_types=["sliding_attention"] * 5 + ["full_attention"], pad_token_id=tok.pad_token_id,
                bos_token_id=tok.bos_token_id, eos_token_id=[tok.eos_token_id, 1])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                  patch_size=14, vision_use_head=False)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=tokens,
                          image_token_index=tok.convert_tokens_to_ids("<image_soft_token>"),
                          boi_token_index=tok.convert_tokens_to_ids("<start_of_image>"),
                          eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"),
                          pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=text["eos_token_id"])
    return processor, config


def _qwen_tokenizer(tmp: Path, data):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_tokenizer_files("qwen3", tmp / "tok", data))


def _qwen_ids(tok) -> dict:
    ids = {k: tok.convert_tokens_to_ids(t) for k, t in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    return dict(ids, bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)


def _qwen2_5_vl(tmp: Path, data):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil

    tok = _qwen_tokenizer(tmp, data)
    # Images of 56 x 56 to 112 x 112 pixels: 4 x 4 to 8 x 8 patches of 14, 4 to 16 tokens after the 2 x 2 merge.
    images = Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112}, patch_size=14,
                                      merge_size=2, temporal_patch_size=2)
    processor = Qwen2_5_VLProcessor(image_processor=images, tokenizer=tok, chat_template=QWEN2_VL_TEMPLATE)
    ids = _qwen_ids(tok)
    # mrope: the 4 rotary frequency pairs of head_dim 8 split 1 temporal, 1 height, 2 width (7B: 16, 24, 24 of 64).
    text = dict(VLM_TEXT, vocab_size=151936, rope_theta=1000000.0, tie_word_embeddings=True,
                rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, **ids)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1], out_hidden_size=32)
    return processor, Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)


def _qwen3_vl(tmp: Path, data):
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLProcessor

    tok = _qwen_tokenizer(tmp, data)
    # Patches of 16, merged 2 x 2: images of 64 x 64 to 128 x 128 pixels, 4 to 16 tokens.
    images = Qwen2VLImageProcessorPil(size={"shortest_edge": 64 * 64, "longest_edge": 128 * 128}, patch_size=16,
                                      merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = Qwen3VLProcessor(image_processor=images, tokenizer=tok, chat_template=QWEN3_VL_TEMPLATE)
    ids = _qwen_ids(tok)
    # Interleaved mrope over head_dim 8's 4 frequency pairs (8B: 24, 20, 20 of 64), Qwen3's q/k norms.
    text = dict(VLM_TEXT, vocab_size=151936, rope_theta=5000000.0, tie_word_embeddings=True,
                rope_scaling={"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True}, **ids)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0],
                  out_hidden_size=32, hidden_act="gelu_pytorch_tanh")
    return processor, Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)


# SmolVLM's tokens beyond SmolLM2's vocabulary, as its tokenizer adds them: the image's frame, the image token, the
# end of a turn, the global image's tag and the tiles' row/column tags.
SMOLVLM_TOKENS = (["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
                  + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)])


def _smolvlm(tmp: Path, data):
    from transformers import AutoTokenizer, SmolVLMConfig, SmolVLMImageProcessorPil, SmolVLMProcessor

    tok = AutoTokenizer.from_pretrained(real_tokenizer_files("smollm2", tmp / "tok", data))
    tok.add_special_tokens({"additional_special_tokens": SMOLVLM_TOKENS})
    tok.eos_token = "<end_of_utterance>"
    # Tiles of 32 pixels (2 x 2 patches of 16, pixel-shuffled by 2 into 1 token); an image of up to 64 pixels is split
    # into up to 2 x 2 tiles plus the global image.
    images = SmolVLMImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                                      do_image_splitting=True)
    processor = SmolVLMProcessor(images, tok, None, image_seq_len=1, chat_template=SMOLVLM_TEMPLATE)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    text = dict(VLM_TEXT, model_type="llama", vocab_size=49280, rope_theta=100000.0, tie_word_embeddings=True, **ids)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=16)
    config = SmolVLMConfig(text_config=text, vision_config=vision, scale_factor=2,
                           image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=True, **ids)
    return processor, config


def _llava_tokenizer(tmp: Path, data):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_tokenizer_files("sentencepiece", tmp / "tok", data))
    tok.add_tokens(["<image>"], special_tokens=True)  # id 32000, then <pad>, as llava-hf's tokenizers add them
    tok.add_special_tokens({"pad_token": "<pad>"})
    return tok


def _llava_common(tok) -> dict:
    return dict(vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14,
                                   projection_dim=32),
                image_token_index=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
                vision_feature_select_strategy="default", pad_token_id=tok.pad_token_id)


def _llava(tmp: Path, data):
    from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaProcessor

    tok = _llava_tokenizer(tmp, data)
    images = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(images, tok, patch_size=14, vision_feature_select_strategy="default",
                               chat_template=LLAVA_TEMPLATE, num_additional_image_tokens=1)
    text = dict(VLM_TEXT, model_type="llama", vocab_size=32064, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return processor, LlavaConfig(text_config=text, **_llava_common(tok))


def _llava_next(tmp: Path, data):
    from transformers import LlavaNextConfig, LlavaNextImageProcessorPil, LlavaNextProcessor

    tok = _llava_tokenizer(tmp, data)
    # llava-v1.6's tiles (336 pixels, pinpoints up to 1008) at 28: a 28-pixel tile, grids up to 2 x 2 and 3 x 1.
    pinpoints = [[28, 56], [56, 28], [56, 56], [84, 28], [28, 84]]
    images = LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                        image_grid_pinpoints=pinpoints)
    processor = LlavaNextProcessor(images, tok, patch_size=14, vision_feature_select_strategy="default",
                                   chat_template=LLAVA_NEXT_MISTRAL_TEMPLATE, num_additional_image_tokens=1)
    text = dict(VLM_TEXT, model_type="mistral", vocab_size=32064, sliding_window=None, rope_theta=1000000.0,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return processor, LlavaNextConfig(text_config=text, image_grid_pinpoints=pinpoints, **_llava_common(tok))


_VLM_BUILDERS = {"gemma3": _gemma3, "qwen2_5_vl": _qwen2_5_vl, "qwen3_vl": _qwen3_vl, "smolvlm": _smolvlm,
                 "llava": _llava, "llava_next": _llava_next}
