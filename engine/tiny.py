"""The embedded ``tiny`` model: built locally from bundled text, once, then cached.

``ensure_tiny_model()`` returns the path of an ordinary Hugging Face model
folder (``model.safetensors``, ``config.json``, ``tokenizer.json``, a chat
template). The first call builds it:

1. a byte-level BPE tokenizer is trained on the prose in ``engine/data/*.txt``
   (written for this package, so nothing is downloaded, ever);
2. a small Llama-shaped ``LlamaForCausalLM`` is trained on the same text for a
   few hundred steps, enough that greedy output looks like English;
3. the folder is written under a temporary name and renamed into place.

Every step is seeded, so the same spec gives the same weights on the same
torch build. The folder name carries a digest of the spec and the corpus, so a
changed spec or corpus builds a new folder instead of reusing a stale one. A
file lock serialises concurrent builders (two servers starting at once build
once); the rename makes a half-written folder impossible to observe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

TINY_FORMAT_VERSION = 3
"""Bump when the build recipe changes in a way the spec does not capture."""

END_OF_TEXT = "<|endoftext|>"
END_OF_TURN = "<|end|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (END_OF_TEXT, END_OF_TURN, *ROLE_TOKENS)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@dataclass(frozen=True, slots=True)
class TinySpec:
    """Shape and training recipe of the tiny model.

    The defaults build in roughly half a minute on two CPU cores; tests pass a
    smaller ``train_steps`` because they only need *a* model, not a fluent one.
    """

    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 3
    num_heads: int = 2
    max_position_embeddings: int = 8192
    """Long enough for the benchmark's 4,000-token prompt."""
    train_steps: int = 600
    batch_size: int = 8
    sequence_length_tokens: int = 128
    learning_rate: float = 3e-3
    seed: int = 0

    def digest(self, corpus_digest: str) -> str:
        """A short hash naming this spec trained on this corpus."""
        payload = json.dumps(
            {"spec": dataclasses.asdict(self), "corpus": corpus_digest,
             "format": TINY_FORMAT_VERSION},
            sort_keys=True,
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    """``$TOKENWIRE_CACHE_DIR`` if set, else ``~/.cache/tokenwire``."""
    configured = os.environ.get("TOKENWIRE_CACHE_DIR")
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "tokenwire"


def load_corpus_documents() -> list[list[str]]:
    """The bundled training text: one list of paragraphs per file, in a stable order."""
    data = resources.files("tokenwire.engine").joinpath("data")
    documents: list[list[str]] = []
    for entry in sorted(data.iterdir(), key=lambda item: item.name):
        if not entry.name.endswith(".txt"):
            continue
        text = entry.read_text(encoding="utf-8")
        documents.append([p.strip() for p in text.split("\n\n") if p.strip()])
    return documents


def load_corpus_paragraphs() -> list[str]:
    """The bundled training text, one string per paragraph, in a stable order."""
    return [paragraph for document in load_corpus_documents() for paragraph in document]


def tiny_model_path(spec: TinySpec | None = None, cache_dir: Path | None = None) -> Path:
    """Where the tiny model described by ``spec`` is (or will be) built; it is
    there once the folder holds ``config.json``."""
    spec = spec or TinySpec()
    documents = load_corpus_documents()
    corpus_digest = hashlib.sha256(
        "\f".join("\n\n".join(document) for document in documents).encode()).hexdigest()
    return (cache_dir or default_cache_dir()) / f"tiny-{spec.digest(corpus_digest)}"


def ensure_tiny_model(
    spec: TinySpec | None = None, cache_dir: Path | None = None, *, log: bool = True,
    say: Callable[[str], None] | None = None,
) -> Path:
    """Return the folder of the tiny model described by ``spec``, building it if needed.

    A build reports its progress: ``log`` draws a bar on stderr (for a
    terminal); ``say``, when given instead, gets one line per stage and per
    tenth of the training (for a log that is not a terminal's, as the engine's
    JSON logs)."""
    spec = spec or TinySpec()
    cache_dir = cache_dir or default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    documents = load_corpus_documents()
    target = tiny_model_path(spec, cache_dir)
    if (target / "config.json").exists():
        return target
    with _exclusive_lock(cache_dir / f"{target.name}.lock"):
        # Another process may have finished the build while we waited.
        if (target / "config.json").exists():
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=cache_dir))
        try:
            started_s = time.monotonic()
            if say is not None:
                say(f"building the tiny model (first run only, about a minute) at {target}")
            bar = _ProgressBar(spec.train_steps, say) if log or say is not None else None
            _build(spec, documents, staging, bar)
            os.rename(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        built = f"built the tiny model in {time.monotonic() - started_s:.1f}s at {target}"
        if say is not None:
            say(built)
        elif log:
            print(f"tokenwire: {built}", flush=True)
    return target


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _chat_example(document: list[str], index: int) -> str:
    """One chat turn: a general request (``_OPEN_REQUESTS``) answered by paragraph
    ``index`` and the two after it.

    So any question, seen or not, gets a few hundred tokens of prose. (Asking
    with a paragraph's first sentence instead taught the model that a turn
    can be one sentence long: unseen questions got one-line answers.) The
    answer ends with the end-of-turn token, so chat completions stop on their
    own instead of at ``max_tokens``.
    """
    request = _OPEN_REQUESTS[(index // 2) % len(_OPEN_REQUESTS)]
    answer = "\n\n".join(document[index : index + _CHAT_ANSWER_PARAGRAPHS])
    return f"<|user|>\n{request}{END_OF_TURN}\n<|assistant|>\n{answer}{END_OF_TURN}\n"


_OPEN_REQUESTS = (
    "Tell me something interesting.", "Write a few paragraphs.", "Tell me about the world.",
    "What do you know?", "Hello, say something.", "Tell me more.", "Describe something you like.",
    "Can you explain something to me.",
)
_CHAT_ANSWER_PARAGRAPHS = 3


def _build(spec: TinySpec, documents: list[list[str]], folder: Path, bar: _ProgressBar | None) -> None:
    # Imported here: building is rare, and these imports cost seconds.
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    paragraphs = [paragraph for document in documents for paragraph in document]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(paragraphs, trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        additional_special_tokens=[END_OF_TURN, *ROLE_TOKENS],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = spec.max_position_embeddings
    end_of_text_id = tokenizer.token_to_id(END_OF_TEXT)
    end_of_turn_id = tokenizer.token_to_id(END_OF_TURN)
    assert end_of_text_id is not None and end_of_turn_id is not None  # special tokens

    # Whole files as documents (paragraphs joined, one end-of-text at the end),
    # so a continuation runs on for paragraphs instead of stopping after one;
    # every other paragraph also starts a chat turn (see _chat_example).
    stream: list[int] = []
    for document in documents:
        stream.extend(tokenizer.encode("\n\n".join(document)).ids)
        stream.append(end_of_text_id)
        for index in range(0, len(document), 2):
            stream.extend(tokenizer.encode(_chat_example(document, index)).ids)
            stream.append(end_of_text_id)

    torch.manual_seed(spec.seed)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=[end_of_text_id, end_of_turn_id],
        pad_token_id=end_of_text_id,
    )
    model = LlamaForCausalLM(config)
    _train(model, stream, spec, bar)
    model.generation_config.eos_token_id = [end_of_text_id, end_of_turn_id]
    model.generation_config.pad_token_id = end_of_text_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(folder, safe_serialization=True)
    # Greedy unless a request asks otherwise: the engine reads do_sample from
    # this file (``loader.py``), and this model's sampled text reads far worse
    # than its greedy text. transformers leaves defaults out of the file.
    generation_file = folder / "generation_config.json"
    generation = json.loads(generation_file.read_text())
    generation["do_sample"] = False
    generation_file.write_text(json.dumps(generation, indent=2) + "\n")
    fast.save_pretrained(folder)
    (folder / "tokenwire_tiny.json").write_text(
        json.dumps({"spec": dataclasses.asdict(spec), "format": TINY_FORMAT_VERSION}, indent=2)
    )


class _ProgressBar:
    """``tokenwire: building the tiny model [#####.....] 50% ...`` on stderr, redrawn
    in place on a terminal; a line per tenth elsewhere, or to ``say`` when given."""

    def __init__(self, total_steps: int, say: Callable[[str], None] | None = None, width: int = 30) -> None:
        self._total = max(1, total_steps)
        self._width = width
        self._say = say
        self._started_s = time.monotonic()
        self._drawn_s = 0.0
        self._interactive = say is None and sys.stderr.isatty()
        self._last_percent = -10

    def update(self, step: int, loss: float) -> None:
        done = step / self._total
        now_s = time.monotonic()
        percent = int(100 * done)
        # Redraw a few times a second on a terminal; in a log, a line per 10 %.
        if self._interactive:
            if now_s - self._drawn_s < 0.2 and step < self._total:
                return
        elif percent < self._last_percent + 10 and step < self._total:
            return
        self._drawn_s, self._last_percent = now_s, percent
        filled = int(self._width * done)
        elapsed_s = now_s - self._started_s
        left_s = elapsed_s / done - elapsed_s if done > 0 else 0.0
        line = (f"building the tiny model (first run only) "
                f"[{'#' * filled}{'.' * (self._width - filled)}] {percent:3d}% "
                f"loss {loss:.2f}, {elapsed_s:.0f}s, ~{left_s:.0f}s left")
        if self._say is not None:
            self._say(line)
            return
        line = "tokenwire: " + line
        end = "\n" if step >= self._total or not self._interactive else ""
        print(("\r" if self._interactive else "") + line, end=end, file=sys.stderr, flush=True)


def _train(model: object, stream: list[int], spec: TinySpec, bar: _ProgressBar | None) -> None:
    import torch

    assert isinstance(model, torch.nn.Module)
    rng = random.Random(spec.seed)
    tokens = torch.tensor(stream, dtype=torch.long)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=0.01)
    warmup_steps = max(1, spec.train_steps // 10)
    # One thread: the result does not depend on the machine's core count (float
    # reductions split across threads round differently), and on a small busy
    # box several threads fighting over two cores made the build 3x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _train_steps(model, tokens, spec, optimizer, rng, warmup_steps, bar)
    finally:
        torch.set_num_threads(threads)
    model.eval()


def _train_steps(model: Any, tokens: Any, spec: TinySpec, optimizer: Any, rng: random.Random,
                 warmup_steps: int, bar: _ProgressBar | None) -> None:
    import torch

    window = spec.sequence_length_tokens
    stream_length = int(tokens.shape[0])
    model.train()
    for step in range(spec.train_steps):
        if step < warmup_steps:
            scale = (step + 1) / warmup_steps
        else:
            progress = (step - warmup_steps) / max(1, spec.train_steps - warmup_steps)
            scale = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        for group in optimizer.param_groups:
            group["lr"] = spec.learning_rate * scale
        starts = [rng.randrange(0, stream_length - window - 1) for _ in range(spec.batch_size)]
        batch = torch.stack([tokens[s : s + window] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if bar is not None:
            bar.update(step + 1, loss.item())
