"""Every network call finetune makes has a bound: a request waits at most `timeout()` seconds for an answer, and a host
that left `tries()` requests in a row unanswered is given up for the rest of the process, so that huggingface_hub's
retries (5, with waits of 1+2+4+8+8 s) come back at once instead of each waiting again. A Hub or tracker that accepts
connections and never answers then ends the command in tries x timeout + 23 s at most (2 x 40 + 23 = 103 s by
default; a call huggingface_hub makes once, such as create_repo, in one timeout), with one line from `describe`
naming the endpoint and what to check.

The Hub: `bound_hub()` installs the bounded client in huggingface_hub (its `set_client_factory`, which datasets'
downloads use too); every function of finetune that calls the Hub calls it first (tests/test_network.py reads the
source for it). A server's Retry-After (or RateLimit reset) above MAX_WAIT_S is cut to it: a retry waits seconds, not
the hour a throttled Hub may ask for. The trackers: `bound_trackers()` gives MLflow's HTTP client the same timeout and
tries where the environment does not set them (W&B bounds its own: 90 s to start); `probe()` asks a tracking server
once, within seconds, before anything loads (finetune/config/ship.py).

FINETUNE_NETWORK_TIMEOUT (seconds) and FINETUNE_NETWORK_TRIES set the bound (docs/network.md)."""

from __future__ import annotations

import functools
import os
import threading
from typing import Any, Mapping, MutableMapping

TIMEOUT_ENV, TRIES_ENV = "FINETUNE_NETWORK_TIMEOUT", "FINETUNE_NETWORK_TRIES"
DEFAULT_TIMEOUT_S = 40.0
DEFAULT_TRIES = 2
MAX_WAIT_S = 10  # the longest wait before a retry that a server's Retry-After may ask for
HUB_BACKOFF_S = 1 + 2 + 4 + 8 + 8  # huggingface_hub's http_backoff: its waits between its 6 attempts
PROBE_TIMEOUT_S = 5.0

# `environ` defaults to None, os.environ read at each call: datasets' map(num_proc=...) replaces the os.environ
# object with a copy (datasets 5.2, arrow_dataset.py: `os.environ = prev_env`), and a default bound at import would
# read the stale one from then on (the bound set after such a map not in effect; 40 s a request instead).


def timeout(environ: Mapping[str, str] | None = None) -> float:
    """Seconds a request may wait for an answer (FINETUNE_NETWORK_TIMEOUT; default 40)."""
    environ = os.environ if environ is None else environ
    try:
        value = float(environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT_S)
    except ValueError:
        return DEFAULT_TIMEOUT_S
    return value if value > 0 else DEFAULT_TIMEOUT_S


def tries(environ: Mapping[str, str] | None = None) -> int:
    """Requests in a row a host may leave unanswered before it is given up (FINETUNE_NETWORK_TRIES; default 2)."""
    environ = os.environ if environ is None else environ
    try:
        value = int(environ.get(TRIES_ENV) or DEFAULT_TRIES)
    except ValueError:
        return DEFAULT_TRIES
    return max(1, value)


def total_bound(environ: Mapping[str, str] | None = None) -> float:
    """The longest a command waits on a host that never answers: its tries, then huggingface_hub's retry waits."""
    environ = os.environ if environ is None else environ
    return tries(environ) * timeout(environ) + HUB_BACKOFF_S


def env_problems(environ: Mapping[str, str] | None = None) -> list[str]:
    """The bound's own variables, when set to something that is not a bound (a flag check, before anything loads)."""
    environ = os.environ if environ is None else environ
    problems = []
    for name, kind, what in ((TIMEOUT_ENV, float, "a number of seconds above 0"),
                             (TRIES_ENV, int, "a whole number of requests, 1 or more")):
        if environ.get(name):
            try:
                ok = kind(environ[name]) > 0
            except ValueError:
                ok = False
            if not ok:
                problems.append(f"{name}={environ[name]}: give {what}")
    return problems


# ----------------------------------------------------------------------------------------------
# The Hub (huggingface_hub's httpx2 client)

_unanswered: dict[str, int] = {}  # host -> requests in a row it left unanswered
_lock = threading.Lock()
_installed = False


def _host(url: Any) -> str:
    return f"{url.scheme}://{url.host}" + (f":{url.port}" if url.port else "")


@functools.cache
def _classes():
    import httpx2

    class Unanswered(httpx2.ConnectTimeout):
        """A host given up: it left FINETUNE_NETWORK_TRIES requests in a row unanswered. A timeout to
        huggingface_hub (its cache fallback reads it so), raised at once, before any wait."""

    class BoundedClient(httpx2.Client):
        """huggingface_hub's client with the bound on every request (one that asks for none, or for longer, gets the
        bound), the unanswered requests counted per host, and a server's retry wait cut to MAX_WAIT_S."""

        def send(self, request, **kwargs):
            host, limit = _host(request.url), timeout()
            with _lock:
                missed = _unanswered.get(host, 0)
            if missed >= tries():
                raise Unanswered(f"{host} left {missed} requests unanswered ({limit:.0f} s each); given up",
                                 request=request)
            bounds = dict(request.extensions.get("timeout") or {})
            request.extensions["timeout"] = {k: min(bounds.get(k) or limit, limit)
                                             for k in ("connect", "read", "write", "pool")}
            try:
                response = super().send(request, **kwargs)
            except httpx2.TimeoutException:
                with _lock:
                    _unanswered[host] = _unanswered.get(host, 0) + 1
                raise
            with _lock:
                _unanswered[host] = 0
            _cut_waits(response.headers)
            return response

    return Unanswered, BoundedClient


def _cut_waits(headers: MutableMapping[str, str]) -> None:
    wait = headers.get("retry-after", "").strip()
    if wait.isdigit() and int(wait) > MAX_WAIT_S:
        headers["retry-after"] = str(MAX_WAIT_S)
    if "ratelimit" in headers:  # '"api";r=0;t=3600': huggingface_hub waits t seconds
        headers["ratelimit"] = ";".join(f"t={min(int(p[2:]), MAX_WAIT_S)}" if p.startswith("t=") and p[2:].isdigit()
                                        else p for p in headers["ratelimit"].split(";"))


def hub_client():
    """A new bounded client, as huggingface_hub's default_client_factory makes its own (its request hook: offline
    mode, request ids; redirects followed)."""
    from huggingface_hub.utils._http import hf_request_event_hook

    _, client = _classes()
    return client(event_hooks={"request": [hf_request_event_hook]}, follow_redirects=True, timeout=timeout())


def bound_hub() -> None:
    """Install the bounded client in huggingface_hub (once per process): every Hub call after it is bounded."""
    global _installed
    if _installed:
        return
    from huggingface_hub import set_client_factory

    set_client_factory(hub_client)
    _installed = True


def forget_unanswered() -> None:
    """Start the count of unanswered requests afresh (a test's next case)."""
    with _lock:
        _unanswered.clear()


def stalled(error: BaseException | None = None) -> str | None:
    """The endpoint that left requests unanswered in this process (the last one counted), or, when `error` or one it
    was raised from is a timeout, the Hub's; None when nothing went unanswered. Libraries wrap a timeout in errors of
    their own (datasets' ConnectionError drops its cause), hence the count."""
    with _lock:
        hosts = [h for h, n in _unanswered.items() if n]
    if hosts:
        return hosts[-1]
    seen = 0
    while error is not None and seen < 8:
        if type(error).__name__ in ("Unanswered", "ReadTimeout", "ConnectTimeout", "WriteTimeout", "PoolTimeout",
                                    "TimeoutException", "TimeoutError", "timeout"):
            return hub_endpoint()
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


def describe(endpoint: str, check: str, environ: Mapping[str, str] | None = None) -> str:
    """One line for an endpoint that did not answer: where, how long, what to check, how to wait longer."""
    environ = os.environ if environ is None else environ
    return (f"{endpoint} did not answer within {timeout(environ):g} s ({tries(environ)} tries); check {check}; "
            f"{TIMEOUT_ENV}=SECONDS waits longer")


def hub_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


# ----------------------------------------------------------------------------------------------
# The trackers

def bound_trackers(environ: MutableMapping[str, str] | None = None) -> None:
    """MLflow's HTTP client (a timeout of 120 s and 7 retries by default: minutes on a server that does not answer)
    gets the bound, unless the environment sets it itself. W&B bounds its own calls (its start waits 90 s at most,
    WANDB_INIT_TIMEOUT)."""
    environ = os.environ if environ is None else environ
    environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(max(1, round(timeout(environ))))))
    environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(tries(environ) - 1))  # tries in all, as for the Hub
    environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")


def probe(url: str, path: str = "/", wait: float = PROBE_TIMEOUT_S) -> str | None:
    """Ask a server once (GET url+path, `wait` seconds at most): None when it answers at all (any HTTP status), else
    why not, in a few words."""
    import socket
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + path, timeout=wait):
            return None
    except urllib.error.HTTPError:
        return None  # it answered
    except (socket.timeout, TimeoutError):
        return f"no answer within {wait:g} s"
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, (socket.timeout, TimeoutError)):
            return f"no answer within {wait:g} s"
        return getattr(reason, "strerror", None) or str(reason)
    except (OSError, ValueError) as e:
        return getattr(e, "strerror", None) or str(e)
