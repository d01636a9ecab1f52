"""``kvmesh up --reasoning-parser``: the local stack's sim workers answer as a reasoning model, and the
router's doors return the reasoning apart from the answer (the official ``openai`` client reads it)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from kvmesh_tools.stack.launcher import LocalStack, StackConfig

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    st = LocalStack(StackConfig(decode_workers=1, prefill_workers=0, redis="off", auth="off", tls="off",
                                metrics_auth="off", reasoning_parser="deepseek_r1", time_scale=20.0,
                                log_dir=str(tmp_path_factory.mktemp("up-reasoning"))))
    st.start()
    try:
        yield st
    finally:
        st.stop()


def test_chat_answers_carry_their_reasoning_apart(stack: LocalStack) -> None:
    client = openai.OpenAI(base_url=stack.http_address + "/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(model=stack.cfg.model, messages=[{"role": "user", "content": "Why?"}],
                                       max_tokens=16)
    msg = r.choices[0].message
    assert msg.model_extra.get("reasoning") and msg.content
    assert r.usage.completion_tokens_details.reasoning_tokens == 8   # the sim's --sim-reasoning-tokens
