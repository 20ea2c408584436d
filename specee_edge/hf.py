"""Models from the Hugging Face Hub in llama.cpp's spelling: `-hf user/repo[:quant]` and `--hf-file FILE`.

Files go through huggingface_hub into the cache llama.cpp's -hf uses (LLAMA_CACHE, HF_HUB_CACHE,
HUGGINGFACE_HUB_CACHE, HF_HOME), with its token (HF_TOKEN), its endpoint (HF_ENDPOINT), offline mode
(HF_HUB_OFFLINE) and its resumed downloads; a model fetched here is the same file llama.cpp,
`Llama.from_pretrained` and the Hub's own tools find. Without a file
named, the quant is picked as llama.cpp picks it: the one the tag names (case-insensitive), else Q4_K_M,
else Q8_0, else the first GGUF; of a split GGUF (`-00001-of-00003.gguf`), every part is fetched and the
first one returned, which is where llama.cpp loads a split model from.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from specee_edge.errors import SpecEEError

if TYPE_CHECKING:  # huggingface_hub is imported where a command goes to the Hub
    from huggingface_hub.errors import HfHubHTTPError

DEFAULT_TAGS = ("Q4_K_M", "Q8_0")
SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
# GGUFs in model repositories that are not models (llama.cpp skips the same names)
NOT_MODELS = ("mmproj", "imatrix")
OFFLINE_VALUES = ("1", "on", "yes", "true")
REVISION = "main"  # what -hf loads, as llama.cpp's -hf does


class HubError(SpecEEError):
    """A model could not be had from the Hub: a wrong repository, quant or file, no network, a cut download."""


@dataclass(frozen=True)
class HfSpec:
    """What -hf names: a repository and the quant tag after its colon, if any."""

    repo: str
    tag: str | None

    @classmethod
    def parse(cls, text: str) -> HfSpec:
        repo, _, tag = text.partition(":")
        owner, _, name = repo.partition("/")
        if not owner or not name or "/" in name:
            raise HubError(f"-hf takes USER/REPO[:QUANT] (e.g. bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M), got {text!r}")
        return cls(repo, tag or None)


@dataclass(frozen=True)
class HfModel:
    """A model -hf named, in the cache."""

    name: str  # hf:USER/REPO/FILE: the name that loads it in every command, as `specee-edge models` shows it
    path: Path  # its file (a split model's first part)


def is_model_gguf(path: str) -> bool:
    name = path.rsplit("/", 1)[-1].lower()
    return name.endswith(".gguf") and not any(word in name for word in NOT_MODELS)


def is_first_part(path: str) -> bool:
    """A single-file GGUF, or the first part of a split one."""
    split = SPLIT.match(path.rsplit("/", 1)[-1])
    return split is None or int(split["index"]) == 1


def pick_file(files: list[str], tag: str | None) -> str | None:
    """The model GGUF llama.cpp would load from a repository of these files (None: no such file)."""
    candidates = [f for f in files if is_model_gguf(f) and is_first_part(f)]
    for wanted in [tag] if tag else DEFAULT_TAGS:
        pattern = re.compile(re.escape(wanted) + r"[.-]", re.IGNORECASE)
        for file in candidates:
            if pattern.search(file):
                return file
    return candidates[0] if candidates and not tag else None


def split_parts(files: list[str], primary: str) -> list[str]:
    """Every part of ``primary``'s split GGUF in order, or [primary] for a single file."""
    folder, _, name = primary.rpartition("/")
    split = SPLIT.match(name)
    if split is None:
        return [primary]
    count = int(split["count"])
    prefix = f"{folder}/{split['prefix']}" if folder else split["prefix"]
    parts = [f"{prefix}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    missing = [p for p in parts if p not in files]
    if missing:
        raise HubError(f"{primary} is part 1 of {count}, but the repository lacks {', '.join(missing)}")
    return parts


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in OFFLINE_VALUES


def expand(path: str | Path) -> Path:
    """A folder from the environment as huggingface_hub reads it: ``~`` and ``$VARIABLES`` expanded."""
    return Path(os.path.expandvars(os.path.expanduser(path)))


def hub_home_cache() -> Path:
    """huggingface_hub's cache where no variable names the folder itself: HF_HOME/hub, else
    XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return expand(home) / "hub"


def hub_cache_dir() -> Path:
    """huggingface_hub's own cache: HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE, else ``hub_home_cache``. This is
    its constants.HF_HUB_CACHE, which it reads once, when imported; read here when called (the tests hold
    the two equal)."""
    configured = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    return expand(configured) if configured else hub_home_cache()


def cache_dir() -> Path:
    """The Hugging Face cache as this llama.cpp's -hf picks it (common/hf-cache.cpp), so that a model either
    downloaded is the other's too: LLAMA_CACHE, else huggingface_hub's own (which llama.cpp looks for in the
    same order); read when called."""
    if configured := os.environ.get("LLAMA_CACHE"):
        return Path(configured).expanduser()
    return hub_cache_dir()


def cache_dirs() -> list[Path]:
    """Every Hugging Face cache a model may lie in, -hf's first: with LLAMA_CACHE or HF_HUB_CACHE set, what
    other tools put in huggingface_hub's cache or in the one under HF_HOME is there still."""
    return list(dict.fromkeys([cache_dir(), hub_cache_dir(), hub_home_cache()]))


def endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


def repo_folder(repo: str) -> Path:
    """Where the cache keeps ``repo`` (USER/REPO)."""
    return cache_dir() / f"models--{repo.replace('/', '--')}"


def main_snapshot(folder: Path) -> Path | None:
    """The snapshot of main (what -hf loads) in a repository's folder of a cache, or None where it has no main."""
    try:
        commit = (folder / "refs" / "main").read_text().strip()
    except OSError:
        return None
    return folder / "snapshots" / commit


def cached_files(repo: str) -> list[str]:
    """The files of ``repo`` in the cache's snapshot of main (what offline mode can load)."""
    snapshot = main_snapshot(repo_folder(repo))
    if snapshot is None:
        return []
    return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())


def repo_files(repo: str) -> tuple[list[str], bool]:
    """The repository's files, and whether they came from the Hub (else from the cache: offline or no network)."""
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    where = endpoint() or "huggingface.co"
    reason = "HF_HUB_OFFLINE is set"
    if not offline():
        try:
            info = HfApi(endpoint=endpoint()).model_info(repo, revision=REVISION)
            return sorted(s.rfilename for s in info.siblings or ()), True
        except HFValidationError as e:
            raise HubError(f"-hf {repo!r} is not a repository id: {first_line(e)}") from None
        except GatedRepoError:
            raise HubError(f"{repo} is gated: accept its terms on its page and set HF_TOKEN") from None
        except RepositoryNotFoundError:
            raise HubError(f"no model repository {repo} on {where} (a private one needs HF_TOKEN)") from None
        except RevisionNotFoundError:
            raise HubError(f"{repo} has no revision {REVISION} on {where}") from None
        except HfHubHTTPError as e:
            raise refusal(e, repo) from None
        except (OfflineModeIsEnabled, httpx2.TransportError) as e:
            reason = f"cannot reach {where}: {e}"
    files = cached_files(repo)
    if not files:
        raise HubError(f"{reason}, and {repo} is not in the Hugging Face cache ({cache_dir()})")
    return files, False


def first_line(error: Exception) -> str:
    """An exception's message, one line of it (its type where it has none)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def refusal(error: HfHubHTTPError, repo: str) -> HubError:
    """One line for an HTTP error of the Hub's other than a missing or gated repository: a token refused, a rate
    limit, a server error."""
    where = endpoint() or "huggingface.co"
    status = error.response.status_code
    if status == 401:
        return HubError(f"{where} refused the token (401): check HF_TOKEN (or the token `hf auth login` saved), or "
                        "unset it for a public repository")
    if status == 429:
        return HubError(f"{where} is limiting requests (429): wait a few minutes and run the command again (HF_TOKEN "
                        "raises the limit)")
    if status >= 500:
        return HubError(f"{where} failed ({status}): run the command again later")
    return HubError(f"{where} answered {status} for {repo}: {first_line(error)}")


def download(repo: str, file: str, online: bool) -> Path:
    """One file through the cache: fetched (or resumed) when online, else the cached copy."""
    import httpx2
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return Path(hf_hub_download(repo, file, cache_dir=cache_dir(), endpoint=endpoint(), local_files_only=not online))
    except (OSError, httpx2.TransportError) as e:  # HfHubHTTPError is an OSError
        if isinstance(e, HfHubHTTPError) and (e.response.status_code in (401, 429) or e.response.status_code >= 500):
            raise refusal(e, repo) from None
        raise HubError(f"downloading {file} from {repo} failed ({first_line(e)}): run the command again to resume") from None


def hf_model(spec_text: str, hf_file: str | None = None) -> HfModel:
    """The model `-hf spec_text [--hf-file hf_file]` names, downloading what is missing."""
    spec = HfSpec.parse(spec_text)
    files, online = repo_files(spec.repo)
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    if hf_file is not None:
        primary = next((f for f in files if f.lower() == hf_file.lower()), None)
        if primary is None:
            raise HubError(f"{spec.repo} has no file {hf_file}: its GGUFs are {', '.join(ggufs) or 'none'}")
    else:
        primary = pick_file(files, spec.tag)
        if primary is None:
            wanted = f"tagged {spec.tag}" if spec.tag else "files"
            raise HubError(f"{spec.repo} has no GGUF {wanted}: it has {', '.join(ggufs) or 'none'}")
    paths = [download(spec.repo, part, online) for part in split_parts(files, primary)]
    return HfModel(f"hf:{spec.repo}/{primary}", paths[0])
