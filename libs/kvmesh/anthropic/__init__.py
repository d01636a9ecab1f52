"""The Anthropic Messages API layer of kvmesh (``/v1/messages``, ``/v1/messages/count_tokens``).

Why it exists: Claude Code, the agent whose traffic kvmesh serves, speaks the
Anthropic Messages API, not OpenAI's. This package turns a Messages request
into the OpenAI-style chat conversation the model's chat template renders
(the same conversion vLLM's own ``/v1/messages`` makes, so both render the same
prompt) and turns the engine's answer back into Anthropic's message, usage,
stop reason, error shape and event stream. It does no I/O; a service (the
router) reads the body, routes the request and calls these builders.

Modules, one job each: ``errors`` (error shape, status -> type), ``requests``
(validation and conversion to a chat request), ``stops`` (stop sequences on
streamed text), ``responses`` (usage, stop reason, tool calls, the message),
``stream`` (the event sequence of a streamed message).
"""
