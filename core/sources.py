"""Where a model, tokenizer or adapter comes from: a local folder or a hub id, told apart before anything loads.

transformers and peft take every string that is not an existing folder for a hub id, so a mistyped
local path costs a minute of retries and ends in "couldn't connect", and a folder that is not a
checkpoint gets "should have a `model_type` key". Every loader asks here first:

* a value is **local** when it exists, is absolute, starts with `.` or `~`, has more than the two
  parts of `owner/name`, or its parent folder exists (`runs/base` beside a `runs/` folder); a
  missing local value is reported at once: "`base` './models/x': no such folder";
* a local folder is a **checkpoint** when it has config.json, an **adapter** when it has
  adapter_config.json (peft); anything else is named for what it lacks;
* a **hub id** is left to transformers and peft once it is known to be there: offline
  (`HF_HUB_OFFLINE=1`, read when asked, not at import) it must already be in the hub cache; online it
  must be in the cache or answer one short request to the hub (`HF_ENDPOINT`, 2 s, no retries), so
  that `missing_dir/base` (a mistyped local path of the form owner/name) or an unreachable hub is
  refused at once with the reason, not after a minute of the hub client's retries.

Every error is a ValueError that names the argument and the value.
"""

from __future__ import annotations

import os
from http import HTTPStatus
from pathlib import Path
from typing import Literal

CONFIG = "config.json"
ADAPTER_CONFIG = "adapter_config.json"
_TRUE = {"1", "on", "yes", "true"}
HUB_TIMEOUT_SECONDS = 2.0


def is_local(source: str | os.PathLike) -> bool:
    """Whether `source` means a local path (see the module doc), so that it must exist."""
    text = os.fspath(source)
    path = Path(text).expanduser()
    if path.exists() or text.startswith((".", "~")) or path.is_absolute() or len(path.parts) > 2:
        return True
    return len(path.parts) == 2 and path.parent.is_dir()  # `owner/name` with a local folder `owner/`


def hub_offline() -> bool:
    """`HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) as it is now; huggingface_hub reads it once, at import."""
    from huggingface_hub import constants

    variables = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return bool(constants.HF_HUB_OFFLINE) or any(value.strip().lower() in _TRUE for value in variables)


def source_kind(source: str | os.PathLike, argument: str) -> Literal["checkpoint", "adapter"]:
    """A full checkpoint or a peft adapter, local or on the hub (a hub id is asked for its adapter_config.json).

    Raises a ValueError naming `argument` for a missing local folder, a folder with neither
    config.json nor adapter_config.json, or a hub id that offline mode cannot load.
    """
    text = _as_text(source, argument)
    if is_local(text):
        folder = _local_folder(text, argument)
        if (folder / ADAPTER_CONFIG).is_file():
            return "adapter"
        if (folder / CONFIG).is_file():
            return "checkpoint"
        raise ValueError(
            f"{_named(argument, text)} is neither a model folder nor a peft adapter folder: "
            f"it has no {CONFIG} and no {ADAPTER_CONFIG} ({folder_contents(folder)})"
        )
    check_hub_id(text, argument)
    if _cached(text, ADAPTER_CONFIG):
        return "adapter"
    if hub_offline():
        _check_cached(text, argument, CONFIG)
        return "checkpoint"
    if not _cached(text, CONFIG):
        check_hub_reachable(text, argument)
    return "adapter" if _hub_has_adapter(text) else "checkpoint"


def check_model_source(
    source: str | os.PathLike,
    argument: str,
    adapter_hint: str = "pass it as an adapter (an expert adapter) on its base",
) -> str:
    """`source` as a string, after checking that it is a full checkpoint (folder with config.json, or a hub id).

    A peft adapter folder is named as one, with `adapter_hint` (what to do with it instead).
    """
    adapter = f"is a peft adapter folder, not a full checkpoint; {adapter_hint}"
    return _check_source(source, argument, CONFIG, (ADAPTER_CONFIG, adapter), "is not a model folder")


def check_adapter_source(source: str | os.PathLike, argument: str) -> str:
    """`source` as a string, after checking that it is a peft adapter (folder with adapter_config.json, or a hub id)."""
    checkpoint = f"is a full checkpoint, not a peft adapter folder (it has no {ADAPTER_CONFIG})"
    return _check_source(source, argument, ADAPTER_CONFIG, (CONFIG, checkpoint), "is not a peft adapter folder")


def _check_source(source: str | os.PathLike, argument: str, wanted: str, other: tuple[str, str], neither: str) -> str:
    """A hub id (cached, when offline), or a local folder with the file `wanted`.

    A folder with `other[0]` instead is refused as `other[1]`.
    """
    text = _as_text(source, argument)
    if not is_local(text):
        check_hub_id(text, argument)
        if hub_offline():
            _check_cached(text, argument, wanted)
        elif not _cached(text, wanted):
            check_hub_reachable(text, argument)
        return text
    folder = _local_folder(text, argument)
    if (folder / wanted).is_file():
        return text
    if (folder / other[0]).is_file():
        raise ValueError(f"{_named(argument, text)} {other[1]}")
    raise ValueError(f"{_named(argument, text)} {neither}: it has no {wanted} ({folder_contents(folder)})")


def check_tokenizer_source(source: str | os.PathLike, argument: str) -> str:
    """`source` as a string: an existing local folder, or a hub id (cached, when offline)."""
    text = _as_text(source, argument)
    if is_local(text):
        _local_folder(text, argument)
        return text
    check_hub_id(text, argument)
    if _cached(text, "tokenizer_config.json") or _cached(text, "tokenizer.json"):
        return text
    if hub_offline():
        raise ValueError(_offline_message(argument, text))
    check_hub_reachable(text, argument)
    return text


# ---- helpers -----------------------------------------------------------------------------------


def _as_text(source: object, argument: str) -> str:
    if not isinstance(source, (str, os.PathLike)) or not os.fspath(source):
        raise ValueError(f"`{argument}` must be a folder or a hub id (a non-empty string), got {source!r}")
    return os.fspath(source)


def _named(argument: str, text: str) -> str:
    return f"`{argument}` {text!r}"


def _local_folder(text: str, argument: str) -> Path:
    folder = Path(text).expanduser()
    if not folder.exists():
        raise ValueError(f"{_named(argument, text)}: no such folder")
    if not folder.is_dir():
        raise ValueError(f"{_named(argument, text)} is a file, not a folder")
    return folder


def folder_contents(folder: Path) -> str:
    """What `folder` holds, in words (its first six names), for a message that says what a folder lacks."""
    names = sorted(path.name for path in folder.iterdir())
    if not names:
        return "the folder is empty"
    return f"it holds {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}"


def check_hub_id(text: str, argument: str) -> None:
    """Raise a ValueError naming `argument` unless `text` has the form of a hub id (owner/name)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        raise ValueError(f"{_named(argument, text)}: no such folder, and not a hub id (owner/name) either") from None


def check_hub_reachable(repo_id: str, argument: str) -> None:
    """Raise a ValueError naming `argument` unless the hub (`HF_ENDPOINT`) answers that model `repo_id` exists.

    One request, `HUB_TIMEOUT_SECONDS` long, no retries; the reason it failed (connection refused,
    timed out, 404 not found) is in the message. A gated repo exists, so it passes (loading it says
    whether the token may read it).
    """
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    try:
        HfApi(endpoint=endpoint).model_info(repo_id, timeout=HUB_TIMEOUT_SECONDS)
        return
    except GatedRepoError:
        return
    except RepositoryNotFoundError:
        reason = f"{endpoint} answered 404 not found"
    except HfHubHTTPError as error:
        status = getattr(error.response, "status_code", None)
        reason = f"{endpoint} answered {_status(status)}" if status else f"{endpoint}: {_first_line(error)}"
    except Exception as error:  # noqa: BLE001 - the transport's errors (refused, timed out, DNS) differ by client
        timed_out = "timeout" in type(error).__name__.lower() or "timed out" in str(error).lower()
        detail = f"timed out after {HUB_TIMEOUT_SECONDS:g} s" if timed_out else _first_line(error)
        reason = f"{endpoint}: {detail}"
    raise ValueError(f"{_named(argument, repo_id)}: no such local folder, and not reachable as a hub id ({reason})")


def _status(code: int) -> str:
    """`404 not found`: an HTTP status with its reason phrase."""
    try:
        return f"{code} {HTTPStatus(code).phrase.lower()}"
    except ValueError:
        return f"HTTP {code}"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _cached(repo_id: str, filename: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, filename), str)


def _check_cached(repo_id: str, argument: str, filename: str) -> None:
    if not _cached(repo_id, filename):
        raise ValueError(_offline_message(argument, repo_id))


def _offline_message(argument: str, repo_id: str) -> str:
    return (
        f"{_named(argument, repo_id)} is not a local folder, so it is a hub id, and HF_HUB_OFFLINE is set but the "
        "hub cache does not hold it; download it while online, or give the path of a local folder"
    )


def _hub_has_adapter(repo_id: str) -> bool:
    """Whether hub repo `repo_id` has adapter_config.json (peft's own check: one small download)."""
    from huggingface_hub import hf_hub_download

    try:
        hf_hub_download(repo_id, ADAPTER_CONFIG)
        return True
    except Exception:  # noqa: BLE001 - no such file, repo or network: loading it as a model reports which
        return False
