"""What a model folder holds, read without loading its weights, and `unmask models`: the models
this machine has (the shipped ones, dLLM folders in the Hugging Face cache, folders under
UNMASK_MODELS or --dir).

Torch-free at import (the CLI's parser imports the argument function); the parameter count
builds the model on the meta device, which allocates nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from unmask.errors import CheckpointError, ConfigError

MODELS_ENV = "UNMASK_MODELS"


@dataclass(frozen=True)
class ModelSummary:
    """A checkpoint folder as its files describe it."""

    name: str  # how to pass it to --model / LLM(...): a hub id, or the folder
    path: str
    family: str  # config.json's model_type
    parameters: int
    dtype: str  # the weights' dtype, or the quantization scheme of a folder saved quantized
    disk_bytes: int
    source: str  # embedded | hub cache | folder


def config_of(folder: Path):
    """The folder's ModelConfig; CheckpointError naming why it is not a dLLM checkpoint."""
    from unmask.config import ModelConfig

    try:
        return ModelConfig.load(folder)
    except ConfigError as e:  # some of its messages name the folder already
        raise CheckpointError(str(e) if str(folder) in str(e) else f"{folder}: {e}") from None


def meta_model(config):
    """The model of `config` on the meta device: shapes, no memory."""
    import torch

    from unmask.models import build_model

    with torch.device("meta"):
        return build_model(config)


def count_parameters(config) -> int:
    return sum(p.numel() for p in meta_model(config).parameters())


def active_parameters(config) -> int:
    """Parameters one token's forward uses: all of them but, in each mixture-of-experts layer,
    the routed experts the router does not send it to (LLaDA2.0-mini: 1.43B of 16.26B)."""
    from torch import nn

    model = meta_model(config)
    total = sum(p.numel() for p in model.parameters())
    if config.num_experts is None:
        return total
    idle = config.num_experts - config.num_experts_per_tok
    experts = [m.experts[0] for m in model.modules()
               if isinstance(getattr(m, "experts", None), nn.ModuleList)]
    return total - idle * sum(p.numel() for e in experts for p in e.parameters())


def weights_dtype(folder: Path, config) -> str:
    from unmask.quantize import QUANTIZED_FILE

    if (folder / QUANTIZED_FILE).is_file():  # the scheme is in the file; reading it loads it
        return "quantized"
    return config.torch_dtype


def disk_bytes(folder: Path) -> int:
    """Bytes of the folder's files, links followed (the hub cache links snapshots to blobs)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def summarize(folder: Path, name: str, source: str) -> ModelSummary:
    """CheckpointError for a folder that is not a dLLM checkpoint, or has no weights (a hub
    snapshot `unmask show` fetched the description of)."""
    from unmask.quantize import QUANTIZED_FILE

    config = config_of(folder)
    if not any(folder.glob("*.safetensors")) and not (folder / QUANTIZED_FILE).is_file():
        raise CheckpointError(f"{folder}: no weights (*.safetensors) in the folder")
    return ModelSummary(name=name, path=str(folder), family=config.model_type,
                        parameters=count_parameters(config),
                        dtype=weights_dtype(folder, config), disk_bytes=disk_bytes(folder),
                        source=source)


def has_chat_template(folder: Path) -> bool:
    """Whether the tokenizer files carry a chat template (tokenizer_config.json's
    chat_template, or a chat_template.jinja beside it), read without loading the tokenizer."""
    if (folder / "chat_template.jinja").is_file():
        return True
    try:
        raw = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and bool(raw.get("chat_template"))


# generation_config.json's key by which a folder says its model was trained on single questions
# (the shipped ones: their MODEL_CARD.md), so that a chat answers each message alone by default.
SINGLE_TURN_KEY = "trained_on_single_turns"


def trained_on_single_turns(folder: Path) -> bool:
    """Whether generation_config.json says SINGLE_TURN_KEY: true (a folder without the file or
    the key is taken as a chat model, trained on conversations)."""
    try:
        raw = json.loads((folder / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and raw.get(SINGLE_TURN_KEY) is True


# --- where models are -------------------------------------------------------------------------
def candidates(dirs: list[Path]) -> list[tuple[Path, str, str]]:
    """(folder, name, source) of every place a model may be: the shipped models, the hub
    cache's model snapshots (the newest revision of each), each dir and its subfolders."""
    from unmask.hub import SHIPPED

    found = [*((folder, name, "embedded") for name, folder in SHIPPED.items()), *hub_snapshots()]
    for d in dirs:
        found += [(sub, str(sub), "folder") for sub in [d, *sorted(d.iterdir())]
                  if sub.is_dir() and (sub != d or (d / "config.json").is_file())]
    return found


def hub_snapshots() -> list[tuple[Path, str, str]]:
    from huggingface_hub import constants, scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir(constants.HF_HUB_CACHE)
    except CacheNotFound:  # nothing was ever downloaded
        return []
    out = []
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type == "model" and repo.revisions:
            newest = max(repo.revisions, key=lambda r: r.last_modified)
            out.append((newest.snapshot_path, repo.repo_id, "hub cache"))
    return out


def model_dirs(flags: list[str] | None) -> list[Path]:
    """--dir flags, else UNMASK_MODELS (folders separated by os.pathsep); each must exist."""
    names = flags or [d for d in os.environ.get(MODELS_ENV, "").split(os.pathsep) if d]
    dirs = [Path(os.path.expanduser(n)) for n in names]
    for d in dirs:
        if not d.is_dir():
            where = "--dir" if flags else MODELS_ENV
            raise CheckpointError(f"{where} names {d}, which is not a folder")
    return dirs


def list_models(dirs: list[Path]) -> tuple[list[ModelSummary], list[str]]:
    """The dLLM checkpoints found, and 'NAME (why)' for each folder with a config.json that
    is not one (a folder without one is no model at all, and not mentioned)."""
    models, left_out = [], []
    for folder, name, source in candidates(dirs):
        if not (folder / "config.json").is_file():
            continue
        try:
            models.append(summarize(folder, name, source))
        except CheckpointError as e:
            left_out.append(f"{name} ({str(e).removeprefix(f'{folder}: ')[:200]})")
    return models, left_out


# --- the command ------------------------------------------------------------------------------
def add_models_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", action="append", default=None, metavar="DIR",
                   help=f"a folder of model folders (or one model folder); repeatable "
                        f"(default: ${MODELS_ENV}, folders separated by '{os.pathsep}')")
    p.add_argument("--json", action="store_true", help="one JSON object per model, one per line")


def run_models(args: argparse.Namespace) -> int:
    models, left_out = list_models(model_dirs(args.dir))
    if args.json:
        for m in models:
            print(json.dumps(asdict(m)))
    else:
        print_table(models)
    if left_out:
        print(f"note: left out {len(left_out)} folder(s) that are not dLLM checkpoints: "
              f"{'; '.join(left_out)}", file=sys.stderr)
    return 0


def print_table(models: list[ModelSummary]) -> None:
    """One row per model; the name is what --model takes (a hub id, or the folder). On a
    terminal a table whose name column folds rather than cuts when narrow; off one (piped), plain
    rows that never wrap, since a name is something people copy and grep for. --json has each
    model's path too."""
    from rich.console import Console

    titles = ("model", "family", "parameters", "dtype", "on disk", "where")
    rows = [(m.name, m.family, human(m.parameters), m.dtype, gib(m.disk_bytes), _where(m))
            for m in models]
    console = Console()
    if not console.is_terminal:
        print(plain_rows(titles, rows), end="")
        return
    from rich.table import Table

    table = Table(box=None)
    table.add_column(titles[0], overflow="fold")
    for title in titles[1:]:
        table.add_column(title, no_wrap=True)
    for row in rows:
        table.add_row(*row)
    console.print(table)


def plain_rows(titles: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """A header and one line per row, columns padded to their widest cell and never wrapped,
    whatever the width of the terminal the text later reaches."""
    widths = [max(len(r[i]) for r in [titles, *rows]) for i in range(len(titles))]
    return "".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n"
                   for r in [titles, *rows])


def _where(m: ModelSummary) -> str:
    from unmask.hub import DEFAULT_NAME

    if m.source != "embedded":
        return m.source
    return "shipped (default)" if m.name == DEFAULT_NAME else "shipped"


def human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
