"""The web app behind `finetune ui` (finetune/apps/ui.py): a JSON API over the commands' own code, and the page.

- plan: finetune.plan.planner's make_plan on the page's flags; its problems are the ConfigError `finetune plan` prints.
- the command line and recipe: the page's flags as `finetune train` reads them (its parser's collect).
- preview: finetune.data.prepare's reading, format detection and tokenize_examples (the loss mask training uses).
- runs: `finetune train` / `finetune export` processes (finetune/apps/ui_runs.py); report: finetune.ship.report.
- chat: finetune.inference.generate's load_for_inference, render and generate (greedy), in this process.

Every path the page sends is confined to the --root folders (resolved: `../` and symlinks out are refused).
"""

from __future__ import annotations

import hmac
import json
import shlex
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.apps.ui_runs import EXPORTS, NAME_RE, UI, Runs, python_cli, shell_line
from finetune.convert.writers import WRITERS

STATIC = Path(__file__).resolve().parent / "ui_static"
COOKIE = "finetune_ui_token"
# The page's fields, in the order the command line shows them (each is a `finetune train` flag).
FIELDS = ("model_name_or_path", "dataset", "dataset_format", "method", "use_peft", "lora_r", "config", "max_steps",
          "learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps", "max_seq_length",
          "gradient_checkpointing", "eval_split_size", "logging_steps", "save_steps")
# Flags whose value is a path the page must confine (config and resume_from_checkpoint also take a name).
PATH_FLAGS = ("model_name_or_path", "dataset", "eval_dataset", "chat_template", "recipe", "output_dir",
              "dataset_cache_dir", "nvme_path", "config", "resume_from_checkpoint", "logging_dir")
SET_BY_PAGE = ("output_dir", "resume_from_checkpoint", "overwrite_output_dir")
PLAN_FIELDS = ("devices_per_node", "num_nodes", "device_memory", "host_memory", "accelerator")
DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


@dataclass
class Settings:
    roots: list[Path]
    runs_dir: Path
    token: str | None = None
    loopback: bool = True


class PageError(Exception):
    """A refusal shown on the page as it is (the CLI's own message, or the page's confinement)."""


# ----------------------------------------------------------------------------------------------
# Paths


class Confine:
    """The --root folders: a path the page sends resolves (symlinks followed) to a place inside one of them."""

    def __init__(self, roots: list[Path]):
        self.roots = [r.resolve() for r in roots]

    def inside(self, real: Path) -> bool:
        return any(real == r or real.is_relative_to(r) for r in self.roots)

    def path(self, value: str, flag: str, *, hub: str | None = None) -> str:
        """The resolved local path of `value`; a Hub id (hub="model" or "dataset") that is no local path passes
        as it is. Raises PageError for anything outside the roots."""
        from finetune.data.sources import LOCAL_SUFFIXES
        from finetune.models.hub import REPO_ID

        given = Path(value).expanduser()
        full = given if given.is_absolute() else self.roots[0] / given
        if hub and not given.is_absolute() and not full.exists() and REPO_ID.match(value) and not (
                hub == "dataset" and value.lower().endswith(LOCAL_SUFFIXES)):
            return value
        real = full.resolve()
        if not self.inside(real):
            roots = ", ".join(map(str, self.roots))
            raise PageError(f"--{flag} {value}: outside the folders this page may use ({roots}); it resolves to "
                            f"{real}. Give a path inside them (start finetune ui with --root FOLDER for another)")
        return str(real)

    def listing(self, *, models: bool, depth: int = 3, limit: int = 200) -> list[str]:
        """Model folders (config.json) or data files found under the roots, relative to the first where possible."""
        found: list[str] = []
        for root in self.roots:
            stack = [(root, 0)]
            while stack and len(found) < limit:
                folder, d = stack.pop()
                try:
                    children = sorted(folder.iterdir())
                except OSError:
                    continue
                for child in children:
                    if child.name.startswith(".") or child.is_symlink():
                        continue
                    if child.is_dir():
                        if (child / "config.json").is_file():  # a model folder: no data inside
                            if models:
                                found.append(self.show(child))
                        elif d < depth and child.name not in ("node_modules", "__pycache__"):
                            stack.append((child, d + 1))
                    elif not models and child.suffix.lower() in DATA_SUFFIXES and "checkpoint-" not in str(child):
                        found.append(self.show(child))
        return sorted(found)[:limit]

    def show(self, path: Path) -> str:
        return str(path.relative_to(self.roots[0])) if path.is_relative_to(self.roots[0]) else str(path)


# ----------------------------------------------------------------------------------------------
# The page's choices as `finetune train` flags


def _train_command():
    from finetune import config as C

    return C.command("finetune train")


def method_options() -> dict[str, list[dict]]:
    """Each method's own flags (finetune.methods' registry): name, the method's default, help, and whether a switch."""
    import dataclasses

    from finetune import methods
    from finetune.methods.base import own_flags

    cmd = _train_command()
    out = {}
    for name in methods.names():
        method = methods.get(name)
        config = method.config()
        out[name] = [{"name": key, "default": _plain(getattr(config, key)),
                      "help": " ".join(str(cmd.flags[key].meta.get("help", "")).split()),
                      "bool": cmd.flags[key].is_bool} for key in own_flags(method)
                     if key in cmd.flags and not dataclasses.is_dataclass(getattr(config, key))]
    return out


def flags_of(fields: dict[str, Any], extra: str, options: dict[str, Any] | None = None) -> list[str]:
    """The page's fields (FIELDS, as the user set them), the chosen method's options and the extra-flags box, as an
    argv; not yet confined. A value equal to its default is left out."""
    from finetune import methods
    from finetune.config.parser import convert
    from finetune.methods.base import own_flags

    cmd = _train_command()
    argv: list[str] = []
    for key in FIELDS:
        value = fields.get(key)
        if value is None or value == "":
            continue
        flag = cmd.flags[key]
        if flag.is_bool:
            on = value is True or str(value).lower() in ("true", "1", "on", "yes")
            if on != bool(flag.default):
                argv += [f"--{key}"] if on else [f"--no_{key}"]
            continue
        if _is_default(cmd, key, value):
            continue  # the command line says what differs from `finetune train`'s defaults
        argv += [f"--{key}", str(value)]
    method = methods.get(str(fields.get("method") or methods.DEFAULT))
    if method is not None:
        config = method.config()
        for key in own_flags(method):
            value = (options or {}).get(key)
            if value is None or value == "" or key not in cmd.flags:
                continue
            try:
                same = convert(value, cmd.flags[key].type) == _plain(getattr(config, key))
            except (ValueError, TypeError):
                same = False  # the parser reports it
            if not same:
                argv += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    try:
        argv += shlex.split(extra or "")
    except ValueError as e:
        raise PageError(f"extra flags: {e} (quote a value with spaces)") from None
    return argv


def _plain(value: Any) -> Any:
    import enum

    return value.value if isinstance(value, enum.Enum) else value


def _is_default(cmd, key: str, value: Any) -> bool:
    from finetune.config.parser import convert

    flag = cmd.flags[key]
    try:
        return convert(value, flag.type) == _plain(cmd.defaults.get(key, flag.default))
    except (ValueError, TypeError):
        return False  # the parser reports it


def confine_argv(argv: list[str], confine: Confine, *, page_sets: tuple[str, ...] = SET_BY_PAGE) -> list[str]:
    """`argv` with the value of every path flag resolved inside the roots (PageError otherwise); the flags the page
    sets itself are refused among the extra flags."""
    from finetune.config.preset import PRESETS

    cmd = _train_command()
    hubs = {"model_name_or_path": "model", "dataset": "dataset", "eval_dataset": "dataset"}

    def resolved(key: str, value: str) -> str:
        if value == "" or (key == "config" and value in PRESETS) or (key == "resume_from_checkpoint"
                                                                    and value == "latest"):
            return value
        return confine.path(value, key, hub=hubs.get(key))

    out, key = [], None
    for token in argv:
        if token.startswith("--") and len(token) > 2:
            spelled, eq, value = token[2:].partition("=")
            key = cmd.aliases.get(spelled.replace("-", "_"), spelled.replace("-", "_"))
            if key in page_sets:
                raise PageError(f"--{spelled}: set by the page (the run's name picks RUNS/NAME; Resume continues "
                                "it); leave it out of the extra flags")
            if eq and key in PATH_FLAGS:
                token = f"--{spelled}=" + ",".join(resolved(key, v) for v in value.split(","))
            out.append(token)
            if eq:
                key = None
            continue
        out.append(resolved(key, token) if key in PATH_FLAGS else token)
    return out


def recipe_of(argv: list[str]) -> str:
    """The flags as a recipe YAML: the keys the command line sets, with the values `finetune train` converts."""
    import yaml

    cmd = _train_command()
    got = cmd.collect(argv)
    if got.problems:
        from finetune.config.parser import ConfigError

        raise PageError(str(ConfigError(got.problems, prog="finetune train")))
    recipe = {}
    for key in argv_keys(argv, cmd):
        section = cmd.flags[key].section
        if key in got.values[section]:
            recipe[key] = got.values[section][key]
    return yaml.safe_dump(recipe, sort_keys=False)


def argv_keys(argv: list[str], cmd) -> list[str]:
    settings, _, _ = cmd.split(list(argv))
    return list(settings)


class _Checked(Exception):
    """Raised where `finetune train` would build TrainingArguments: every check of its flags has passed."""


def train_problems(argv: list[str]) -> str | None:
    """What `finetune train ARGV` prints when it refuses its flags (the same parse and checks, in this process;
    stopped before TrainingArguments, which a DeepSpeed preset would make start a process group), or None."""
    from finetune import config as C
    from finetune.config.parser import ConfigError

    def stop(preset) -> None:
        raise _Checked

    try:
        C.parse(list(argv), before_arguments=stop)
    except _Checked:
        return None
    except ConfigError as e:
        return str(e)
    return None


def plan_of(argv: list[str], plan_fields: dict[str, Any]) -> dict:
    """`finetune plan` with the run's flags and the machine's (devices, memory): its data and its printed text."""
    from finetune.config.parser import ConfigError
    from finetune.plan import planner

    extra = []
    for key in PLAN_FIELDS:
        value = plan_fields.get(key)
        if value not in (None, ""):
            extra += [f"--{key}", str(value)]
    try:
        plan = planner.make_plan([*argv, *extra])
    except ConfigError as e:
        raise PageError(str(e)) from None
    return {"plan": plan, "text": planner.render(plan), "argv": [*argv, *extra]}


# ----------------------------------------------------------------------------------------------
# Data preview with the real loss mask


def preview(confine: Confine, body: dict, tokenizers: dict) -> dict:
    from types import SimpleNamespace

    from finetune.constants import IGNORE_INDEX
    from finetune.data import formats, prepare
    from finetune.data.errors import DataError
    from finetune.models.load import WeightsError, load_tokenizer

    model = confine.path(str(body.get("model_name_or_path") or ""), "model_name_or_path", hub="model")
    dataset = str(body.get("dataset") or "")
    if not dataset:
        raise PageError("--dataset: required (a data file inside the roots, or a Hub data set's org/name)")
    data = confine.path(dataset, "dataset", hub="dataset")
    fmt_given = str(body.get("dataset_format") or "auto")
    completion_only = str(body.get("completion_only_loss", True)).lower() not in ("false", "0", "no", "off")
    n = max(1, min(int(body.get("n") or 3), 10))
    max_len = int(body.get("max_seq_length") or 1024)
    if not Path(model).is_dir():
        from finetune.models.hub import HubError, resolve_model

        try:  # a Hub id: its snapshot folder, as training resolves it (the cache, or a download)
            model = resolve_model(model, str(body.get("model_revision") or "main")).folder
        except HubError as e:
            raise PageError(str(e)) from None
    key = model
    if key not in tokenizers:
        try:
            tokenizers[key] = load_tokenizer(SimpleNamespace(model_name_or_path=model, trust_remote_code=False,
                                                             chat_template=None))
        except WeightsError as e:
            raise PageError(str(e)) from None
    tokenizer = tokenizers[key]
    try:
        if Path(data).exists():
            records, where = prepare.read_records(data)
        else:
            hub = prepare.load_hub(SimpleNamespace(dataset=data, dataset_config=body.get("dataset_config"),
                                                   dataset_split=body.get("dataset_split") or "train",
                                                   dataset_revision=None))
            records, where = prepare.read_hub_records(hub)
        out = []
        for record, loc in list(zip(records, where))[:n]:
            fmt = prepare.detect_format(record, loc) if fmt_given == "auto" else formats.get(fmt_given).name
            prepare.validate_record(record, fmt, loc)
            examples = prepare.tokenize_examples(tokenizer, record, fmt, completion_only, loc)
            for ids, labels in examples:
                cut = len(ids) > max_len
                ids, labels = ids[:max_len], labels[:max_len]  # as training truncates (prepare.tokenize_all)
                pieces = [tokenizer.decode([i]) for i in ids]
                trained = sum(1 for x in labels[1:] if x != IGNORE_INDEX)
                out.append({"where": loc, "format": fmt, "tokens": [[p, lab != IGNORE_INDEX] for p, lab in
                                                                     zip(pieces, labels)],
                            "labels": labels, "input_ids": ids, "truncated": cut, "trained": trained,
                            # as training drops it: nothing left to learn from once cut (prepare.tokenize_all)
                            "dropped": trained == 0})
    except DataError as e:
        raise PageError(str(e)) from None
    return {"records": out, "total": len(records)}


# ----------------------------------------------------------------------------------------------
# Chat with a finished run


class Chats:
    """Loaded models by run folder (reloaded when the folder's weights change); one generation at a time."""

    def __init__(self):
        self.models: dict[str, tuple[float, Any, Any]] = {}
        self.lock = threading.Lock()

    def reply(self, out: Path, messages: list[dict], max_new_tokens: int, *, do_sample: bool = False,
              temperature: float = 1.0, seed: int = 0) -> dict:
        from finetune.inference.generate import GenerationError, LoadOptions, generate, load_for_inference, render

        adapter = (out / "adapter_config.json").is_file()
        weights = [p for p in out.glob("*.safetensors")]
        if not weights:
            raise PageError(f"{out}: no saved model yet (a run can be chatted with once it has finished)")
        stamp = max(p.stat().st_mtime for p in weights)
        with self.lock:
            cached = self.models.get(str(out))
            if cached is None or cached[0] != stamp:
                if adapter:
                    base = json.loads((out / "adapter_config.json").read_text()).get("base_model_name_or_path")
                    opts = LoadOptions(model_name_or_path=base, adapter=str(out))
                else:
                    opts = LoadOptions(model_name_or_path=str(out))
                try:
                    model, tokenizer, _ = load_for_inference(opts, log=lambda *a: None)
                except GenerationError as e:
                    raise PageError(str(e)) from None
                self.models = {str(out): (stamp, model, tokenizer)}  # one model in memory at a time
            _, model, tokenizer = self.models[str(out)]
            try:
                prompt = render(tokenizer, messages, True, "chat")
                # `finetune generate`'s decoding: greedy, or sampled after set_seed(seed) (--do_sample --seed).
                result = generate(model, tokenizer, [prompt], max_new_tokens=max_new_tokens, do_sample=do_sample,
                                  temperature=temperature, seed=seed if do_sample else None)[0]
            except GenerationError as e:
                raise PageError(str(e)) from None
        return {"reply": result["completion"], "finish_reason": result["finish_reason"],
                "completion_ids": result["completion_ids"], "prompt": prompt.text}


# ----------------------------------------------------------------------------------------------
# The app


def create_app(settings: Settings):
    from fastapi import FastAPI, Request
    from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
    from fastapi.staticfiles import StaticFiles

    confine = Confine(settings.roots)
    runs = Runs(settings.runs_dir, settings.roots[0])
    chats = Chats()
    tokenizers: dict = {}
    app = FastAPI(title="finetune ui", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.runs = runs

    @app.middleware("http")
    async def guard(request: Request, call_next):
        # DNS rebinding: on loopback, only a loopback Host may talk to the page.
        host = (request.headers.get("host") or "").rsplit(":", 1)[0].strip("[]")
        if settings.loopback and host not in ("127.0.0.1", "localhost", "::1"):
            return PlainTextResponse(f"finetune ui: Host {host!r} refused (this page answers on 127.0.0.1 only)",
                                     status_code=403)
        set_cookie = False
        if settings.token:
            given = (request.headers.get("x-finetune-token") or request.cookies.get(COOKIE)
                     or request.query_params.get("token") or "")
            if not hmac.compare_digest(given.encode(), settings.token.encode()):
                return PlainTextResponse("finetune ui: this page needs its token: open the address `finetune ui` "
                                         "printed (…/?token=…)", status_code=401)
            set_cookie = request.query_params.get("token") is not None
        if request.method not in ("GET", "HEAD"):
            # A form on another site cannot send JSON without a preflight, which this page never answers.
            if not (request.headers.get("content-type") or "").startswith("application/json"):
                return PlainTextResponse("finetune ui: requests that change things are JSON", status_code=415)
            origin = request.headers.get("origin")
            if origin and origin.split("://", 1)[-1] != request.headers.get("host"):
                return PlainTextResponse(f"finetune ui: origin {origin} refused", status_code=403)
        response = await call_next(request)
        if set_cookie:
            response.set_cookie(COOKIE, settings.token, httponly=True, samesite="strict")
        return response

    @app.exception_handler(PageError)
    def refused(request, e: PageError) -> JSONResponse:  # every route's refusal: one 400 with the message
        return JSONResponse({"error": str(e)}, status_code=400)

    def run_name(name: str) -> str:
        if not NAME_RE.match(name or "") or name in (UI, EXPORTS):
            raise PageError(f"run name {name!r}: letters, digits and ._- only (at most 64), not {UI} or {EXPORTS}")
        return name

    def train_argv(body: dict) -> list[str]:
        return confine_argv(flags_of(body.get("fields") or {}, body.get("extra") or "", body.get("options")), confine)

    @app.get("/")
    def index():
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/api/info")
    def info():
        from finetune import methods
        from finetune.config.preset import PRESETS
        from finetune.data import formats

        return {"roots": [str(r) for r in confine.roots], "runs_dir": str(settings.runs_dir),
                "methods": methods.names(), "method_options": method_options(), "presets": list(PRESETS), "formats": ["auto", *formats.names()],
                "models": confine.listing(models=True), "datasets": confine.listing(models=False)}

    @app.post("/api/plan")
    def plan(body: dict):
        argv = train_argv(body)
        name = run_name(body.get("name") or "run")
        full = [*argv, "--output_dir", str(runs.output_dir(name)), "--resume_from_checkpoint", "latest"]
        if problems := train_problems(full):
            raise PageError(problems)
        result = plan_of(argv, body.get("plan") or {})
        recipe = recipe_of(full)
        return {**result, "command": launch_line(full, body), "recipe": recipe}

    def launch_line(argv: list[str], body: dict) -> str:
        devices = int((body.get("plan") or {}).get("devices_per_node") or 1)
        head = ["finetune", "train"] if devices <= 1 else ["torchrun", "--nproc_per_node", str(devices), "-m",
                                                           "finetune.cli", "train"]
        return shell_line([*head, *argv])

    def launch_cmd(argv: list[str], body: dict) -> list[str]:
        import sys

        devices = int((body.get("plan") or {}).get("devices_per_node") or 1)
        if devices <= 1:
            return python_cli("train", *argv)
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(devices), "-m",
                "finetune.cli", "train", *argv]

    @app.post("/api/preview")
    def preview_(body: dict):
        return preview(confine, body, tokenizers)

    @app.get("/api/runs")
    def list_runs():
        return {"runs": [runs.summary_of(n) for n in runs.names()]}

    @app.post("/api/runs")
    def launch(body: dict):
        name = run_name(body.get("name") or "")
        argv = train_argv(body)
        if runs.record(name) is not None or runs.output_dir(name).exists():
            raise PageError(f"run {name} exists: pick another name, or open it and Resume")
        full = [*argv, "--output_dir", str(runs.output_dir(name)), "--resume_from_checkpoint", "latest"]
        if problems := train_problems(full):
            raise PageError(problems)
        record, error = runs.launch(name, launch_cmd(full, body), launch_line(full, body))
        if error:
            return JSONResponse({"error": error}, status_code=400)
        return {"run": record}

    @app.get("/api/runs/{name}")
    def run_detail(name: str):
        run_name(name)
        if name not in runs.names():
            return JSONResponse({"error": f"no run named {name}"}, status_code=404)
        return runs.detail(name)

    @app.post("/api/runs/{name}/stop")
    def stop(name: str):
        run_name(name)
        result = runs.stop(name)
        return JSONResponse(result, status_code=400 if "error" in result else 200)

    @app.post("/api/runs/{name}/resume")
    def resume(name: str):
        run_name(name)
        record = runs.record(name)
        if record is None:
            raise PageError(f"run {name} was not started from this page: resume it with its own command and "
                            "--resume_from_checkpoint latest")
        again, error = runs.launch(name, record["command"], record["shown"])
        if error:
            return JSONResponse({"error": error}, status_code=400)
        return {"run": again}

    @app.post("/api/runs/{name}/report")
    def report(name: str):
        from finetune.ship.report import ReportError, write_report

        run_name(name)
        try:
            folder = write_report(runs.output_dir(name))
        except ReportError as e:
            raise PageError(f"finetune report: {e}") from None
        return {"report": str(folder), "images": sorted(p.name for p in folder.glob("*.png"))}

    @app.get("/api/runs/{name}/report/{file}")
    def report_file(name: str, file: str):
        if not NAME_RE.match(name) or not NAME_RE.match(file) or not file.endswith((".png", ".md", ".json")):
            return PlainTextResponse("no such file", status_code=404)
        path = runs.output_dir(name) / "report" / file
        if not path.is_file():
            return PlainTextResponse("no such file", status_code=404)
        return FileResponse(path, headers={"Cache-Control": "no-store"})

    @app.post("/api/runs/{name}/export")
    def export(name: str, body: dict):
        to = body.get("to")
        run_name(name)
        if to not in WRITERS:
            raise PageError(f"export: to {to!r}: " + "; or ".join(f"{w.name} ({w.summary})" for w in WRITERS.values()))
        out = runs.output_dir(name)
        adapter = (out / "adapter_config.json").is_file()
        if not adapter and not (out / "config.json").is_file():
            raise PageError(f"run {name}: no saved model yet (export once it has finished)")
        if not adapter and "model" not in WRITERS[to].sources:
            raise PageError(f"run {name} trained all weights: {out} is already a model folder (safetensors with its "
                            f"tokenizer); export to {to} ({WRITERS[to].summary}) starts from a LoRA adapter")
        target = runs.export_paths(name, to)
        args = ["--to", to, *(["--adapter", str(out)] if adapter else ["--model_name_or_path", str(out)]),
                "--output_dir", str(target), "--overwrite"]
        runs.start_export(name, python_cli("export", *args), to, shell_line(["finetune", "export", *args]))
        return {"export": to, "path": str(target)}

    @app.post("/api/chat")
    def chat(body: dict):
        name = run_name(body.get("run") or "")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise PageError("chat: no message")
        try:
            limit = int(body.get("max_new_tokens") or 64)
            temperature = float(body.get("temperature") or 1.0)
            seed = int(body.get("seed") or 0)
        except ValueError as e:
            raise PageError(f"chat: {e}") from None
        if not 1 <= limit <= 2048 or temperature <= 0:
            raise PageError("chat: max new tokens 1-2048, temperature above 0")
        return chats.reply(runs.output_dir(name), messages, limit, do_sample=bool(body.get("do_sample")),
                           temperature=temperature, seed=seed)

    return app
