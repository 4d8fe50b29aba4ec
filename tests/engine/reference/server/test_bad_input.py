"""Requests a demanding user sends, over real HTTP: each bad one gets a one-line JSON 400 (never a
500, never a traceback in the server's log), odd but valid ones are served, and the server answers
a good request the same way afterwards."""

from __future__ import annotations

import httpx
import pytest

from ....support.client import EngineClient

# A real server subprocess (one for this module).
pytestmark = pytest.mark.slow

PROMPT = "def parse(s):\n    "
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(server):
    with EngineClient(server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def reference(client):
    """A greedy answer from before any bad request, for the server to repeat after them."""
    return client.generate(PROMPT, sampling_params={"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True})


@pytest.fixture
def log_mark(server) -> int:
    """Where the server's log stands before the test: what the test adds to it is read from there."""
    return server.log_path.stat().st_size


def assert_healthy(server, client, reference, log_mark: int) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    again = client.generate(PROMPT, sampling_params={"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True})
    assert again["output_ids"] == reference["output_ids"]
    with open(server.log_path, "rb") as log:
        log.seek(log_mark)
        assert b"Traceback" not in log.read()


def _post(server, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    return httpx.post(server.url + path, json=body, timeout=60)


BAD = [
    # seeds beyond what a torch.Generator takes failed the request's first round with a 500
    ("seed past 2**64", "/generate", {"text": "x", "sampling_params": {"temperature": 1.0, "seed": 2 ** 64}}),
    ("seed below -2**63", "/generate", {"text": "x", "sampling_params": {"temperature": 1.0, "seed": -2 ** 63 - 1}}),
    ("openai seed past 2**64", "/v1/completions", {"prompt": "x", "temperature": 1.0, "seed": 2 ** 64}),
    # a lone UTF-16 surrogate is not text: the tokenizer raised (500), and a reply echoing it
    # could not be encoded (500, or a stream cut off after its 200 with a traceback in the log)
    ("surrogate in text", "/generate", b'{"text": "a\\ud800b"}'),
    ("surrogate as raw bytes", "/generate", b'{"text": "a\xed\xa0\x80b"}'),
    ("surrogate in rid", "/generate", b'{"text": "x", "rid": "\\udc00"}'),
    ("surrogate in a key", "/generate", b'{"text": "x", "sampling_params": {"\\uD800": 1}}'),
    ("surrogate in model", "/v1/completions", b'{"prompt": "x", "model": "\\ud800", "max_tokens": 2}'),
    ("surrogate in model, streamed", "/v1/completions",
     b'{"prompt": "x", "model": "\\ud800", "max_tokens": 2, "stream": true}'),
    ("surrogate in chat content", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'),
    # a misspelt speculative key ran the server's default, unnoticed
    ("unknown speculative key", "/generate", {"text": "x", "speculative": {"algorithm": "ddtree", "budgte": 4}}),
    # OpenAI fields that change the output were ignored
    ("logit_bias", "/v1/completions", {"prompt": "x", "max_tokens": 2, "logit_bias": {"5": 100}}),
    ("tools", "/v1/chat/completions",
     {"messages": CHAT, "max_tokens": 2, "tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("response_format json", "/v1/chat/completions",
     {"messages": CHAT, "max_tokens": 2, "response_format": {"type": "json_object"}}),
    ("chat_template_kwargs not an object", "/v1/chat/completions",
     {"messages": CHAT, "max_tokens": 2, "chat_template_kwargs": "x"}),
    ("chat_template_kwargs setting a reserved argument", "/v1/chat/completions",
     {"messages": CHAT, "max_tokens": 2, "chat_template_kwargs": {"add_generation_prompt": False}}),
    # usage was asked for on a reply that has no stream to carry it (OpenAI refuses it too)
    ("stream_options without stream", "/v1/completions",
     {"prompt": "x", "max_tokens": 2, "stream_options": {"include_usage": True}}),
    # a role no chat format has reached the template (or the fallback transcript) as written
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 2}),
]


@pytest.mark.parametrize("path,body", [(p, b) for _, p, b in BAD], ids=[n for n, _, _ in BAD])
def test_bad_request_gets_a_json_400_and_the_server_answers_as_before(server, client, reference, log_mark, path, body):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text[:300]
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()
    assert err["object"] == "error" and err["code"] == 400 and err["type"] == "BadRequestError"
    assert err["message"] and "\n" not in err["message"]
    assert_healthy(server, client, reference, log_mark)


def test_a_surrogate_pair_is_text(server, client, reference, log_mark):
    """Only a lone surrogate is refused: a pair escaped in JSON is one character (an emoji)."""
    r = _post(server, "/generate", b'{"text": "x = \\ud83d\\ude00", "sampling_params": {"max_new_tokens": 2}}')
    assert r.status_code == 200, r.text[:300]
    r = _post(server, "/v1/completions", b'{"prompt": "x", "model": "m\\ud83d\\ude00", "max_tokens": 2}')
    assert r.status_code == 200 and r.json()["model"] == "m\U0001F600"
    assert_healthy(server, client, reference, log_mark)


@pytest.mark.parametrize("top_p", [1e-300, 1e-50], ids=["1e-300", "1e-50"])
def test_a_tiny_top_p_samples_the_top_token(server, client, reference, log_mark, top_p):
    """A nucleus smaller than the top token's probability holds that token alone: sampling gives
    the greedy output. A top_p that rounds to 0 in the logits' dtype emptied it (a 500)."""
    for seed in (1, 2):
        got = client.generate(PROMPT, sampling_params={"max_new_tokens": 12, "temperature": 1.0, "top_p": top_p,
                                                       "seed": seed, "ignore_eos": True})
        assert got["output_ids"] == reference["output_ids"]
    assert_healthy(server, client, reference, log_mark)


def test_seeds_at_the_ends_of_the_range_are_served(server, client, reference, log_mark):
    for seed in (-2 ** 63, 2 ** 64 - 1):
        r = _post(server, "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2, "temperature": 1.0,
                                                                         "seed": seed}})
        assert r.status_code == 200, r.text[:300]
    assert_healthy(server, client, reference, log_mark)


def test_chat_template_kwargs_reach_the_template(server):
    """SGLang's chat_template_kwargs (Qwen3's enable_thinking): the tiny pair's template, as
    Qwen3's, adds an empty think block when enable_thinking is false. They were ignored."""
    def prompt_tokens(**extra) -> int:
        r = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "temperature": 0.0, **extra})
        assert r.status_code == 200, r.text[:300]
        return r.json()["usage"]["prompt_tokens"]

    plain = prompt_tokens()
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == plain
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) > plain
    assert prompt_tokens(response_format={"type": "text"}, tools=[], logit_bias={}) == plain


def test_get_model_info_as_sglang(server):
    r = httpx.get(server.url + "/get_model_info")
    assert r.status_code == 200
    info = r.json()
    assert info["is_generation"] is True
    assert info["model_path"] == httpx.get(server.url + "/server_info").json()["model_path"]
    assert info["tokenizer_path"] == info["model_path"]


@pytest.mark.parametrize("value", [10 ** 400, -(10 ** 400)])
def test_a_huge_max_new_tokens_is_refused_in_one_short_line(server, client, reference, log_mark, value):
    """JSON integers have no size limit; the refusal names the number without echoing every digit."""
    r = _post(server, "/generate", {"text": "x", "sampling_params": {"max_new_tokens": value}})
    assert r.status_code == 400, r.text[:300]
    message = r.json()["message"]
    assert "max_new_tokens" in message and "401 digits" in message and len(message) < 200
    assert_healthy(server, client, reference, log_mark)


def test_a_number_past_pythons_digit_limit_is_a_400(server, client, reference, log_mark):
    """json.loads raises a plain ValueError past 4300 digits (not a JSONDecodeError): a 500 before."""
    body = b'{"text": "x", "sampling_params": {"max_new_tokens": 1' + b"0" * 5000 + b"}}"
    r = _post(server, "/generate", body)
    assert r.status_code == 400, r.text[:300]
    assert r.json()["message"].startswith("malformed JSON: a number has more digits")
    assert_healthy(server, client, reference, log_mark)
