"""--push_to_hub: a verified local result pushed to the Hugging Face Hub in ONE commit, with its model card.

huggingface_hub does the work (HfApi.create_repo, then create_commit with every file and README.md), and honours
HF_TOKEN (or `hf auth login`'s saved token) and HF_ENDPOINT itself. The push comes after the local save is
verified and committed, from the main process only; a failed push leaves the local result as it is and says so in
one line (exit 1). Every call is bounded (finetune.network): a Hub that never answers ends the push in minutes. The flags are the Trainer's (--push_to_hub, --hub_model_id, --hub_private_repo, --hub_token):
the training commands take them from TrainingArguments, `finetune export` from HubFlags."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from finetune import network
from finetune.ship import report
from finetune.ship.card import model_card

# The one sub-folder of a run pushed (whole): `finetune report`'s, whose loss curve the card shows. Checkpoints,
# TensorBoard's and the trackers' logs and the staging folder stay local.
_PUSHED_DIRS = ("report",)
CARD = "README.md"
_URL_QUERY = re.compile(r"(https?://[^\s'\"?]+)\?[^\s'\"]*")


@dataclass
class HubFlags:
    """Push the result to the Hugging Face Hub (one commit with a model card)"""

    push_to_hub: bool = field(default=False, metadata={"help": "Push the verified export to the Hub in one commit, with "
                                                              "a model card (HF_TOKEN, or `hf auth login`)."})
    hub_model_id: str | None = field(default=None, metadata={"help": "The repo (org/name or name); default: the "
                                                                     "output's name."})
    hub_private_repo: bool | None = field(default=None, metadata={"help": "Create the repo private (an existing repo "
                                                                          "keeps its visibility)."})
    hub_token: str | None = field(default=None, metadata={"help": "Token with write access (default: HF_TOKEN, else "
                                                                  "the saved login)."})


def run_files(folder: Path, *, write_report: bool = False) -> dict[str, Path]:
    """A final save's files as repo paths: the folder's own files (not hidden ones, not checkpoints or logs) and
    `finetune report`'s folder when there is one. write_report: write that folder first, from the final save's
    log history (a training push: the card shows the run's loss curve); a run with no log history has none."""
    folder = Path(folder)
    if write_report:
        try:
            report.write_report(folder)
        except report.ReportError:
            pass  # nothing logged: the card has no curve and no loss table either
    files = {p.name: p for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(".")}
    files.update(report_files(folder))
    files.pop(CARD, None)  # the card is made for the push
    return files


def report_files(run_folder: Path | None) -> dict[str, Path]:
    """`finetune report`'s folder of the run an export came from, as repo paths (report/...): pushed with the export,
    so that its card shows the run's loss curve."""
    folder = Path(run_folder) / _PUSHED_DIRS[0] if run_folder is not None else None
    if folder is None or not folder.is_dir():
        return {}
    return {f"{_PUSHED_DIRS[0]}/{p.relative_to(folder)}": p for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith(".")}


def default_repo_id(local: Path) -> str:
    """The Trainer's default: the output's name (a .gguf file: its name without the suffix)."""
    local = Path(local).absolute()
    return local.stem if local.suffix == ".gguf" else local.name


def push(repo_id: str, files: dict[str, Path], card: str, *, private: bool | None = None, token: str | None = None,
         message: str = "finetune: upload") -> tuple[str, int]:
    """Create the repo (kept if it exists) and add every file and README.md in one commit: (commit url, files)."""
    from huggingface_hub import CommitOperationAdd, HfApi

    network.bound_hub()
    api = HfApi(token=token)  # None: HF_TOKEN, else the saved login (huggingface_hub.get_token)
    url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path)) for name, path in sorted(files.items())]
    operations.append(CommitOperationAdd(path_in_repo=CARD, path_or_fileobj=card.encode()))
    info = api.create_commit(url.repo_id, operations, commit_message=message, repo_type="model")
    return info.commit_url, len(operations)


def _reason(e: BaseException | None) -> str:
    """The failure in one line: the first line of each message down the chain of causes (an LFS upload's error
    wraps the HTTP error that says why), URLs without their query (a storage URL's is a signature)."""
    parts = []
    while e is not None and len(parts) < 3:
        response = getattr(e, "response", None)
        status = getattr(response, "status_code", None)
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        text = f"HTTP {status}: {text}" if status is not None and str(status) not in text else text
        parts.append(_URL_QUERY.sub(r"\1", text).rstrip("."))
        e = e.__cause__
    return ": ".join(parts)


def push_or_exit(local: Path, files: dict[str, Path], *, run_folder: Path | None, what: str, repo_id: str | None,
                 private: bool | None, token: str | None) -> str:
    """Push `files` (repo path -> local file) with the card of `run_folder`; print the commit. A failure prints one
    line saying the local result is intact and exits 1."""
    repo = repo_id or default_repo_id(local)
    card = model_card(run_folder, [*files, CARD], what=what, repo_id=repo)
    try:
        url, n = push(repo, files, card, private=private, token=token, message=f"finetune: {what}")
    except Exception as e:  # HTTP errors, a refused connection, a bad token: the push failed, the local result stands
        endpoint = network.stalled(e)
        reason = network.describe(endpoint, "the network, HF_ENDPOINT and any proxy") if endpoint else _reason(e)
        print(f"finetune: --push_to_hub: the push to {repo} failed ({reason}); the local {what} in {local} is "
              f"intact; push it again with `hf upload {repo} {local}`", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    print(f"pushed {n} files to {repo} in one commit: {url}", flush=True)
    return url
