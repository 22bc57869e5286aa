"""Start `python -m mlx_flash.server` on the embedded SmolLM2-135M-Instruct and ask it a question
through its OpenAI-compatible chat endpoint (the standard library's urllib; any OpenAI client works
with base_url http://127.0.0.1:PORT/v1).

    python examples/server_client.py ["Your question"] [--model PACK --memory-budget 0.65 ...]

Extra arguments after the question go to the server (e.g. a flash pack and its budget).
"""

import json
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, server, seconds=300):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with code {server.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if json.loads(r.read()).get("status") == "ok":
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"the server did not answer on port {port} within {seconds} s")


def ask(port: int, question: str, max_tokens=48) -> dict:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0.0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def main(question="What is the capital of France?", server_args=()):
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlx_flash.server", "--port", str(port), *server_args],
                              stderr=subprocess.DEVNULL)
    try:
        wait_healthy(port, server)
        reply = ask(port, question)
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(reply["choices"][0]["message"]["content"])
    usage = reply["usage"]
    print(f"[{usage['prompt_tokens']} prompt tokens, {usage['completion_tokens']} completion tokens]")
    return reply


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["What is the capital of France?"]), server_args=sys.argv[2:])
