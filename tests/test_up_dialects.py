"""The openai and anthropic SDKs against a real ``tokenwire up``, as a user points them at it.

One ``tokenwire up`` for the module (``targets.tokenwire_up``: the engine on a Unix
socket, the sidecar in front of it with resume on, as ``up`` runs it), reached at
the API address its banner prints, with the key its banner shows (``up`` asks for
none; the SDKs insist on some string). Every answer is checked three ways: the
SDK's own objects, the engine's ``request finished`` log line for that request
(its ``finish_reason`` is what ``stop_reason`` / ``status`` must say), and the
sidecar's ``stream ended`` line (it named the stream's dialect and saw its end).

The tiny test model says `` the`` forever when greedy, so it never ends an answer
by itself. As in ``tests/engine/test_dialect_api.py``, the model ``up`` serves here
gets three more stop tokens (``.``, a newline, ``,``: written into a copy of its
``generation_config.json``), which greedy decoding never picks: greedy requests run
to their length limit (``response.incomplete``, ``max_tokens``), and a sampled one
(temperature 1) ends with one of them within a few tokens, which is how a test gets
a ``response.completed`` / ``end_turn`` answer, the one ``get_final_response()``
needs. The anthropic SDK sends no ``temperature``: the model's default applies,
greedy (its ``generation_config.json`` says ``do_sample: false``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from testbed.targets import child_lines, tiny_model, tokenwire_up

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

# The first run builds the tiny model (seconds here) and starts both children; the
# module's setup counts towards its first test's timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "tiny"
"""The folder name ``up --model`` serves, so the name the engine serves it under."""
PROMPT = "Tell me about the sea."
_STOP_TEXTS = (".", "\n", ",")
_LOG_WAIT_S = 10.0
"""How long a log line may lag the answer it is about (both children echo through ``up``)."""
_STOP_WAIT_S = 15.0
"""How long the engine's and the sidecar's own children may take to end after ``up`` has."""
_BANNER_API = re.compile(r"^\s*API \(sidecar[^)]*\)\s+(http://\S+)/v1\s*$")


@dataclass(frozen=True, slots=True)
class Up:
    root: str
    """The API address ``up``'s banner prints, without its ``/v1``."""
    log_path: Path

    def openai(self) -> Any:
        return openai.OpenAI(base_url=f"{self.root}/v1", api_key="none", max_retries=0, timeout=60)

    def anthropic(self) -> Any:
        return anthropic.Anthropic(base_url=self.root, api_key="none", max_retries=0, timeout=60)

    def finished(self, request_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """The sidecar's ``stream ended`` line for ``request_id`` and the engine's
        ``request finished`` line for the request it sent on, once both are logged."""
        deadline_s = time.monotonic() + _LOG_WAIT_S
        while True:
            logged = self.log_path.read_text()
            sidecar = _entries(logged, "sidecar", "stream ended", request_id=request_id)
            if sidecar:
                upstream_id = sidecar[0].get("upstream_request_id", request_id)
                engine = _entries(logged, "engine", "request finished", request_id=upstream_id)
                if engine:
                    return sidecar[0], engine[0]
            if time.monotonic() > deadline_s:
                raise AssertionError(f"no log lines for {request_id} in {_LOG_WAIT_S:g} s:\n{logged[-3000:]}")
            time.sleep(0.05)


def _entries(logged: str, child: str, msg: str, **fields: str) -> list[dict[str, Any]]:
    entries = (json.loads(line) for line in child_lines(logged, child) if line.startswith("{"))
    return [entry for entry in entries
            if entry.get("msg") == msg and all(entry.get(key) == value for key, value in fields.items())]


def _with_stop_tokens(built: Path, target: Path) -> Path:
    """A copy of the tiny model folder ``built`` at ``target`` whose generation
    config also stops at ``_STOP_TEXTS`` (their last token, as the engine test
    takes them)."""
    from tokenizers import Tokenizer  # the tokenizer's own library: no torch in this process

    shutil.copytree(built, target)
    tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
    stops = {tokenizer.encode(text).ids[-1] for text in _STOP_TEXTS}
    config_path = target / "generation_config.json"
    config = json.loads(config_path.read_text())
    eos = config["eos_token_id"]
    config["eos_token_id"] = sorted({*(eos if isinstance(eos, list) else [eos]), *stops})
    config_path.write_text(json.dumps(config, indent=2))
    return target


def _process_groups(pid: int) -> list[int]:
    """The process groups of ``pid``'s children (``up`` starts each in a session of its own)."""
    with contextlib.suppress(OSError):
        return [os.getpgid(int(child))
                for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


def _live_members(groups: list[int]) -> list[int]:
    """The processes of ``groups`` that still run (a zombie waiting for init to reap
    it, as multiprocessing's resource tracker is for a moment, has ended)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
            if int(pgrp) in groups and state not in ("Z", "X"):
                live.append(int(stat.parent.name))
    return live


def _wait_gone(groups: list[int], timeout_s: float = _STOP_WAIT_S) -> list[int]:
    """Waits for ``groups`` to end; the processes still running after ``timeout_s``."""
    deadline_s = time.monotonic() + timeout_s
    while (live := _live_members(groups)) and time.monotonic() < deadline_s:
        time.sleep(0.1)
    return live


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    pytest.importorskip("torch")
    cache_dir = tmp_path_factory.mktemp("tokenwire-cache")
    built = tiny_model(cache_dir, timeout_s=300)
    model_dir = _with_stop_tokens(built, tmp_path_factory.mktemp("model") / MODEL)
    log_path = tmp_path_factory.mktemp("up") / "up.log"
    groups: list[int] = []
    process = None
    try:
        # tokenwire_up reads up's output until its banner (up bounds its children's
        # start itself: 300 s for the engine, 30 s for the sidecar, then it exits), and
        # at the end stops it with SIGTERM, as Ctrl-C would.
        with tokenwire_up(model_dir, cache_dir, log_path) as running:
            process = running.process
            groups = _process_groups(running.pid)
            assert process.stdout is not None
            api_line = process.stdout.readline()  # the banner is printed whole, at once
            printed = _BANNER_API.match(api_line)
            assert printed is not None, f"no API line in up's banner: {api_line!r}"
            assert printed.group(1) == f"http://127.0.0.1:{running.port}"
            yield Up(printed.group(1), log_path)
        assert process.returncode == 0, log_path.read_text()[-3000:]  # "stopped"
    finally:
        if process is not None and process.poll() is None:  # tokenwire_up's wait ran out
            process.kill()
            process.wait()
        left = _wait_gone(groups)
        if left:
            for pgid in groups:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
        assert not left, f"up left processes {left} of its children's groups {groups} running"


def _request_id(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def _headers(request_id: str) -> dict[str, str]:
    return {"X-Request-Id": request_id}


def test_up_serves_the_model_by_its_folder_name(up: Up) -> None:
    assert [model.id for model in up.openai().models.list()] == [MODEL]


def test_up_api_root_is_a_404_that_points_at_the_api_and_the_playground(up: Up) -> None:
    """The first thing a person opens: the API port's ``/``. The sidecar forwards it to
    the engine like any path, and the engine's answer says where to go instead."""
    root = httpx.get(f"{up.root}/", timeout=30)
    assert root.status_code == 404
    assert root.headers["content-type"] == "text/plain; charset=utf-8"
    assert "POST /v1/chat/completions" in root.text and "playground" in root.text
    # Only ``/``: another unknown path is the bare 404 it always was.
    other = httpx.get(f"{up.root}/nothing-here", timeout=30)
    assert other.status_code == 404 and "playground" not in other.text


# -- openai-python: the Responses API ------------------------------------------------------

_OPENING = ["response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added"]
_CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.mark.parametrize("temperature", [{"temperature": 0}, {}], ids=["temperature-0", "model-default"])
def test_responses_greedy_stream_equals_the_whole_answer(up: Up, temperature: dict[str, Any]) -> None:
    """``responses.create(stream=True)`` iterates to ``response.incomplete`` with
    the text, the usage and the status of ``responses.create()`` for the same
    greedy request (explicitly, and by the model's default)."""
    client = up.openai()
    request: dict[str, Any] = {"model": MODEL, "input": PROMPT, "max_output_tokens": 12, **temperature}
    whole = client.responses.create(**request, extra_headers=_headers(whole_id := _request_id("resp-whole")))
    assert whole.object == "response" and whole.model == MODEL
    assert whole.status == "incomplete" and whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output_text
    assert whole.usage is not None and whole.usage.output_tokens == 12
    assert whole.usage.total_tokens == whole.usage.input_tokens + 12 and whole.usage.input_tokens > 0

    stream_id = _request_id("resp-stream")
    events = list(client.responses.create(**request, stream=True, extra_headers=_headers(stream_id)))
    types = [event.type for event in events]
    assert types[:4] == _OPENING
    assert types[-4:] == [*_CLOSING, "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.status == "incomplete" and final.output_text == whole.output_text
    assert final.incomplete_details is not None and final.incomplete_details.reason == "max_output_tokens"
    assert final.usage == whole.usage

    for request_id in (whole_id, stream_id):
        _, engine = up.finished(request_id)
        assert (engine["endpoint"], engine["finish_reason"]) == ("responses", "length")
        assert engine["completion_tokens"] == 12
    sidecar, _ = up.finished(stream_id)
    assert (sidecar["dialect"], sidecar["end_reason"], sidecar["status"]) == ("responses", "complete", 200)
    assert sidecar["tokens_out"] == 12


def test_responses_stream_helper_at_the_length_limit(up: Up) -> None:
    """``responses.stream()`` on a greedy request: its events run to
    ``response.incomplete`` with no error. (``get_final_response()`` is for a
    ``response.completed``: the SDK raises without one, by design.)"""
    request_id = _request_id("resp-helper-length")
    with up.openai().responses.stream(model=MODEL, input=PROMPT, max_output_tokens=8, temperature=0,
                                      extra_headers=_headers(request_id)) as stream:
        events = list(stream)
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == text == " the" * 8
    _, engine = up.finished(request_id)
    assert engine["finish_reason"] == "length"


def test_responses_stream_helper_gets_the_final_response(up: Up) -> None:
    """Sampled, so it ends on a stop token: ``response.completed``, which
    ``get_final_response()`` returns."""
    request_id = _request_id("resp-helper")
    with up.openai().responses.stream(
        model=MODEL, instructions="Answer briefly.", max_output_tokens=400, temperature=1.0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": PROMPT}]}],
        extra_headers=_headers(request_id),
    ) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.incomplete_details is None
    assert final.output_text == "".join(deltas)
    assert final.instructions == "Answer briefly." and final.model == MODEL
    assert final.usage is not None and final.usage.output_tokens >= 1
    sidecar, engine = up.finished(request_id)
    assert (engine["endpoint"], engine["finish_reason"]) == ("responses", "stop")
    assert engine["completion_tokens"] == final.usage.output_tokens
    assert (sidecar["dialect"], sidecar["end_reason"]) == ("responses", "complete")


# -- anthropic-python: the Messages API ----------------------------------------------------

_MESSAGES_REQUEST: dict[str, Any] = {"model": MODEL, "max_tokens": 10, "system": "Be brief.",
                                     "messages": [{"role": "user", "content": PROMPT}]}


def test_messages_stream_helper_and_raw_stream_equal_the_whole_message(up: Up) -> None:
    """Greedy (the SDK sends no temperature): ``messages.create()``,
    ``messages.stream()`` (``text_stream``, ``get_final_message()``) and
    ``messages.create(stream=True)`` give one text, ``max_tokens``, the same usage."""
    client = up.anthropic()
    whole_id, helper_id, raw_id = (_request_id(name) for name in ("msg-whole", "msg-helper", "msg-raw"))
    whole = client.messages.create(**_MESSAGES_REQUEST, extra_headers=_headers(whole_id))
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    assert whole.usage.output_tokens == 10 and whole.usage.input_tokens > 0
    assert whole.content[0].type == "text" and whole.content[0].text

    with client.messages.stream(**_MESSAGES_REQUEST, extra_headers=_headers(helper_id)) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == whole.content[0].text == final.content[0].text
    assert (final.stop_reason, final.stop_sequence) == ("max_tokens", None)
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens, 10)

    events = list(client.messages.create(**_MESSAGES_REQUEST, stream=True, extra_headers=_headers(raw_id)))
    types = [event.type for event in events]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"}
    start, delta = events[0], events[-2]
    assert start.message.usage.input_tokens == whole.usage.input_tokens
    assert start.message.usage.output_tokens == 0 and start.message.stop_reason is None
    assert "".join(event.delta.text for event in events[2:-3]) == whole.content[0].text
    assert (delta.delta.stop_reason, delta.delta.stop_sequence) == ("max_tokens", None)
    assert delta.usage.output_tokens == 10

    for request_id in (whole_id, helper_id, raw_id):
        _, engine = up.finished(request_id)
        assert (engine["endpoint"], engine["finish_reason"]) == ("messages", "length")
        assert (engine["prompt_tokens"], engine["completion_tokens"]) == (whole.usage.input_tokens, 10)
    for request_id in (helper_id, raw_id):
        sidecar, _ = up.finished(request_id)
        assert (sidecar["dialect"], sidecar["end_reason"], sidecar["status"]) == \
            ("anthropic.messages", "complete", 200)
        assert sidecar["usage"] == {"input_tokens": whole.usage.input_tokens, "output_tokens": 10}


def test_messages_sampled_stream_ends_its_turn(up: Up) -> None:
    """Sampled, so it ends on a stop token: ``end_turn``, the engine's ``stop``."""
    request_id = _request_id("msg-end-turn")
    with up.anthropic().messages.stream(
        model=MODEL, max_tokens=400, extra_body={"temperature": 1.0}, extra_headers=_headers(request_id),
        messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("end_turn", None)
    assert final.content[0].text == streamed
    assert final.usage.input_tokens > 0 and final.usage.output_tokens >= 1
    sidecar, engine = up.finished(request_id)
    assert (engine["finish_reason"], engine["completion_tokens"]) == ("stop", final.usage.output_tokens)
    assert (sidecar["dialect"], sidecar["end_reason"]) == ("anthropic.messages", "complete")


def test_messages_stop_sequence_streamed_and_not(up: Up) -> None:
    client = up.anthropic()
    request: dict[str, Any] = {"model": MODEL, "max_tokens": 50, "stop_sequences": ["the the"],
                               "messages": [{"role": "user", "content": PROMPT}]}
    whole = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    for message in (whole, final):
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "the the")
    assert streamed == whole.content[0].text == final.content[0].text
    assert "the the" not in streamed
    assert final.usage.output_tokens == whole.usage.output_tokens
