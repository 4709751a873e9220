"""OpenAI request validation: accepted, refused by name, or unknown by name."""

from __future__ import annotations

from typing import Any

import pytest
from tokenwire.engine.openai_requests import ProtocolError, parse_chat_request, parse_completion_request

COMPLETION = {"model": "tiny", "prompt": "Hello"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}]}


@pytest.mark.parametrize(
    ("endpoint", "extra", "param"),
    [
        # unknown fields
        ("completions", {"foo": 1}, "foo"),
        ("chat", {"temprature": 0.5}, "temprature"),
        ("chat", {"stream": True, "stream_options": {"include_usage": True, "x": 1}},
         "stream_options.x"),
        # implemented nowhere here: refused when set to a non-default value
        ("completions", {"logit_bias": {"50256": -100}}, "logit_bias"),
        ("completions", {"frequency_penalty": 0.5}, "frequency_penalty"),
        ("completions", {"presence_penalty": -1}, "presence_penalty"),
        ("completions", {"logprobs": 2}, "logprobs"),
        ("completions", {"echo": True}, "echo"),
        ("completions", {"best_of": 3}, "best_of"),
        ("completions", {"suffix": "!"}, "suffix"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("chat", {"tool_choice": "required"}, "tool_choice"),
        ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
        ("chat", {"logprobs": True}, "logprobs"),
        ("chat", {"top_logprobs": 3}, "top_logprobs"),
        ("chat", {"reasoning_effort": "high"}, "reasoning_effort"),
        ("chat", {"store": True}, "store"),
        ("chat", {"min_p": 0.1}, "min_p"),
        ("chat", {"repetition_penalty": 1.2}, "repetition_penalty"),
        ("chat", {"stream": True, "stream_options": {"continuous_usage_stats": True}},
         "stream_options.continuous_usage_stats"),
        # n > 1 and bad values
        ("completions", {"n": 2}, "n"),
        ("chat", {"n": 3}, "n"),
        ("chat", {"temperature": 3}, "temperature"),
        ("chat", {"temperature": "hot"}, "temperature"),
        ("chat", {"top_p": 0}, "top_p"),
        ("chat", {"max_tokens": 0}, "max_tokens"),
        ("chat", {"max_tokens": True}, "max_tokens"),
        ("chat", {"stop": ["ok", ""]}, "stop"),
        ("chat", {"stop_token_ids": [-1]}, "stop_token_ids"),
        ("chat", {"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ("chat", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content[0]"),
        ("chat", {"messages": [{"role": "user", "content": "x", "tool_call_id": "1"}]},
         "messages[0].tool_call_id"),
        ("completions", {"prompt": ["one", "two"]}, "prompt"),
        ("completions", {"prompt": 5}, "prompt"),
    ],
)
def test_rejected_requests_name_the_field(endpoint: str, extra: dict[str, Any], param: str) -> None:
    base, parse = (COMPLETION, parse_completion_request) if endpoint == "completions" else (
        CHAT, parse_chat_request)
    with pytest.raises(ProtocolError) as raised:
        parse({**base, **extra})
    assert raised.value.http_status == 400
    assert raised.value.param == param
    assert param.split(".")[0].split("[")[0] in raised.value.message


@pytest.mark.parametrize(
    ("endpoint", "extra"),
    [
        # unimplemented fields at their defaults are accepted
        ("completions", {"logit_bias": {}, "frequency_penalty": 0, "presence_penalty": 0.0,
                         "logprobs": None, "echo": False, "best_of": 1, "suffix": None, "n": 1}),
        ("chat", {"tools": [], "tool_choice": "none", "response_format": {"type": "text"},
                  "logprobs": False, "top_logprobs": 0, "store": False, "n": 1,
                  "parallel_tool_calls": True, "service_tier": "auto", "modalities": ["text"]}),
        # informational fields
        ("chat", {"user": "alice", "metadata": {"team": "x"}, "safety_identifier": "s"}),
        # implemented fields, vLLM extensions included
        ("chat", {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 7, "stop": "END",
                  "stop_token_ids": [3], "ignore_eos": True, "min_tokens": 2,
                  "max_completion_tokens": 30, "stream": True,
                  "stream_options": {"include_usage": True}, "skip_special_tokens": False}),
        ("completions", {"prompt": [1, 2, 3], "max_tokens": 5, "top_k": -1}),
        ("completions", {"prompt": ["only one"]}),
    ],
)
def test_accepted_requests(endpoint: str, extra: dict[str, Any]) -> None:
    base, parse = (COMPLETION, parse_completion_request) if endpoint == "completions" else (
        CHAT, parse_chat_request)
    parse({**base, **extra})


def test_parsed_values() -> None:
    chat = parse_chat_request({**CHAT, "max_tokens": 10, "max_completion_tokens": 20,
                               "stop": "END", "top_k": -1, "stream": True,
                               "stream_options": {"include_usage": True},
                               "messages": [{"role": "developer", "content": [
                                   {"type": "text", "text": "Be "}, {"type": "text",
                                                                     "text": "brief."}]}]})
    assert chat.sampling.max_tokens == 20  # max_completion_tokens wins
    assert chat.sampling.stop == ("END",)
    assert chat.sampling.top_k == 0
    assert chat.include_usage and chat.stream
    assert chat.messages[0].role == "system" and chat.messages[0].content == "Be brief."
    assert parse_chat_request(CHAT).sampling.max_tokens is None  # up to the context
    completion = parse_completion_request(COMPLETION)
    assert completion.sampling.max_tokens == 16  # OpenAI's completions default
    assert completion.sampling.temperature is None  # the model's default applies
