"""Fake OpenAI-, Anthropic- and Gemini-compatible judge servers on 127.0.0.1 (stdlib http.server).

Each server speaks enough of its provider's wire format for the official SDK clients: chat
completions / messages / generateContent, and the model metadata endpoint used by check_ready().
It records every request (model, temperature, prompt, attached images, headers), answers with a
programmable ``answer(prompt, images) -> str`` (default: a "brightness judge" that prefers the
brighter image, so answers depend on the images actually attached), and injects faults from a
queue: "429" (with Retry-After), "500", "timeout" (sleeps past the client timeout), "malformed"
(invalid JSON body), "refusal" (the provider's refusal shape), "garbage" (an unparseable answer).
``latency`` seconds are added to every generation request.
"""

from __future__ import annotations

import base64
import io
import json
import re
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from PIL import Image, ImageStat

from rewards.judge_prompts import LIKERT_LABELS

KINDS = ("openai", "anthropic", "gemini")


def brightness(img: Image.Image) -> float:
    return sum(ImageStat.Stat(img.convert("L")).mean) / 255.0


def brightness_judge(prompt: str, images: list[Image.Image]) -> str:
    """A deterministic judge whose answer depends on the pixels: brighter is better."""
    values = [brightness(img) for img in images]
    if len(images) == 2:
        r1, r2 = (round(1 + 9 * v, 1) for v in values)
        better = 0 if r1 == r2 else (1 if r1 > r2 else 2)
        return json.dumps({"analysis": "brighter is better", "image_1_rating": r1, "image_2_rating": r2,
                           "better_image": better})
    if "labels, from worst to best" in prompt:
        levels = 10 if "Below Average" in prompt else 5
        labels = LIKERT_LABELS[levels]
        return json.dumps({"analysis": "ok", "rating": labels[min(levels - 1, int(values[0] * levels))]})
    lo, hi = (float(x) for x in re.search(r"scale from (\S+) \(worst\) to (\S+) \(best\)", prompt).groups())
    return json.dumps({"analysis": "ok", "rating": round(lo + (hi - lo) * values[0], 2)})


def constant_judge(prompt: str, images: list) -> str:
    """Always the same pair verdict; needs no decoded images (benchmarks)."""
    return json.dumps({"analysis": "same", "image_1_rating": 6, "image_2_rating": 5, "better_image": 1})


def position_biased_judge(prompt: str, images: list[Image.Image]) -> str:
    """Always prefers the first image shown (the failure mode order swapping must catch)."""
    return json.dumps({"analysis": "first", "image_1_rating": 8, "image_2_rating": 5, "better_image": 1})


class FakeJudgeServer:
    """``with FakeJudgeServer("openai") as server: ...``; ``server.base_url`` goes to the SDK."""

    def __init__(self, kind: str, answer=brightness_judge, latency: float = 0.0,
                 models: tuple[str, ...] = ("fake-model",), api_key: str | None = None,
                 timeout_sleep: float = 2.0, decode_images: bool = True, retrieve_endpoint: bool = True,
                 port: int = 0, reuse_port: bool = False, logprobs=None):
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r} not in {KINDS}")
        self.kind, self.answer, self.latency, self.models = kind, answer, latency, set(models)
        self.api_key, self.timeout_sleep = api_key, timeout_sleep
        # decode_images=False: count the images but skip PNG decoding (cheap server for benchmarks)
        self.decode_images = decode_images
        # retrieve_endpoint=False: like vLLM, GET /v1/models/{id} is 404 and only the list exists
        self.retrieve_endpoint = retrieve_endpoint
        # logprobs(prompt, images) -> [(token, logprob), ...]: the first answer token's top logprobs, sent when a
        # request asks for logprobs (an OpenAI-compatible server like vLLM); None: a server that sends none
        self.logprobs = logprobs
        self.faults: deque[str] = deque()
        self.calls: list[dict] = []  # generation requests, in arrival order
        self.model_checks: list[str] = []
        self.lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        # reuse_port: several server processes listen on one port and the kernel spreads the
        # connections over them (SO_REUSEPORT), like the many servers behind a real API
        self.bind_port, self.reuse_port = port, reuse_port

    # ---- lifecycle -----------------------------------------------------------------------------
    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self) -> None:
        handler = type("Handler", (_Handler,), {"server_state": self})
        server_class = type("Server", (ThreadingHTTPServer,), {"allow_reuse_port": self.reuse_port})
        self._httpd = server_class(("127.0.0.1", self.bind_port), handler)
        self._httpd.daemon_threads = True
        self._httpd.block_on_close = False
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def base_url(self) -> str:
        root = f"http://127.0.0.1:{self.port}"
        return root + "/v1" if self.kind == "openai" else root

    def inject(self, *faults: str) -> None:
        with self.lock:
            self.faults.extend(faults)

    def next_fault(self) -> str | None:
        with self.lock:
            return self.faults.popleft() if self.faults else None

    # ---- request decoding -----------------------------------------------------------------------
    def decode(self, body: dict, path: str) -> tuple[str, str, float | None, list[Image.Image]]:
        """(model, prompt text, temperature, images) from a provider-specific request body."""
        texts, images = [], []
        if self.kind == "openai":
            model, temperature = body.get("model"), body.get("temperature")
            for part in body["messages"][-1]["content"]:
                if part["type"] == "text":
                    texts.append(part["text"])
                elif part["type"] == "image_url":
                    images.append(self._image(part["image_url"]["url"].split(",", 1)[1]))
        elif self.kind == "anthropic":
            model, temperature = body.get("model"), body.get("temperature")
            for part in body["messages"][-1]["content"]:
                if part["type"] == "text":
                    texts.append(part["text"])
                elif part["type"] == "image":
                    images.append(self._image(part["source"]["data"]))
        else:
            model = re.search(r"models/([^/:]+):generateContent", path).group(1)
            temperature = body.get("generationConfig", {}).get("temperature")
            for part in body["contents"][-1]["parts"]:
                if "text" in part:
                    texts.append(part["text"])
                inline = part.get("inlineData") or part.get("inline_data")
                if inline:
                    images.append(self._image(inline["data"]))
        return model, texts[0] if texts else "", temperature, images

    def _image(self, data: str):
        return _decode_b64(data) if self.decode_images else len(data)


def _decode_b64(data: str) -> Image.Image:
    # Google's JSON carries bytes as URL-safe base64; accept both alphabets.
    img = Image.open(io.BytesIO(base64.b64decode(data.replace("-", "+").replace("_", "/"))))
    img.load()
    return img.convert("RGB")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # headers and body go out in two writes: without TCP_NODELAY, Nagle + delayed ACK add ~40 ms each
    disable_nagle_algorithm = True
    server_state: FakeJudgeServer

    def log_message(self, *args):  # keep test output quiet
        pass

    # ---- plumbing -------------------------------------------------------------------------------
    def _send(self, status: int, payload, headers: dict | None = None) -> None:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout fault)
            pass

    def _error(self, status: int, message: str, headers: dict | None = None) -> None:
        kind = self.server_state.kind
        if kind == "anthropic":
            payload = {"type": "error", "error": {"type": "api_error", "message": message}}
        elif kind == "gemini":
            payload = {"error": {"code": status, "message": message, "status": "ERROR"}}
        else:
            payload = {"error": {"message": message, "type": "error", "code": status}}
        self._send(status, payload, headers)

    def _authorised(self) -> bool:
        expected = self.server_state.api_key
        if expected is None:
            return True
        bearer = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
        # Anthropic SDKs send x-api-key (older) or a bearer token (newer); Gemini sends x-goog-api-key.
        got = {"openai": [bearer], "anthropic": [self.headers.get("x-api-key"), bearer],
               "gemini": [self.headers.get("x-goog-api-key")]}[self.server_state.kind]
        return expected in got

    # ---- endpoints ------------------------------------------------------------------------------
    def do_GET(self):
        state = self.server_state
        if not self._authorised():
            return self._error(401, "invalid api key")
        if state.kind == "openai" and self.path.rstrip("/").endswith("/models"):
            return self._send(200, {"object": "list", "data": [
                {"id": m, "object": "model", "created": 0, "owned_by": "fake"} for m in sorted(state.models)]})
        match = re.search(r"/models/([^/?]+)", self.path)
        if not match or (state.kind == "openai" and not state.retrieve_endpoint):
            return self._error(404, "not found")
        model = match.group(1)
        state.model_checks.append(model)
        if model not in state.models:
            return self._error(404, f"model {model} not found")
        if state.kind == "openai":
            return self._send(200, {"id": model, "object": "model", "created": 0, "owned_by": "fake"})
        if state.kind == "anthropic":
            return self._send(200, {"type": "model", "id": model, "display_name": model,
                                    "created_at": "2025-01-01T00:00:00Z"})
        return self._send(200, {"name": f"models/{model}", "displayName": model})

    def do_POST(self):
        state = self.server_state
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if not self._authorised():
            return self._error(401, "invalid api key")
        model, prompt, temperature, images = state.decode(body, self.path)
        fault = state.next_fault()
        with state.lock:
            state.calls.append({"model": model, "prompt": prompt, "temperature": temperature, "images": images,
                                "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body, "fault": fault, "time": time.monotonic()})
        if model not in state.models:
            return self._error(404, f"model {model} not found")
        if state.latency:
            time.sleep(state.latency)
        if fault == "429":
            return self._error(429, "rate limited", {"retry-after": "0.2"})
        if fault == "500":
            return self._error(500, "internal error")
        if fault == "timeout":
            time.sleep(state.timeout_sleep)
        if fault == "malformed":
            return self._send(200, b'{"choices": [ this is not json')
        refusal = fault == "refusal"
        text = "The picture has lots of colours and shapes." if fault == "garbage" else state.answer(prompt, images)
        payload = self._success(model, body, text, refusal, len(images))
        if state.kind == "openai" and body.get("logprobs") and state.logprobs is not None:
            top = state.logprobs(prompt, images)[:int(body.get("top_logprobs") or 0) or 1]
            entries = [{"token": t, "logprob": lp, "bytes": None} for t, lp in top]
            payload["choices"][0]["logprobs"] = {"content": [{**entries[0], "top_logprobs": entries}]}
        self._send(200, payload)

    def _success(self, model: str, body: dict, text: str, refusal: bool, n_images: int) -> dict:
        kind = self.server_state.kind
        usage_in, usage_out = 100 + 85 * n_images, 20
        if kind == "openai":
            message = {"role": "assistant", "content": None if refusal else text,
                       "refusal": "I'm sorry, I can't assist with that." if refusal else None}
            return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": model,
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": usage_in, "completion_tokens": usage_out,
                              "total_tokens": usage_in + usage_out}}
        if kind == "anthropic":
            if refusal:
                content, stop = [{"type": "text", "text": "I can't help with that."}], "refusal"
            elif body.get("tools") and not body.get("output_config"):
                try:
                    tool_input = json.loads(text)
                except ValueError:
                    tool_input = {"analysis": text}
                content = [{"type": "tool_use", "id": "toolu_1", "name": body["tools"][0]["name"],
                            "input": tool_input}]
                stop = "tool_use"
            else:
                content, stop = [{"type": "text", "text": text}], "end_turn"
            return {"id": "msg_1", "type": "message", "role": "assistant", "model": model, "content": content,
                    "stop_reason": stop, "stop_sequence": None,
                    "usage": {"input_tokens": usage_in, "output_tokens": usage_out}}
        usage = {"promptTokenCount": usage_in, "candidatesTokenCount": usage_out,
                 "totalTokenCount": usage_in + usage_out}
        if refusal:
            return {"candidates": [{"finishReason": "SAFETY", "index": 0}], "usageMetadata": usage}
        return {"candidates": [{"content": {"role": "model", "parts": [{"text": text}]}, "finishReason": "STOP",
                                "index": 0}], "usageMetadata": usage, "modelVersion": model}
