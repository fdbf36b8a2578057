"""unmask.tokens: a chat's ids from cached pieces between added tokens are the whole text's ids,
for the shipped tokenizers and the other configurations it allows; where a piece would encode
differently alone (Metaspace "first", an lstrip token) it keeps the whole-text encode; the cache
is thread-safe and stays within its caps."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from unmask.api import LLM, load_tokenizer
from unmask.hub import SHIPPED
from unmask.tokens import ChatTokens, PieceCache

CORPUS = ["What is 12 times 13? Think step by step.", "You are a careful assistant.\n\n",
          "The answer is 156.\tDone.", "über naïve café 東京 😀", "  spaces   and\nlines\n"] * 20
ADDED = ["<|user|>", "<|assistant|>", "<|eos|>", "<|us"]  # "<|us" overlaps "<|user|>"


def small(pre_tokenizer=None, normalizer=None, added: list[AddedToken] | None = None
          ) -> PreTrainedTokenizerFast:
    """A BPE trained on CORPUS in a fraction of a second, with the given pieces."""
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.normalizer, tok.pre_tokenizer = normalizer, pre_tokenizer
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    tok.add_special_tokens(added or [AddedToken(t, normalized=False) for t in ADDED])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


SHIPPED_TOKENIZERS = {name: load_tokenizer(path) for name, path in SHIPPED.items()}
ALLOWED = {  # configurations the split is exact for beyond the shipped ones
    "bytelevel-prefix-space": small(pre_tokenizers.ByteLevel(add_prefix_space=True)),
    "metaspace-always": small(pre_tokenizers.Metaspace(prepend_scheme="always")),
    "llama-normalizer": small(normalizer=normalizers.Sequence([
        normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])),
}
OFF = {  # (tokenizer, a text whose pieces encode differently alone)
    "metaspace-first": (small(pre_tokenizers.Metaspace(prepend_scheme="first")),
                        "hello<|user|>hello"),
    "lstrip-token": (small(pre_tokenizers.ByteLevel(add_prefix_space=False), added=[
        AddedToken("<|user|>", lstrip=True, normalized=False)]), "a  <|user|>b"),
}


def whole(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def added_of(tok) -> list[str]:
    return [str(t) for t in tok.added_tokens_decoder.values()]


def texts(added: list[str]) -> st.SearchStrategy[str]:
    piece = st.one_of(
        st.text(st.characters(blacklist_categories=("Cs",)), max_size=12),  # any unicode
        st.text("abcdefgh XYZ.,!?'-", max_size=20),
        st.text("0123456789", min_size=1, max_size=8),
        st.text(" \n\t\r", min_size=1, max_size=6),  # whitespace runs
        st.sampled_from(added),
        st.sampled_from(added).map(lambda t: t[: len(t) // 2]),  # a token's broken start
        st.just(""))
    return st.lists(piece, max_size=14).map("".join)


@pytest.mark.parametrize("name", [*SHIPPED_TOKENIZERS, *ALLOWED])
def test_pieces_give_the_whole_texts_ids(name):
    tok = SHIPPED_TOKENIZERS.get(name) or ALLOWED[name]
    chat = ChatTokens(tok)
    assert chat.why_whole is None, chat.why_whole

    @settings(max_examples=300, deadline=None)
    @given(texts(added_of(tok)))
    def check(text):
        expect = whole(tok, text)
        assert chat.encode(text) == expect
        assert chat.encode(text) == expect  # every piece now from the cache

    check()


@pytest.fixture(scope="module", params=list(SHIPPED))
def llm(request) -> LLM:
    return LLM(request.param, device="cpu", prefix_cache=False)


CHATS = [
    [{"role": "system", "content": "You are terse.\n\nAnswer with a number."},
     {"role": "user", "content": "What is 12 times 13?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 1 2  3"},
     {"role": "user", "content": "\tAnd again?\n"}],
    [{"role": "system", "content": "<|user|> inside a message"},
     {"role": "user", "content": "tokens <|assistant|><|eos|> in text"}],
]


@pytest.mark.parametrize("messages", CHATS)
def test_encode_messages_is_the_uncached_encode(llm, messages):
    expect = whole(llm.tokenizer, llm.render_chat(messages))
    assert llm.encode_messages(messages) == expect
    assert llm.encode_messages(messages) == expect


@pytest.mark.parametrize("name", list(OFF))
def test_split_off_where_pieces_encode_differently(name):
    tok, text = OFF[name]
    chat = ChatTokens(tok)
    assert chat.why_whole is not None
    assert chat.encode(text) == whole(tok, text)
    chat.why_whole = None  # split anyway: the ids differ, which is why it is off
    assert chat.encode(text) != whole(tok, text)


def test_threads_encode_concurrently():
    tok = SHIPPED_TOKENIZERS["unmask-sdar"]
    chat = ChatTokens(tok, PieceCache(max_pieces=4))  # small: threads evict each other's pieces
    rnd = random.Random(0)
    samples = ["".join(rnd.choice([*CORPUS[:5], *ADDED[:3], "\n"]) for _ in range(8))
               for _ in range(40)]
    expect = [whole(tok, s) for s in samples]
    wrong: list[int] = []

    def work(seed: int) -> None:
        order = random.Random(seed).sample(range(len(samples)), len(samples))
        wrong.extend(i for i in order * 5 if chat.encode(samples[i]) != expect[i])

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
    assert len(chat.cache) <= 4


def test_cache_stays_within_its_caps():
    cache = PieceCache(max_pieces=5, max_chars=100)
    rnd = random.Random(1)
    for i in range(500):
        text = f"{i}" * rnd.randint(1, 40)
        cache.put(text, (i,))
        assert len(cache) <= 5 and cache.chars <= 100
        assert cache.chars == sum(map(len, cache._ids))
    cache.put("x" * 101, (0,))  # longer than the whole cap: not kept
    assert cache.get("x" * 101) is None
    chat = ChatTokens(SHIPPED_TOKENIZERS["unmask-sdar"], PieceCache(max_pieces=3, max_chars=60))
    for i in range(50):
        chat.encode(f"<|user|>\nquestion {i} {'!' * i}<|assistant|>\n")
        assert len(chat.cache) <= 3 and chat.cache.chars <= 60
