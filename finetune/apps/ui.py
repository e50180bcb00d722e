"""`finetune ui`: a local web page to plan, launch, watch and try runs (docs/ui.md).

    finetune ui                                   # http://127.0.0.1:7860, the current folder as its root
    finetune ui --root ~/models --root ~/data     # the folders the page may read and write
    finetune ui --host 0.0.0.0                    # reachable from other machines: a token is made and printed

The page is a small web app (FastAPI, served by uvicorn; static HTML/JS/CSS shipped with the package, no CDN). What it
shows comes from the commands' own code: the plan is `finetune plan`'s, a run is a `finetune train` process, chat is
`finetune generate`'s loading and decoding, export is a `finetune export` process (finetune/apps/ui_app.py).
"""

from __future__ import annotations

import ipaddress
import re
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

from finetune.config.parser import Command

LOOPBACK = ("127.0.0.1", "localhost", "::1")
TOKEN_RE = re.compile(r"^[A-Za-z0-9_\-.~]{16,}$")


@dataclass
class UiArgs:
    """Where the page listens and what it may touch"""

    host: str = field(default="127.0.0.1", metadata={
        "help": "Address to listen on. Any other than 127.0.0.1/localhost/::1 requires a token (--token, else one is "
                "made and printed)."})
    port: int = field(default=7860, metadata={"help": "Port to listen on (0: a free one, printed)."})
    root: list[str] = field(default_factory=lambda: ["."], metadata={
        "help": "The folders the page may read and write (repeatable; the first holds relative paths and runs). Paths "
                "outside them, through ../ or a symlink, are refused.", "repeat": True})
    runs_dir: str | None = field(default=None, metadata={
        "help": "Where runs started from the page are written, inside a --root (default: the first root's runs/)."})
    token: str | None = field(default=None, metadata={
        "help": "The token the page asks for (at least 16 letters, digits or -_.~). Default: none on loopback; a "
                "random one, printed, on any other host."})


def is_loopback(host: str) -> bool:
    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_args(parsed) -> list[str]:
    args: UiArgs = parsed.args
    problems = []
    if not 0 <= args.port <= 65535:
        problems.append(f"--port: must be 0-65535, got {args.port}")
    for root in args.root:
        if not Path(root).is_dir():
            problems.append(f"--root {root}: no such folder")
    if args.token is not None and not TOKEN_RE.match(args.token):
        problems.append("--token: at least 16 characters, letters, digits or -_.~ only (it travels in a URL)")
    if args.runs_dir is not None and not problems:
        roots = [Path(r).resolve() for r in args.root]
        runs = (Path(args.root[0]) / args.runs_dir).resolve()
        if not any(runs.is_relative_to(r) for r in roots):
            problems.append(f"--runs_dir {args.runs_dir}: outside every --root ({', '.join(map(str, roots))}); the "
                            "page writes only inside the folders it was given")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        problems.append(f"finetune ui needs {e.name}: pip install 'finetune[ui]' (fastapi and uvicorn)")
    return problems


def command() -> Command:
    return Command("finetune ui", {"args": UiArgs}, description=__doc__.split("\n\n")[0].split(": ", 1)[1])


def settings_of(args: UiArgs):
    """The app's settings from the flags: resolved roots, the runs folder, and the token (made when needed)."""
    from finetune.apps.ui_app import Settings

    roots = [Path(r).resolve() for r in args.root]
    runs = (roots[0] / (args.runs_dir or "runs")).resolve()
    token = args.token
    if token is None and not is_loopback(args.host):
        token = secrets.token_urlsafe(24)
    return Settings(roots=roots, runs_dir=runs, token=token, loopback=is_loopback(args.host))


def main(argv: list[str] | None = None) -> None:
    args: UiArgs = command().parse_or_exit(argv, check_args).args
    import socket

    import uvicorn

    from finetune.apps.ui_app import create_app

    settings = settings_of(args)
    settings.runs_dir.mkdir(parents=True, exist_ok=True)
    app = create_app(settings)
    # The socket is bound and listening here, so that port 0 is resolved before the address is printed (tests wait for
    # that line).
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        print(f"finetune ui: --host {args.host} --port {args.port}: cannot listen there ({e.strerror}); choose another "
              "--port (0: any free one)", file=sys.stderr)
        raise SystemExit(2) from None
    sock.listen(128)  # connections made once the address is printed wait in the backlog for uvicorn
    port = sock.getsockname()[1]
    shown = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{shown}:{port}/" + (f"?token={settings.token}" if settings.token else "")
    print(f"finetune ui: {url}", flush=True)
    print(f"finetune ui: roots {', '.join(map(str, settings.roots))}; runs in {settings.runs_dir}", flush=True)
    if settings.token and not args.token:
        print("finetune ui: the token above was made for this session; the page asks for it on every request",
              flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
