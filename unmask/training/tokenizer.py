"""Byte-level BPE tokenizer for the embedded model, trained on the training data.

Digits are split one per token (``Digits(individual_digits=True)``) so that column arithmetic
works on single-digit tokens. Special tokens follow LLaDA: ``<|eos|>`` doubles as the padding
token (answers are padded with EOS to the canvas), ``<|mask|>`` is the diffusion mask.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, MASK, USER, ASSISTANT = "<|bos|>", "<|eos|>", "<|mask|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = [BOS, EOS, MASK, USER, ASSISTANT]  # ids 0..4, in this order

# Renders `<|bos|><|user|>\n{q}<|assistant|>\n` for a single user turn with a generation prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n' + message['content'] + eos_token }}"
    "{% else %}{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def format_prompt(question: str) -> str:
    """The chat-template rendering of one user question, ready for generation (as text)."""
    return f"{BOS}{USER}\n{question}{ASSISTANT}\n"


def build_tokenizer(texts: Iterable[str], vocab_size: int = 4096) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, max_length: int = 2048) -> Path:
    """Write tokenizer.json and tokenizer_config.json (with the chat template) to ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "mask_token": MASK,
        "additional_special_tokens": [USER, ASSISTANT],
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def training_texts(n_math: int = 40_000, seed: int = 0) -> list[str]:
    """Prompts and responses from the training splits only (never held-out data)."""
    from unmask.tasks import code, math

    texts: list[str] = []
    for p in math.make_split("train", n_math, seed=seed):
        texts += [p.prompt, p.response]
    for c in code.make_split("train", None, seed=seed):
        texts += [c.prompt, c.response]
    return texts


def train_tokenizer(out_dir: str | Path, vocab_size: int = 4096, seed: int = 0) -> Tokenizer:
    tok = build_tokenizer(training_texts(seed=seed), vocab_size=vocab_size)
    save_tokenizer(tok, out_dir)
    return tok


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Train the embedded model's BPE tokenizer.")
    ap.add_argument("out_dir")
    ap.add_argument("--vocab-size", type=int, default=4096)
    a = ap.parse_args()
    t = train_tokenizer(a.out_dir, a.vocab_size)
    print(f"vocab {t.get_vocab_size()} -> {a.out_dir}")
