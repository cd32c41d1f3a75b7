"""Demo traffic: a few multi-turn chats per gateway, streamed, forever (standard library only)."""

import json
import random
import sys
import time
import urllib.error
import urllib.request

GATEWAYS = sys.argv[1:] or ["http://127.0.0.1:8000"]
SYSTEM = "You are a terse travel agent. " * 20


def chat(base: str, messages: list[dict[str, str]], session: str) -> str:
    body = {
        "model": "kvgate-sim",
        "messages": messages,
        "max_tokens": random.randint(8, 64),
        "stream": True,
    }
    request = urllib.request.Request(
        base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "x-session-id": session},
    )
    text = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text)


def main() -> None:
    conversations: dict[str, list[dict[str, str]]] = {}
    turn = 0
    while True:
        turn += 1
        session = f"demo-{random.randint(0, 40)}"
        history = conversations.setdefault(session, [{"role": "system", "content": SYSTEM}])
        history.append({"role": "user", "content": f"Plan day {turn} of the trip."})
        try:
            history.append(
                {"role": "assistant", "content": chat(random.choice(GATEWAYS), history, session)}
            )
        except (urllib.error.URLError, OSError) as exc:
            print(f"request failed: {exc}", file=sys.stderr)
            history.pop()
            time.sleep(1)
        if len(history) > 30:
            del conversations[session]
        time.sleep(random.uniform(0.05, 0.3))


if __name__ == "__main__":
    main()
