"""Calls the gateway with the official OpenAI and Anthropic SDKs, as a user would.

Usage: clients.py GATEWAY_URL API_KEY TEST_ID OPENAI_MODEL... (tests/tests/e2e/one_url.rs)

One OpenAI client with base_url=GATEWAY_URL/v1 calls every OPENAI_MODEL, not streamed and
streamed, and lists the models; one Anthropic client with base_url=GATEWAY_URL calls Messages
(the model named by the environment's ANTHROPIC_MODEL), not streamed and streamed. Prints one
JSON object: what each call answered.
"""

import json
import os
import sys

import anthropic
import openai


def main() -> None:
    gateway, key, test_id, *models = sys.argv[1:]
    headers = {"x-test-id": test_id}
    out = {"openai_version": openai.__version__, "anthropic_version": anthropic.__version__}

    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, default_headers=headers)
    messages = [{"role": "user", "content": "hello there"}]
    for model in models:
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=3)
        text = ""
        chunks = 0
        for chunk in client.chat.completions.create(
            model=model, messages=messages, max_tokens=3, stream=True
        ):
            chunks += 1
            for choice in chunk.choices:
                text += choice.delta.content or ""
        out[model] = {
            "model": r.model,
            "text": r.choices[0].message.content,
            "completion_tokens": r.usage.completion_tokens,
            "stream_text": text,
            "stream_chunks": chunks,
        }
    out["models"] = [m.id for m in client.models.list()]
    try:
        client.chat.completions.create(model="no-such-model", messages=messages, max_tokens=1)
        out["unknown"] = "answered"
    except openai.NotFoundError as e:
        out["unknown"] = {"status": e.status_code, "code": e.code}

    claude = os.environ.get("ANTHROPIC_MODEL")
    if claude:
        a = anthropic.Anthropic(base_url=gateway, api_key=key, default_headers=headers)
        m = a.messages.create(model=claude, max_tokens=4, messages=messages)
        with a.messages.stream(model=claude, max_tokens=4, messages=messages) as s:
            streamed = "".join(s.text_stream)
            final = s.get_final_message()
        out["anthropic"] = {
            "type": m.type,
            "text": m.content[0].text,
            "output_tokens": m.usage.output_tokens,
            "stream_text": streamed,
            "stream_output_tokens": final.usage.output_tokens,
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
