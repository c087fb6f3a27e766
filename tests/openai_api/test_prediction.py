"""Predicted Outputs over the OpenAI-compatible HTTP API of the embedded deployment (the shared
``serving`` fixture), through the official ``openai`` client: ``prediction`` on chat (a string
or text parts) and completions, ``usage.completion_tokens_details`` whole and streamed, and a
prediction type other than "content" refused with 400."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from spin.engine.prediction import PREDICTION

MESSAGES = [{"role": "user", "content": "def load(path):\n    # predicted outputs over HTTP\n"}]
PROMPT = "def save(path, rows):\n    # predicted outputs over HTTP\n"
NAMED = {"speculation": {"mode": "drafter", "drafter": PREDICTION, "k": 8}}


@pytest.fixture(scope="module")
def http(serving) -> str:
    assert serving.router.http_port, "the embedded router serves no HTTP API"
    return f"http://127.0.0.1:{serving.router.http_port}"


@pytest.fixture(scope="module")
def client(http: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{http}/v1", api_key="-", max_retries=0, timeout=120)


def _details(usage) -> tuple[int, int]:
    d = usage.completion_tokens_details
    return d.accepted_prediction_tokens, d.rejected_prediction_tokens


def test_chat_with_a_prediction_of_its_output(client: openai.OpenAI) -> None:
    kw = dict(model="target", messages=MESSAGES, max_tokens=32, temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True,
                          "speculation": {"mode": "off"}})
    off = client.chat.completions.create(**kw)
    text = off.choices[0].message.content
    assert text and _details(off.usage) == (0, 0)
    parts = [{"type": "text", "text": text[:10]}, {"type": "text", "text": text[10:]}]
    for prediction, extra in (({"type": "content", "content": text}, NAMED),
                              ({"type": "content", "content": parts}, NAMED),
                              ({"type": "content", "content": text}, {})):  # mode auto
        kw["extra_body"] = {"ignore_eos": True, "return_token_ids": True, **extra}
        out = client.chat.completions.create(**kw, prediction=prediction)
        assert out.choices[0].model_extra["token_ids"] == off.choices[0].model_extra["token_ids"]
        accepted, rejected = _details(out.usage)
        assert accepted > 0 and accepted + rejected <= out.usage.model_extra["speculation"][
            "draft_tokens"]
        if extra:
            assert accepted >= 20, out.usage  # most of the output came from the prediction


def test_completions_take_it_too_and_the_streamed_usage_reports_it(client: openai.OpenAI
                                                                   ) -> None:
    kw = dict(model="target", prompt=PROMPT, max_tokens=32, temperature=0)
    off = client.completions.create(**kw, extra_body={"ignore_eos": True,
                                                      "speculation": {"mode": "off"}})
    text = off.choices[0].text
    body = {"ignore_eos": True, "prediction": {"type": "content", "content": text}, **NAMED}
    out = client.completions.create(**kw, extra_body=body)
    assert out.choices[0].text == text
    accepted, rejected = _details(out.usage)
    assert accepted >= 20 and rejected <= 8
    chunks = list(client.completions.create(**kw, extra_body=body, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and _details(chunks[-1].usage) == (accepted, rejected)


def test_a_prediction_type_other_than_content_is_a_400(client: openai.OpenAI, http: str
                                                       ) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="target", messages=MESSAGES, max_tokens=4,
                                       prediction={"type": "image", "content": "x"})
    assert err.value.param == "prediction" and "prediction.type" in err.value.message
    body = json.dumps({"model": "target", "prompt": PROMPT, "max_tokens": 4,
                       "prediction": {"type": "file", "content": "x"}}).encode()
    req = urllib.request.Request(f"{http}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as raw:
        urllib.request.urlopen(req, timeout=60)
    assert raw.value.code == 400
    error = json.loads(raw.value.read())["error"]
    assert error["param"] == "prediction" and error["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="prediction has"):
        client.completions.create(model="target", prompt=PROMPT, max_tokens=4, extra_body={
            "prediction": {"type": "content", "content": "x" * 262145}})
