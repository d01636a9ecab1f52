"""Stored Responses: the OpenAI Responses API's server-side state (``store``,
``previous_response_id``, ``item_reference``, ``GET``/``DELETE /v1/responses/{id}``).

Why it exists: clients that let the server keep the conversation (the Agents SDK with
``previous_response_id``, the Vercel AI SDK, which sends earlier items back as
``item_reference``) fail against a server that keeps nothing. The store holds each answered
response with the conversation it answered, per tenant, for a bounded time and size. One
interface (``base``), one backend per module (``memory``, ``redis_store``), and the table of
names (``registry``).
"""
