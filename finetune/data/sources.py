"""Hugging Face Hub data sets (`--dataset org/name`) as records for prepare.py.

datasets.load_dataset does the reading and the caching (HF_HOME / HF_DATASETS_CACHE; with HF_HUB_OFFLINE=1 it reads
the prepared copy a previous online run left in that cache). The records it gives go through the same validation,
masks, tokenize cache, packing and data order as a local file's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from finetune import network
from finetune.constants import COMMIT, REPO_ID

LOCAL_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def looks_like_dataset_id(name: str | None) -> bool:
    """A data set's org/name (constants.REPO_ID) that is not a local path; a name ending in a data file suffix is
    taken for a (missing) local file."""
    return (bool(name) and REPO_ID.match(name) is not None and not Path(name).exists()
            and not name.lower().endswith(LOCAL_SUFFIXES))


class HubDataError(Exception):
    """One line naming the data set and the fix; prepare.py turns it into its DataError."""


@dataclass
class HubData:
    dataset: object  # datasets.Dataset
    repo_id: str
    revision: str | None  # the commit the data came from, where the cache names it
    fingerprint: str  # datasets' own fingerprint of the Arrow data


def is_hub_dataset(cfg) -> bool:
    return looks_like_dataset_id(cfg.dataset)


def load_hub(cfg) -> HubData:
    """datasets.load_dataset(org/name, config, split, revision), with its errors turned into one line."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError
    from huggingface_hub import constants

    repo_id, split, revision = cfg.dataset, cfg.dataset_split or "train", cfg.dataset_revision
    cache = datasets.config.HF_DATASETS_CACHE
    network.bound_hub()
    try:
        ds = datasets.load_dataset(repo_id, cfg.dataset_config, split=split, revision=revision)
    except DatasetNotFoundError as e:
        msg = str(e)
        fix = ("set HF_TOKEN (or `hf auth login`) after accepting its terms on the Hub" if "gated" in msg
               else "check the name and --dataset_revision" if "Revision" in msg
               else "check the spelling; if it is private, set HF_TOKEN")
        raise HubDataError(f"--dataset {repo_id}: {msg} ({fix})") from None
    except ConnectionError as e:
        if not constants.HF_HUB_OFFLINE and (endpoint := network.stalled(e)):
            raise HubDataError(f"--dataset {repo_id}: "
                               + network.describe(endpoint, "the network, HF_ENDPOINT and any proxy")) from None
        if constants.HF_HUB_OFFLINE:
            raise HubDataError(
                f"--dataset {repo_id}: not in the datasets cache ({cache}) and HF_HUB_OFFLINE=1 forbids downloading; "
                "unset HF_HUB_OFFLINE to download it, or point HF_HOME at a cache that holds it"
            ) from None
        raise HubDataError(f"--dataset {repo_id}: the Hub cannot be reached ({e}); check the network") from None
    except ValueError as e:  # an unknown split or config: datasets lists the ones there are
        raise HubDataError(f"--dataset {repo_id}: {str(e).splitlines()[0]} (see --dataset_config, --dataset_split)") from None
    except FileNotFoundError as e:
        raise HubDataError(f"--dataset {repo_id}: {str(e).splitlines()[0]}") from None
    resolved = _commit_of(ds)
    if revision and COMMIT.match(revision) and resolved and resolved != revision:
        # Offline, datasets reads whichever prepared copy is cached and ignores the revision asked for.
        raise HubDataError(
            f"--dataset_revision {revision}: the cache holds {repo_id} at {resolved} only; go online to fetch "
            f"{revision}, or pass --dataset_revision {resolved}"
        )
    return HubData(ds, repo_id, resolved or revision, ds._fingerprint)


def _commit_of(ds) -> str | None:
    """A Hub data set is prepared in <cache>/<org>___<name>/<config>/<version>/<commit>/: the folder names the commit."""
    for f in getattr(ds, "cache_files", None) or []:
        name = Path(f["filename"]).parent.name
        if COMMIT.match(name):
            return name
    return None


def records_of(hub: HubData) -> tuple[list[dict], list[str]]:
    records = hub.dataset.to_list()
    where = f"{hub.repo_id}" + (f"@{hub.revision[:12]}" if hub.revision else "")
    return records, [f"{where} row {i}" for i in range(len(records))]
