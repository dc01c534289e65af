"""Hostile requests against the gateway: how long a refusal takes, and what other clients see meanwhile.

    python bench/gateway_hostile.py [--smoke]

A Gateway over a scripted engine (8192-token context; replies cost nothing) with SmolLM2-135M's
tokenizer (--smoke: the tiny test model's, and the other bodies a tenth the size) serves on its own thread.
One client sends each hostile body below; meanwhile another sends small chat requests back to back.
Per case: the status and error code, seconds until the answer, how many small requests were served
meanwhile and the worst of their latencies, and the process's peak RSS so far. Client and server
share one process (and its GIL), so latencies include the client's own work.

Cases: a body past the 32 MiB cap (413, refused from its Content-Length); 30 MB of message text
(400 before tokenizing: more characters than the context can hold); text just inside that bound
(rendered and tokenized on a worker thread, then 400 context_length_exceeded); a body of 100,000
nested arrays (400). Last line: `name=value` pairs.
"""

from __future__ import annotations

import argparse
import json
import resource
import threading
import time
from typing import Any

import httpx

from sleuth.gateway.app import MAX_BODY_BYTES, Gateway, GatewayServer
from sleuth.records import SamplingParams
from sleuth.system.hardware import cpu_description
from sleuth.testing.scripted import ScriptedEngine

CONTEXT = 8192


def cases(gateway: Gateway, scale: float) -> list[tuple[str, bytes]]:
    def text(chars: int) -> bytes:
        return json.dumps({"messages": [{"role": "user", "content": "word " * (chars // 5)}]}).encode()

    bound = CONTEXT * gateway.max_token_chars
    return [("body over the cap", text(max(int(50e6 * scale), MAX_BODY_BYTES + 2**20))), ("text past the context", text(int(30e6 * scale))),
            ("text inside the bound", text(int(bound * 0.9))),
            ("nested body", b"[" * 100_000 + b"]" * 100_000)]


def measure(url: str, body: bytes) -> dict[str, Any]:
    small = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=300) as client:
            while not done.is_set():
                t = time.perf_counter()
                client.post(url, content=small)
                latencies.append(time.perf_counter() - t)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.2)
    t = time.perf_counter()
    r = httpx.post(url, content=body, timeout=300)
    seconds = time.perf_counter() - t
    done.set()
    poller.join()
    return {"status": r.status_code, "code": r.json()["error"]["code"] or r.json()["error"]["type"],
            "seconds": seconds, "small": len(latencies), "worst": max(latencies, default=0.0),
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the tiny tokenizer and smaller bodies (for tests)")
    args = parser.parse_args()
    print(cpu_description())
    if args.smoke:
        from sleuth.testing.tiny_model import build_tokenizer

        tokenizer = build_tokenizer()
    else:
        from sleuth.system.models import load_tokenizer, resolve_model_path

        tokenizer = load_tokenizer(str(resolve_model_path("smollm2-135m-instruct")))
    gateway = Gateway(ScriptedEngine(tokenizer, ["ok"], context_len=CONTEXT), tokenizer, SamplingParams(max_tokens=4))
    rows = []
    with GatewayServer(gateway) as server:
        url = server.url() + "/chat/completions"
        for name, body in cases(gateway, 0.1 if args.smoke else 1.0):
            rows.append((name, len(body), measure(url, body)))
    print(f"{'case':<24}{'MB':>7}  {'answer':<32}{'s':>7}{'small':>7}{'worst s':>9}{'RSS MB':>8}")
    for name, size, m in rows:
        print(f"{name:<24}{size / 1e6:>7.1f}  {str(m['status']) + ' ' + m['code']:<32}{m['seconds']:>7.2f}"
              f"{m['small']:>7}{m['worst']:>9.3f}{m['rss_mb']:>8.0f}")
    print(" ".join(f"{name.replace(' ', '_')}_s={m['seconds']:.3f}" for name, _, m in rows)
          + f" worst_small_request_s={max(m['worst'] for _, _, m in rows):.3f}"
          + f" peak_rss_mb={max(m['rss_mb'] for _, _, m in rows):.0f}")


if __name__ == "__main__":
    main()
