"""Unit tests of the OpenAI API's plain data (services/coordinator/openai_format.py and
scoring.py): the chat template, request checks and defaults, the prompts' four forms, the
scoring fields (echo, logprobs), the reply shapes and the legacy logprobs object, without a socket."""

from __future__ import annotations

import json

import pytest
import torch

from services.coordinator.openai_format import (
    OpenAIError,
    ReplyFormat,
    parse_request,
    render_chat,
    sampling_params,
    scoring_params,
)
from services.coordinator.scoring import ScoringBatch, choice_logprobs
from shared.inference import Scores


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
    assert (text.prompts, text.temperature, text.top_p, text.stream, text.stop) == (("Hello",), 1.0, 1.0, False, ())
    assert not text.scoring and (text.echo, text.logprobs) == (False, None)
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
        ("prompt", None),
        ("prompt", []),
        ("prompt", [[]]),
        ("prompt", [-1]),
        ("prompt", [True]),
        ("prompt", [1.0]),
        ("prompt", [1, "a"]),
        ("prompt", ["a", [1]]),
        ("prompt", [[1], 2]),
        ("prompt", ["a"] * 257),
        ("echo", "yes"),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", True),
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


def test_prompts_come_in_openais_four_forms():
    def prompts(prompt):
        return parse_request({"prompt": prompt}, chat=False).prompts

    assert prompts("Hi") == prompts(["Hi"]) == ("Hi",)
    assert prompts(["a", "b", ""]) == ("a", "b", "")
    assert prompts([7, 0, 255]) == ((7, 0, 255),)
    assert prompts([[1, 2], [3]]) == ((1, 2), (3,))
    with pytest.raises(OpenAIError) as refused:  # streams take one prompt
        parse_request({"prompt": ["a", "b"], "stream": True}, chat=False)
    assert refused.value.param == "prompt"


def test_echo_and_logprobs_make_a_scoring_request_of_at_most_one_token():
    lm_eval = parse_request(
        {"prompt": [[1, 2, 3]], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0, "seed": 1234},
        chat=False,
    )
    assert lm_eval.scoring and (lm_eval.echo, lm_eval.logprobs, lm_eval.max_tokens) == (True, 1, 1)
    assert scoring_params(lm_eval, [3], 128).max_tokens == 1
    assert scoring_params(parse_request({"prompt": "x", "echo": True, "max_tokens": 0}, chat=False), [1], 128) is None
    assert parse_request({"prompt": "x", "logprobs": 0, "max_tokens": 1}, chat=False).scoring
    for body, param in [
        ({"echo": True}, "echo"),  # the default max_tokens, 16: more than a scoring pass draws
        ({"logprobs": 2, "max_tokens": 2}, "logprobs"),
        ({"echo": True, "max_tokens": 1, "stream": True}, "stream"),
        ({"logprobs": 1, "max_tokens": 0}, "max_tokens"),  # 0 needs echo
        ({"echo": True, "max_tokens": -1}, "max_tokens"),
    ]:
        with pytest.raises(OpenAIError) as refused:
            parse_request({"prompt": "x", **body}, chat=False)
        assert (refused.value.status, refused.value.param) == (400, param), body
    for field, value in [("echo", True), ("logprobs", True)]:  # chat keeps refusing them
        with pytest.raises(OpenAIError) as refused:
            parse_request({"messages": [{"role": "user", "content": "x"}], field: value}, chat=True)
        assert refused.value.param == field
    with pytest.raises(OpenAIError) as refused:  # a prompt longer than the context
        scoring_params(lm_eval, [3, 129], 128)
    assert (refused.value.param, refused.value.code) == ("prompt", "context_length_exceeded")
    assert "prompt 1" in refused.value.message


def test_a_batch_is_right_padded_and_each_position_targets_the_next_token():
    batch = ScoringBatch.of([[5, 6, 7], [8]], pad_id=0)
    assert batch.ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch.targets.tolist() == [[6, 7, -1], [-1, -1, -1]]
    assert batch.logits_at == [2, 0] and batch.lengths == (3, 1)


def test_the_legacy_logprobs_object_lists_the_prompt_then_the_drawn_token():
    # one row of 3 prompt tokens; 2 alternatives per position; vocabulary of 4 tokens named a..d
    scores = Scores(
        logits=torch.tensor([[0.0, 3.0, 1.0, 0.0]]),
        target_logprobs=torch.tensor([[-0.5, -1.5, 0.0]]),
        top_ids=torch.tensor([[[1, 0], [2, 3], [1, 2]]]),
        top_logprobs=torch.tensor([[[-0.25, -2.0], [-0.75, -1.0], [-0.125, -2.5]]]),
    )
    text = "abcd".__getitem__
    decode = lambda ids: "".join(text(t) for t in ids)  # noqa: E731
    echoed = choice_logprobs(scores, 0, [0, 1, 2], [1], echo=True, token_text=text, decode=decode)
    assert echoed == {
        "tokens": ["a", "b", "c", "b"],
        "token_logprobs": [None, -0.5, -1.5, -0.125],  # the drawn token: its top value, the same number
        "top_logprobs": [None, {"b": -0.25, "a": -2.0}, {"c": -0.75, "d": -1.0}, {"b": -0.125, "c": -2.5}],
        "text_offset": [0, 1, 2, 3],
    }
    drawn = choice_logprobs(scores, 0, [0, 1, 2], [3], echo=False, token_text=text, decode=decode)  # not in the top 2
    assert drawn["tokens"] == ["d"] and drawn["text_offset"] == [0]
    assert drawn["token_logprobs"][0] == pytest.approx(float(torch.log_softmax(scores.logits[0], -1)[3]))
    # alternatives of one text keep the likelier; offsets count the decoded text, not the token's name
    same = choice_logprobs(scores, 0, [0, 1, 2], [], echo=True, token_text=lambda t: "bytes:x", decode=decode)
    assert same["top_logprobs"][1] == {"bytes:x": -0.25} and same["text_offset"] == [0, 1, 2]


def test_a_reply_has_one_choice_per_prompt_in_order():
    reply = ReplyFormat(False, "run", "cmpl-1", 7).whole_choices(
        [("a", "length", None), ("b", "stop", {"tokens": ["b"]})], {"prompt_tokens": 2}
    )
    assert [(c["index"], c["text"], c["finish_reason"], c["logprobs"]) for c in reply["choices"]] == [
        (0, "a", "length", None),
        (1, "b", "stop", {"tokens": ["b"]}),
    ]
