"""tokenwire.engine: the embedded OpenAI-compatible engine.

Modules, one idea each:

- ``tiny``: builds the default ``tiny`` model from bundled text, once, cached;
- ``loader``: loads any local Hugging Face causal-LM folder;
- ``backend``: the narrow add / cancel / step interface;
- ``scheduler`` (+ ``batch``): continuous batching over plain forward passes;
- ``sampling``, ``detok``: per-request sampling, incremental detokenisation;
- ``runner``: the engine thread and its one hand-off per step to asyncio;
- ``scheduler_process``: that thread in a process of its own, behind two pipes (the
  default with two CPUs or more);
- ``service``, ``api``, ``streaming``, ``metrics``: the HTTP side, one path for every API;
- ``dialect`` (+ ``request_fields``): what an API dialect is; ``openai_dialect`` (+
  ``openai_requests``), ``responses_api``, ``messages_api``: OpenAI Chat Completions and
  Completions, the OpenAI Responses API, the Anthropic Messages API;
- ``server``: ``tokenwire engine`` / ``python -m tokenwire.engine.server``; ``loading``: its
  answers while the model loads (``/healthz`` 200, ``/readyz`` 503); ``probe``: an exec
  probe of an engine on a Unix socket.
"""
