"""`finetune serve`, started as a real process on a free loopback port and called with the official `openai` client:
greedy completions equal transformers' own `generate` on the same chat-template rendering (base and two LoRA adapters,
streamed and not), 8 concurrent requests batched and each equal to its answer alone, bad requests answered with 4xx
JSON while the server keeps serving, an API key, and SIGTERM / Ctrl-C ending it within seconds."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from finetune.models import tiny
from launch import BIN, Launched, env, free_port, REPO

pytestmark = pytest.mark.usefixtures("one_thread")
openai = pytest.importorskip("openai")

KEY = "test-key"
PROMPTS = ["count: red blue green", "reverse: the cat sat on the long road", "hi", "copy: one two three four five six",
           "sort: dog cat bird", "find: river stone", "name: light dark small large quick", "list: a b c d e f g h"]
TIGHT = "cpu=600KB,disk=1GB"  # the embeddings and the first blocks in memory, the rest on disk


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    model = tiny.build(root / "model", style="chatml", hidden=64, layers=4)
    return dict(root=root, model=model, a=tiny.save_random_adapter(model, root / "a", r=4, seed=1),
                b=tiny.save_random_adapter(model, root / "b", r=4, seed=2))


class Reference:
    """transformers' own greedy `generate`, one prompt at a time, on the model (and adapter) the server loads."""

    def __init__(self, files):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.files = files
        self.tokenizer = AutoTokenizer.from_pretrained(files["model"])
        self.models = {"model": AutoModelForCausalLM.from_pretrained(files["model"]).eval()}
        self.stop = [self.models["model"].generation_config.eos_token_id, self.tokenizer.eos_token_id]

    def model(self, name: str):
        if name not in self.models:
            from peft import PeftModel
            from transformers import AutoModelForCausalLM

            base = AutoModelForCausalLM.from_pretrained(self.files["model"])
            self.models[name] = PeftModel.from_pretrained(base, str(self.files[name])).eval()
        return self.models[name]

    def __call__(self, name: str, prompt: str, max_tokens: int, chat: bool = True) -> tuple[str, str, int]:
        """(text, finish_reason, completion tokens)"""
        new, reason = self.ids(name, prompt, max_tokens, chat)
        return self.tokenizer.decode(new, skip_special_tokens=True), reason, len(new)

    def ids(self, name: str, prompt: str, max_tokens: int, chat: bool = True, temperature: float = 0.0,
            top_p: float = 1.0, seed: int | None = None) -> tuple[list[int], str]:
        """(completion token ids without the stop token, finish_reason); temperature above 0: transformers' own
        sampling (do_sample, top_k off) after torch.manual_seed(seed)."""
        import torch

        if chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                      add_generation_prompt=True)
            ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")
        else:
            ids = self.tokenizer(prompt, return_tensors="pt")
        model = self.model(name)  # loaded before the seed is set: loading draws random numbers
        decoding = dict(do_sample=False)
        if temperature > 0:
            decoding = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
            torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=max_tokens, eos_token_id=self.stop,
                                            pad_token_id=self.stop[0], **decoding)
        new = out[0, ids["input_ids"].shape[1]:].tolist()
        reason = "length"
        if new and new[-1] in self.stop:
            new, reason = new[:-1], "stop"
        return new, reason


@pytest.fixture(scope="module")
def reference(files):
    return Reference(files)


def start(files, *flags, port: int | None = None) -> tuple[Launched, str]:
    port = port or free_port()
    job = Launched([str(BIN / "finetune"), "serve", "--model_name_or_path", str(files["model"]), "--served_model_name", "model",
                    "--port", str(port), *map(str, flags)], REPO, env())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if job.returncode is not None:
            job.drain()
            raise AssertionError(f"finetune serve exited ({job.returncode}):\n{job.output[-4000:]}")
        try:
            urllib.request.urlopen(url + "/stats", timeout=2).read()
            return job, url
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.25)
    job.abort()
    raise AssertionError(f"finetune serve did not answer within 240 s:\n{job.output[-4000:]}")


def stop(job: Launched, sig: int, bound: float = 20.0) -> float:
    """Send `sig`, return the seconds until the process ended (it must within `bound`)."""
    t = time.monotonic()
    job.proc.send_signal(sig)
    ended = job.wait(bound)
    took = time.monotonic() - t
    if not ended:
        job.abort()
    assert ended, f"finetune serve still running {bound} s after signal {sig}:\n{job.output[-4000:]}"
    assert job.finish() == [], job.output[-3000:]
    return took


@pytest.fixture(scope="module")
def server(files):
    job, url = start(files, "--adapter", f"a={files['a']}", "--adapter", f"b={files['b']}", "--api_key", KEY,
                     "--max_concurrent", "8", "--max_model_len", "256")
    with job:
        yield job, url


def client(url: str, key: str = KEY):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, timeout=120, max_retries=0)


def stats(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/stats", timeout=10).read())


def test_lists_models_and_listens_on_loopback_only(server):
    import psutil

    job, url = server
    assert [m.id for m in client(url).models.list().data] == ["model", "a", "b"]
    addresses = {c.laddr.ip for c in psutil.Process(job.proc.pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN}
    assert addresses == {"127.0.0.1"}, addresses


@pytest.mark.parametrize("name", ["model", "a", "b"])
def test_greedy_equals_transformers_generate(server, reference, name):
    _, url = server
    c = client(url)
    for prompt in PROMPTS[:3]:
        want, reason, count = reference(name, prompt, 20)
        got = c.chat.completions.create(model=name, messages=[{"role": "user", "content": prompt}], max_tokens=20)
        assert (got.choices[0].message.content, got.choices[0].finish_reason, got.usage.completion_tokens) == \
            (want, reason, count), prompt
        chunks = list(c.chat.completions.create(model=name, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=20, stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
        assert chunks[-1].choices[0].finish_reason == reason
        assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) > 1  # streamed, not in one piece
    want, reason, _ = reference(name, PROMPTS[3], 12, chat=False)
    got = c.completions.create(model=name, prompt=PROMPTS[3], max_tokens=12)
    assert (got.choices[0].text, got.choices[0].finish_reason) == (want, reason)
    # the adapters change the answers (else this test could not tell them apart)
    if name != "model":
        assert reference(name, PROMPTS[0], 20)[0] != reference("model", PROMPTS[0], 20)[0]


def concurrently(url: str, jobs: list[tuple[str, str, int]]) -> list[str]:
    barrier = threading.Barrier(len(jobs))
    out: list = [None] * len(jobs)

    def one(i, name, prompt, n):
        c = client(url)
        barrier.wait(30)
        try:
            out[i] = c.chat.completions.create(model=name, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=n).choices[0].message.content
        except Exception as e:  # reported by the assertion below
            out[i] = e

    threads = [threading.Thread(target=one, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), "a request did not return within 180 s"
    return out


def test_eight_concurrent_requests_are_batched_and_each_gets_its_answer_alone(server, reference):
    _, url = server
    jobs = [("a", p, 16 + 4 * i) for i, p in enumerate(PROMPTS)]
    got = concurrently(url, jobs)
    assert got == [reference(*job)[0] for job in jobs]
    after = stats(url)
    assert after["batching"] == "continuous"
    assert after["max_running"] >= 4, after  # generated together, not in turn
    # requests for the three models at once: each adapter's requests run apart, none gets another's answer
    mixed = [(("model", "a", "b")[i % 3], p, 16) for i, p in enumerate(PROMPTS)]
    assert concurrently(url, mixed) == [reference(*job)[0] for job in mixed]


def post(url: str, body: bytes, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url + "/v1/chat/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_requests_get_4xx_json_and_the_server_keeps_serving(server, reference):
    _, url = server
    c = client(url)
    good = dict(model="a", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=8)
    want = reference("a", PROMPTS[0], 8)[0]

    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(**{**good, "model": "c"})
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"
    assert "this server serves: model, a, b" in e.value.body["message"]
    assert c.chat.completions.create(**good).choices[0].message.content == want

    status, body = post(url, b'{"model": "a", "messages": [')
    assert status == 400 and "not valid JSON" in body["error"]["message"], body
    assert c.chat.completions.create(**good).choices[0].message.content == want

    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(**{**good, "max_tokens": 250})  # 256-token context; the prompt is longer than 6
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "max_tokens", e.value.body
    assert c.chat.completions.create(**good).choices[0].message.content == want

    with pytest.raises(openai.AuthenticationError):
        client(url, key="wrong").chat.completions.create(**good)
    status, body = post(url, json.dumps(good).encode(), key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    for extra, param in (({"n": 2}, "n"), ({"logprobs": True}, "logprobs"), ({"temperature": 2.5}, "temperature"),
                         ({"top_p": 0.5}, "top_p"), ({"temperature": 1, "seed": -1}, "seed"),
                         ({"presence_penalty": 0.5}, "presence_penalty")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(**good, **extra)
        assert e.value.body["param"] == param, (extra, e.value.body)
        assert e.value.body["message"].startswith(f"'{param}'"), e.value.body
    assert c.chat.completions.create(**good).choices[0].message.content == want


# ----------------------------------------------------------------------------------------------
# Sampling: temperature, top_p and seed


def sample(url: str, name: str, prompt: str, n: int, **decoding) -> tuple[list[int], str]:
    got = client(url).chat.completions.create(model=name, messages=[{"role": "user", "content": prompt}], max_tokens=n,
                                              extra_body={"return_token_ids": True}, **decoding)
    return got.choices[0].model_extra["token_ids"], got.choices[0].finish_reason


SAMPLED = [("a", PROMPTS[0], 20, dict(temperature=1.0, seed=11)), ("a", PROMPTS[1], 24, dict(temperature=0.7, top_p=0.9,
           seed=12)), ("model", PROMPTS[2], 16, dict(temperature=1.3, seed=2**40 + 5)), ("a", PROMPTS[3], 28,
           dict(temperature=0.9, top_p=0.8, seed=0)), ("b", PROMPTS[4], 20, dict(temperature=1.0, seed=14)),
           ("a", PROMPTS[5], 18, dict(temperature=1.5, seed=15))]


def test_seeded_sampling_equals_transformers_sampling_alone_and_among_concurrent_requests(server, reference):
    """A request with a temperature and a seed gets the token ids of transformers' generate(do_sample=True, top_k off)
    after set_seed(seed), on the same rendering: alone, again, and while 7 others (sampled and greedy, three models)
    run at once. temperature 0 is greedy whatever the seed; without a seed two samples differ."""
    _, url = server
    want = [reference.ids(name, p, n, temperature=d["temperature"], top_p=d.get("top_p", 1.0), seed=d["seed"])
            for name, p, n, d in SAMPLED]
    greedy = [reference.ids("a", PROMPTS[6], 16), reference.ids("model", PROMPTS[7], 12)]
    assert want[0] != reference.ids("a", PROMPTS[0], 20)  # sampling is not the greedy answer
    assert want[0] != reference.ids("a", PROMPTS[0], 20, temperature=1.0, seed=99)  # the seed matters
    for (name, p, n, d), w in zip(SAMPLED, want):
        assert sample(url, name, p, n, **d) == w, (name, p, d)
    assert sample(url, *SAMPLED[0][:3], **SAMPLED[0][3]) == want[0]  # the same again
    # streamed, token by token: the same text
    name, p, n, d = SAMPLED[1]
    chunks = [ch.choices[0].delta.content for ch in client(url).chat.completions.create(
        model=name, messages=[{"role": "user", "content": p}], max_tokens=n, stream=True, **d) if ch.choices]
    assert "".join(c or "" for c in chunks) == reference.tokenizer.decode(want[1][0], skip_special_tokens=True)
    assert len([c for c in chunks if c]) > 1
    # 8 at once: the 6 sampled requests and 2 greedy ones, over three models
    barrier = threading.Barrier(8)
    jobs = [(name, p, n, d) for name, p, n, d in SAMPLED] + [("a", PROMPTS[6], 16, {}), ("model", PROMPTS[7], 12, {})]
    got: list = [None] * len(jobs)

    def one(i, name, p, n, d):
        barrier.wait(30)
        try:
            got[i] = sample(url, name, p, n, **d)
        except Exception as e:  # reported by the assertion below
            got[i] = e

    threads = [threading.Thread(target=one, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), "a request did not return within 180 s"
    assert got == want + greedy
    assert stats(url)["max_running_sampled"] >= 2, stats(url)  # sampled requests generated together
    # temperature 0 with a seed: greedy; no seed: a fresh draw each time
    assert sample(url, "a", PROMPTS[0], 20, temperature=0, seed=5) == reference.ids("a", PROMPTS[0], 20)
    assert sample(url, "a", PROMPTS[0], 20, temperature=1.0) != sample(url, "a", PROMPTS[0], 20, temperature=1.0)


def test_seeded_request_equals_finetune_generate_do_sample_seed(server, files, tmp_path):
    """The same request as `finetune generate --chat --do_sample --temperature T --top_p P --seed S` (one prompt):
    the same token ids."""
    from finetune.inference.generate import GenerateArgs, run

    _, url = server
    name, p, n, d = SAMPLED[1]
    cli = run(GenerateArgs(model_name_or_path=str(files["model"]), adapter=str(files["a"]), prompt=[p], chat=True,
                           max_new_tokens=n, do_sample=True, temperature=d["temperature"], top_p=d["top_p"],
                           seed=d["seed"], output=str(tmp_path / "gen.jsonl")))
    assert sample(url, name, p, n, **d)[0] == cli[0]["completion_ids"] and len(cli[0]["completion_ids"]) > 0


def test_sigterm_during_a_streamed_reply_ends_it_within_seconds(server, capsys):
    job, url = server
    stream = client(url).chat.completions.create(model="b", messages=[{"role": "user", "content": PROMPTS[1]}],
                                                  max_tokens=180, stream=True)
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    took = stop(job, signal.SIGTERM)
    with capsys.disabled():
        print(f"\nfinetune serve: SIGTERM during a streamed reply -> exited in {took:.2f} s")
    assert took < 10
    assert "finetune serve: stopped" in job.output


@pytest.mark.slow
def test_offloaded_base_with_an_adapter_batches_in_a_queue_and_ctrl_c_stops_it(files, reference, capsys):
    """A base offloaded to disk (transformers' continuous batching cannot place it) is served through the batching
    queue; greedy answers equal the model's in one piece; Ctrl-C (SIGINT) ends it."""
    job, url = start(files, "--adapter", f"a={files['a']}", "--device_map", "auto", "--max_memory", TIGHT)
    with job:
        assert stats(url)["batching"] == "queue"
        assert "disk offload folder:" in job.output
        jobs = [("a", p, 12) for p in PROMPTS[:4]]
        got = concurrently(url, jobs)
        assert got == [reference(*j)[0] for j in jobs]
        assert stats(url)["max_running"] >= 2
        took = stop(job, signal.SIGINT)
        with capsys.disabled():
            print(f"\nfinetune serve (disk offload, queue): Ctrl-C -> exited in {took:.2f} s")
        assert took < 10


def test_quantized_base_through_the_engine_equals_its_own_generate(files, one_thread):
    """An 8-bit base (bitsandbytes), loaded as `finetune generate --load_in_8bit` loads it, through the engine's
    continuous batching: each request's tokens equal transformers' generate on that same quantized model."""
    import torch

    from finetune.inference.engine import Engine, Request
    from finetune.inference.generate import LoadOptions, load_for_inference

    model, tok, _ = load_for_inference(LoadOptions(model_name_or_path=str(files["model"]), adapter=str(files["a"]),
                                                   load_in_8bit=True), log=lambda *a: None)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for p in PROMPTS[:4]]
    alone = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=[2],
                                 pad_token_id=2)
            alone.append(out[0, len(ids):].tolist())
    engine = Engine(model, tok, {"a": "default"}, batching="continuous", max_model_len=128).start()
    try:
        done = threading.Event()
        got: dict[int, list[int]] = {}

        def on_output(i):
            def f(tokens, finished, error):
                assert error is None, error
                if finished:
                    got[i] = tokens
                    if len(got) == len(prompts):
                        done.set()
            return f

        for i, ids in enumerate(prompts):
            engine.submit(Request(f"r{i}", "a", ids, 10, on_output(i)))
        assert done.wait(120), got
        assert [got[i] for i in range(len(prompts))] == alone
        assert engine.max_running >= 2
    finally:
        engine.close()


@pytest.mark.slow
def test_4bit_base_served_equals_its_own_generate_alone_and_concurrently(files, capsys):
    """`finetune serve --load_in_4bit` (bitsandbytes nf4, as `finetune generate --load_in_4bit` loads it) with two
    adapters: each greedy answer, base and adapters, equals transformers' generate on that same 4-bit model and
    rendering; 8 concurrent requests (continuous batching) each get their answer alone; a seeded sampled request gets
    the token ids of transformers' sampling on that model."""
    import bitsandbytes
    import torch

    from finetune.inference.generate import LoadOptions, load_for_inference, use_adapter

    model, tok, _ = load_for_inference(LoadOptions(model_name_or_path=str(files["model"]), adapter=str(files["a"]),
                                                   load_in_4bit=True), log=lambda *a: None)
    model.load_adapter(str(files["b"]), adapter_name="b")
    base = model.get_base_model()
    four_bit = [m for m in base.modules() if isinstance(m, bitsandbytes.nn.Linear4bit)]
    assert len(four_bit) == 4 * 7 and {m.weight.quant_state.quant_type for m in four_bit} == {"nf4"}  # every block's
    stop_ids = [base.generation_config.eos_token_id, tok.eos_token_id]

    def generate(adapter, prompt, n, seed=None) -> list[int]:
        use_adapter(base, adapter)
        ids = tok(tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                          add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        decoding = dict(do_sample=False)
        if seed is not None:
            decoding = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
            torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, eos_token_id=stop_ids,
                                 pad_token_id=stop_ids[0], **decoding)
        new = out[0, len(ids):].tolist()
        return new[:-1] if new and new[-1] in stop_ids else new

    text = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    jobs = [("model", p, 12 + 2 * i) for i, p in enumerate(PROMPTS)]
    want = [text(generate(None, p, n)) for _, p, n in jobs]
    want_ab = [text(generate(adapter, p, 12)) for adapter in ("default", "b") for p in PROMPTS[:2]]
    assert want_ab[:2] != want[:2] and want_ab[2:] != want[:2]  # each adapter changes the answers
    sampled = generate("b", PROMPTS[2], 16, seed=21)
    assert sampled and sampled != generate("b", PROMPTS[2], 16)
    job, url = start(files, "--load_in_4bit", "--adapter", f"a={files['a']}", "--adapter", f"b={files['b']}",
                     "--api_key", KEY, "--max_model_len", "128")
    with job:
        c = client(url)
        alone = [c.chat.completions.create(model=name, messages=[{"role": "user", "content": p}], max_tokens=n)
                 .choices[0].message.content for name, p, n in jobs]
        assert alone == want
        assert [c.chat.completions.create(model=name, messages=[{"role": "user", "content": p}], max_tokens=12)
                .choices[0].message.content for name in ("a", "b") for p in PROMPTS[:2]] == want_ab
        assert concurrently(url, jobs) == want
        seen = stats(url)
        assert seen["batching"] == "continuous" and seen["max_running"] >= 4, seen
        assert sample(url, "b", PROMPTS[2], 16, temperature=1.0, seed=21)[0] == sampled
        took = stop(job, signal.SIGTERM)
    with capsys.disabled():
        print(f"\nfinetune serve --load_in_4bit: 8 answers = generate on the 4-bit model, alone and concurrently "
              f"({seen['max_running']} generated together), 2 adapters, a seeded sample; SIGTERM -> exited in "
              f"{took:.2f} s")


@pytest.mark.slow
def test_smollm2_stops_at_its_stop_token_as_generate_does(smollm2_dir, capsys):
    """SmolLM2-135M-Instruct (the quickstart's model, its real ChatML template and <|im_end|>): short answers end at
    the stop token (finish_reason "stop"), token for token transformers' greedy generate, concurrently too."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    stop_ids = [model.generation_config.eos_token_id, tok.eos_token_id]
    questions = ["What is the capital of France? Answer in one word.", "Say hello.",
                 "Extract the order as JSON with keys name, city, item, quantity.\nAda Lovelace would like 3 units of "
                 "blue cup sent to Oslo."]
    want = []
    for q in questions:
        ids = tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
                  add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=60, do_sample=False, eos_token_id=stop_ids, pad_token_id=stop_ids[0])
        new = out[0, ids["input_ids"].shape[1]:].tolist()
        assert new[-1] in stop_ids, tok.decode(new)  # each answer ends before 60 tokens
        want.append(tok.decode(new[:-1], skip_special_tokens=True))
    job, url = start({"model": smollm2_dir}, "--max_model_len", "512")
    with job:
        c = client(url)
        for q, w in zip(questions, want):
            got = c.chat.completions.create(model="model", messages=[{"role": "user", "content": q}], max_tokens=60)
            assert (got.choices[0].message.content, got.choices[0].finish_reason) == (w, "stop")
        assert concurrently(url, [("model", q, 60) for q in questions]) == want
        took = stop(job, signal.SIGTERM)
    with capsys.disabled():
        print(f"\nfinetune serve (SmolLM2): {len(questions)} answers = generate, ended by <|im_end|>; SIGTERM -> "
              f"exited in {took:.2f} s; answers: {want}")

