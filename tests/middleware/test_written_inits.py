"""The dataclasses whose ``__init__`` is written out (``init=False``; compiled,
for what a stream's set-up and end cost) take what dataclass's own would:
the fields as parameters, in order, with their defaults, each set from its
own argument, ``__post_init__`` called where there is one. And the record
built that way is still a frozen value (equality, hash, ``replace``)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
from pathlib import Path

import pytest
from tokenwire.middleware import EndReason, ErrorCode, StreamRecord

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"middleware": "tokenwire.middleware", "sidecar": "tokenwire.sidecar"}


def _written_inits() -> list[tuple[str, ast.ClassDef]]:
    """Every ``@dataclass(..., init=False)`` class of the packages that defines
    ``__init__``: (its module's import name, its class node). Read from the
    source: compiled, ``__init__`` shows no signature."""
    found = []
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in tree.body:
                if isinstance(node, ast.ClassDef) and any(
                        isinstance(d, ast.Call) and ast.unparse(d.func) == "dataclass"
                        and any(k.arg == "init" and ast.literal_eval(k.value) is False for k in d.keywords)
                        for d in node.decorator_list):
                    module = ".".join([package, *path.relative_to(ROOT / folder).with_suffix("").parts])
                    found.append((module, node))
    return found


def test_the_written_inits_are_found() -> None:
    assert {node.name for _, node in _written_inits()} >= {"StreamRecord", "SSEEvent", "Peer"}


@pytest.mark.parametrize(("module", "node"), _written_inits(), ids=lambda x: getattr(x, "name", x))
def test_a_written_init_takes_the_fields_in_order(module: str, node: ast.ClassDef) -> None:
    cls = getattr(importlib.import_module(module), node.name)
    (init,) = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    names = [arg.arg for arg in init.args.args][1:]
    fields = dataclasses.fields(cls)
    assert names == [f.name for f in fields]
    assert [ast.literal_eval(d) for d in init.args.defaults] == [
        f.default for f in fields if f.default is not dataclasses.MISSING]
    assert len(names) - len(init.args.defaults) == sum(f.default is dataclasses.MISSING for f in fields)
    # Each field set once, from its own argument: object.__setattr__(self, "name", name).
    sets = [(ast.literal_eval(call.args[1]), ast.unparse(call.args[2])) for call in ast.walk(init)
            if isinstance(call, ast.Call) and ast.unparse(call.func) == "object.__setattr__"]
    assert sets == [(name, name) for name in names]
    calls_post_init = any(isinstance(c, ast.Call) and ast.unparse(c.func) == "self.__post_init__"
                          for c in ast.walk(init))
    assert calls_post_init == hasattr(cls, "__post_init__")


_DISTINCT: dict[str, object] = {
    "request_id": "r", "upstream": "u", "status": 200, "end_reason": EndReason.COMPLETE,
    "error_code": ErrorCode.UPSTREAM_TIMEOUT, "started_at": 1.0, "duration_s": 2.0, "ttfb_s": 0.5,
    "max_event_gap_s": 0.1, "event_gap_buckets": (1, 2), "events_in": 3, "events_out": 4, "bytes_out": 5,
    "heartbeats": 6, "coalesced_events": 7, "dropped_events": 8, "retries": 9, "refused_retries": 10,
    "pending_high_water_bytes": 11, "usage": {"completion_tokens": 3}, "ttft_s": 0.7, "event_gap_sum_s": 0.3,
    "content_events": 12, "stream_id": "s", "dialect": "chat.completions", "upstream_keepalives": 13,
    "tokens_counted": 14, "producer_wait_s": 0.9}
_REQUIRED = [f.name for f in dataclasses.fields(StreamRecord) if f.default is dataclasses.MISSING]


def _record(**changes: object) -> StreamRecord:
    values = {name: _DISTINCT[name] for name in _REQUIRED}
    values.update(changes)
    return StreamRecord(**values)  # type: ignore[arg-type]


def test_every_field_is_set_from_its_argument() -> None:
    fields = [f.name for f in dataclasses.fields(StreamRecord)]
    assert sorted(fields) == sorted(_DISTINCT)
    by_keyword = StreamRecord(**_DISTINCT)  # type: ignore[arg-type]
    by_position = StreamRecord(*(_DISTINCT[name] for name in fields))  # type: ignore[arg-type]
    for record in (by_keyword, by_position):
        assert {name: getattr(record, name) for name in fields} == {name: _DISTINCT[name] for name in fields}


def test_it_is_still_a_frozen_value() -> None:
    record = _record(usage={"completion_tokens": 3}, dialect="chat.completions", error_code=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.status = 500  # type: ignore[misc]
    assert record == _record(usage={"other": 1}, dialect="chat.completions", error_code=None)  # not compared
    assert hash(record) == hash(_record(dialect="chat.completions", error_code=None))
    assert dataclasses.replace(record, upstream="pod") == _record(upstream="pod", dialect="chat.completions",
                                                                  error_code=None)
    assert record.tokens_out == (3, "usage") and record.producer_wait_s == 0.0
