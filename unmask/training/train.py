"""Train a small LLaDA-format (masked diffusion) or SDAR-format (block diffusion) model.

``--model-type`` picks the objective (`objective_for`): LLaDA's below, or SDAR's in
``unmask.training.block_diffusion``; the data and schedule below, and the batch, masking and
loss weights of ``unmask.training.objective``, are shared.

Objective (LLaDA SFT): the prompt is never masked; every response position — including the EOS
padding that fills the canvas — is masked independently with probability p = (1 - eps) t + eps,
t ~ U(0, 1) per sequence. The loss is cross-entropy on masked positions weighted by 1/p, summed
per sequence, divided by that sequence's response length, and averaged over the batch. With
``pad_weight`` < 1 the EOS padding after the answer's own EOS counts that much per position (in
the sum and in the length it is divided by): on a 1024 canvas the padding is >90% of the
positions, and at weight 1 it takes most of the gradient although it is the easiest thing to
learn (the first run spent ~55% of its positions on padding and learned little else).

Data: worked arithmetic (``unmask.tasks.math``) and stdlib function bodies
(``unmask.tasks.code``), generated on the fly from the training splits only. Every batch has
one canvas length: either "tight" (the longest response in the batch plus a few EOS) or drawn
from ranges that reach 1024, so the model learns the EOS tail at the canvas sizes it will be
decoded with, while tight batches spend almost all compute on answer tokens.

Schedule: linear warm-up then cosine decay over a "progress" in [0, 1] which is the larger of
step / max_steps and elapsed / time_budget, so a run with a wall-clock budget ends on time with
a fully decayed learning rate.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from unmask.errors import CheckpointError, InputError, UnmaskError
from unmask.training.args import (
    DEFAULT_BUCKETS,
    DEFAULT_VOCAB,
    MAX_PROMPT,
    MAX_ROWS,
    CanvasBucket,
    add_train_arguments,
    check_train_args,
    longest_canvas,
    parse_buckets,
)
from unmask.training.block_diffusion import BlockDiffusion
from unmask.training.objective import (
    Batch,
    Decode,
    LossWeights,
    TextEncoder,
    mask_batch,
    same_config,
    weighted_ce,
)

__all__ = ["DEFAULT_BUCKETS", "CanvasBucket", "add_train_arguments", "parse_buckets", "run_train"]

# ------------------------------------------------------------------------------------ data


class DataStream:
    """Endless batches from the training splits (math + code), with a resumable RNG."""

    def __init__(self, enc: TextEncoder, *, split: str = "train", code_frac: float = 0.25,
                 batch_tokens: int = 8192, max_batch: int = MAX_ROWS,
                 buckets: tuple[CanvasBucket, ...] = DEFAULT_BUCKETS, seed: int = 0,
                 code_max_tokens: int = 0) -> None:
        from unmask.tasks import code as code_task
        from unmask.tasks import math as math_task

        self.enc, self.split, self.code_frac = enc, split, code_frac
        self.batch_tokens, self.max_batch, self.buckets = batch_tokens, max_batch, buckets
        self.rng = random.Random(seed + (0 if split == "train" else 7_000_001))
        self._tight_queue: dict[bool, list[list[tuple[list[int], list[int]]]]] = {}
        self._math = math_task
        # Code examples are few (thousands): tokenize once. Drop the ones too long for any canvas.
        # The longest fixed canvas also caps the answers a tight batch may hold.
        self.max_canvas = max_canvas = max(b.hi for b in buckets if not b.tight)
        self.code: list[tuple[list[int], list[int]]] = []
        if code_frac > 0:
            pairs = [(enc.prompt(c.prompt), enc.response(c.response))
                     for c in code_task.make_split(split, None, seed=0)]  # type: ignore[arg-type]
            cap = min(code_max_tokens, max_canvas) if code_max_tokens > 0 else max_canvas
            self.code = [c for c in pairs if len(c[1]) <= cap and len(c[0]) <= MAX_PROMPT]

    def _example(self, max_resp: int, is_code: bool) -> tuple[list[int], list[int]]:
        """One (prompt ids, response ids incl. one EOS) pair whose response fits ``max_resp``."""
        for _ in range(10_000):  # canvases shorter than every answer would loop forever
            if is_code:
                p, r = self.code[self.rng.randrange(len(self.code))]
            else:
                prob = self._math.generate_problem(self.rng)
                if self._math.is_heldout(prob.prompt) != (self.split == "heldout"):
                    continue
                p, r = self.enc.prompt(prob.prompt), self.enc.response(prob.response)
            if len(r) <= max_resp:
                return p, r
        raise InputError(f"no {'code' if is_code else 'math'} answer in 10,000 fits a canvas of "
                         f"{max_resp} tokens; give --buckets longer canvases")

    def canvas_length(self) -> int | tuple[int, int]:
        """A canvas length, or for a tight bucket the (lo, hi) range of extra EOS."""
        b = self.rng.choices(self.buckets, weights=[b.weight for b in self.buckets])[0]
        return (b.lo, b.hi) if b.tight else self.rng.randint(b.lo, b.hi)

    def _tight_pairs(self, is_code: bool, extra_range: tuple[int, int]
                     ) -> tuple[list[tuple[list[int], list[int]]], int]:
        """A batch of examples of similar response length, and its canvas (longest + U[extra_range]).

        Examples are drawn in pools of 16 batches' worth, sorted by response length and cut
        into batches that are served in random order: the example distribution is unchanged,
        but a batch no longer pads 20 short answers to its one long one.
        """
        queue = self._tight_queue.setdefault(is_code, [])
        extra = extra_range[1]  # batches are sized for the most extra EOS they can get
        if not queue:
            pool, size = [], 0
            while size < 16 * self.batch_tokens:
                p, r = self._example(self.max_canvas, is_code)
                pool.append((p, r))
                size += len(p) + len(r) + extra
            pool.sort(key=lambda pr: len(pr[1]))
            batch: list[tuple[list[int], list[int]]] = []
            longest_p = 0
            for p, r in pool:  # ascending length: the newest row is the longest
                cost = (len(batch) + 1) * (max(longest_p, len(p)) + len(r) + extra)
                if batch and (cost > self.batch_tokens or len(batch) >= self.max_batch):
                    queue.append(batch)
                    batch, longest_p = [], 0
                batch.append((p, r))
                longest_p = max(longest_p, len(p))
            queue.append(batch)
            self.rng.shuffle(queue)
        pairs = queue.pop()
        return pairs, max(len(r) for _, r in pairs) + self.rng.randint(*extra_range)

    def next_batch(self) -> Batch:
        canvas = self.canvas_length()
        # Batches are all-math or all-code: code prompts are ~5x longer than math prompts, and a
        # mixed batch would pad every math row to the longest code prompt.
        is_code = bool(self.code) and self.rng.random() < self.code_frac
        if isinstance(canvas, tuple):
            pairs, canvas = self._tight_pairs(is_code, canvas)
        else:
            prompt_guess = 160 if is_code else 32
            n = max(1, min(self.max_batch, self.batch_tokens // (canvas + prompt_guess)))
            pairs = [self._example(canvas, is_code) for _ in range(n)]
        # Rows share one total length T = longest prompt + canvas; a shorter prompt gets a longer
        # canvas, whose extra EOS padding is legitimately part of the response.
        t_len = max(len(p) for p, _ in pairs) + canvas
        n = len(pairs)
        ids = torch.full((n, t_len), self.enc.eos_id, dtype=torch.long)
        prompt_mask = torch.zeros((n, t_len), dtype=torch.bool)
        resp_len = torch.empty(n, dtype=torch.long)
        for i, (p, r) in enumerate(pairs):
            ids[i, : len(p)] = torch.tensor(p)
            ids[i, len(p): len(p) + len(r)] = torch.tensor(r)
            prompt_mask[i, : len(p)] = True
            resp_len[i] = t_len - len(p)
        answer_len = torch.tensor([len(r) for _, r in pairs], dtype=torch.long)
        return Batch(ids, prompt_mask, resp_len, answer_len)


# ------------------------------------------------------------------------------------ loss

def sft_loss(model: nn.Module, batch: Batch, mask_id: int, gen: torch.Generator | None = None,
             weights: LossWeights = LossWeights(), semi_ar: float = 0.0) -> Tensor:
    """LLaDA SFT loss: per row, sum of w * CE / p_mask over masked positions divided by the
    row's total weight (= response length with the default weights); mean over the batch."""
    noisy, masked, p_mask = mask_batch(batch, mask_id, gen, semi_ar=semi_ar)
    b, t_len = noisy.shape
    pos = torch.arange(t_len, device=noisy.device).expand(b, t_len)
    logits = model(noisy, pos)  # (B, T, V)
    return weighted_ce(logits[masked], batch, masked, p_mask, weights)


def batch_to(batch: Batch, device: torch.device) -> Batch:
    return Batch(batch.input_ids.to(device), batch.prompt_mask.to(device), batch.response_len.to(device),
                 None if batch.answer_len is None else batch.answer_len.to(device))


# ------------------------------------------------------------------------------------ training


def lr_at(progress: float, peak: float, warmup: float, final_frac: float = 0.1) -> float:
    """Linear warm-up over the first ``warmup`` of progress, then cosine to final_frac * peak."""
    if progress < warmup:
        return peak * progress / warmup
    x = min(1.0, (progress - warmup) / max(1e-9, 1 - warmup))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * x)))


def _device(name: str) -> torch.device:
    from unmask.api import resolve_device

    return resolve_device(None if name == "auto" else name)


RUN_FILES = ("state.pt", "summary.json")  # what makes a folder hold a run


def _check_run_folder(out: Path, resume: bool) -> None:
    """A new run never writes over an earlier one (its state.pt, summary.json and exports are
    replaced as it goes), and --resume never quietly starts from scratch."""
    held = [f for f in RUN_FILES if (out / f).is_file()]
    if held and not resume:
        raise InputError(f"{out} holds a run ({', '.join(held)}); pass --resume to continue it, "
                         "or a new --out")
    if resume and not (out / "state.pt").is_file():
        raise InputError(f"--resume: {out} holds no state.pt to resume from; drop --resume to "
                         "start a new run there")


def _check_vocab(args: argparse.Namespace, tok_dir: Path, enc: TextEncoder) -> None:
    """A tokenizer that already exists decides the vocabulary: a typed --vocab-size that differs
    is refused rather than ignored (args.json recorded it as if it had been used)."""
    if args.vocab_size is not None and args.vocab_size != enc.vocab_size:
        raise InputError(f"--vocab-size {args.vocab_size}: the tokenizer in {tok_dir} has "
                         f"{enc.vocab_size} tokens; drop --vocab-size or give {enc.vocab_size}")


def _check_out_paths(out: Path, tok_dir: Path, export: Path | None) -> None:
    """Make the run folder and check the others before training, not after it."""
    for flag, folder in (("--out", out), ("--tokenizer", tok_dir)):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InputError(f"{flag} {folder} cannot be used as a folder: {e}") from None
    if export is None:
        return
    # _export replaces the folder: never one that holds anything but an earlier export.
    if export.exists() and not (export.is_dir() and (not any(export.iterdir())
                                                     or (export / "config.json").is_file())):
        raise InputError(f"--export {export} exists and is not a model folder; it would be replaced: "
                         "name a new folder or an earlier export")
    try:
        export.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"--export {export}: its parent cannot be used as a folder: {e}") from None


def _check_fits(config, tokens: int, device: torch.device) -> None:  # config: ModelConfig
    """Refuse a model that cannot fit before allocating it (an allocation of many GB is killed by
    the OS, not refused): float32 weights, gradients and two AdamW moments (16 bytes per
    parameter) plus the float32 logits of one row of ``tokens`` positions (with their softmax
    and gradient: 12 bytes per position per vocabulary entry). A lower bound, not a forecast."""
    from unmask.models import build_model

    with torch.device("meta"):
        n_params = sum(p.numel() for p in build_model(config).parameters())
    need = 16 * n_params + 12 * tokens * config.vocab_size
    if device.type == "cuda":
        have = torch.cuda.get_device_properties(device).total_memory
    else:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise InputError(f"a model of {n_params:,} parameters needs at least {need / 2**30:.1f} GiB to "
                         f"train, more than the {have / 2**30:.1f} GiB of {device.type} memory here; "
                         "use a smaller --d-model, --n-layers, --mlp-hidden, --vocab-size or --buckets")


def _model_config(args: argparse.Namespace, enc: TextEncoder):  # -> ModelConfig
    from unmask.config import ModelConfig

    return ModelConfig(
        model_type=args.model_type, d_model=args.d_model, n_heads=args.n_heads, n_kv_heads=args.n_heads,
        n_layers=args.n_layers, mlp_hidden_size=args.mlp_hidden, vocab_size=enc.vocab_size,
        embedding_size=enc.vocab_size, rope_theta=10000.0, rms_norm_eps=1e-5,
        max_sequence_length=args.max_seq_len, weight_tying=False, mask_token_id=enc.mask_id,
        eos_token_id=enc.eos_id, include_bias=False,
        **objective_for(args.model_type).config_fields(args),
    )


def _optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    # No decay on norms (1-D) and embeddings: decaying them only hurts tiny models.
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        embedding = "wte" in name or "embed_tokens" in name
        (decay if p.dim() >= 2 and not embedding else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


@torch.no_grad()
@contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """Eval mode for the block, then the mode the model had before."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@torch.no_grad()  # evaluation only: no autograd graph
def heldout_loss(model: nn.Module, batches: list[Batch], mask_id: int, device: torch.device,
                 weights: LossWeights = LossWeights(), loss: Callable[..., Tensor] = sft_loss) -> float:
    """loss: (model, batch, mask_id, generator, weights) -> the objective's loss."""
    gen = torch.Generator(device=device).manual_seed(1234)  # same masks every evaluation
    with _evaluating(model):
        total = sum(float(loss(model, batch_to(b, device), mask_id, gen, weights)) for b in batches)
    return total / len(batches)


@torch.no_grad()
def digit_recall(model: nn.Module, batches: list[Batch], mask_id: int, digit_ids: tuple[int, ...],
                 device: torch.device, rate: float = 0.15) -> float:
    """Share of masked response digits predicted exactly when only digits are masked (``rate`` of
    them), everything else visible.

    Why: the held-out loss hides whether the model copies and computes digits from context (the
    skill the answers depend on) behind the easy template tokens; this number stays at chance
    (~0.1-0.3) until that skill appears, then climbs.
    """
    if not digit_ids:
        return float("nan")
    gen = torch.Generator(device="cpu").manual_seed(4321)
    digits = torch.tensor(digit_ids)
    hit = total = 0
    for b in batches:
        ids = b.input_ids
        target = torch.isin(ids, digits) & ~b.prompt_mask & (torch.rand(ids.shape, generator=gen) < rate)
        if not bool(target.any()):
            continue
        noisy = torch.where(target, torch.full_like(ids, mask_id), ids).to(device)
        pos = torch.arange(ids.shape[1], device=device).expand_as(noisy)
        with _evaluating(model):
            pred = model(noisy, pos).argmax(-1).cpu()
        hit += int((pred[target] == ids[target]).sum())
        total += int(target.sum())
    return hit / total if total else float("nan")


def engine_decoder(model: nn.Module, enc: TextEncoder, block_length: int = 32) -> Decode:
    """static-1 with early exit, temperature 0, through the engine (a bidirectional canvas)."""
    from unmask.decoding.params import DecodeParams
    from unmask.engine import decode as engine_decode

    def decode(prompts: list[list[int]], gen_length: int,
               on_event: Callable[[Any], None] | None) -> list[list[int]]:
        params = DecodeParams.parse("static-1,early_exit=true", gen_length=gen_length,
                                    block_length=block_length)
        results = engine_decode(model, params, prompts, mask_id=enc.mask_id, eos_id=enc.eos_id,
                                on_event=on_event)
        return [list(r.token_ids) for r in results]
    return decode


@torch.no_grad()
def solve_rate(model: nn.Module, enc: TextEncoder, problems: list, gen_length: int = 192,
               block_length: int = 32, check: Callable[[str, Any], bool] | None = None,
               on_event: Callable[[Any], None] | None = None, decode: Decode | None = None) -> float:
    """Share of held-out ``problems`` whose greedy decode (``decode``; default the engine's
    static-1 with early exit, temperature 0) ``check(text, problem)`` accepts (default: the math
    checker on the problem's answer): the embedded model's quality bars (its MODEL_CARD.md: math
    >= 60% at 256, code bodies that parse >= 50%), on a shorter canvas so they are cheap enough
    to log. ``on_event`` receives the decode's step events (a progress bar counts the finished
    ones).

    Why: digit recall scores one digit with the rest of the answer visible, where most digits have
    a copy elsewhere (``write 5`` ... ``= 85`` ... ``#### 85``); decoding from a blank canvas is what
    the model is for, and this number stays at 0 long after recall looks good.
    """
    from unmask.engine.request import useful_length
    from unmask.tasks import math as math_task

    check = check or (lambda text, p: math_task.check(text, p.answer))
    if not problems:
        return float("nan")
    decode = decode or engine_decoder(model, enc, block_length)
    with _evaluating(model):
        outputs = decode([enc.prompt(p.prompt) for p in problems], gen_length, on_event)
    solved = 0
    for p, ids in zip(problems, outputs, strict=True):
        text = enc.tok.decode(ids[: useful_length(ids, enc.eos_id)])
        solved += bool(check(text, p))
    return solved / len(problems)


@dataclass(frozen=True)
class MaskedDiffusion:
    """The LLaDA family's objective for `Trainer`: `sft_loss` on a bidirectional canvas."""

    model_type: str = "llada"

    def config_fields(self, args: argparse.Namespace) -> dict[str, Any]:
        return {}

    def loss(self, model: nn.Module, batch: Batch, mask_id: int, gen: torch.Generator | None,
             weights: LossWeights, semi_ar: float = 0.0) -> Tensor:
        return sft_loss(model, batch, mask_id, gen, weights, semi_ar)

    def decoder(self, model: nn.Module, enc: TextEncoder) -> Decode:
        return engine_decoder(model, enc)

    def init_state(self, src: nn.Module, model: nn.Module) -> dict[str, Tensor]:
        same_config(src.config, model.config, exclude=("extra",))
        return src.state_dict()


def objective_for(model_type: str) -> Any:  # MaskedDiffusion | BlockDiffusion
    """The training objective of a model family (`--model-type`)."""
    objectives = {o.model_type: o for o in (MaskedDiffusion(), BlockDiffusion())}
    if model_type not in objectives:
        raise InputError(f"--model-type {model_type!r}: unmask train knows {sorted(objectives)}")
    return objectives[model_type]


def _args_dict(args: argparse.Namespace) -> dict[str, Any]:
    """The run's arguments without the CLI's dispatch function (not JSON, not a setting)."""
    out = {k: v for k, v in vars(args).items() if not callable(v)}
    if "buckets" in out:
        out["buckets"] = [asdict(b) for b in out["buckets"]]
    return out


def load_state(path: Path, device: torch.device) -> dict[str, Any]:
    """A run's ``state.pt``, read with ``weights_only=True``: tensors and plain Python values
    only, so a crafted file cannot run code when it is loaded."""
    import pickle  # only for the error type: nothing here unpickles with it

    try:
        st = torch.load(path, map_location=device, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} is not a training state this version can load safely "
                              f"(tensors and plain values only): {first}") from None
    if not isinstance(st, dict):
        raise CheckpointError(f"{path} holds a {type(st).__name__}, not a training state")
    return st


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _export(model: nn.Module, folder: Path, tok_dir: Path) -> None:
    from unmask.catalog import SINGLE_TURN_KEY
    from unmask.checkpoint import save_checkpoint

    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    save_checkpoint(model, tmp, tokenizer_dir=tok_dir)
    # its data holds single questions: chat answers each message alone (unmask.catalog)
    (tmp / "generation_config.json").write_text(json.dumps({SINGLE_TURN_KEY: True}, indent=2)
                                                 + "\n")
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)


def run_train(args: argparse.Namespace) -> dict[str, Any]:
    """Train (or resume) a run in ``args.out``; returns a summary dict (also saved as JSON)."""
    return Trainer(args).run()


class Trainer:
    """One training run: set up (tokenizer, model, data, a resumed state) on construction, then
    `run` steps until the step or time budget is spent, logging, evaluating and checkpointing
    on their schedules, and writes the final checkpoint and summary."""

    def __init__(self, args: argparse.Namespace) -> None:
        from rich.console import Console

        from unmask.api import set_threads

        check_train_args(args)
        self.args = args
        self.console = Console(stderr=False)
        self.auto_threads = args.threads == "auto"
        if self.auto_threads:
            torch.set_num_threads(2)
        else:
            set_threads(int(args.threads))
        self.device = _device(args.device)
        self.out = Path(args.out)
        self.tok_dir = Path(args.tokenizer) if args.tokenizer else self.out / "tokenizer"
        _check_run_folder(self.out, args.resume)
        self.enc = self._tokenizer()
        self.weights = LossWeights(pad=args.pad_weight, digit=args.digit_weight,
                                   digit_ids=self.enc.digit_ids())
        torch.manual_seed(args.seed)
        self.objective = objective_for(args.model_type)
        self.config = _model_config(args, self.enc)
        _check_fits(self.config, longest_canvas(args.buckets) + MAX_PROMPT, self.device)
        self.model = self._model()
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.opt = _optimizer(self.model, args)
        self._data()
        self.gen = torch.Generator(device=self.device).manual_seed(args.seed)
        self.step, self.elapsed, self.tokens_seen, self.history = 0, 0.0, 0, []
        self.state_path = self.out / "state.pt"
        if args.resume and self.state_path.is_file():
            self._resume()
        (self.out / "args.json").write_text(json.dumps(_args_dict(args), indent=2) + "\n")
        self.command = _command_line()
        self.console.print(f"model: {self.n_params / 1e6:.2f}M params, config "
                           f"{asdict(self.config)}; device {self.device}")
        self.n_threads = torch.get_num_threads()
        self.last_eval_loss = self.last_recall = self.last_solve = self.last_parse = float("nan")
        self.ema_loss: float | None = None

    # --- setup -----------------------------------------------------------------------------------
    def _tokenizer(self) -> TextEncoder:
        """The run's tokenizer: the one in its folder, or one trained now."""
        from unmask.training.tokenizer import train_tokenizer

        args, tok_dir = self.args, self.tok_dir
        tok_file = tok_dir / "tokenizer.json"
        enc = TextEncoder(tok_file) if tok_file.is_file() else None
        if enc is not None:
            _check_vocab(args, tok_dir, enc)
        elif args.tokenizer and not args.train_tokenizer:
            raise InputError(f"--tokenizer {tok_dir}: no tokenizer.json there; give a folder that "
                             f"holds one, or add --train-tokenizer to train one into it")
        _check_out_paths(self.out, tok_dir, Path(args.export) if args.export else None)
        if enc is None:
            asked = args.vocab_size or DEFAULT_VOCAB
            self.console.print(f"training tokenizer (vocab {asked}) -> {tok_dir}")
            train_tokenizer(tok_dir, vocab_size=asked, seed=args.seed)
            enc = TextEncoder(tok_file)
            if enc.vocab_size != asked:
                self.console.print(f"the tokenizer has {enc.vocab_size} tokens, not {asked}: the "
                                   "training texts have no more merges")
        # args.json and the summary record the vocabulary the run has, not the flag's default.
        args.vocab_size = enc.vocab_size
        return enc

    def _model(self) -> nn.Module:
        """A freshly initialised model, or --init's weights (unless a state is resumed)."""
        from unmask.models import build_model

        args, config = self.args, self.config
        model = build_model(config)
        model.init_weights()
        if args.init and not (args.resume and (self.out / "state.pt").is_file()):
            from unmask.checkpoint import load_model

            src = load_model(args.init)
            try:
                model.load_state_dict(self.objective.init_state(src, model))
            except (InputError, RuntimeError) as e:  # RuntimeError: a tensor that does not fit
                why = " ".join(str(e).removeprefix("--init: ").split())
                raise InputError(f"--init {args.init}: {why[:300]}") from None
            self.console.print(f"initialised from the weights in {args.init}")
        return model.to(self.device)

    def _data(self) -> None:
        """The training stream, and the fixed held-out batches and problems."""
        from unmask.tasks import code as code_task
        from unmask.tasks.math import make_split

        args, enc = self.args, self.enc
        self.data = DataStream(enc, code_frac=args.code_frac, batch_tokens=args.batch_tokens,
                               buckets=args.buckets, seed=args.seed,
                               code_max_tokens=args.code_max_tokens)
        # Held-out batches and problems are drawn with seed 0, not --seed: eval_loss and the
        # solve rates then compare across runs (with --seed they differed 10x between A/B arms
        # by draw alone).
        eval_data = DataStream(enc, split="heldout", code_frac=args.code_frac,
                               batch_tokens=args.batch_tokens, buckets=args.buckets, seed=0)
        self.eval_batches = [eval_data.next_batch() for _ in range(args.eval_batches)]
        self.solve_problems = make_split("heldout", args.solve_n, seed=0) if args.solve_every else []
        self.code_problems = (code_task.make_split("heldout", args.solve_n, seed=0)
                              if args.solve_every and args.code_frac > 0 else [])

    def _resume(self) -> None:
        st = load_state(self.state_path, self.device)
        try:
            self.model.load_state_dict(st["model"])
            self.opt.load_state_dict(st["optimizer"])
            self.step, self.elapsed = st["step"], st["elapsed"]
            self.tokens_seen, self.history = st["tokens"], st["history"]
            self.data.rng.setstate(st["data_rng"])
            self.gen.set_state(st["gen_state"])
            torch.set_rng_state(st["torch_rng"])
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            # load_state_dict lists every mismatched tensor on a line of its own: one line here
            why = " ".join(str(e).split())
            raise CheckpointError(f"{self.state_path} does not fit this run (same --d-model, "
                                  f"--n-layers, ... as the run that wrote it?): "
                                  f"{why if len(why) <= 300 else why[:300] + '...'}") from None
        self.console.print(f"resumed from {self.state_path} at step {self.step} "
                           f"({self.elapsed / 60:.1f} min)")

    # --- measures and checkpoints --------------------------------------------------------------
    def progress(self) -> float:
        args = self.args
        p = self.step / args.max_steps if args.max_steps > 0 else 1.0  # 0 steps: just export --init
        if args.time_budget_min:
            p = max(p, self.elapsed / (args.time_budget_min * 60))
        return p

    def evaluate(self) -> None:
        """Held-out loss and digit recall on the fixed held-out batches."""
        mask_id = self.config.mask_token_id
        self.last_eval_loss = heldout_loss(self.model, self.eval_batches, mask_id, self.device,
                                           self.weights, self.objective.loss)
        self.last_recall = digit_recall(self.model, self.eval_batches, mask_id,
                                        self.weights.digit_ids, self.device)

    def decode_rates(self, on_event: Callable[[Any], None] | None = None) -> None:
        """Math solve rate and code parse rate of the fixed held-out problems."""
        from unmask.tasks import code as code_task

        decode = self.objective.decoder(self.model, self.enc)
        self.last_parse = solve_rate(self.model, self.enc, self.code_problems,
                                     check=lambda text, ex: code_task.check(ex.prompt, text),
                                     on_event=on_event, decode=decode)
        self.last_solve = solve_rate(self.model, self.enc, self.solve_problems, on_event=on_event,
                                     decode=decode)

    def final_evaluation(self) -> None:
        """The held-out loss, then the decode rates, with a progress bar of their own: decoding
        the problems takes minutes on a CPU (it ran under a training bar stuck at its last
        step, for ~10 minutes after a one-step run)."""
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        n = len(self.solve_problems) + len(self.code_problems) if self.args.solve_every else 0
        self.console.print(f"final evaluation: held-out loss on {len(self.eval_batches)} batches"
                           + (f", then decoding {n} held-out problems" if n else "")
                           + " (--no-final-eval skips it)")
        columns = (TextColumn("evaluating"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.description}"), TimeElapsedColumn())
        with Progress(*columns, console=self.console, transient=False) as bar:
            task = bar.add_task("held-out loss", total=1 + n)
            self.evaluate()
            bar.update(task, advance=1, description="problems decoded")
            if n:
                self.decode_rates(lambda ev: bar.update(task, advance=1) if ev.finished else None)

    def save_state(self) -> None:
        _atomic_save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                      "step": self.step, "elapsed": self.elapsed, "tokens": self.tokens_seen,
                      "history": self.history, "data_rng": self.data.rng.getstate(),
                      "gen_state": self.gen.get_state(), "torch_rng": torch.get_rng_state(),
                      "args": _args_dict(self.args)}, self.state_path)
        _export(self.model, self.out / "latest", self.tok_dir)

    def pick_threads(self) -> int:
        """Time forward+backward of a fixed small batch with 1 and 2 threads; keep the faster."""
        probe = batch_to(self.eval_batches[0], self.device)
        best, best_t = 1, float("inf")
        for n in (1, 2):
            torch.set_num_threads(n)
            t0 = time.time()
            for _ in range(2):
                self.objective.loss(self.model, probe, self.config.mask_token_id, self.gen,
                                    self.weights).backward()
            if time.time() - t0 < best_t:
                best, best_t = n, time.time() - t0
        self.opt.zero_grad(set_to_none=True)
        torch.set_num_threads(best)
        return best

    # --- the run ---------------------------------------------------------------------------------
    def train_step(self) -> tuple[float, float, float, int]:
        """One optimizer step: (loss, gradient norm, learning rate, tokens in the batch)."""
        lr = lr_at(self.progress(), self.args.lr, self.args.warmup)
        for g in self.opt.param_groups:
            g["lr"] = lr
        batch = batch_to(self.data.next_batch(), self.device)
        loss = self.objective.loss(self.model, batch, self.config.mask_token_id, self.gen,
                                   self.weights, self.args.semi_ar)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(nn.utils.clip_grad_norm_(self.model.parameters(), self.args.grad_clip))
        self.opt.step()
        return float(loss.detach()), gnorm, lr, batch.input_ids.numel()

    def run(self) -> dict[str, Any]:
        self._loop()
        if not self.args.no_final_eval:
            self.final_evaluation()
        self.save_state()
        _export(self.model, self.out / "final", self.tok_dir)
        summary = self.summary()
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if self.args.export:
            _export(self.model, Path(self.args.export), self.tok_dir)
        self.console.print(f"done: {self.step} steps, {self.elapsed / 60:.1f} min, held-out "
                           f"loss {summary['final_heldout_loss']}")
        return summary

    def _loop(self) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        args = self.args
        last_ckpt = time.time()
        win_tokens, win_time = 0, 0.0
        columns = [TextColumn("step {task.fields[step]}"), BarColumn(),
                   TextColumn("{task.percentage:>5.1f}%"),
                   TextColumn("loss {task.fields[loss]:.4f} eval {task.fields[eval]:.4f}"),
                   TextColumn("{task.fields[tps]:.0f} tok/s"), TimeElapsedColumn()]
        self.model.train()
        with Progress(*columns, console=self.console, transient=False) as bar:
            task = bar.add_task("train", total=1.0, loss=float("nan"), eval=float("nan"), tps=0.0,
                                step=self.step)
            tick = time.time()  # `elapsed` is wall time (eval, checkpoints included): budgets hold
            while self.progress() < 1.0:
                if self.auto_threads and self.device.type == "cpu" and self.step % 200 == 0:
                    self.n_threads = self.pick_threads()
                t0 = time.time()
                lv, gnorm, lr, n_tok = self.train_step()
                dt = time.time() - t0
                self.step += 1
                self.elapsed += time.time() - tick
                tick = time.time()
                self.tokens_seen += n_tok
                win_tokens, win_time = win_tokens + n_tok, win_time + dt
                self.ema_loss = lv if self.ema_loss is None else 0.98 * self.ema_loss + 0.02 * lv
                if self.step % args.eval_every == 0:
                    self.evaluate()
                if args.solve_every and self.step % args.solve_every == 0:
                    self.decode_rates()
                if self.step % args.log_every == 0 or self.step % args.eval_every == 0:
                    tps = win_tokens / max(win_time, 1e-9)
                    self._log(lr, gnorm, tps)
                    bar.update(task, completed=min(1.0, self.progress()), step=self.step,
                               loss=self.ema_loss, eval=self.last_eval_loss, tps=tps)
                    win_tokens, win_time = 0, 0.0
                if time.time() - last_ckpt > args.ckpt_minutes * 60:
                    self.save_state()
                    last_ckpt = time.time()
            # the bar showed its last logged step (step 0, loss nan, after a run shorter than
            # --log-every)
            bar.update(task, completed=min(1.0, self.progress()), step=self.step,
                       loss=_or_nan(self.ema_loss), eval=self.last_eval_loss)

    def _log(self, lr: float, gnorm: float, tps: float) -> None:
        rec = {"step": self.step, "minutes": round(self.elapsed / 60, 2),
               "loss": measured(self.ema_loss, 4), "eval_loss": measured(self.last_eval_loss, 4),
               "digit_recall": measured(self.last_recall, 3),
               "solve_rate": measured(self.last_solve, 3),
               "parse_rate": measured(self.last_parse, 3), "lr": lr, "grad_norm": round(gnorm, 3),
               "tok_per_s": round(tps), "tokens": self.tokens_seen, "threads": self.n_threads}
        self.history.append(rec)
        if not self.console.is_terminal:  # under nohup the live bar is invisible: log lines
            print(json.dumps(rec), flush=True)

    def summary(self) -> dict[str, Any]:
        # No step in this call (a resumed run already at --max-steps): the loss the run last
        # logged (null, as every value here not measured, when it logged none: --max-steps 0
        # --init).
        ema = self.ema_loss
        if ema is None and self.history:
            ema = self.history[-1]["loss"]
        return {"command": self.command, "params": self.n_params, "steps": self.step,
                "train_minutes": round(self.elapsed / 60, 2), "tokens": self.tokens_seen,
                "final_train_loss": measured(ema, 4),
                "final_heldout_loss": measured(self.last_eval_loss, 4),
                "final_digit_recall": measured(self.last_recall, 3),
                "final_solve_rate": measured(self.last_solve, 3),
                "final_parse_rate": measured(self.last_parse, 3),
                "config": asdict(self.config), "args": _args_dict(self.args)}


def measured(value: float | None, digits: int) -> float | None:
    """A number for the summary and the log, rounded; None (JSON null) where nothing was
    measured: a bare NaN, which json.dumps writes, is refused by strict JSON parsers."""
    return None if value is None or math.isnan(value) else round(value, digits)


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else value


def _command_line() -> str:
    """The command that started the run, as the summary records it."""
    prog = "python -m unmask.training" if sys.argv[0].endswith("__main__.py") else "unmask train"
    argv = sys.argv[1:]
    if prog == "unmask train" and argv[:1] == ["train"]:
        argv = argv[1:]  # the subcommand is already in `prog`
    return " ".join([prog, *argv])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m unmask.training", description=__doc__.split("\n")[0])
    add_train_arguments(p)
    args = p.parse_args(argv)
    try:
        run_train(args)
    except UnmaskError as e:  # the caller's input: one line, exit 2, as `unmask train` does
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
