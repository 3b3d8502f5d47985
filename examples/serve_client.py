"""Talk to `deinfer-megatron serve` with the official `openai` client.

Start a server first, e.g.

    deinfer-megatron serve --model out/smollm2-dec --tp 2 --port 8000

then run

    python examples/serve_client.py --base-url http://127.0.0.1:8000/v1 --model smollm2-dec

It sends one completion, the same completion streamed (the chunks add up to the same text with
temperature 0), and one chat completion, and prints one JSON object with what came back.
The API key is read from DEINFER_API_KEY when the server was started with --api-key.
"""

from __future__ import annotations

import argparse
import json
import os

import openai


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", required=True, help="the server's --served-model-name (default: folder name)")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=os.environ.get("DEINFER_API_KEY", "none"))
    completion = client.completions.create(model=args.model, prompt=args.prompt, max_tokens=args.max_tokens,
                                           temperature=0)
    streamed = "".join(
        chunk.choices[0].text
        for chunk in client.completions.create(model=args.model, prompt=args.prompt, max_tokens=args.max_tokens,
                                               temperature=0, stream=True)
        if chunk.choices)
    chat = client.chat.completions.create(model=args.model, max_tokens=args.max_tokens, temperature=0,
                                          messages=[{"role": "user", "content": args.prompt}])
    print(json.dumps({"completion": completion.choices[0].text, "streamed": streamed,
                      "chat": chat.choices[0].message.content, "usage": completion.usage.model_dump()}))


if __name__ == "__main__":
    main()
