"""Use a running llminfer server with the official ``openai`` client: chat without and with streaming,
a completion with logprobs, and llminfer's extra sampling fields.

    llminfer serve &                       # or: python examples/run_server.py &
    python examples/openai_api_client.py   # --base-url http://127.0.0.1:8000/v1 --api-key KEY

``llminfer serve`` serves the trained SmolLM2-135M-Instruct by default, so the answers read as text (a 135M
model's); with ``--model llminfer/tiny-qwen2`` (random weights) the text is gibberish, and the API behaves
the same.
"""

from __future__ import annotations

import argparse

import openai


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="not-needed", help="the server's --api-key, if it has one")
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": "Give me three names for a cat."}]

    # 1. Chat, non-streaming.
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0.7, seed=1)
    print("chat:", reply.choices[0].message.content)
    print(f"  finish={reply.choices[0].finish_reason} usage={reply.usage.model_dump(exclude_none=True)}")

    # 2. Chat, streaming; the last chunk carries the usage.
    print("stream: ", end="", flush=True)
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0.7, seed=1,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage is not None:
            print(f"\n  usage={chunk.usage.model_dump(exclude_none=True)}")

    # 3. Completion with the top-2 logprobs of each token, and llminfer extras through extra_body.
    done = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, logprobs=2,
                                     extra_body={"top_k": 40, "repetition_penalty": 1.1})
    choice = done.choices[0]
    print("completion:", repr(choice.text))
    for token, logprob in zip(choice.logprobs.tokens, choice.logprobs.token_logprobs):
        print(f"  {token!r:>16} {logprob:8.3f}")


if __name__ == "__main__":
    main()
