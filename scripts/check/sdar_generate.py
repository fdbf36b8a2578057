"""Our block-diffusion decoding against SDAR's `block_diffusion_generate` and FreeDave's block
decoders, token by token, on the same weights and held-out math prompts.

    python scripts/check/sdar_generate.py <JetAstra/SDAR> <cychomatica/FreeDave> \\
        [--model FOLDER] [--n 16] [--gen-length 32] [--dtype float32|bfloat16] \\
        [--out benchmarks/check/sdar-generate.md] [--setting static-1 ...]

Each repository path is a checkout or a bare git directory (the `fetch` tool's mirror). What
the references compute, and where it is not what their names say: docs/sdar-reference-
semantics.md. The references run on CPU from a temporary folder, never imported by unmask:

- SDAR's modeling code through scripts/check/sdar_reference.py's loader and stand-ins;
- SDAR's generate.py, its DynamicCache given transformers 4.52's `cache[layer]`;
- FreeDave's generation/ package, `deprecated` (a decorator it imports) stood in for.

Greedy decoding everywhere: SDAR's file has no greedy path (temperature 0 divides by zero; top_k=1
makes every confidence 1.0), so its sampler is replaced by FreeDave's temperature-0 one (argmax,
confidence = the softmax probability of the argmax); one row runs it as published with top_k=1.
SDAR's entropy_bounded raises UnboundLocalError as published; its row runs it with
`transfer_index` created each step (the only change) and a row records the error.

Without --model the weights are a tiny random SDAR with the shipped model's tokenizer, its
output row for the mask token zeroed (neither reference removes the mask token from the
vocabulary: a random model could predict it, a trained one does not). NFE and token-forwards
of the references are counted by a forward hook on the model, as FreeDave's own monitor does:
prefill, denoising, verification and store forwards all count. tests/block_reference.py (the
re-implementation the CI tests hold ours to) runs beside them as `re-impl`, through our model.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import shutil
import sys
import tempfile
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1] / "tests")]
import block_reference  # noqa: E402  (the CI test's re-implementation, checked here)
import sdar_reference as sdar_ref  # noqa: E402  (the loader and stand-ins, shared)

import unmask  # noqa: E402
from unmask.bench.tasks import load_task  # noqa: E402
from unmask.checkpoint import save_checkpoint  # noqa: E402
from unmask.config import ModelConfig  # noqa: E402
from unmask.errors import UnmaskError  # noqa: E402
from unmask.models import build_model  # noqa: E402

MODELING = "SDAR-4B-Chat"  # whose modeling_sdar.py and config keys the tiny model takes
SHIPPED = Path(unmask.__file__).parent / "assets" / "default_model"  # its tokenizer
LOGIT_SCALE = 6.0  # the tiny model's output rows scaled up: peaky, varied confidences
THRESHOLD = 0.9  # FreeDave's evaluation setting
EB_THRESHOLD = 0.35  # generate.py's command-line default
FREEDAVE_FILES = ("__init__", "core", "sampling_utils", "attn_utils", "cache_utils", "monitor_utils")


# --- the references, loaded ---------------------------------------------------------------------
EB_BRANCH = '            elif remasking_strategy == "entropy_bounded":\n'
EB_FIX = "                transfer_index = torch.zeros_like(x0, dtype=torch.bool)\n"


def load_sdar_generate(repo: Path, fix_entropy_bounded: bool) -> types.ModuleType:
    """generate.py as module `generate` of a scratch package; fix_entropy_bounded: its
    entropy_bounded branch given the all-false transfer_index the other branches create."""
    text = sdar_ref.repo_file(repo, "generate.py").decode()
    assert text.count(EB_BRANCH) == 1, "generate.py's entropy_bounded branch moved"
    if fix_entropy_bounded:
        text = text.replace(EB_BRANCH, EB_BRANCH + EB_FIX)
    name = "sdar_generate_fixed" if fix_entropy_bounded else "sdar_generate"
    package = sdar_ref.scratch_package(name, {"generate": text.encode()})
    module = importlib.import_module(f"{package.__name__}.generate")
    module.DynamicCache = sdar_ref.indexed_cache_class()
    return module


def greedy_sampler(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                   top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """FreeDave's temperature-0 sampling with SDAR's signature: (..., V) -> argmax (lowest id on
    ties) and its softmax probability, in the logits' dtype."""
    token = logits.argmax(-1)
    return token, F.softmax(logits, dim=-1).gather(-1, token[..., None])[..., 0]


def load_freedave(repo: Path) -> types.ModuleType:
    """FreeDave's generation/ package; its core module."""
    deprecated = types.ModuleType("deprecated")
    deprecated.deprecated = lambda *args, **kwargs: (lambda f: f)  # a warning, nothing else
    sys.modules.setdefault("deprecated", deprecated)
    files = {stem: sdar_ref.repo_file(repo, f"generation/{stem}.py") for stem in FREEDAVE_FILES}
    core = importlib.import_module(f"{sdar_ref.scratch_package('freedave_generation', files).__name__}.core")
    core.DynamicCache = sdar_ref.indexed_cache_class()
    return core


class Counter:
    """NFE and token-forwards of a model, by a forward hook (FreeDave's ForwardMonitor's way)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.nfe = self.tokens = 0
        model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output) -> None:
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        self.nfe += 1
        self.tokens += ids.numel()

    def take(self) -> tuple[int, int]:
        got, self.nfe, self.tokens = (self.nfe, self.tokens), 0, 0
        return got


# --- the weights ----------------------------------------------------------------------------------
def tiny_folder(repo: Path, out: Path, seed: int = 0) -> Path:
    """A tiny random SDAR folder with the shipped tokenizer and the published config's keys."""
    tok = json.loads((SHIPPED / "config.json").read_text())
    raw = {**json.loads(sdar_ref.read_reference(repo, MODELING, "config.json")), **sdar_ref.TINY,
           "vocab_size": tok["vocab_size"], "mask_token_id": tok["mask_token_id"],
           "eos_token_id": tok["eos_token_id"], "bos_token_id": tok["eos_token_id"]}
    model = build_model(ModelConfig.from_dict(raw)).eval()
    sdar_ref.randomize(model, seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(LOGIT_SCALE)
        model.lm_head.weight[raw["mask_token_id"]] = 0  # logit 0: never the argmax
    save_checkpoint(model, out, tokenizer_dir=SHIPPED)
    return out


def reference_model(ref_module: types.ModuleType, repo: Path, folder: Path, ours: torch.nn.Module):
    """The reference holding our weights. Keys of the published config that the folder's lacks
    (unmask writes no training-only key, and the reference's code reads fuse_cross_entropy)
    come from the published one."""
    published = json.loads(sdar_ref.read_reference(repo, MODELING, "config.json"))
    raw = {**published, **json.loads((folder / "config.json").read_text())}
    return sdar_ref.reference_model(ref_module, raw, ours.state_dict())


# --- the runs -------------------------------------------------------------------------------------
@dataclass
class Run:
    """One side's output for one prompt: generated ids (cut at gen_length and after the first
    EOS), NFE, token-forwards; error: why it produced nothing."""

    tokens: list[int] = field(default_factory=list)
    nfe: int = 0
    token_forwards: int = 0
    error: str = ""
    note: str = ""


def failed(e: Exception) -> Run:
    return Run(error=f"{type(e).__name__}: {str(e).splitlines()[0][:150]}")


@dataclass
class Sides:
    """What every run reads: the reference model and its counter, the loaded references, ours."""

    ref: torch.nn.Module
    counter: Counter
    sdar: types.ModuleType
    sdar_fixed: types.ModuleType  # entropy_bounded given its transfer_index
    freedave: types.ModuleType
    llm: unmask.LLM
    block: int
    mask: int
    eos: int
    gen_length: int

    def answer(self, generated: list[int]) -> list[int]:
        return block_reference.answer(generated, self.eos, self.gen_length, self.mask)

    def reference(self, call: Callable[[torch.Tensor], torch.Tensor], prompt: list[int]) -> Run:
        """One reference call on the prompt's (1, P) ids, counted; its generated ids as `answer`
        cuts them."""
        self.counter.take()
        try:
            x = call(torch.tensor([prompt]))[0].tolist()
        except Exception as e:  # noqa: BLE001  (a reference that cannot run is a result)
            self.counter.take()
            return failed(e)
        nfe, tf = self.counter.take()
        note = "prompt overwritten" if x[: len(prompt)] != prompt else ""
        return Run(self.answer(x[len(prompt):]), nfe, tf, note=note)


def sdar_runner(sampler: str) -> Callable[[Sides, dict, list[list[int]]], list[Run]]:
    """block_diffusion_generate with the greedy sampler, or ("published") its own."""

    def run(s: Sides, kw: dict, prompts: list[list[int]]) -> list[Run]:
        module = s.sdar_fixed if kw["remasking_strategy"] == "entropy_bounded" else s.sdar
        published = module.__dict__.setdefault("published_sampler", module.sample_with_temperature_topk_topp)
        module.sample_with_temperature_topk_topp = published if sampler == "published" else greedy_sampler
        return [s.reference(lambda ids: module.block_diffusion_generate(
            s.ref, {"input_ids": ids}, s.mask, gen_length=s.gen_length, block_length=s.block,
            stopping_criteria_idx=[s.eos], **kw), p) for p in prompts]

    return run


def run_freedave(s: Sides, kw: dict, prompts: list[list[int]]) -> list[Run]:
    """FreeDave's block decoder, or with draft_steps its FreeDave decoder; greedy, early exit."""
    gen = s.freedave.DLMGeneration(device=torch.device("cpu"))
    decode = (gen.block_decode_with_block_attention_FreeDave if "draft_steps" in kw
              else gen.block_decode_with_block_attention)
    return [s.reference(lambda ids: decode(
        s.ref, ids, temperature=0.0, block_length=s.block, max_gen_length=s.gen_length,
        mask_token_id=s.mask, eos_token_id=s.eos, early_exit=True, **kw).sequences, p)
        for p in prompts]


def run_reimplementation(s: Sides, spec: tuple[block_reference.Strategy, str],
                         prompts: list[list[int]]) -> list[Run]:
    """tests/block_reference.py's loop, forwarding through our model without a cache."""
    strategy, stop = spec
    runs = []
    for p in prompts:
        with torch.no_grad():
            r = block_reference.generate(lambda ids, pos: s.llm.model(ids, pos), p, s.mask,
                                         s.gen_length, s.block, strategy, [s.eos], stop)
        note = "prompt overwritten" if r.canvas[: len(p)] != p else ""
        runs.append(Run(s.answer(r.canvas[len(p):]), r.nfe, r.token_forwards, note=note))
    return runs


def run_freedave_reimplementation(s: Sides, kw: dict, prompts: list[list[int]]) -> list[Run]:
    """tests/block_reference.py's FreeDave (no eager acceptance), through our model."""
    runs = []
    for p in prompts:
        with torch.no_grad():
            r = block_reference.freedave(lambda ids, pos: s.llm.model(ids, pos), p, s.mask,
                                         s.gen_length, s.block, kw["draft_steps"],
                                         kw.get("confidence_threshold"), [s.eos])
        runs.append(Run(s.answer(r.canvas[len(p):]), r.nfe, r.token_forwards))
    return runs


def run_ours(s: Sides, spec: str, prompts: list[list[int]]) -> list[Run]:
    try:
        params = unmask.DecodeParams.parse(spec, gen_length=s.gen_length, block_length=s.block)
        # one prompt at a time, as the references decode: their times compare (the tokens,
        # NFE and token-forwards are the same in any batch)
        outs = s.llm.generate_ids(prompts, params, batch_size=1)
    except UnmaskError as e:
        return [failed(e)] * len(prompts)
    return [Run(s.answer(list(g.token_ids)), g.nfe, g.token_forwards) for g in outs]


# --- the settings ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Side:
    """One implementation of a setting: a label, its runner and what the runner is given."""

    label: str
    run: Callable[[Sides, object, list[list[int]]], list[Run]]
    spec: object  # the reference's keywords, or our decoder spec

    def spelled(self) -> str:
        if isinstance(self.spec, tuple):  # the re-implementation's (Strategy, stop)
            return f"{self.spec[0]}, stop: {self.spec[1]}"
        return f"`{self.spec}`" if isinstance(self.spec, str) else json.dumps(self.spec)


@dataclass(frozen=True)
class Setting:
    name: str
    sides: tuple[Side, ...]
    note: str = ""


SDAR, SDAR_PUBLISHED = sdar_runner("greedy"), sdar_runner("published")
SDAR_STOP, FREEDAVE_STOP = block_reference.STOPS


def sdar_sides(kw: dict) -> tuple[Side, Side]:
    """SDAR's generate.py and the re-implementation of it, for generate.py's keywords."""
    names = {"low_confidence_static": "static", "low_confidence_dynamic": "dynamic"}
    strategy = block_reference.Strategy(
        names.get(kw["remasking_strategy"], kw["remasking_strategy"]), kw["denoising_steps"],
        **{ours: kw[theirs] for theirs, ours in (("confidence_threshold", "threshold"),
                                                 ("eb_threshold", "eb_threshold")) if theirs in kw})
    return Side("sdar", SDAR, kw), Side("re-impl", run_reimplementation, (strategy, SDAR_STOP))


def freedave_sides(b: int, threshold: float | None, label: str) -> tuple[Side, Side]:
    """FreeDave's base block decoder (static-1, or threshold >= with the top one) and the
    re-implementation of it."""
    kw = {} if threshold is None else {"confidence_threshold": threshold}
    strategy = (block_reference.Strategy("static", b) if threshold is None else
                block_reference.Strategy("dynamic", b, threshold=threshold, at_least=True))
    return (Side(label, run_freedave, kw),
            Side("re-impl", run_reimplementation, (strategy, FREEDAVE_STOP)))


def settings(b: int, gen_length: int) -> list[Setting]:
    half = b // 2
    static = {"remasking_strategy": "low_confidence_static"}
    dynamic = {"remasking_strategy": "low_confidence_dynamic", "confidence_threshold": THRESHOLD}
    eb = {"remasking_strategy": "entropy_bounded", "eb_threshold": EB_THRESHOLD}
    freedave_static = freedave_sides(b, None, "freedave static-1")
    freedave_threshold = freedave_sides(b, THRESHOLD, "freedave threshold")
    return [
        Setting("static-1", (*sdar_sides({**static, "denoising_steps": b}),
                             Side("freedave", run_freedave, {}), Side("ours", run_ours, "static-1"))),
        Setting(f"static, {half} steps per block", (
            *sdar_sides({**static, "denoising_steps": half}),
            Side("ours", run_ours, f"static,steps={half * gen_length // b}")),
            f"{b // half} per step, counted over the whole block: a first decode block holding an odd "
            "number of masks runs out of them a step early, and SDAR then rewrites a prompt token "
            "(ours commits the last mask alone)"),
        Setting(f"dynamic {THRESHOLD}", (
            *sdar_sides({**dynamic, "denoising_steps": b}),
            Side("freedave", run_freedave, {"confidence_threshold": THRESHOLD}),
            Side("ours", run_ours, f"threshold,threshold={THRESHOLD}")),
            "SDAR commits conf > threshold, FreeDave and ours conf >= threshold"),
        Setting(f"dynamic {THRESHOLD}, {half} steps per block",
                sdar_sides({**dynamic, "denoising_steps": half}),
                f"fallback: the top {b // half} (ours has no threshold with a per-step count)"),
        Setting(f"entropy-bounded {EB_THRESHOLD}, fixed to run", (
            *sdar_sides({**eb, "denoising_steps": b}),
            Side("ours", run_ours, f"entropy_bounded,eb_threshold={EB_THRESHOLD}")),
            "SDAR's formula: one count per block from the chosen tokens' probabilities, the "
            "leftmost masks (docs/sdar-reference-semantics.md); ours is the EB-sampler the name "
            "promises (each position's own entropy, in confidence order): not meant to match"),
        Setting("static-1: SDAR as published (top_k=1) vs greedy", (
            Side("sdar top_k=1", SDAR_PUBLISHED, {**static, "denoising_steps": b, "top_k": 1}),
            Side("sdar greedy", SDAR, {**static, "denoising_steps": b})),
            "top_k=1 makes every confidence 1.0: positions go in torch.topk's tie order"),
        Setting("freedave, 4 drafts", (
            *freedave_static, Side("freedave", run_freedave, {"draft_steps": 4}),
            Side("freedave re-impl", run_freedave_reimplementation, {"draft_steps": 4}),
            Side("ours", run_ours, "freedave,draft_steps=4"))),
        Setting("freedave, 8 drafts, eager acceptance (FreeDave's evaluation)", (
            *freedave_static,
            Side("freedave", run_freedave, {"draft_steps": 8, "eager_acceptance_mode": True}),
            Side("ours", run_ours, "freedave,draft_steps=8"))),
        Setting(f"freedave++ {THRESHOLD}, 4 drafts", (
            *freedave_threshold,
            Side("freedave++", run_freedave, {"draft_steps": 4, "confidence_threshold": THRESHOLD}),
            Side("freedave++ re-impl", run_freedave_reimplementation,
                 {"draft_steps": 4, "confidence_threshold": THRESHOLD}),
            Side("ours", run_ours, f"freedave++,draft_steps=4,threshold={THRESHOLD}"))),
    ]


# --- comparison and report ------------------------------------------------------------------------
def first_diff(a: Run, b: Run) -> str:
    """'=' when identical, else the first differing generated position (or where one ends)."""
    if a.error or b.error:
        return "-"
    if a.tokens == b.tokens:
        return "="
    n = min(len(a.tokens), len(b.tokens))
    return str(next((i for i in range(n) if a.tokens[i] != b.tokens[i]), n))


def cost(r: Run) -> str:
    return "-" if r.error else f"{r.nfe} / {r.token_forwards}"


def section(setting: Setting, prompts: list[list[int]], runs: dict[str, list[Run]],
            seconds: dict[str, float]) -> list[str]:
    """One setting's markdown: what each side ran, identity counts, time, then per prompt."""
    sides = list(runs)
    pairs = [(sides[0], b) for b in sides[1:]]  # each against the first
    lines = [f"### {setting.name}", "", *([setting.note, ""] if setting.note else [])]
    lines += [f"- {side.label}: {side.spelled()}" for side in setting.sides]
    errors = sorted({f"{k}: {r.error}" for k in sides for r in runs[k] if r.error})
    lines += [f"- **error** {e}" for e in errors]
    lines += [f"- {a} vs {b}: **{identical(runs, a, b)}** prompts token-identical" for a, b in pairs]
    lines += [f"- NFE / token-forwards, all prompts: {totals(runs)}",
              f"- CPU seconds, all prompts (x {sides[0]}'s): {times(seconds)}", ""]
    head = ["prompt", "P", f"{sides[0]} tokens", *[f"{a} vs {b}" for a, b in pairs],
            *[f"{k} NFE / TF" for k in sides], "notes"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, p in enumerate(prompts):
        row = [str(i), str(len(p)), str(len(runs[sides[0]][i].tokens)),
               *[first_diff(runs[a][i], runs[b][i]) for a, b in pairs],
               *[cost(runs[k][i]) for k in sides],
               "; ".join(f"{k}: {runs[k][i].note}" for k in sides if runs[k][i].note)]
        lines.append("| " + " | ".join(row) + " |")
    return lines + [""]


def identical(runs: dict[str, list[Run]], a: str, b: str) -> str:
    same = sum(first_diff(x, y) == "=" for x, y in zip(runs[a], runs[b], strict=True))
    return f"{same}/{len(runs[a])}"


def totals(runs: dict[str, list[Run]]) -> str:
    return ", ".join(f"{k} {sum(r.nfe for r in rs)} / {sum(r.token_forwards for r in rs)}"
                     for k, rs in runs.items())


def times(seconds: dict[str, float]) -> str:
    """Each side's CPU seconds and their ratio to the first side's."""
    first = next(iter(seconds.values()))
    return ", ".join(f"{k} {v:.1f} ({v / first:.2f}x)" for k, v in seconds.items())


def summary_row(setting: Setting, runs: dict[str, list[Run]], seconds: dict[str, float]) -> str:
    first, *others = runs
    same = ", ".join(f"{b} {identical(runs, first, b)}" for b in others)
    return f"| {setting.name} | {first} | {same} | {totals(runs)} | {times(seconds)} |"


def check(s: Sides, prompts: list[list[int]], only: list[str] | None = None,
          ) -> tuple[list[str], list[str]]:
    """(the summary table's rows, the per-setting sections); only: the settings of those names
    (None: all)."""
    rows, body = [], []
    for setting in settings(s.block, s.gen_length):
        if only is not None and setting.name not in only:
            continue
        runs, seconds = {}, {}
        for side in setting.sides:
            # CPU time of this process (one torch thread by default): the machine's other
            # processes do not move it
            t = time.process_time()
            runs[side.label] = side.run(s, side.spec, prompts)
            seconds[side.label] = time.process_time() - t
        block = section(setting, prompts, runs, seconds)
        print("\n".join(block), flush=True)
        rows.append(summary_row(setting, runs, seconds))
        body += block
    return rows, body


def published_entropy_bounded(s: Sides, prompt: list[int]) -> str:
    """What SDAR's entropy_bounded does as published (its first step raises)."""
    run = s.reference(lambda ids: s.sdar.block_diffusion_generate(
        s.ref, {"input_ids": ids}, s.mask, gen_length=s.gen_length,
        block_length=s.block, denoising_steps=s.block, remasking_strategy="entropy_bounded",
        eb_threshold=EB_THRESHOLD), prompt)
    return run.error or "it ran"


SEMANTICS = [
    "- **The two references agree** where both have the mode: SDAR's static with one step per "
    "position is FreeDave's static-1, SDAR's dynamic with one step per position is FreeDave's "
    "threshold (`>` against `>=` only differs on a confidence exactly at the threshold). FreeDave "
    "and FreeDave++ (tree-attention verification, eager or not) reproduce the rule they wrap, at "
    "fewer forwards and many more token-forwards (FreeDave++ at more forwards than its rule on a "
    "trained model: when the threshold step completes the block it still forwards the drafts).",
    "- **Where they disagree with their names**: SDAR has no greedy mode (`top_k=1`, its only "
    "deterministic one, makes every confidence 1.0, so `low_confidence_*` ranks by `torch.topk`'s "
    "tie order: the as-published row); `entropy_bounded` crashes as published, and fixed it ranks "
    "nothing by entropy (one count per block, the leftmost masks); static with fewer steps than "
    "the block overwrites a prompt or committed token when a first decode block holds an odd "
    "number of masks (`prompt overwritten`, or a committed one).",
    "- **Ours** runs SDAR's loop with FreeDave's greedy sampler in static-1, static with fewer "
    "steps (without the overwrite: ours commits only masked positions) and threshold, and "
    "FreeDave's decoders; its entropy_bounded is the EB-sampler, not SDAR's formula, and it has no "
    "threshold with a per-step count. "
    "NFE: ours fuses each store forward with the next block's first call (and the prefill with the "
    "first block's), and never stores the last block.",
]
BY_DTYPE = {
    "float32": "- In float32 every shared mode is token-identical (table). The tests "
    "(tests/test_sdar_reference.py) hold ours to tests/block_reference.py, the `re-impl` rows: "
    "identical to both references, NFE and token-forwards equal.",
    "bfloat16": "- In bfloat16 the references' confidences are bfloat16 (ties and near-ties "
    "common, ranked by `torch.topk`) and their kernels differ from call to call (3-D or 4-D mask, "
    "cache or tree attention): they disagree with each other and FreeDave with its own rule on "
    "some prompts, so token identity is measured against that spread, not expected. unmask "
    "scores in float32 (docs/design.md § Exactness and ties).",
}


def weights_hash(folder: Path) -> str:
    """The first 12 hex digits of model.safetensors' sha256: which weights a report is of."""
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()[:12]


def report(args, s: Sides, prompts: list[list[int]], rows: list[str], body: list[str],
           seconds: float) -> str:
    commits = {name: sdar_ref.reference_commit(repo)[:12]
               for name, repo in (("JetAstra/SDAR", args.sdar), ("cychomatica/FreeDave", args.freedave))}
    model = (f"{args.model.name} (model.safetensors sha256 {weights_hash(args.model)})" if args.model
             else f"a tiny random SDAR ({json.dumps(sdar_ref.TINY)}, output rows x{LOGIT_SCALE})")
    return "\n".join([
        "# SDAR block decoding: ours vs SDAR's generate.py and FreeDave's block decoders", "",
        f"`python scripts/check/sdar_generate.py` ({', '.join(f'{k} {v}' for k, v in commits.items())}; "
        f"torch {torch.__version__}, {args.dtype}, CPU, {seconds:.0f} s). Weights: {model}, block "
        f"{s.block}, {'its' if args.model else 'the shipped'} tokenizer; {len(prompts)} held-out "
        "math prompts (chat template, "
        f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens), gen_length {s.gen_length}, "
        f"stop at EOS ({s.eos}). Greedy: argmax, confidence = softmax probability (SDAR's sampler "
        "swapped for FreeDave's temperature-0 one, except where a row says 'as published'). "
        "What each reference computes: docs/sdar-reference-semantics.md.", "",
        "Tokens compared: the generated ids through the first EOS, cut at gen_length. A cell "
        "'=' is token-identical, a number is the first differing position. NFE / TF: forwards "
        "and token-forwards of the whole request (prefill and store forwards included; SDAR "
        "decodes the EOS block to its end, FreeDave until a block of EOS only). CPU s: the "
        f"process's CPU seconds for the side's {len(prompts)} prompts, one prompt at a time "
        f"(ours too), {torch.get_num_threads()} torch thread(s), in the order the table lists "
        "them (the first side of the first setting pays the warm-up).", "",
        f"SDAR's entropy_bounded as published: {published_entropy_bounded(s, prompts[0])}.", "",
        "Reading:", "", *SEMANTICS, BY_DTYPE[args.dtype], "",
        "| setting | against | token-identical prompts | NFE / token-forwards, all prompts | "
        "CPU s, all prompts (x the first side's) |",
        "|---|---|---|---|---|", *rows, "", *body])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sdar", type=Path, help="JetAstra/SDAR: a checkout or a bare git directory")
    ap.add_argument("freedave", type=Path, help="cychomatica/FreeDave: a checkout or a bare git directory")
    ap.add_argument("--model", type=Path, help="an SDAR folder (default: a tiny random one)")
    ap.add_argument("--n", type=int, default=16, help="held-out math prompts")
    ap.add_argument("--gen-length", type=int, default=32)
    ap.add_argument("--out", type=Path, help="write the markdown report here")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="both models' weights (the published ones are bfloat16)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--setting", action="append", dest="only",
                    help="run only the setting of this name (repeatable; default: every one)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="sdar-generate-"))
    try:
        folder = args.model or tiny_folder(args.sdar, scratch / "tiny-sdar")
        llm = unmask.LLM(folder, device="cpu", dtype=args.dtype)
        ref = sdar_ref.as_loaded(reference_model(sdar_ref.load_reference(args.sdar, MODELING),
                                                 args.sdar, folder, llm.model),
                                 getattr(torch, args.dtype))
        c = llm.config
        s = Sides(ref, Counter(ref), load_sdar_generate(args.sdar, False),
                  load_sdar_generate(args.sdar, True), load_freedave(args.freedave), llm,
                  c.block_size, c.mask_token_id, c.eos_token_id, args.gen_length)
        prompts = [llm.encode_prompt(e.prompt) for e in load_task("math", args.n).examples]
        rows, body = check(s, prompts, args.only)
        text = report(args, s, prompts, rows, body, time.perf_counter() - start)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
