"""Model names: a local folder, a model shipped in the package (SHIPPED: ``unmask-llada``, the
default, and ``unmask-sdar``), or a Hugging Face hub id (``org/name``) downloaded on first use.

A name that is not a local folder and looks like ``org/name`` is fetched with huggingface_hub's
``snapshot_download`` into that library's own cache (``HF_HOME``, ``HF_HUB_CACHE``), with its
progress bar, ``HF_HUB_OFFLINE``, ``HF_ENDPOINT`` and token handling (``HF_TOKEN``, ``hf auth
login``) as it does them; only the files the loader reads come down (ALLOW_PATTERNS). Every
other name is returned as a path, for the loader to say what is wrong with it. Each way a
download fails is one CheckpointError saying which (offline, unknown id, gated, unreachable).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from unmask.errors import CheckpointError

# config.json, the tokenizer files (unmask.checkpoint.TOKENIZER_FILES), generation_config.json
# (what chat reads: unmask.catalog.SINGLE_TURN_KEY) and the weights: one model.safetensors or
# shards with their index. Nothing else (pytorch_model.bin, GGUF, images).
DESCRIPTION_PATTERNS = ["config.json", "tokenizer.json", "tokenizer_config.json",
                        "special_tokens_map.json", "chat_template.jinja", "generation_config.json"]
ALLOW_PATTERNS = [*DESCRIPTION_PATTERNS, "*.safetensors", "model.safetensors.index.json"]
ASSETS = Path(__file__).parent / "assets"
# The models the package ships (unmask/assets/*/MODEL_CARD.md), by the name --model takes; a local
# folder of the same name wins, as any existing folder does.
SHIPPED = {"unmask-llada": ASSETS / "default_model", "unmask-sdar": ASSETS / "sdar_model"}
DEFAULT_NAME = "unmask-llada"  # what runs when no model is named

# The hub's own rule for repository names: letters, digits, '-', '_', '.'; no '--' or '..'.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")


def looks_like_hub_id(name: str) -> bool:
    return bool(HUB_ID.match(name)) and ".." not in name and "--" not in name


def resolve_model(name: str, patterns: list[str] = ALLOW_PATTERNS) -> Path:
    """The folder `name` names: itself when it exists, a shipped model's (SHIPPED), itself when
    it is not a hub id, else the hub snapshot of that id with the files `patterns` match
    (downloaded if the cache lacks them; DESCRIPTION_PATTERNS: what `unmask show` reads, no
    weights)."""
    path = Path(os.path.expanduser(name))  # "~nobody/x" stays as written
    if not path.exists() and name in SHIPPED:
        return SHIPPED[name]
    if path.exists() or not looks_like_hub_id(name):
        return path
    return download(name, patterns)


def model_name(name: str | None, folder: Path) -> str:
    """What a model is called wherever unmask names it (`unmask models`, a server's model id,
    chat): a shipped model by its SHIPPED name, a hub download by its id, a folder by its own
    name. name: as the caller gave it (None: the default model)."""
    shipped = {p.resolve(): n for n, p in SHIPPED.items()}
    if folder.resolve() in shipped:
        return shipped[folder.resolve()]
    if name is not None and not Path(os.path.expanduser(name)).exists() and looks_like_hub_id(name):
        return name
    return folder.name


def download(repo_id: str, patterns: list[str]) -> Path:
    """snapshot_download of `repo_id`'s files `patterns` match; CheckpointError naming the
    cause when it cannot."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id!r} is not a local folder"
    endpoint = constants.ENDPOINT
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except GatedRepoError:  # before RepositoryNotFoundError, its base class
        raise CheckpointError(f"{where}, and on {endpoint} it is a gated model: accept its terms "
                              f"on its page, then set HF_TOKEN (or run `hf auth login`)") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{where}, and {endpoint} has no model {repo_id!r} (or it is private "
                              f"and no valid token was sent: set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{where}, and {endpoint} has no main revision of it") from None
    except LocalEntryNotFoundError as e:
        if constants.HF_HUB_OFFLINE:
            raise CheckpointError(f"{where}, and not in the Hugging Face cache "
                                  f"({constants.HF_HUB_CACHE}) while HF_HUB_OFFLINE is set: "
                                  f"download it with network, or unset HF_HUB_OFFLINE") from None
        cause = e.__cause__ or e
        raise CheckpointError(f"{where}, and {endpoint} cannot be reached to download it "
                              f"({type(cause).__name__}); it is not in the Hugging Face cache "
                              f"either") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "no"
        raise CheckpointError(f"{where}, and downloading it from {endpoint} failed (HTTP "
                              f"{status}: {str(e).splitlines()[0][:200]})") from None
