"""Drive a server with MT-Bench 81-88 as 2-turn chats, 64 tokens each (ignore_eos), one at a
time, streamed: the load under which `server_chat_profile.txt` was sampled and
`thread_cpu.txt` measured.

    python benchmarks/studies/plain-path/drive_chat.py PORT [PASSES]
"""

from __future__ import annotations

import sys
import time

import httpx

from specdecode.prompts import load_prompts


def drive(port: str, passes: int, model: str = "qwen2.5-coder-1.5b") -> tuple[int, int]:
    """Chunks that carry an event and requests sent; a refused request raises."""
    chunks = requests = 0
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    for _ in range(passes):
        for prompt in load_prompts("mtbench", limit=8):
            messages = [{"role": "user", "content": prompt.text}]
            for _turn in range(2):
                body = {
                    "model": model, "messages": messages, "max_tokens": 64,
                    "ignore_eos": True, "temperature": 0, "stream": True,
                }  # fmt: skip
                with httpx.stream("POST", url, json=body, timeout=300) as response:
                    response.raise_for_status()
                    chunks += sum(line.startswith("data: {") for line in response.iter_lines())
                requests += 1
                messages = [
                    *messages,
                    {"role": "assistant", "content": "ok " * 30},
                    {"role": "user", "content": "Say more."},
                ]
    return chunks, requests


if __name__ == "__main__":
    port = sys.argv[1] if len(sys.argv) > 1 else "8191"
    passes = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    start = time.time()
    chunks, _ = drive(port, passes)
    print("chunks", chunks, "seconds", round(time.time() - start, 1))
