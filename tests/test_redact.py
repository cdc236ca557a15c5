"""Secrets never written (issue 41, item 9): what ``redact`` keeps and what it hides."""

from __future__ import annotations

from variantbench.redact import REDACTED, redact_plan, redact_text, redact_url, redacted_keys, split_url


def test_urls_lose_user_info_and_query_values_and_keep_the_rest() -> None:
    assert redact_url("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000/v1"
    assert redact_url("http://h:1/v1#noop") == "http://h:1/v1#noop"  # NAME=URL#MODEL keeps its model
    assert (
        redact_url("https://me:pw@h/v1?api-version=2&key=s3#m")
        == "https://***@h/v1?api-version=***&key=***#m"
    )
    said = redact_text("cannot reach http://me:pw@h/x?token=s3: refused")
    assert "pw" not in said and "s3" not in said and "http://***@h/x" in said
    base, headers, query = split_url("http://me:p%40w@h:9/v1?k=v")
    assert base == "http://h:9/v1" and query == "k=v" and headers["Authorization"].startswith("Basic ")


def test_a_plan_keeps_references_and_hides_literal_secrets() -> None:
    plan = {
        "model": {"endpoint": "http://u:p@h/v1"},
        "endpoints": {"gw": {"url": "http://h/v1?key=s", "headers": {"X-Key": "literal", "X-Env": "$TOKEN"},
                             "api_key_env": "TEAM_KEY"}},
        "serve": {"api_key": "$VARIANTBENCH_API_KEY"},
        "monitor": {"url": "http://h/v1"},
    }  # fmt: skip
    out = redact_plan(plan)
    assert out["endpoints"]["gw"]["headers"] == {"X-Key": REDACTED, "X-Env": "$TOKEN"}
    assert (
        out["endpoints"]["gw"]["url"] == "http://h/v1?key=***"
        and out["model"]["endpoint"] == "http://***@h/v1"
    )
    assert out["serve"]["api_key"] == "$VARIANTBENCH_API_KEY" and out["monitor"]["url"] == "http://h/v1"
    assert redact_plan({"serve": {"api_key": "sk-live"}})["serve"]["api_key"] == REDACTED
    assert sorted(redacted_keys(out)) == ["endpoints.gw.headers.X-Key", "endpoints.gw.url", "model.endpoint"]
