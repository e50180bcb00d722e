"""The generation engine behind `finetune serve`: one base model, its LoRA adapters, one worker thread.

Requests come from any thread (`Engine.submit`); a worker thread owns the model. Requests for the model that is
active (the base, or one adapter set on it) run together; another model's requests wait until those in flight are
done, then that model is activated (peft's `set_adapter`, or the adapter layers disabled for the base), so a batch
never mixes adapters. Within a model:

- `continuous`: transformers' continuous batching (`ContinuousBatchingManager`: paged attention, requests join and
  leave the running batch at every step). Prefix sharing is off: two adapters' caches of one prompt differ.
- `queue`: a batching queue: the waiting requests of the active model go to one left-padded `generate` call
  (`finetune.inference.generate.generate`); each row streams its tokens as they come and is answered when it stops.
  transformers' manager cannot place a disk-offloaded model (its cache reads a weight on the meta device), so such a
  model is served this way.

A request that samples (temperature above 0; `finetune.inference.sampling`) runs in a lane of its own, apart from
the greedy requests of its model: its batch is one padded `generate` call whose rows each draw from their own seeded
generator, so a seeded request gets the same tokens alone or among others (transformers' continuous batching samples
every running request from one generator). The stop tokens are the model's and the tokenizer's end-of-sequence ids
(`eos_ids`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

from finetune.inference.sampling import Sampling

BATCHINGS = ("auto", "continuous", "queue")


Lane = tuple[str, bool]  # (served name, sampled): the requests that may run together


@dataclass
class Request:
    """One completion: `on_output(tokens so far, finished, error)` is called from the worker thread (on every new
    token when `stream`, else once)."""

    id: str
    model: str  # the served name: the base's or an adapter's
    prompt_ids: list[int]
    max_new_tokens: int
    on_output: Callable[[list[int], bool, str | None], None]
    stream: bool = False
    sampling: Sampling | None = None  # None: greedy
    arrived: float = field(default_factory=time.monotonic)


class Engine:
    """The worker thread and its scheduling; `names` maps each served name to its peft adapter name (None: the
    base with adapters off)."""

    def __init__(self, model, tokenizer, names: dict[str, str | None], *, batching: str = "auto",
                 max_model_len: int, max_concurrent: int = 8, log=None):
        from finetune.inference.generate import _offload_hooks, eos_ids

        self.model, self.tokenizer, self.names = model, tokenizer, dict(names)
        self.base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.stop_ids = eos_ids(model, tokenizer)
        self.max_model_len, self.max_concurrent = max_model_len, max_concurrent
        if batching == "auto":
            batching = "queue" if _offload_hooks(self.base) else "continuous"
        self.batching = batching
        self.log = log or (lambda *a: None)
        self._inbox: queue.Queue = queue.Queue()
        self._cancelled: queue.Queue = queue.Queue()
        self._waiting: OrderedDict[Lane, deque[Request]] = OrderedDict(
            ((n, sampled), deque()) for n in self.names for sampled in (False, True))
        self._inflight: dict[str, Request] = {}
        self._active: Lane | None = None
        self._adapter: str | None = None  # the served name whose adapter is on
        self._stop = threading.Event()
        self._manager = None
        self.error: str | None = None  # set when the worker died: the server answers 503 from then on
        self.max_running = 0  # the most requests generated together so far (GET /stats)
        self.max_sampled = 0  # the most sampled requests generated together so far
        self._thread = threading.Thread(target=self._run, name="finetune-engine", daemon=True)

    # -------------------------------------------------------------------------------- from any thread
    def start(self) -> "Engine":
        if self.batching == "continuous":
            self._manager = self._start_manager()
        self._thread.start()
        return self

    def submit(self, request: Request) -> None:
        if request.model not in self.names:
            raise KeyError(request.model)
        if self.error is not None:
            request.on_output([], True, self.error)
            return
        self._inbox.put(request)

    def cancel(self, request_id: str) -> None:
        self._cancelled.put(request_id)

    def shutdown(self) -> None:
        """Ask the worker to stop (returns at once): what is waiting or in flight ends with an error."""
        self._stop.set()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker and transformers' manager, waiting at most about `timeout` seconds for each."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._manager is not None:
            self._manager.stop(block=True, timeout=timeout, hard_stop=True)
            self._manager = None

    # -------------------------------------------------------------------------------- the worker
    @staticmethod
    def lane(request: Request) -> Lane:
        return request.model, request.sampling is not None

    def _start_manager(self):
        from transformers import ContinuousBatchingConfig, GenerationConfig

        gen = GenerationConfig(do_sample=False, max_new_tokens=self.max_model_len, eos_token_id=self.stop_ids,
                               pad_token_id=self.tokenizer.pad_token_id)
        page = 32
        blocks = -(-self.max_model_len // page) * self.max_concurrent  # room for every request at full length
        config = ContinuousBatchingConfig(
            page_size=page, num_blocks=blocks, max_batch_tokens=max(page, min(self.max_model_len, 1024)),
            max_requests_per_batch=self.max_concurrent, allow_block_sharing=False, use_cuda_graph=False,
            auto_switch_to_flash=False, max_blocks_per_request=0)
        self._plain_attention = self.base.config._attn_implementation
        manager = self.base.init_continuous_batching(generation_config=gen, continuous_batching_config=config)
        manager.start()
        return manager

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._take_inbox(block=not self._inflight)
                self._drop_cancelled()
                if not self._inflight:
                    self._activate_oldest()
                if self.batching == "continuous" and self._active is not None and not self._active[1]:
                    self._admit_continuous()
                    self._collect_continuous()
                else:
                    self._run_queue_batch()
            self.error = "the server is stopping"
        except Exception as e:  # the worker is gone
            import traceback

            traceback.print_exc()
            self.error = f"the generation engine stopped: {type(e).__name__}: {e}"
        # Every waiting and running request gets the error, and what arrives later too (submit checks it).
        self._take_inbox(block=False)
        for request in [*self._inflight.values(), *(r for d in self._waiting.values() for r in d)]:
            request.on_output([], True, self.error)
        self._inflight.clear()

    def _take_inbox(self, block: bool) -> None:
        try:
            request = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._waiting[self.lane(request)].append(request)
            try:
                request = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drop_cancelled(self) -> None:
        while True:
            try:
                rid = self._cancelled.get_nowait()
            except queue.Empty:
                return
            request = self._inflight.pop(rid, None)
            if request is not None and self._manager is not None and request.sampling is None:
                self._manager.cancel_request(rid)  # a greedy request runs in transformers' manager
            for d in self._waiting.values():
                for r in [r for r in d if r.id == rid]:
                    d.remove(r)

    def _activate_oldest(self) -> None:
        """With nothing in flight: the lane whose request has waited longest becomes the active one."""
        heads = [(d[0].arrived, lane) for lane, d in self._waiting.items() if d]
        if not heads:
            return
        self._active = lane = min(heads)[1]
        if lane[0] != self._adapter:
            self._switch(self.names[lane[0]])
            self._adapter = lane[0]

    def _switch(self, adapter: str | None) -> None:
        if len(self.names) > 1:
            from finetune.inference.generate import use_adapter

            use_adapter(self.base, adapter)

    def _others_waiting(self) -> bool:
        return any(d for lane, d in self._waiting.items() if lane != self._active)

    def _admit_continuous(self) -> None:
        # Another model's requests waiting: admit no more of this one once its batch runs, so the batch drains and
        # that model gets its turn.
        if self._active is None or (self._inflight and self._others_waiting()):
            return
        waiting = self._waiting[self._active]
        while waiting and len(self._inflight) < self.max_concurrent:
            request = waiting.popleft()
            self._inflight[request.id] = request
            self._manager.add_request(request.prompt_ids, request_id=request.id, max_new_tokens=request.max_new_tokens,
                                      streaming=request.stream, eos_token_id=self.stop_ids)
        self.max_running = max(self.max_running, len(self._inflight))

    def _collect_continuous(self) -> None:
        if not self._inflight:
            return
        result = self._manager.get_result(timeout=0.02)
        while result is not None:
            request = self._inflight.get(result.request_id)
            if request is not None:  # else: cancelled
                done = result.is_finished()
                if done:
                    del self._inflight[result.request_id]
                request.on_output(list(result.generated_tokens), done, result.error)
            result = self._manager.get_result(timeout=0)

    def _run_queue_batch(self) -> None:
        """The active lane's waiting requests (up to --max_concurrent) in one left-padded `generate` call. Each row's
        tokens go out as they come (to a streamed request) and it is answered when it stops (a stop token, its own
        max_tokens, a cancel), not when the longest row does. A sampled lane's rows draw from their own generators."""
        from transformers import LogitsProcessorList, StoppingCriteriaList

        from finetune.inference.generate import Prompt, generate
        from finetune.inference.sampling import RowSampler

        if self._active is None or not self._waiting[self._active]:
            return
        waiting = self._waiting[self._active]
        batch = [waiting.popleft() for _ in range(min(len(waiting), self.max_concurrent))]
        for request in batch:
            self._inflight[request.id] = request
        self.max_running = max(self.max_running, len(batch))
        if self._active[1]:
            self.max_sampled = max(self.max_sampled, len(batch))
        rows = _Rows(self, batch)
        sampler = (LogitsProcessorList([RowSampler([r.sampling for r in batch])])
                   if any(r.sampling is not None for r in batch) else None)
        # transformers' manager may have set a paged attention kernel (for eager) that a plain generate cannot use;
        # nothing of the manager's runs while this lane is active.
        attention = self.base.config._attn_implementation
        plain = getattr(self, "_plain_attention", attention)
        if plain != attention:
            self.base.set_attn_implementation(plain)
        try:
            prompts = [Prompt(r.prompt_ids, self.tokenizer.decode(r.prompt_ids), True) for r in batch]
            generate(self.model, self.tokenizer, prompts, batch_size=len(batch),
                     max_new_tokens=max(r.max_new_tokens for r in batch), token_ids=[r.prompt_ids for r in batch],
                     logits_processor=sampler, streamer=rows, stopping_criteria=StoppingCriteriaList([rows.stop]))
        finally:
            if plain != attention:
                self.base.set_attn_implementation(attention)
        if not self._stop.is_set():  # else the rows still in flight get the engine's error
            rows.finish()


class _Rows:
    """A queue batch's rows as `generate` makes them: the tokens of each (the streamer's `put`), which rows are done
    (the stopping criterion: its max_tokens, a cancel, the engine stopping), each answered once."""

    def __init__(self, engine: Engine, batch: list[Request]):
        self.engine, self.batch = engine, batch
        self.tokens: list[list[int]] = [[] for _ in batch]
        self.answered = [False] * len(batch)
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:  # generate hands the prompt ids first
            self.prompt_seen = True
            return
        for i, token in enumerate(value.reshape(-1).tolist()):
            if self.answered[i]:
                continue
            request, tokens = self.batch[i], self.tokens[i]
            tokens.append(int(token))
            if token in self.engine.stop_ids or len(tokens) >= request.max_new_tokens:
                self.answer(i)
            elif request.stream:
                request.on_output(list(tokens), False, None)

    def end(self) -> None:
        pass

    def answer(self, i: int) -> None:
        self.answered[i] = True
        if self.engine._inflight.pop(self.batch[i].id, None) is not None:  # else cancelled
            self.batch[i].on_output(list(self.tokens[i]), True, None)

    def stop(self, input_ids, scores, **kwargs):
        """Per row: stop generating it (its own max_tokens reached, or cancelled; every row once the engine stops)."""
        import torch

        self.engine._drop_cancelled()
        stopping = self.engine._stop.is_set()
        return torch.tensor([stopping or self.answered[i] or self.batch[i].id not in self.engine._inflight
                             or len(self.tokens[i]) + 1 >= r.max_new_tokens for i, r in enumerate(self.batch)],
                            dtype=torch.bool, device=input_ids.device)

    def finish(self) -> None:
        for i in range(len(self.batch)):
            if not self.answered[i]:
                self.answer(i)


def finish_reason(tokens: list[int], stop_ids: list[int]) -> str:
    return "stop" if tokens and tokens[-1] in stop_ids else "length"


def visible(tokens: list[int], stop_ids: list[int]) -> list[int]:
    """The completion's tokens without the stop token that ended it."""
    return tokens[:-1] if tokens and tokens[-1] in stop_ids else tokens


class TextStream:
    """Token ids in, text deltas out: the whole completion decoded each time, a delta held back while it ends in an
    incomplete UTF-8 sequence (decoded as U+FFFD), so the deltas join to the full decoding."""

    def __init__(self, tokenizer, stop_ids: list[int]):
        self.tokenizer, self.stop_ids, self.sent = tokenizer, stop_ids, ""

    def delta(self, tokens: list[int], final: bool) -> str:
        text = self.tokenizer.decode(visible(tokens, self.stop_ids), skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            return ""
        out, self.sent = text[len(self.sent):], text
        return out

