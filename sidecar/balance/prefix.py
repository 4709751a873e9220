"""The affinity key of a request: the start of its prompt, without a tokenizer.

``prefix-affinity`` wants requests that share a prompt prefix (a system
prompt, the first turns of a conversation) on the same pod, where the
engine's prefix cache already holds it. The key is the first
``prefix_affinity_tokens`` tokens' *worth* of the prompt, measured without a
tokenizer as ``BYTES_PER_TOKEN`` (4) bytes of UTF-8 per token: the usual
figure for English with BPE vocabularies (OpenAI's rule of thumb; Llama and
Qwen tokenizers come out close). For text with more tokens per byte (code,
CJK) the key covers fewer real tokens than N, never more than N x 4 bytes of
prompt. A prompt given as token ids (``"prompt": [1, 2, ...]``) is measured
exactly: its first N ids.

The prompt text is the chat ``messages`` in order, each as its role and its
text (string content, or the text parts of a content list), or the
completions ``prompt``. The ``model`` comes first, so two models never share
a key. A body that is not such JSON has no key (the policy falls back).
"""

from __future__ import annotations

import json
from typing import Any, Final

BYTES_PER_TOKEN: Final = 4
"""How many bytes of UTF-8 text count as one token."""

_SEPARATOR: Final = b"\x1e"  # ASCII record separator: never part of a role or of the JSON text


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content
                       if isinstance(part, dict) and isinstance(part.get("text", ""), str))
    return ""


def prefix_key(body: bytes, tokens: int) -> bytes | None:
    """The first ``tokens`` tokens' worth of the prompt in ``body``; None if it has none."""
    if tokens <= 0 or not body or body.lstrip()[:1] != b"{":
        return None
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(payload, dict):
        return None
    model = payload.get("model")
    head = (model.encode("utf-8", "replace") if isinstance(model, str) else b"") + _SEPARATOR
    limit_bytes = tokens * BYTES_PER_TOKEN
    messages = payload.get("messages")
    prompt = payload.get("prompt")
    out = bytearray()
    if isinstance(messages, list) and messages:
        for message in messages:
            if not isinstance(message, dict):
                continue
            role = message.get("role")
            out += (role if isinstance(role, str) else "").encode("utf-8", "replace") + b":"
            out += _content_text(message.get("content")).encode("utf-8", "replace") + _SEPARATOR
            if len(out) >= limit_bytes:
                break
        text = bytes(out[:limit_bytes])
    elif isinstance(prompt, str) and prompt:
        text = prompt.encode("utf-8", "replace")[:limit_bytes]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt[:tokens]):
        text = b"ids:" + ",".join(str(t) for t in prompt[:tokens]).encode()
    else:
        return None
    return head + text if text else None
