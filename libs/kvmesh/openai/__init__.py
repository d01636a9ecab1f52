"""The one OpenAI-compatible HTTP layer of kvmesh, shared by the router's and the worker's FastAPI apps.

Why it exists: the router and every worker answer the same OpenAI API
(``/v1/completions``, ``/v1/chat/completions``), so the request rules, the
error shape, the SSE framing and the response/usage objects live here once;
each service only turns a parsed request into its own call (router: route to
a worker over gRPC; worker: run its engine) and adds its own ``kvmesh`` key.

Modules, one job each: ``errors`` (error shape, exception -> JSON response),
``requests`` (body reading, parsing and validation), ``usage`` (usage object),
``responses`` (response and chunk builders), ``sse`` (event-stream framing).
"""
