"""The quickstart's training process: finetune/train.py's main with a progress bar and a time bound.

Launched by `finetune quickstart` (one process, or one per rank under accelerate launch); takes train.py's flags.
QUICKSTART_DEADLINE (seconds since the epoch) is the time bound: training stops after the step that would
otherwise let the next one end past it, and the model trained so far is saved as usual.
"""

from __future__ import annotations

import os
import sys
import time


from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback


class TimeBound(TrainerCallback):
    """Stop at a wall-clock deadline. Every rank must stop at the same step (a rank that stops alone leaves the
    others waiting in the next all-reduce forever), so rank 0 decides and broadcasts its decision."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.last = None
        self.step_times: list[float] = []
        self.stopped_early = False

    def on_step_begin(self, args, state, control, **kwargs):
        if self.last is None:
            self.last = time.time()

    def on_step_end(self, args, state, control, **kwargs):
        import torch
        import torch.distributed as dist

        now = time.time()
        self.step_times.append(now - self.last)
        self.last = now
        # The next step takes about as long as the recent ones (the first one also pays warm-up: skip it).
        recent = self.step_times[1:][-5:] or self.step_times
        stop = now + sum(recent) / len(recent) > self.deadline
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([1.0 if stop else 0.0], device=args.device)
            dist.broadcast(flag, src=0)
            stop = bool(flag.item())
        if stop and state.global_step < state.max_steps:
            self.stopped_early = True
            control.should_training_stop = True
            if state.is_world_process_zero:
                print(f"\nquickstart: time bound reached after step {state.global_step} of {state.max_steps}; "
                      "saving the model trained so far", file=sys.stderr, flush=True)


class QuietProgress(ProgressCallback):
    """The Trainer's progress bar, with the latest loss in the bar instead of one printed line per step."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and logs and "loss" in logs:
            self.training_bar.set_postfix(loss=f"{logs['loss']:.4f}")


def main(argv: list[str] | None = None) -> None:
    import transformers.trainer

    from finetune.training import trainer as train

    # The Trainer reads this module attribute when it is built: our bar replaces the default one.
    transformers.trainer.DEFAULT_PROGRESS_CALLBACK = QuietProgress
    callbacks = []
    if os.environ.get("QUICKSTART_DEADLINE"):
        callbacks.append(TimeBound(float(os.environ["QUICKSTART_DEADLINE"])))
    train.main(sys.argv[1:] if argv is None else argv, callbacks=callbacks)


def launch(argv: list[str]) -> None:
    """`accelerate launch ARGV`, minus the launcher's traceback (torch elastic's ChildFailedError) when a rank fails:
    the rank has printed its own message; the launcher exits with the rank's exit status."""
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        launch_command(launch_command_parser().parse_args(argv))
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        raise SystemExit(next((c for c in codes if c and c > 0), 1)) from None


if __name__ == "__main__":
    if sys.argv[1:2] == ["launch"]:
        launch(sys.argv[2:])
    else:
        from finetune.process import run_rank

        run_rank(main, own_process=True)  # ends without the interpreter shutdown once done (finetune.process)
