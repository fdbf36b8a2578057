"""Fill MODEL_CARD.md for a trained run from its summary.json (written by `run_train`)."""

from __future__ import annotations

import json
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any

from unmask.errors import InputError

TEMPLATE = Path(__file__).with_name("MODEL_CARD.md.template")
# An issue number ("issue" and a number, or a hash and one to three digits): a card is read where
# the tracker is not, so it says what the number stood for instead (tests/test_docs.py holds the
# repository's text to the same rule).
ISSUE_CITATION = re.compile(r"\b[Ii]ssues?\s?#?\d+|(?<![#&\w])#\d{1,3}(?![\w])")
# One card per model family (the run's config.json model_type)
TEMPLATES = {"llada": TEMPLATE, "sdar": Path(__file__).with_name("SDAR_MODEL_CARD.md.template")}


def _buckets_text(buckets: list[dict[str, Any]] | None) -> str:
    from dataclasses import asdict

    from unmask.training.args import DEFAULT_BUCKETS

    bs = buckets if buckets is not None else [asdict(b) for b in DEFAULT_BUCKETS]
    return ", ".join(f"{b['weight']:.0%} " + (f"longest answer + {b['lo']}-{b['hi']} EOS" if b.get("tight")
                                              else f"{b['lo']}-{b['hi']}") for b in bs)


def render_model_card(summary: dict[str, Any], scores: str = "To be added by the eval command.",
                      hardware: str | None = None, lineage: str = "") -> str:
    """lineage: a paragraph on where an ``--init`` run's starting weights came from. scores and
    lineage are written by hand: an issue number in either is refused (InputError)."""
    from unmask.tasks import code

    for name, text in (("scores", scores), ("lineage", lineage)):
        if m := ISSUE_CITATION.search(text):
            raise InputError(f"{name} cites {m.group()!r}: say what it stood for")

    cfg, args = summary["config"], summary["args"]
    if args.get("init") and not lineage:
        lineage = f"- Started from the weights of `{args['init']}` (`--init`), not from scratch."
    code_frac = float(args.get("code_frac", 0.25))
    return TEMPLATES[cfg.get("model_type", "llada")].read_text().format(
        params=summary["params"], params_m=summary["params"] / 1e6,
        block_size=cfg.get("block_size"), head_dim=cfg.get("head_size") or cfg["d_model"] // cfg["n_heads"],
        d_model=cfg["d_model"], n_layers=cfg["n_layers"], n_heads=cfg["n_heads"],
        mlp_hidden_size=cfg["mlp_hidden_size"], vocab_size=cfg["vocab_size"],
        max_sequence_length=cfg["max_sequence_length"],
        math_pct=round(100 * (1 - code_frac)), code_pct=round(100 * code_frac),
        n_code_train=len(code.all_examples("train")), n_code_heldout=len(code.all_examples("heldout")),
        py_version=platform.python_version(), command=summary["command"],
        weight_decay=args["weight_decay"], lr=args["lr"], grad_clip=args["grad_clip"],
        batch_tokens=args["batch_tokens"], steps=summary["steps"], tokens=summary["tokens"],
        pad_weight=args.get("pad_weight", 1.0), digit_weight=args.get("digit_weight", 1.0),
        buckets=_buckets_text(args.get("buckets")), lineage=lineage,
        train_minutes=summary["train_minutes"],
        hardware=hardware or f"a {os.cpu_count()}-core {platform.machine()} CPU",
        final_train_loss=_shown(summary["final_train_loss"]),
        final_heldout_loss=_shown(summary["final_heldout_loss"]),
        scores=scores, semi_ar_text=_semi_ar_text(float(args.get("semi_ar", 0.0))),
        final_digit_recall=_shown(summary.get("final_digit_recall")),
        final_solve_rate=_shown(summary.get("final_solve_rate")),
        final_parse_rate=_shown(summary.get("final_parse_rate")), solve_n=args.get("solve_n", "n/a"),
        code_cut_text=_code_cut_text(int(args.get("code_max_tokens", 0) or 0)),
    )


def _code_cut_text(cap: int) -> str:
    if cap <= 0:
        return ""
    return (f" The last stage trained only on the functions whose body is at most {cap} tokens"
            f" (`--code-max-tokens`): the model is too small to close long bodies; the held-out"
            f" functions it is scored on are not cut.")


def _semi_ar_text(share: float) -> str:
    if share <= 0:
        return ""
    from unmask.training.objective import SEMI_AR_BLOCK

    return (f"\n  {share:.0%} of rows are instead masked as semi-autoregressive decoding sees its "
            f"canvas\n  (`--semi-ar`): clean response before a cut at a {SEMI_AR_BLOCK}-token block "
            "boundary, the block after it\n  masked at rate t, everything after the block masked.")


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("run_dir", help="run folder with summary.json")
    ap.add_argument("model_dir", help="model folder to write MODEL_CARD.md into")
    ap.add_argument("--hardware", default=None)
    ap.add_argument("--scores", default="To be added by the eval command.")
    ap.add_argument("--lineage", default="", help="paragraph on the --init weights' own training")
    a = ap.parse_args(argv)
    summary = json.loads((Path(a.run_dir) / "summary.json").read_text())
    try:
        card = render_model_card(summary, a.scores, a.hardware, a.lineage)
    except InputError as e:
        ap.error(str(e))
    (Path(a.model_dir) / "MODEL_CARD.md").write_text(card)
    print(f"wrote {Path(a.model_dir) / 'MODEL_CARD.md'}", file=sys.stderr)


def _shown(value: object) -> object:
    """A summary number as the card writes it: n/a where the run measured none (null)."""
    return "n/a" if value is None else value


if __name__ == "__main__":
    main()

