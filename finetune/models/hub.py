"""Hugging Face Hub model ids -> a local snapshot folder in the standard HF cache.

`--model_name_or_path org/name [--model_revision REV]` is resolved here, once, before any model code runs; everything
downstream loads the returned folder as it loads any local one, so the local-folder checks (safetensors only, no
remote code by default) apply unchanged. huggingface_hub does the work and honours HF_HOME / HF_HUB_CACHE,
HF_HUB_OFFLINE, HF_TOKEN and HF_ENDPOINT itself. Offline, a branch or tag is read from the cache's refs/<name> file
and a commit from snapshots/<commit>/ (files there are links into blobs/).

Every process resolves on its own (each rank of a job too): from a warm cache that is a few file reads; when several
ranks download at once, huggingface_hub's per-blob file locks let one of them fetch each file and the others reuse it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from finetune import network
from finetune.constants import COMMIT, REPO_ID

# What a training / inference job needs from a model repository; *.bin only with --allow_pickle.
MODEL_PATTERNS = [
    "config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
]
PICKLE_PATTERNS = ["*.bin", "pytorch_model.bin.index.json"]


class HubError(Exception):
    """A Hub look-up that cannot succeed: one line naming the repo and the fix."""


@dataclass
class HubModel:
    repo_id: str
    revision: str  # as asked (branch, tag or commit)
    commit: str  # the commit it resolved to
    folder: str  # the snapshot folder in the cache


def looks_like_repo_id(name: str | None) -> bool:
    """True for a model's 'org/name' (constants.REPO_ID) that is not an existing local path (a local folder always
    wins)."""
    return bool(name) and REPO_ID.match(name) is not None and not Path(name).exists()


def cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _repo_folder(repo_id: str, repo_type: str = "model") -> Path:
    return Path(cache_dir()) / f"{repo_type}s--{repo_id.replace('/', '--')}"


def cached_revisions(repo_id: str, repo_type: str = "model") -> list[str]:
    """The branches/tags (refs/) and commits (snapshots/) this cache holds for a repo, for error messages."""
    folder = _repo_folder(repo_id, repo_type)
    refs = sorted(str(p.relative_to(folder / "refs")) for p in (folder / "refs").rglob("*") if p.is_file()) \
        if (folder / "refs").is_dir() else []
    commits = sorted(p.name for p in (folder / "snapshots").iterdir()) if (folder / "snapshots").is_dir() else []
    return refs + commits


def explain(error: BaseException, repo_id: str, revision: str, flag: str = "--model_name_or_path",
            repo_type: str = "model") -> str:
    """One line for a huggingface_hub error: what failed and the fix."""
    from huggingface_hub.errors import (
        GatedRepoError, IncompleteSnapshotError, LocalEntryNotFoundError, RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    rev_flag = "--model_revision" if repo_type == "model" else "--dataset_revision"
    page = f"https://huggingface.co/{'datasets/' if repo_type == 'dataset' else ''}{repo_id}"
    has_token = bool(os.environ.get("HF_TOKEN") or _stored_token())
    # GatedRepoError derives from RepositoryNotFoundError: test it first.
    if isinstance(error, GatedRepoError):
        if has_token:
            return (f"{flag} {repo_id}: a gated repository and your token has no access; "
                    f"ask for access at {page}, then run again")
        return (f"{flag} {repo_id}: a gated repository; accept its terms at {page}, then set HF_TOKEN "
                "(or run `hf auth login`)")
    if isinstance(error, RevisionNotFoundError):
        return f"{rev_flag} {revision}: no such branch, tag or commit in {repo_id}; check the name at {page}"
    if isinstance(error, RepositoryNotFoundError):
        token_hint = "" if has_token else "; if it is private, set HF_TOKEN"
        return f"{flag} {repo_id}: no such repository on the Hub (check the spelling{token_hint}), or give a local folder"
    if isinstance(error, IncompleteSnapshotError):
        return (f"{flag} {repo_id}: the cached snapshot at {revision} is incomplete ({error.snapshot_path}; an "
                "interrupted download?); go online (unset HF_HUB_OFFLINE) to complete it")
    if not offline() and (endpoint := network.stalled(error)):
        return f"{flag} {repo_id}: {network.describe(endpoint, 'the network, HF_ENDPOINT and any proxy')}"
    if isinstance(error, LocalEntryNotFoundError):
        cached = cached_revisions(repo_id, repo_type)
        where = _repo_folder(repo_id, repo_type)
        if cached:
            return (f"{rev_flag} {revision}: not in the cache for {repo_id} (cached: {', '.join(cached)}; "
                    f"cache {where}); pick one of those, or go online (unset HF_HUB_OFFLINE) to fetch it")
        if offline():
            return (f"{flag} {repo_id}: not in the Hugging Face cache ({cache_dir()}) and HF_HUB_OFFLINE=1 "
                    "forbids downloading; unset HF_HUB_OFFLINE to download it, point HF_HOME at a cache that holds "
                    "it, or give a local folder")
        return (f"{flag} {repo_id}: the Hub cannot be reached and the cache ({cache_dir()}) does not hold it; "
                "check the network (or HF_ENDPOINT), or give a local folder")
    return f"{flag} {repo_id}: the Hub look-up failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def _stored_token() -> str | None:
    try:
        from huggingface_hub import get_token

        return get_token()
    except Exception:
        return None


def resolve_model(repo_id: str, revision: str | None = "main", *, allow_pickle: bool = False,
                  config_only: bool = False, flag: str = "--model_name_or_path") -> HubModel:
    """Download (or find in the cache) what a job needs from `repo_id` at `revision`; raise HubError on failure.

    config_only: only config.json (for `finetune plan`, which reads nothing else)."""
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    revision = revision or "main"
    network.bound_hub()
    try:
        if config_only:
            path = hf_hub_download(repo_id, "config.json", revision=revision)
            folder = str(Path(path).parent)
        else:
            patterns = MODEL_PATTERNS + (PICKLE_PATTERNS if allow_pickle else [])
            folder = snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
    except (HfHubHTTPError, LocalEntryNotFoundError) as e:
        raise HubError(explain(e, repo_id, revision, flag)) from None
    except HFValidationError as e:
        raise HubError(f"{flag} {repo_id}: not a valid Hub repo id or revision ({e})") from None
    except OSError as e:  # network errors that are not HTTP answers (refused, DNS), disk full
        raise HubError(f"{flag} {repo_id}: the Hub look-up failed: {e}") from None
    commit = Path(folder).name
    if not COMMIT.match(commit):  # snapshot folders are named by commit; anything else is not the HF cache
        raise HubError(f"{flag} {repo_id}: resolved to {folder}, which is not a snapshot folder of the HF cache")
    return HubModel(repo_id, revision, commit, folder)


def stamp_config(config, hub: HubModel | None) -> None:
    """Record the base repo and commit in a model config, so the saved config.json names exactly what was tuned.

    transformers drops `_name_or_path` from a saved config.json, so the repo id goes in `finetune_base_model`."""
    if hub is None:
        return
    config._name_or_path = hub.repo_id
    config.finetune_base_model = hub.repo_id
    config.finetune_base_revision = hub.commit
