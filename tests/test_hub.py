"""Hub ids: `LLM("org/name")` and `--model org/name` download through huggingface_hub from a local
HTTP server standing in for the hub (HF_ENDPOINT), answering the endpoints that library calls:
the revision's model info, the file tree, and HEAD/GET of each file with the headers it checks
(X-Repo-Commit, ETag, Content-Length). Each run is a fresh process with its own HF_HOME, since
huggingface_hub reads its settings when imported."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from unmask.api import DEFAULT_MODEL
from unmask.hub import looks_like_hub_id

ROOT = Path(__file__).resolve().parents[1]
REPO = "unmask-test/toy"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub(BaseHTTPRequestHandler):
    """The shipped model's folder (MODEL_CARD.md too, which the download must skip) as REPO."""

    files = {p.name: p for p in sorted(DEFAULT_MODEL.iterdir()) if p.is_file()}
    requested: list[str] = []

    def log_message(self, *args: object) -> None:  # keep pytest's output clean
        pass

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        path = self.path.split("?")[0]
        self.requested.append(f"{self.command} {path}")
        if path == f"/api/models/{REPO}/revision/main":
            siblings = [{"rfilename": n} for n in self.files]
            return self._json({"id": REPO, "sha": COMMIT, "siblings": siblings}, body)
        if path == f"/api/models/{REPO}/tree/{COMMIT}":
            tree = [{"type": "file", "path": n, "size": p.stat().st_size, "oid": self._sha1(p)}
                    for n, p in self.files.items()]
            return self._json(tree, body)
        prefix = f"/{REPO}/resolve/{COMMIT}/"
        if path.startswith(prefix) and path[len(prefix):] in self.files:
            data = self.files[path[len(prefix):]].read_bytes()
            self.send_response(200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)
            return
        gated = "gated/" in path
        self.send_response(403 if gated else 404)
        self.send_header("X-Error-Code", "GatedRepo" if gated else "RepoNotFound")
        self.send_header("Content-Type", "application/json")
        message = json.dumps({"error": "gated" if gated else "Repository not found"}).encode()
        self.send_header("Content-Length", str(len(message)))
        self.end_headers()
        if body:
            self.wfile.write(message)

    def _json(self, obj: object, body: bool) -> None:
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    @staticmethod
    def _sha1(p: Path) -> str:
        return hashlib.sha1(p.read_bytes()).hexdigest()


@pytest.fixture
def hub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    FakeHub.requested = []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def run(code_or_argv: str | list[str], home: Path, endpoint: str, offline: bool = False):
    """A fresh Python process with HF_HOME `home` and HF_ENDPOINT `endpoint`."""
    env = {**os.environ, "HF_HOME": str(home), "HF_ENDPOINT": endpoint, "PYTHONPATH": str(ROOT),
           "OMP_NUM_THREADS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    env.pop("HF_HUB_CACHE", None)
    env.pop("HF_TOKEN", None)
    env["HF_HUB_OFFLINE"] = "1" if offline else "0"
    argv = (["-c", code_or_argv] if isinstance(code_or_argv, str)
            else ["-m", "unmask.cli", *code_or_argv])
    return subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True,
                          timeout=300)


GENERATE = """
import unmask
llm = unmask.LLM({name!r})
print(llm.path)
print(llm.generate(["What is 47 + 38?"], "exact", gen_length=64, block_length=32)[0].text)
"""


def test_a_hub_id_downloads_the_loaders_files_and_generates_as_the_folder_does(hub, tmp_path) -> None:
    got = run(GENERATE.format(name=REPO), tmp_path, hub)
    assert got.returncode == 0, got.stderr
    folder, text = got.stdout.split("\n", 1)
    snapshot = tmp_path / "hub" / "models--unmask-test--toy" / "snapshots" / COMMIT
    assert Path(folder) == snapshot
    assert sorted(p.name for p in snapshot.iterdir()) == [  # generation_config.json: chat's
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]
    assert f"GET /{REPO}/resolve/{COMMIT}/model.safetensors" in FakeHub.requested
    assert not any("MODEL_CARD" in r for r in FakeHub.requested)  # only what the loader reads
    import unmask

    local = unmask.LLM().generate(["What is 47 + 38?"], "exact", gen_length=64, block_length=32)
    assert text.strip() == local[0].text.strip()

    # the cache now answers offline, without the hub
    FakeHub.requested = []
    again = run(GENERATE.format(name=REPO), tmp_path, hub, offline=True)
    assert again.returncode == 0, again.stderr
    assert again.stdout == got.stdout and FakeHub.requested == []


@pytest.mark.parametrize(("repo", "offline", "expect"), [
    (REPO, True, "not in the Hugging Face cache"),  # an empty cache, HF_HUB_OFFLINE=1
    ("nobody/no-such-model", False, "has no model 'nobody/no-such-model'"),
    ("gated/model", False, "gated model"),
])
def test_a_hub_id_that_cannot_download_is_one_line_exit_2(hub, tmp_path, repo, offline, expect) -> None:
    got = run(["generate", "hi", "--model", repo], tmp_path, hub, offline=offline)
    assert got.returncode == 2, got.stderr
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("unmask: error: ") and expect in lines[0], lines
    assert "HF_HUB_OFFLINE" in lines[0] if offline else hub in lines[0]


def test_an_unreachable_hub_is_one_line_exit_2(tmp_path) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    got = run(["generate", "hi", "--model", REPO], tmp_path, endpoint)
    assert got.returncode == 2, got.stderr
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot be reached" in lines[0], lines


@pytest.mark.parametrize(("name", "hub_id"), [
    ("GSAI-ML/LLaDA-8B-Instruct", True), ("Dream-org/Dream-v0-Instruct-7B", True),
    ("a/b/c", False), ("./x", False), ("/abs/path", False), ("../up", False), ("x/..", False),
    ("~/models", False), ("org/", False), ("org--a/b", False), ("x", False),
])
def test_which_names_are_hub_ids(name: str, hub_id: bool) -> None:
    assert looks_like_hub_id(name) is hub_id


def test_show_of_a_hub_id_downloads_no_weights(hub, tmp_path) -> None:
    got = run(["show", REPO, "--json"], tmp_path, hub)
    assert got.returncode == 0, got.stderr
    report = json.loads(got.stdout)
    assert report["family"] == "llada" and report["parameters"] == 1_377_408
    assert report["chat_template"] is True
    assert not any("model.safetensors" in r for r in FakeHub.requested)
    assert f"GET /{REPO}/resolve/{COMMIT}/config.json" in FakeHub.requested


def test_shipped_names_resolve_and_a_folder_of_that_name_wins(tmp_path, monkeypatch) -> None:
    from unmask.hub import DEFAULT_NAME, SHIPPED, resolve_model

    assert set(SHIPPED) == {"unmask-llada", "unmask-sdar"} and SHIPPED[DEFAULT_NAME] == DEFAULT_MODEL
    for name, folder in SHIPPED.items():
        assert resolve_model(name) == folder and (folder / "model.safetensors").is_file()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "unmask-sdar").mkdir()
    assert resolve_model("unmask-sdar") == Path("unmask-sdar")


def test_generate_with_a_shipped_name_and_an_unknown_one(capsys) -> None:
    from unmask.cli import main

    assert main(["generate", "--model", "unmask-llada", "--gen-length", "32", "--json",
                 "What is 2 + 3?"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["text"]
    assert main(["generate", "--model", "unmask-sdra", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "unmask-sdra does not exist" in err and "unmask-llada, unmask-sdar" in err
