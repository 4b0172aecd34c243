"""A Hub model id checked once, quickly, before anything downloads it.

Why: with no network and ``HF_HUB_OFFLINE`` unset, transformers tries the Hub for each file it wants (config,
tokenizer files, weights), each try with huggingface_hub's retries: about a minute of ``Retrying in 8s`` lines,
then an ``OSError`` about whichever file came first (the tokenizer's, so the error named ``model.tokenizer``, a key
the user never set). One HEAD request for ``config.json`` without retries answers the question in well under a
second when the connection is refused (10 s at most when it hangs), and the answer is one line naming
``model.name_or_path`` and the ways out.

When the Hub cannot be reached but the model is in the local cache, the run goes on from the cache: the base
becomes the cached snapshot directory, so nothing after this tries the network again.
"""

from __future__ import annotations

from pathlib import Path

from hf_stable.errors import ModelError
from hf_stable.logging import get_logger

logger = get_logger(__name__)

PROBE_TIMEOUT = 10.0  # seconds for the one HEAD request: a reachable Hub answers in well under that


class HubUnreachableError(ModelError):
    """The Hub cannot be reached (or ``HF_HUB_OFFLINE=1``) and the model is not in the local cache: an environment
    problem, with the ways out (`what` and `ways_out` for the doctor's row; the message is both, on one line)."""

    def __init__(self, field: str, what: str, name: str):
        self.what, self.ways_out = f"{field}: {what}", _ways_out(name)
        super().__init__(f"{self.what}; {self.ways_out}")


def _ways_out(name: str) -> str:
    return (
        f"ways out: set model.name_or_path to a local model directory; download it where the Hub is reachable "
        f"(`hf download {name}`, then copy the cache or the directory here); or, with the model already in the "
        "cache (HF_HOME), set HF_HUB_OFFLINE=1"
    )


def _cached_snapshot(name: str, revision: str | None) -> str | None:
    """The cached snapshot directory of `name` when its config.json is in the local Hub cache, else None."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(name, "config.json", revision=revision)
    return str(Path(found).parent) if isinstance(found, str) else None


def hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def resolve_hub_model(name: str, revision: str | None = None, *, field: str = "model.name_or_path") -> str:
    """What to load for the Hub id `name`: the id itself when the Hub answers, the cached snapshot directory when
    it cannot be reached (or ``HF_HUB_OFFLINE=1``) but the model is cached.

    Raises:
        ModelError: one line naming `field`: the Hub unreachable (or offline mode) and the model not cached, or
            the Hub saying the repository does not exist / is gated.
    """
    import httpx2
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import EntryNotFoundError, GatedRepoError, RepositoryNotFoundError

    cache = constants.HF_HUB_CACHE
    if hub_offline():
        snapshot = _cached_snapshot(name, revision)
        if snapshot is None:
            raise ModelError(
                f"{field}: HF_HUB_OFFLINE=1 and {name!r} is not in the local cache ({cache}); {_ways_out(name)}"
            )
        return name  # transformers reads the cache itself in offline mode
    try:
        get_hf_file_metadata(hf_hub_url(name, "config.json", revision=revision), timeout=PROBE_TIMEOUT)
    except EntryNotFoundError:
        return name  # a repository without config.json: transformers says what it needs
    except GatedRepoError:
        raise ModelError(
            f"{field}: {name!r} is gated on the Hub: accept its terms on the model page, then log in "
            "(`hf auth login`) or set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise ModelError(
            f"{field}: {name!r} is not a model on the Hub (or it is private: log in with `hf auth login`); "
            "a local directory must start with ./ or /"
        ) from None
    except (httpx2.TransportError, OSError) as e:  # refused, no route, DNS, timeout, a proxy or server error
        snapshot = _cached_snapshot(name, revision)
        why = f"{type(e).__name__}: {e}".splitlines()[0]
        if snapshot is None:
            what = (
                f"cannot reach the Hugging Face Hub at {constants.ENDPOINT} ({why}) to download {name!r}, "
                f"and it is not in the local cache ({cache})"
            )
            raise HubUnreachableError(field, what, name) from None
        logger.warning(
            "the Hugging Face Hub at %s cannot be reached (%s): loading %s from the local cache %s "
            "(set HF_HUB_OFFLINE=1 to skip this check)",
            constants.ENDPOINT,
            why,
            name,
            snapshot,
        )
        return snapshot
    return name
