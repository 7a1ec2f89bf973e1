"""Unit tests of the OpenAI API's plain data (services/coordinator/openai_format.py): the chat
template, request checks and defaults, and the reply shapes, without a socket."""

from __future__ import annotations

import json

import pytest

from services.coordinator.openai_format import OpenAIError, ReplyFormat, parse_request, render_chat, sampling_params


def test_the_chat_template_is_one_line_per_message_then_the_assistants_turn():
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "Again"},
    ]
    assert render_chat(messages) == "system: Be brief.\nuser: Hi there\nassistant: \nuser: Again\nassistant:"
    req = parse_request({"messages": messages, "stop": "."}, chat=True)
    assert req.stop == ("\nuser:", ".") and req.prompt_param == "messages"


def test_defaults_follow_openai_and_max_tokens_is_bounded_by_the_context():
    text = parse_request({"prompt": ["Hello"]}, chat=False)
    assert (text.prompt, text.temperature, text.top_p, text.stream, text.stop) == ("Hello", 1.0, 1.0, False, ())
    assert sampling_params(text, 5, 128).max_tokens == 16  # completions: 16
    assert sampling_params(text, 120, 128).max_tokens == 8  # ... or what the context leaves
    chat = parse_request({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 7}, chat=True)
    assert chat.max_tokens_param == "max_completion_tokens" and sampling_params(chat, 5, 128).max_tokens == 7
    assert (
        sampling_params(parse_request({"messages": [{"role": "user", "content": "x"}]}, chat=True), 28, 128).max_tokens
        == 100
    )  # chat: the rest
    for prompt_tokens, max_tokens, param in ((5, 124, "max_tokens"), (128, None, "prompt")):
        with pytest.raises(OpenAIError) as refused:
            sampling_params(parse_request({"prompt": "x", "max_tokens": max_tokens}, chat=False), prompt_tokens, 128)
        assert (refused.value.status, refused.value.param) == (400, param)


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 2),
        ("echo", True),
        ("best_of", 3),
        ("logprobs", 5),
        ("presence_penalty", 0.5),
        ("temperature", -0.1),
        ("temperature", True),
        ("top_p", 0),
        ("seed", -1),
        ("seed", 1.5),
        ("stop", ""),
        ("stop", ["a"] * 5),
        ("max_tokens", 0),
        ("max_tokens", "8"),
        ("stream", 1),
        ("stream_options", {"include_usage": "yes"}),
        ("prompt", [1, 2]),
        ("prompt", ["a", "b"]),
        ("prompt", None),
    ],
)
def test_bad_fields_are_refused_naming_the_field(field, value):
    with pytest.raises(OpenAIError) as refused:
        parse_request({"prompt": "x", field: value}, chat=False)
    body = refused.value.body()["error"]
    assert refused.value.status == 400 and body["param"] == field and body["type"] == "invalid_request_error"


def test_replies_have_openais_shapes():
    text, chat = ReplyFormat(False, "run", "cmpl-1", 7), ReplyFormat(True, "run", "chatcmpl-1", 7)
    usage = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert text.whole("abc", "length", usage) == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 7,
        "model": "run",
        "choices": [{"index": 0, "text": "abc", "logprobs": None, "finish_reason": "length"}],
        "usage": usage,
    }
    assert chat.whole("abc", "stop", usage)["choices"][0]["message"] == {"role": "assistant", "content": "abc"}

    def data(event: bytes) -> dict:
        assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n") == 2
        return json.loads(event[6:])

    assert data(chat.chunk("a", first=True))["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    assert data(chat.chunk("b"))["object"] == "chat.completion.chunk"
    last = data(chat.chunk(None, "stop"))["choices"][0]
    assert (last["delta"], last["finish_reason"]) == ({}, "stop")
    assert data(text.chunk("x\n\ny"))["choices"][0] == {
        "index": 0,
        "text": "x\n\ny",
        "logprobs": None,
        "finish_reason": None,
    }
    assert data(text.usage_chunk(usage))["choices"] == []
