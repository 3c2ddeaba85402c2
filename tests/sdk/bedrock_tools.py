"""Calls a Bedrock model through the gateway with the official OpenAI SDK: tools and an image.

Usage: bedrock_tools.py GATEWAY_URL API_KEY TEST_ID MODEL (tests/tests/e2e/bedrock.rs)

Asks for a tool call (not streamed), sends the call back as the SDK returned it with the tool's
result for the answer, asks for a tool call streamed (the call's deltas joined by index, as a
client does) and sends an image as a data: URL. Prints one JSON object: what each call answered.
"""

import json
import sys

import openai

# A 1×1 PNG.
PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]


def streamed_call(client: openai.OpenAI, model: str, messages: list) -> dict:
    calls: dict = {}
    text = ""
    finish = None
    for chunk in client.chat.completions.create(
        model=model,
        messages=messages,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64,
        stream=True,
    ):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": None, "name": None, "arguments": "", "deltas": 0})
                if d.id:
                    c["id"] = d.id
                if d.function and d.function.name:
                    c["name"] = d.function.name
                if d.function and d.function.arguments:
                    c["arguments"] += d.function.arguments
                    c["deltas"] += 1
            if choice.finish_reason:
                finish = choice.finish_reason
    return {
        "text": text,
        "finish_reason": finish,
        "calls": [
            {
                "index": i,
                "id": c["id"],
                "name": c["name"],
                "arguments": json.loads(c["arguments"]),
                "deltas": c["deltas"],
            }
            for i, c in sorted(calls.items())
        ],
    }


def main() -> None:
    gateway, key, test_id, model = sys.argv[1:]
    client = openai.OpenAI(
        base_url=f"{gateway}/v1", api_key=key, default_headers={"x-test-id": test_id}
    )
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = {"openai_version": openai.__version__}

    r = client.chat.completions.create(
        model=model, messages=ask, tools=TOOLS, tool_choice="auto", max_tokens=64
    )
    m = r.choices[0].message
    call = m.tool_calls[0]
    out["call"] = {
        "finish_reason": r.choices[0].finish_reason,
        "content": m.content,
        "calls": len(m.tool_calls),
        "id": call.id,
        "type": call.type,
        "name": call.function.name,
        "arguments": json.loads(call.function.arguments),
        "completion_tokens": r.usage.completion_tokens,
    }

    # The call sent back as the SDK returned it, then the tool's result.
    turn = ask + [
        m.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]
    r = client.chat.completions.create(model=model, messages=turn, tools=TOOLS, max_tokens=64)
    out["answer"] = {
        "finish_reason": r.choices[0].finish_reason,
        "text": r.choices[0].message.content,
        "tool_calls": r.choices[0].message.tool_calls is not None,
    }

    out["stream"] = streamed_call(client, model, ask)

    r = client.chat.completions.create(
        model=model,
        max_tokens=64,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this image?"},
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
                ],
            }
        ],
    )
    out["image"] = {"text": r.choices[0].message.content, "finish_reason": r.choices[0].finish_reason}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
