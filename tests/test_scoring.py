"""Prompt scoring on our server (``echo`` + ``logprobs``, vLLM's tokenizer endpoints) and the client
that reads a served variant's likelihood scores from it: the numbers are the engine's own."""

from __future__ import annotations

import math

import httpx
import pytest
from test_server import MESSAGES, PROMPT, backends, running  # noqa: F401 - the module's fixture

from variantbench.backends.base import GenerationRequest
from variantbench.backends.openai_http import OpenAIBackend
from variantbench.errors import ScoringUnavailable


def test_echo_scores_each_prompt_token_as_the_engine_does_and_tokenize_round_trips(backends) -> None:  # noqa: ANN001, F811
    engine = backends["int8"]
    with running(backends) as srv:
        ids = httpx.post(srv.url + "/tokenize", json={"model": "int8", "prompt": PROMPT}).json()
        assert ids["tokens"] == list(engine.tokenizer(PROMPT)["input_ids"]) and ids["count"] == len(
            ids["tokens"]
        )
        assert ids["max_model_len"] == 256
        back = httpx.post(srv.url + "/detokenize", json={"model": "int8", "tokens": ids["tokens"]}).json()
        assert back["prompt"] == engine.tokenizer.decode(ids["tokens"])
        templated = httpx.post(srv.url + "/tokenize", json={"model": "int8", "messages": MESSAGES}).json()[
            "tokens"
        ]
        assert templated == engine.encode(GenerationRequest("m", messages=tuple(MESSAGES)))
        info = httpx.get(srv.url + "/tokenizer_info").json()
        assert info["eos_token"] == engine.tokenizer.eos_token and info["model_max_length"] == 256

        # lm-eval's local-completions request: token ids, one new token, top-1, echoed
        body = {"model": "int8", "prompt": [ids["tokens"], ids["tokens"][:5]], "echo": True, "logprobs": 2,
                "max_tokens": 1, "temperature": 0}  # fmt: skip
        r = httpx.post(srv.url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert [c["index"] for c in choices] == [0, 1]
        lp = engine.token_log_probs(ids["tokens"])
        got = choices[0]["logprobs"]
        assert got["token_logprobs"][0] is None and len(got["token_logprobs"]) == len(ids["tokens"]) + 1
        for i, t in enumerate(ids["tokens"][1:], start=1):
            assert math.isclose(got["token_logprobs"][i], float(lp[i - 1, t]), abs_tol=1e-4)
        assert got["tokens"][-1] == engine.tokenizer.decode([int(lp[-1].argmax())])  # the greedy next token
        assert all(len(top) in (2, 3) for top in got["top_logprobs"][1:])  # the top 2, and the token itself
        assert got["text_offset"] == sorted(got["text_offset"])
        assert len(choices[1]["logprobs"]["token_logprobs"]) == 6

        # a text prompt: offsets from the tokenizer, the prompt echoed as its text
        r = httpx.post(srv.url + "/v1/completions", json={"model": "fp32", "prompt": PROMPT, "echo": True,
                                                          "logprobs": 0, "max_tokens": 0})  # fmt: skip
        text = r.json()["choices"][0]
        assert text["text"] == PROMPT and text["logprobs"]["text_offset"][0] == 0
        assert len(text["logprobs"]["token_logprobs"]) == len(ids["tokens"])

        for bad in (
            {"max_tokens": 2},
            {"stream": True},
            {"logprobs": 21},
            {"prompt": [[]]},
            {"prompt": [10**9]},
        ):
            r = httpx.post(srv.url + "/v1/completions", json={**body, **bad})
            assert r.status_code == 400 and r.json()["error"]["message"], bad
        assert httpx.post(srv.url + "/detokenize", json={"tokens": [-1]}).status_code == 400
        assert httpx.post(srv.url + "/tokenize", json={"prompt": 3}).status_code == 400


def test_a_served_variants_continuations_are_scored_as_the_engine_scores_them(backends) -> None:  # noqa: ANN001, F811
    engine = backends["fp32"]
    request = GenerationRequest("s", messages=tuple(MESSAGES))
    prompt = engine.encode(request)
    with running(backends) as srv:
        client = OpenAIBackend(srv.url, model="fp32")
        got = client.continuation_logprobs(request, ["The town has a mill.", "positive"], max_tokens=4)
        for text, scored in zip(["The town has a mill.", "positive"], got, strict=True):
            cont = engine.tokenize(text)[:4]
            lp = engine.token_log_probs(prompt + cont)
            want = [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(cont)]
            assert scored == pytest.approx(want, abs=1e-4)
        # a server that cannot score says why, in one line
        with pytest.raises(ScoringUnavailable, match="HTTP 404"):
            OpenAIBackend(srv.url, model="nope").continuation_logprobs(request, ["x"], max_tokens=4)


def test_lm_eval_on_a_served_variant_through_its_api_model(backends, tmp_path, monkeypatch) -> None:  # noqa: ANN001, F811
    """lm-eval's ``local-completions`` model over our server (its tokenizer remote, its log-likelihoods
    from echo): each document's accuracy is the engine's, and a server without the tokenizer
    endpoints is reported as not available."""
    from test_quality_decision import LETTERS, _task_folder, direct_accuracies

    from variantbench.loadgen.noop_server import ThreadServer, make_app
    from variantbench.metrics.lm_eval import LmEvalSpec, evaluate_served

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = LmEvalSpec(tasks=("vb_sentiment",), include_path=str(_task_folder(tmp_path)))
    engine = backends["fp32"]
    with running(backends) as srv:
        out = evaluate_served(srv.url, "fp32", spec)
    assert out.get("unavailable") is None, out
    docs = {d["doc_id"]: d["acc"] for d in out["docs"]["vb_sentiment"]}
    assert [docs[i] for i in range(len(LETTERS))] == direct_accuracies(
        engine.tokenizer, engine.token_log_probs
    )
    assert out["tasks"]["vb_sentiment"]["acc"] == pytest.approx(sum(docs.values()) / len(docs))
    with ThreadServer(app=make_app(tokens=2)) as bare:
        missing = evaluate_served(bare.url, "noop", spec)
    assert missing["tasks"] == {} and "tokenizer" in missing["unavailable"]
