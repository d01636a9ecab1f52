"""OpenAI's Responses API (``/v1/responses``) over kvmesh's chat path: request conversion, answers, events."""
