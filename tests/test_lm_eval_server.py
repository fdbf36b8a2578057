"""lm-eval's `local-completions` model against a live `unmask serve`.

With `--apply_chat_template` and `tokenizer_backend=huggingface,tokenizer=<model folder>`, lm-eval
applies the checkpoint's chat template itself and sends the prompt as token ids
(`{"prompt": [[ids]], "model", "max_tokens": max_gen_toks, "temperature": 0,
"stop": [eos_token], "seed": 1234}`); the server decodes those ids as they are. The prompts are
then `unmask eval`'s token for token, and so are the outputs and the accuracy.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import test_server
from helpers import LiveServer, assert_lm_eval_equals_unmask_eval

from unmask import LLM
from unmask.evaluation import TASKS_DIR
from unmask.tasks import TASKS

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's API models need lm-eval[api]

from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: E402

llm = test_server.llm  # fixture: the embedded model
server = test_server.server  # fixture: a LiveServer over it, decoder threshold

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}


def model_args(server: LiveServer, llm: LLM) -> str:
    return (f"model={llm.name},base_url={server.url}/v1/completions,"
            f"tokenizer_backend=huggingface,tokenizer={llm.path},num_concurrent=8")


def lm_eval_payload(lm: LocalCompletionsAPI, prompt: str) -> dict:
    """The body lm-eval's local-completions posts for one unmask_math request under
    --apply_chat_template: its own methods, in the order generate_until calls them."""
    context = lm.apply_chat_template([{"role": "user", "content": prompt}])
    ids = lm.tok_encode([context], add_special_tokens=lm.add_bos_token)
    return lm._create_payload(lm.create_message(ids), generate=True,
                              gen_kwargs={"until": [], "do_sample": False},  # unmask_math.yaml's
                              seed=lm._seed, eos=lm.eos_string)


def test_lm_eval_payload_is_served_as_unmask_eval_decodes(server: LiveServer, llm: LLM) -> None:
    """Fast check of the contract the CLI run below relies on."""
    lm = LocalCompletionsAPI(model=llm.name, base_url=f"{server.url}/v1/completions",
                             tokenizer_backend="huggingface", tokenizer=str(llm.path))
    prompt = TASKS["math"].load("heldout", 1)[0].prompt
    body = lm_eval_payload(lm, prompt)
    assert body == {"prompt": [llm.encode_prompt(prompt, chat=True)], "model": "unmask-llada",
                    "max_tokens": 256, "temperature": 0, "stop": [llm.tokenizer.eos_token],
                    "seed": 1234}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    want = llm.generate([prompt], "threshold", gen_length=256, chat=True)[0].text
    assert lm.parse_generations(r.json()) == [want]


def test_token_id_prompts(server: LiveServer, llm: LLM) -> None:
    """All four OpenAI prompt forms; token ids are decoded as they are (no chat template)."""
    url = f"{server.url}/v1/completions"
    texts = ["What is 47 + 38?", "What is 12 * 3 + 7?"]
    ids = [llm.encode_prompt(t, chat=False) for t in texts]

    def choices(prompt) -> list[str]:
        r = httpx.post(url, json={"prompt": prompt, "max_tokens": 32}, timeout=120)
        assert r.status_code == 200, r.text
        return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

    assert choices(ids) == choices(texts)
    assert choices(ids[0]) == choices(texts[0])
    for bad in ([[]], [-1], [ids[0] + [10**9]], [True], [1.5], ["a", [1]]):
        r = httpx.post(url, json={"prompt": bad, "max_tokens": 32}, timeout=30)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_lm_eval_cli_accuracy_equals_unmask_eval(server: LiveServer, llm: LLM,
                                                 tmp_path: Path) -> None:
    """`lm_eval --model local-completions` against the server scores unmask_math as
    `unmask eval --task math --decoder threshold` does: same prompts, outputs and accuracy.
    Both generate 256 tokens: lm-eval's default max_gen_toks (unmask_math sets none) is sent as
    max_tokens, a multiple of block_length 32, and `unmask eval`'s default --gen-length."""
    n = 8
    env = {**os.environ, **OFFLINE, "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets")}
    run = subprocess.run([str(Path(sys.executable).parent / "lm_eval"), "--model", "local-completions",
                          "--model_args", model_args(server, llm), "--tasks", "unmask_math",
                          "--include_path", str(TASKS_DIR), "--apply_chat_template",
                          "--limit", str(n), "--log_samples", "--output_path", str(tmp_path / "out")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    acc = assert_lm_eval_equals_unmask_eval(tmp_path / "out", tmp_path, n, ["--decoder", "threshold"])
    print(f"unmask_math acc over {n} problems: lm-eval via the server = unmask eval = {acc}")
    assert acc >= 0.5  # the embedded model scores ~84% on these problems
