"""Fast checks of the training data, tokenizer and objective (tiny config, CPU)."""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
from pathlib import Path

import pytest
import torch
from helpers import unpacked_call

from unmask.errors import CheckpointError, InputError
from unmask.tasks import TASKS
from unmask.tasks import code as code_task
from unmask.tasks import math as math_task
from unmask.training.objective import SEMI_AR_BLOCK, TextEncoder, mask_batch
from unmask.training.tokenizer import BOS, EOS, MASK, SPECIAL_TOKENS, build_tokenizer, save_tokenizer
from unmask.training.train import CanvasBucket, DataStream, _model_config, sft_loss


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    texts = []
    for p in math_task.make_split("train", 2000, seed=0):
        texts += [p.prompt, p.response]
    for c in code_task.make_split("train", 300, seed=0):
        texts += [c.prompt, c.response]
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(build_tokenizer(texts, vocab_size=600), out)
    return out


@pytest.fixture(scope="module")
def enc(tok_dir: Path) -> TextEncoder:
    return TextEncoder(tok_dir / "tokenizer.json")


def test_math_splits_disjoint() -> None:
    train = {p.prompt for p in math_task.make_split("train", 5000, seed=0)}
    held = {p.prompt for p in math_task.make_split("heldout", 500, seed=0)}
    assert train.isdisjoint(held)
    assert all(math_task.is_heldout(p) for p in held)
    assert not any(math_task.is_heldout(p) for p in train)


def test_code_splits_disjoint_by_file() -> None:
    train, held = code_task.make_split("train"), code_task.make_split("heldout")
    assert len(train) > 500 and len(held) > 20
    assert {c.source for c in train}.isdisjoint({c.source for c in held})
    assert {c.prompt for c in train}.isdisjoint({c.prompt for c in held})


def test_math_families_and_checker() -> None:
    rng = random.Random(0)
    for gen in math_task.FAMILIES.values():
        for _ in range(50):
            p = gen(rng)
            assert math_task.check(p.response, p.answer)
            assert math_task.extract_answer(p.response) == p.answer
            wrong = p.response.rsplit("####", 1)[0] + "#### 12345678"
            assert not math_task.check(wrong, p.answer)
    assert not math_task.check("no answer here", "3")
    ex = math_task.gen_add(random.Random(1))
    assert ex.response.endswith(f"#### {ex.answer}")


def test_canonical_prompt_in_distribution() -> None:
    prompts = {p.prompt for p in math_task.make_split("train", 3000, seed=0)}
    assert any(p.startswith("What is ") and " + " in p and p.endswith("?") for p in prompts)


def test_math_responses_average_40_tokens(enc: TextEncoder) -> None:
    ps = math_task.make_split("train", 500, seed=3)
    assert statistics.mean(len(enc.response(p.response)) for p in ps) >= 40


def test_code_checker() -> None:
    ex = code_task.make_split("heldout", 5, seed=0)[0]
    assert code_task.check(ex.prompt, ex.response)
    assert not code_task.check(ex.prompt, "    return (((\n")
    task = TASKS["code"]
    e = task.load("heldout", 3)[0]
    assert task.check(e, e.response)
    m = TASKS["math"].load("heldout", 3)[0]
    assert TASKS["math"].check(m, m.response) and not TASKS["math"].check(m, "#### -1")


def test_chat_template(tok_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    t = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    s = t.apply_chat_template([{"role": "user", "content": "What is 47 + 38?"}],
                              add_generation_prompt=True, tokenize=False)
    assert s == "<|bos|><|user|>\nWhat is 47 + 38?<|assistant|>\n"
    assert t.bos_token == BOS and t.eos_token == EOS and t.mask_token == MASK
    assert [t.convert_tokens_to_ids(x) for x in SPECIAL_TOKENS] == list(range(5))
    ids = t("12345", add_special_tokens=False)["input_ids"]
    assert len(ids) == 5  # digits are split one per token


def test_masking_never_touches_prompt(enc: TextEncoder) -> None:
    data = DataStream(enc, batch_tokens=2048, seed=0, code_frac=0.5)
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        b = data.next_batch()
        noisy, masked, _ = mask_batch(b, enc.mask_id, gen)
        assert not (masked & b.prompt_mask).any()
        assert torch.equal(noisy[b.prompt_mask], b.input_ids[b.prompt_mask])
        assert masked.any()
        assert int(b.response_len.min()) >= 48
        assert (b.input_ids[:, -1] == enc.eos_id).all()  # responses are EOS-padded to the canvas


def test_code_max_tokens_cuts_training_code_only(enc: TextEncoder) -> None:
    full = DataStream(enc, batch_tokens=2048, seed=0, code_frac=1.0)
    short = DataStream(enc, batch_tokens=2048, seed=0, code_frac=1.0, code_max_tokens=32)
    heldout = DataStream(enc, split="heldout", batch_tokens=2048, seed=0, code_frac=1.0,
                         code_max_tokens=32)
    assert 0 < len(short.code) < len(full.code)
    assert max(len(r) for _, r in short.code) <= 32 < max(len(r) for _, r in full.code)
    assert set(map(str, short.code)) <= set(map(str, full.code))
    assert max(len(r) for _, r in heldout.code) <= 32  # the stream obeys it on any split...
    from unmask.tasks import code

    # ...but the held-out task that `unmask eval` scores is never cut.
    assert max(len(enc.response(c.response)) for c in code.make_split("heldout", None)) > 32


@pytest.fixture
def one_thread():
    # Two threads on a busy 2-core machine run several times slower than one (oversubscription).
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def test_few_steps_lower_loss(enc: TextEncoder, one_thread: None) -> None:
    model = _tiny_model(enc)
    cfg = model.config
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = DataStream(enc, batch_tokens=1024, seed=0, code_frac=0.0)
    data.canvas_length = lambda: 64  # type: ignore[method-assign]
    batch = data.next_batch()
    gen = torch.Generator().manual_seed(0)

    def loss_now() -> float:
        with torch.no_grad():
            return float(sft_loss(model, batch, cfg.mask_token_id, torch.Generator().manual_seed(1)))

    before = loss_now()
    for _ in range(15):
        loss = sft_loss(model, batch, cfg.mask_token_id, gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss_now() < 0.8 * before


def test_tight_batches_fit_their_longest_answer(enc: TextEncoder) -> None:
    from unmask.training.train import CanvasBucket

    data = DataStream(enc, batch_tokens=2048, seed=1, code_frac=0.3,
                      buckets=(CanvasBucket(0, 8, 1.0, tight=True), CanvasBucket(300, 400, 0.0)))
    for _ in range(12):
        b = data.next_batch()
        assert b.answer_len is not None
        canvas = b.input_ids.shape[1] - int(b.prompt_mask.sum(1).max())
        assert 0 <= canvas - int(b.answer_len.max()) <= 8
        assert b.input_ids.numel() <= 2048 or b.input_ids.shape[0] == 1
        for i in range(b.input_ids.shape[0]):  # each answer ends with its EOS inside the canvas
            start = b.input_ids.shape[1] - int(b.response_len[i])
            assert int(b.input_ids[i, start + int(b.answer_len[i]) - 1]) == enc.eos_id
    with pytest.raises(ValueError):
        CanvasBucket(5, 2, 1.0)


def test_pad_weight(enc: TextEncoder) -> None:
    from unmask.training.objective import Batch, LossWeights, position_weights

    data = DataStream(enc, batch_tokens=2048, seed=0, code_frac=0.0)
    b = data.next_batch()
    w = position_weights(b, LossWeights(pad=0.25))
    assert (w[b.prompt_mask] == 0).all()
    prompt_len = b.input_ids.shape[1] - b.response_len
    for i in range(b.input_ids.shape[0]):
        p, a = int(prompt_len[i]), int(b.answer_len[i])
        assert (w[i, p:p + a] == 1).all() and (w[i, p + a:] == 0.25).all()
    # pad_weight 1 is LLaDA's loss: every response position weighted 1, divided by response length
    assert torch.equal(position_weights(b), (~b.prompt_mask).float())
    digits = enc.digit_ids()
    assert len(digits) == 10
    wd = position_weights(b, LossWeights(digit=3.0, digit_ids=digits))
    is_digit = torch.isin(b.input_ids, torch.tensor(digits)) & ~b.prompt_mask
    assert is_digit.any() and (wd[is_digit] == 3).all() and (wd[~is_digit & ~b.prompt_mask] == 1).all()
    model = _tiny_model(enc)
    no_answer = Batch(b.input_ids, b.prompt_mask, b.response_len, None)
    l1 = sft_loss(model, b, enc.mask_id, torch.Generator().manual_seed(0))
    l2 = sft_loss(model, no_answer, enc.mask_id, torch.Generator().manual_seed(0), LossWeights(pad=0.25))
    assert torch.allclose(l1, l2)  # without answer lengths there is no padding to down-weight
    l3 = sft_loss(model, b, enc.mask_id, torch.Generator().manual_seed(0), LossWeights(pad=0.25))
    assert not torch.allclose(l1, l3)
    with pytest.raises(ValueError):
        LossWeights(digit=-1)


def test_semi_ar_masks_follow_the_decoding_canvas(enc: TextEncoder) -> None:
    """semi_ar=1: clean response before a block-aligned cut, nothing clean after the block,
    p_mask 1 after it, prompt never masked; semi_ar=0 leaves LLaDA's masks untouched."""
    data = DataStream(enc, batch_tokens=4096, seed=3, code_frac=0.0,
                      buckets=(CanvasBucket(100, 320, 1.0),))
    cuts = set()
    for seed in range(4):
        b = data.next_batch()
        _, masked, p_mask = mask_batch(b, enc.mask_id, torch.Generator().manual_seed(seed), semi_ar=1.0)
        t_len = b.input_ids.shape[1]
        assert not bool((masked & b.prompt_mask).any())
        for r in range(b.input_ids.shape[0]):
            start = t_len - int(b.response_len[r])
            first = int(masked[r].float().argmax())
            cut = start + (first - start) // SEMI_AR_BLOCK * SEMI_AR_BLOCK
            assert bool(masked[r, cut + SEMI_AR_BLOCK :].all())
            assert not bool(masked[r, start:cut].any())
            assert bool((p_mask[r, cut + SEMI_AR_BLOCK :] == 1).all())
            assert cut - start < int(b.answer_len[r])  # the block holds answer tokens
            cuts.add(cut - start)
        plain = mask_batch(b, enc.mask_id, torch.Generator().manual_seed(seed))
        mixed = mask_batch(b, enc.mask_id, torch.Generator().manual_seed(seed), semi_ar=0.0)
        assert all(torch.equal(x, y) for x, y in zip(plain, mixed, strict=True))
    assert len(cuts) > 1  # cuts vary
    with pytest.raises(ValueError):
        mask_batch(b, enc.mask_id, semi_ar=1.5)


def test_digit_recall_scores_masked_digits(enc: TextEncoder) -> None:
    from unmask.training.train import digit_recall

    data = DataStream(enc, batch_tokens=2048, seed=0, code_frac=0.0)
    batches = [data.next_batch()]
    digits = enc.digit_ids()

    class Oracle(torch.nn.Module):  # predicts the true token everywhere: recall 1
        def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.one_hot(batches[0].input_ids, enc.vocab_size).float()

    assert digit_recall(Oracle(), batches, enc.mask_id, digits, torch.device("cpu")) == 1.0
    assert digit_recall(_tiny_model(enc), batches, enc.mask_id, digits, torch.device("cpu")) < 0.5


class _Writer(torch.nn.Module):
    """Stands in for a model: at every scored position it predicts the token of ``answers[q]`` for
    the prompt q the row starts with (without a cache the runner forwards only visible slots, so
    left padding never reaches the model), then EOS. Enough of the model interface for decoding."""

    logit_shift = 0

    def __init__(self, enc: TextEncoder, answers: dict[tuple[int, ...], list[int]]) -> None:
        super().__init__()
        self.enc, self.answers = enc, answers
        self.config = argparse.Namespace(
            vocab_size=enc.vocab_size, embedding_size=enc.vocab_size, mask_token_id=enc.mask_id,
            eos_token_id=enc.eos_id, max_sequence_length=4096)
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, ids, pos, frame=None, embeds=None, logits_at=None):
        ids, pos, (rows, cols) = unpacked_call(ids, pos, frame, logits_at)
        out = torch.full((rows.numel(), self.enc.vocab_size), -10.0)
        for n, (r, c) in enumerate(zip(rows.tolist(), cols.tolist(), strict=True)):
            prompt = next(q for q in self.answers if ids[r, : len(q)].tolist() == list(q))
            resp = self.answers[prompt]
            i = int(pos[r, c]) - len(prompt)
            out[n, resp[i] if i < len(resp) else self.enc.eos_id] = 10.0
        return out


def test_solve_rate_decodes_and_checks(enc: TextEncoder, one_thread: None) -> None:
    from unmask.tasks.math import make_split
    from unmask.training.train import solve_rate

    probs = [p for p in make_split("heldout", 40, seed=0) if p.family == "add"][:2]
    assert len(probs) == 2
    right = {tuple(enc.prompt(p.prompt)): enc.response(p.response) for p in probs}
    assert solve_rate(_Writer(enc, right), enc, probs, gen_length=192) == 1.0
    # The same worked solutions with the final answer off by one: nothing is solved.
    wrong = {tuple(enc.prompt(p.prompt)): enc.response(p.response.rsplit(" ", 1)[0]
                                                       + f" {int(p.answer) + 1}") for p in probs}
    assert solve_rate(_Writer(enc, wrong), enc, probs, gen_length=192) == 0.0
    assert solve_rate(_tiny_model(enc), enc, probs, gen_length=64) == 0.0
    # Any checker: code bodies that parse after the prompt's signature.
    from unmask.tasks import code

    funcs = code.make_split("heldout", 2, seed=0)
    bodies = {tuple(enc.prompt(f.prompt)): enc.response(f.response) for f in funcs}
    broken = {tuple(enc.prompt(f.prompt)): enc.response("    return (") for f in funcs}

    def parses(text: str, f: code.CodeExample) -> bool:
        return code.check(f.prompt, text)

    assert solve_rate(_Writer(enc, bodies), enc, funcs, gen_length=256, check=parses) == 1.0
    assert solve_rate(_Writer(enc, broken), enc, funcs, gen_length=256, check=parses) == 0.0


def _tiny_model(enc: TextEncoder):
    from unmask.models import build_model

    torch.manual_seed(0)
    ns = argparse.Namespace(model_type="llada", d_model=64, n_heads=4, n_layers=2, mlp_hidden=128,
                            max_seq_len=2048)
    model = build_model(_model_config(ns, enc))
    model.init_weights()
    return model


def _train_args(tok_dir: Path, *extra: str) -> argparse.Namespace:
    from unmask.training.train import add_train_arguments

    p = add_train_arguments(argparse.ArgumentParser())
    return p.parse_args(["--tokenizer", str(tok_dir), "--d-model", "32", "--n-layers", "1",
                         "--n-heads", "2", "--mlp-hidden", "64", "--batch-tokens", "512",
                         "--code-frac", "0", "--eval-every", "2", "--eval-batches", "1",
                         "--solve-every", "0", "--threads", "1", *extra])


class _Payload:
    """Unpickling this runs ``open(marker, "w")``: the shape of any code-execution payload."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (open, (self.marker, "w"))


def test_resume_refuses_a_state_that_runs_code(tok_dir: Path, tmp_path: Path, one_thread: None) -> None:
    from unmask.training.train import run_train

    marker = tmp_path / "pwned"
    out = tmp_path / "run"
    out.mkdir()
    torch.save({"model": {}, "step": 0, "payload": _Payload(marker)}, out / "state.pt")
    with pytest.raises(CheckpointError, match="state.pt"):
        run_train(_train_args(tok_dir, "--out", str(out), "--max-steps", "1", "--resume"))
    assert not marker.exists(), "loading state.pt ran code"
    # The same file does run code when it is unpickled without weights_only: the test is live.
    torch.load(out / "state.pt", weights_only=False)
    assert marker.exists()


def test_resume_names_a_state_from_another_architecture(tok_dir: Path, tmp_path: Path,
                                                       one_thread: None) -> None:
    from unmask.training.train import run_train

    out = tmp_path / "run"
    run_train(_train_args(tok_dir, "--out", str(out), "--max-steps", "1"))
    with pytest.raises(CheckpointError, match="does not fit this run") as e:
        run_train(_train_args(tok_dir, "--out", str(out), "--max-steps", "2", "--resume",
                              "--d-model", "64"))
    # load_state_dict's message is one line per mismatched tensor (13 lines here): cut to one
    assert "\n" not in str(e.value) and "size mismatch" in str(e.value)


def test_train_cli_bad_input_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from unmask.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--buckets", "9-3:1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "bad canvas bucket" in err and len(err.strip().splitlines()) == 1
    assert main(["train", "--device", "tpu", "--max-steps", "1", "--threads", "1"]) == 2
    assert "valid here" in capsys.readouterr().err


def test_run_train_resume_and_init(tok_dir: Path, tmp_path: Path, one_thread: None) -> None:
    from unmask.checkpoint import load_model
    from unmask.training.train import add_train_arguments, run_train

    def args(*extra: str) -> argparse.Namespace:
        p = add_train_arguments(argparse.ArgumentParser())
        return p.parse_args(["--tokenizer", str(tok_dir), "--d-model", "32", "--n-layers", "1",
                             "--n-heads", "2", "--mlp-hidden", "64", "--batch-tokens", "512",
                             "--code-frac", "0", "--eval-every", "2", "--eval-batches", "1",
                             "--threads", "1", *extra])

    a = tmp_path / "a"
    s1 = run_train(args("--out", str(a), "--max-steps", "3"))
    assert s1["steps"] == 3 and (a / "final" / "model.safetensors").is_file()
    from unmask.catalog import trained_on_single_turns

    assert trained_on_single_turns(a / "final")  # its data: single questions (chat reads it)
    s2 = run_train(args("--out", str(a), "--max-steps", "5", "--resume"))
    assert s2["steps"] == 5 and s2["tokens"] > s1["tokens"]  # continued, not restarted
    # resumed with nothing left to train: the loss the run last logged, not NaN
    s3 = run_train(args("--out", str(a), "--max-steps", "5", "--resume"))
    assert s3["steps"] == 5 and math.isfinite(s3["final_train_loss"])
    assert 0 <= s2["final_digit_recall"] <= 1

    b = tmp_path / "b"
    run_train(args("--out", str(b), "--max-steps", "0", "--init", str(a / "final")))
    src, dst = load_model(a / "final"), load_model(b / "final")
    for (name, x), (_, y) in zip(src.state_dict().items(), dst.state_dict().items(), strict=True):
        assert torch.equal(x, y), name  # zero steps: exactly the --init weights
    with pytest.raises(InputError, match="config differs"):
        run_train(args("--out", str(tmp_path / "c"), "--d-model", "64", "--init", str(a / "final")))


def card_summary() -> dict:
    """A run's summary.json as `run_train` writes it, for the model card."""
    args = {"weight_decay": 0.1, "lr": 1e-3, "grad_clip": 1.0, "batch_tokens": 4096, "code_frac": 0.25,
            "pad_weight": 0.1, "digit_weight": 5.0, "init": "some/model"}
    cfg = {"d_model": 256, "n_layers": 4, "n_heads": 4, "mlp_hidden_size": 768, "vocab_size": 2048,
           "max_sequence_length": 2048}
    return {"config": cfg, "args": args, "params": 4458752, "command": "unmask train --out x",
            "steps": 10, "tokens": 12345, "train_minutes": 1.5, "final_train_loss": 0.5,
            "final_heldout_loss": 0.6}


def test_model_card_renders_the_run() -> None:
    from unmask.training.model_card import render_model_card

    summary = card_summary()
    args = summary["args"]
    card = render_model_card(summary, scores="| math | 1% |")
    for text in ("`unmask train --out x`", "digit tokens 5.0", "padding after", "longest answer +",
                 "12,345", "| math | 1% |", "`some/model` (`--init`)"):
        assert text in card, text
    assert "{question}" in card and "{" not in card.replace("{question}", "")  # all fields filled
    assert "--semi-ar" not in card
    assert "--code-max-tokens" not in card
    summary["args"] = {**args, "semi_ar": 0.5, "code_max_tokens": 48}
    summary.update(final_digit_recall=0.9, final_solve_rate=0.25, final_parse_rate=0.375)
    card = render_model_card(summary)
    assert "50% of rows are instead masked as semi-autoregressive" in card
    assert "0.9" in card and "0.25" in card and "0.375" in card
    assert "at most 48 tokens (`--code-max-tokens`)" in card


@pytest.mark.parametrize("flag", ["--scores", "--lineage"])
def test_model_card_refuses_an_issue_number(tmp_path: Path, flag: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The hand-written parts of a card say what a number stood for: the card is read where the
    tracker is not. One line, exit 2, no card written."""
    from unmask.training.model_card import main

    (tmp_path / "summary.json").write_text(json.dumps(card_summary()))
    number = 3  # not in the source's text, which tests/test_docs.py holds to the same rule
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path), str(tmp_path), flag, f"| task | score | bar (issue {number}) |"])
    assert e.value.code == 2
    assert f"cites 'issue {number}': say what it stood for" in capsys.readouterr().err
    assert not (tmp_path / "MODEL_CARD.md").exists()
    main([str(tmp_path), str(tmp_path), flag, "| task | score | quality bar |"])
    assert "quality bar" in (tmp_path / "MODEL_CARD.md").read_text()


def test_parse_buckets() -> None:
    from unmask.training.train import DEFAULT_BUCKETS, CanvasBucket, parse_buckets

    assert parse_buckets("tight:0-16:0.65,100-320:0.2,321-1024:0.15") == DEFAULT_BUCKETS
    assert parse_buckets("56-144:0.6") == (CanvasBucket(56, 144, 0.6),)
    for bad in ("56-144", "a-b:1", "tight:0-4:1", "9-3:1"):
        with pytest.raises(ValueError, match="bucket|needed"):
            parse_buckets(bad)


def test_python_m_unmask_training_bad_input_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from unmask.training.train import main

    with pytest.raises(SystemExit) as e:
        main(["--device", "tpu", "--max-steps", "1", "--threads", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "valid here" in err and len(err.strip().splitlines()) == 1


# --- run folders, --max-steps 0 and --vocab-size (the tester's adversarial pass) -----------------


def test_a_new_run_never_writes_over_an_earlier_one(tok_dir: Path, tmp_path: Path, one_thread: None,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`unmask train --out r1` into a folder holding a run, without --resume, replaced its
    state.pt, summary.json and exports with a new run's."""
    from unmask.cli import main
    from unmask.training.train import run_train

    out = tmp_path / "r1"
    run_train(_train_args(tok_dir, "--out", str(out), "--max-steps", "1"))
    before = {f: (out / f).read_bytes() for f in ("state.pt", "summary.json", "args.json")}
    with pytest.raises(InputError, match=r"r1 holds a run \(state.pt, summary.json\); pass "
                                         r"--resume to continue it, or a new --out"):
        run_train(_train_args(tok_dir, "--out", str(out), "--max-steps", "2"))
    (out / "state.pt").unlink()  # a finished run whose state was cleaned up is still a run
    with pytest.raises(InputError, match=r"holds a run \(summary.json\)"):
        run_train(_train_args(tok_dir, "--out", str(out), "--max-steps", "2"))
    assert all((out / f).read_bytes() == b for f, b in before.items() if f != "state.pt")
    assert main(["train", "--out", str(out), "--tokenizer", str(tok_dir), "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert "holds a run" in err and len(err.strip().splitlines()) == 1


def test_resume_without_a_state_is_refused(tok_dir: Path, tmp_path: Path, one_thread: None) -> None:
    """--resume into a folder with no state.pt started a new run from scratch, silently."""
    from unmask.training.train import run_train

    out = tmp_path / "fresh"
    with pytest.raises(InputError, match="--resume: .*fresh holds no state.pt to resume from; "
                                         "drop --resume"):
        run_train(_train_args(tok_dir, "--out", str(out), "--max-steps", "1", "--resume"))
    assert not (out / "summary.json").exists()


def test_zero_steps_without_init_is_refused(tok_dir: Path, tmp_path: Path, one_thread: None) -> None:
    """--max-steps 0 without --init exported the random initialisation as a model (and wrote
    final_train_loss NaN); 0 steps means "export --init as it is"."""
    from unmask.training.train import run_train

    out = tmp_path / "zero"
    with pytest.raises(InputError, match="--max-steps 0 only exports the starting weights: give "
                                         "--init"):
        run_train(_train_args(tok_dir, "--out", str(out), "--max-steps", "0"))
    assert not (out / "final").exists()


def test_vocab_size_is_the_tokenizers(tok_dir: Path, tmp_path: Path, one_thread: None) -> None:
    """With an existing tokenizer, --vocab-size was ignored while args.json recorded it (and the
    untyped default 2048 was recorded for a 600-token tokenizer)."""
    from unmask.training.train import run_train

    vocab = TextEncoder(tok_dir / "tokenizer.json").vocab_size
    assert vocab != 500
    with pytest.raises(InputError, match=f"--vocab-size 500: the tokenizer in .* has {vocab} "
                                         f"tokens; drop --vocab-size or give {vocab}"):
        run_train(_train_args(tok_dir, "--out", str(tmp_path / "v1"), "--max-steps", "1",
                              "--vocab-size", "500"))
    assert not (tmp_path / "v1").exists()  # refused before the run folder is made
    out = tmp_path / "v2"
    summary = run_train(_train_args(tok_dir, "--out", str(out), "--max-steps", "1"))
    recorded = json.loads((out / "args.json").read_text())["vocab_size"]
    assert recorded == summary["args"]["vocab_size"] == summary["config"]["vocab_size"] == vocab
    run_train(_train_args(tok_dir, "--out", str(tmp_path / "v3"), "--max-steps", "1",
                          "--vocab-size", str(vocab)))  # the same size typed: fine


def test_train_help_shows_every_default() -> None:
    """`--out` silently wrote to runs/default: --help names each flag's default."""
    from unmask.cli import build_parser

    train = build_parser()._subparsers._group_actions[0].choices["train"]
    text = " ".join(train.format_help().split())
    assert "(default: runs/default)" in text
    for action in train._actions:
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            entry = " ".join(train._get_formatter()._format_action(action).split())
            assert "default" in entry, entry


def _strict_json(path: Path) -> dict:
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


def test_a_first_run_evaluates_under_its_own_bar_and_writes_strict_json(
        tok_dir: Path, tmp_path: Path, one_thread: None, capsys: pytest.CaptureFixture[str]) -> None:
    """A one-step run decoded the held-out problems for minutes under a training bar stuck at
    "step 0 0.0% loss nan", and its summary.json held bare NaN (unmeasured rates), which
    strict JSON parsers refuse: null now."""
    from unmask.training.train import run_train

    out = tmp_path / "run"
    run_train(_train_args(tok_dir, "--out", str(out), "--max-steps", "1", "--solve-every", "5",
                          "--solve-n", "2"))
    shown = capsys.readouterr().out
    assert "step 1" in shown  # the training bar's last state
    assert "final evaluation" in shown and "--no-final-eval" in shown
    assert re.search(r"evaluating.*3/3", shown), shown  # the loss, then 2 problems decoded
    summary = _strict_json(out / "summary.json")
    assert summary["final_parse_rate"] is None  # --code-frac 0: no code problems
    assert 0 <= summary["final_solve_rate"] <= 1 and summary["final_heldout_loss"] > 0


def test_no_final_eval_skips_it(tok_dir: Path, tmp_path: Path, one_thread: None,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    from unmask.training import train

    def fail(*a, **k):
        raise AssertionError("evaluated")
    monkeypatch.setattr(train, "heldout_loss", fail)
    monkeypatch.setattr(train, "solve_rate", fail)
    out = tmp_path / "run"
    summary = train.run_train(_train_args(tok_dir, "--out", str(out), "--max-steps", "1",
                                          "--solve-every", "5", "--no-final-eval"))
    assert summary["final_heldout_loss"] is None and summary["final_solve_rate"] is None
    assert _strict_json(out / "summary.json")["steps"] == 1


def test_a_missing_tokenizer_folder_is_refused_unless_asked_to_train_one(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A mistyped --tokenizer trained a new tokenizer into a folder it created."""
    from unmask.cli import main

    typo = tmp_path / "tokenzier"
    assert main(["train", "--out", str(tmp_path / "run"), "--tokenizer", str(typo),
                 "--threads", "1", "--max-steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--tokenizer {typo}: no tokenizer.json there" in err
    assert "--train-tokenizer" in err and not typo.exists()
