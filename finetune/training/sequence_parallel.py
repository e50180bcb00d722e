"""--sequence_parallel_size N on the engine path and the loop: DeepSpeed Ulysses (docs/sequence-parallel.md).

Ranks r*N .. r*N + N - 1 form a sequence-parallel group (DeepSpeed's parallel_state_sp makes the groups so): they
draw the same records (data parallel over world / N groups: DistributedSampler over the groups) and each trains
its slice of every row (finetune.data.sequence). DeepSpeed's UlyssesSPAttentionHF takes over the model's attention
function: an all-to-all turns [slice, all heads] into [whole row, heads / N], the model's own kernel attends (sdpa
causally, or finetune.models.attention's variable-length kernel by the row's record boundaries), and a second
all-to-all gives each rank its slice back. Everything else in a layer works on the slice, so activations per rank
are about 1/N of the unsplit run's.

The loss needs no collective of its own: each rank's loss is its slice's token-loss sum over the trained tokens of
the whole global batch (core.global_count adds every rank's slice counts, so each token counts once), DeepSpeed
averages gradients over all ranks, and the path multiplies by the world size, as without sequence parallelism;
the all-to-all's backward carries each slice's gradient to the ranks whose heads it attended with.
"""

from __future__ import annotations

from finetune import methods
from finetune.process import exit_with

ENGINE = "scripts/sft.py"
LOOP = "finetune/loop.py"


def path_problems(cfg, script: str) -> list[str]:
    """What a path refuses of --sequence_parallel_size (the checks every path makes: finetune.config.training)."""
    size = cfg.launch.sequence_parallel_size
    if size == 1:
        return []
    problems = []
    if script not in (ENGINE, LOOP):
        problems.append(f"sequence_parallel_size: {script} does not split records; sequence parallelism runs on the "
                        "engine path (`deepspeed --num_gpus N scripts/sft.py --config zero3 --sequence_parallel_size "
                        f"{size} ...`, or `finetune engine`) and the loop (finetune/loop.py, `finetune loop`)")
    elif script == LOOP and not cfg.preset.is_deepspeed:
        problems.append(f"sequence_parallel_size: on the loop it needs a DeepSpeed preset (DeepSpeed's communication "
                        f"groups carry the exchange), not --config {cfg.preset.name}; use --config zero2 or zero3")
    name = getattr(getattr(cfg, "objective", None), "method", methods.DEFAULT)
    if name != methods.DEFAULT:
        problems.append(f"sequence_parallel_size: method {name} is not supported (only {methods.DEFAULT}: its "
                        "reference model, pairs and generation are not split); drop --sequence_parallel_size")
    data = cfg.data
    if getattr(data, "eval_dataset", None) or getattr(data, "eval_split_size", None):
        problems.append("sequence_parallel_size: evaluation during training is not supported with it (evaluation "
                        "would run each whole record on one rank); drop --eval_dataset / --eval_split_size and run "
                        "`finetune eval` on the saved model")
    return problems


def groups_or_exit(size: int, world: int, rank: int) -> tuple[int, int, int]:
    """(data-parallel world, data-parallel rank, rank in the sequence-parallel group) of this rank."""
    if world % size:
        exit_with(f"sequence_parallel_size: {size} does not divide the world size {world}; launch a multiple of "
                  f"{size} processes, or set --sequence_parallel_size to a divisor of {world}")
    return world // size, rank // size, rank % size


def model_problems(config, size: int) -> list[str]:
    """What Ulysses cannot split of this model: its attention heads over `size` ranks (key/value heads: divisible,
    or dividing `size`, as DeepSpeed replicates them), a vision tower, an eager kernel (a [length x length] mask)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads, kv = text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    problems = []
    if heads % size:
        problems.append(f"sequence_parallel_size: the model's {heads} attention heads do not split over {size} ranks; "
                        f"use a divisor of {heads}")
    elif kv % size and size % kv:
        problems.append(f"sequence_parallel_size: the model's {kv} key/value heads and {size} ranks: one must divide the "
                        "other; use a divisor of " + str(kv))
    if text is not config:
        problems.append("sequence_parallel_size: vision-language models are not supported (their image tokens and "
                        "vision tower are not split); drop --sequence_parallel_size")
    impl = getattr(config, "_attn_implementation", None)
    if impl in ("eager", "paged|eager"):
        problems.append(f"sequence_parallel_size: attention '{impl}' needs a whole-row mask; use "
                        "--attn_implementation sdpa")
    return problems


def attach(model, size: int) -> None:
    """DeepSpeed's Ulysses attention in place of the model's attention function (every rank, before any forward)."""
    if problems := model_problems(model.config, size):
        exit_with("\n".join(problems))
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = model.config._attn_implementation
    _replaced[impl] = ALL_ATTENTION_FUNCTIONS[impl]
    # Batches of one row (config validation), of any length (a multiple of `size`: finetune.data.sequence pads).
    # disable_in_eval: a forward in eval mode (the saved model's check) runs whole rows on one rank.
    UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=impl, sequence_parallel_size=size, micro_batch_size=1,
        seq_length_is_variable=True, disable_in_eval=True)


def detach() -> None:
    """The attention functions attach replaced, back (DeepSpeed replaces them for every model of the process): after
    training, the final save's reload check runs the saved model on rank 0 alone."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for impl, fn in _replaced.items():
        ALL_ATTENTION_FUNCTIONS[impl] = fn
    _replaced.clear()


_replaced: dict = {}
