"""Shared fixtures: a tiny random-weight Llama with grouped-query attention and a real tokenizer.

Built in-process (no network, seconds): the code paths are the real ones, only the weights are
random. Session-scoped so every test reuses the same folders.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from variantbench.models.tiny import tiny_tokenizer


def build_tiny_llama(folder: Path, tie: bool = False, seed: int = 0, layers: int = 2) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=tie,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the default init: logits with clear winners
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_tied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-tied"), tie=True, seed=1)


@pytest.fixture(scope="session", autouse=True)
def _private_history(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Runs made by the tests go to a history of their own, never the user's <cache>/history.db."""
    import os

    os.environ["VARIANTBENCH_HISTORY"] = str(tmp_path_factory.mktemp("history") / "history.db")


CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                  "--disable-background-networking", "--disable-component-update"]  # fmt: skip


def _find_chromium() -> str | None:
    import os
    import shutil

    for candidate in (os.environ.get("VARIANTBENCH_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser"), shutil.which("google-chrome")):  # fmt: skip
        if candidate and os.path.exists(candidate):
            return candidate
    return None


@pytest.fixture
def browser():  # noqa: ANN201 - a playwright Browser
    """Debian's chromium driven by Playwright (by its executable path: no browser download).

    Installed with apt when missing and we may (root, apt-get present), so the README's test command
    works on a fresh machine; `.ci/run` installs it first and sets VARIANTBENCH_REQUIRE_BROWSER=1,
    so in CI a missing browser fails instead of skipping. One per test: Playwright's sync API runs
    an event loop on this thread while it is open, and every later asyncio.run() in the session
    would fail ("cannot be called from a running event loop")."""
    import os
    import shutil
    import subprocess

    path = _find_chromium()
    if path is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], capture_output=True, timeout=900,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})  # fmt: skip
        path = _find_chromium()
    if path is None:
        if os.environ.get("VARIANTBENCH_REQUIRE_BROWSER"):
            pytest.fail("no chromium: install Debian's chromium package (apt-get install chromium)")
        pytest.skip("no chromium browser (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=CHROMIUM_FLAGS)
        yield b
        b.close()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVER_PIDS: dict[str, int] = {}  # a served() server's process id, by its URL


@contextmanager
def served(model_dir: Path, variants: str = "fp32") -> Iterator[str]:
    """``variantbench serve`` in a process of its own on 127.0.0.1 (a real server, its own CPU time);
    yields its OpenAI base URL once /v1/models answers."""
    import subprocess
    import sys
    import time
    import urllib.request

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "variantbench", "serve", "--model", str(model_dir),
                             "--variants", variants, "--port", str(port), "--max-len", "512"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 120
    try:
        while True:
            try:
                urllib.request.urlopen(url + "/models", timeout=1).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(
                        f"the server did not start: {proc.stderr.read()[-2000:] if proc.poll() is not None else 'timeout'}"
                    )
                time.sleep(0.5)
        SERVER_PIDS[url] = proc.pid
        yield url
    finally:
        SERVER_PIDS.pop(url, None)
        proc.terminate()
        proc.wait(timeout=30)
