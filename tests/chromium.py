"""Headless Chromium driven over the DevTools protocol, with the standard library only (tests/test_site.py).

Debian's `chromium` is started with --remote-debugging-port=0; it prints the port it chose, the page target's
WebSocket URL comes from /json/list, and CDP's JSON messages go over a minimal RFC 6455 client (text frames, masked
as a client must; the browser's frames are unmasked). Console errors are the page's uncaught exceptions
(Runtime.exceptionThrown), console.error calls (Runtime.consoleAPICalled) and the browser's own error entries, such
as a stylesheet that failed to load (Log.entryAdded).
"""
from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import tempfile
import time
import urllib.request


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


class WebSocket:
    def __init__(self, url: str, timeout_s: float = 30):
        m = re.match(r"ws://([^/:]+):(\d+)(/.*)", url)
        host, port, path = m.group(1), int(m.group(2)), m.group(3)
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
                          .encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError("the browser closed the WebSocket during the handshake")
            head += chunk
        head, self.buffer = head.split(b"\r\n\r\n", 1)
        if b" 101 " not in head.split(b"\r\n")[0]:
            raise ConnectionError(f"WebSocket handshake refused: {head.splitlines()[0]!r}")

    def _read(self, n: int) -> bytes:
        while len(self.buffer) < n:
            chunk = self.sock.recv(max(65536, n - len(self.buffer)))
            if not chunk:
                raise ConnectionError("the browser closed the WebSocket")
            self.buffer += chunk
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out

    def send(self, text: str) -> None:
        payload = text.encode()
        n = len(payload)
        header = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n)
                                  if n < 65536 else bytes([0x80 | 127]) + struct.pack(">Q", n))
        mask = os.urandom(4)
        self.sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def recv(self) -> str:
        message = b""
        while True:
            b0, b1 = self._read(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._read(8))[0]
            payload = self._read(n)
            opcode = b0 & 0x0F
            if opcode == 0x8:
                raise ConnectionError("the browser closed the WebSocket")
            if opcode in (0x9, 0xA):  # ping, pong: control frames between a message's fragments
                continue
            message += payload
            if b0 & 0x80:
                return message.decode()

    def close(self) -> None:
        self.sock.close()


class Browser:
    """One headless Chromium and its first page: navigate(), evaluate(), screenshot(); errors collects what the
    console reported since the last navigate()."""

    def __init__(self, binary: str, timeout_s: float = 30):
        self.profile = tempfile.mkdtemp(prefix="chromium-profile-")
        self.proc = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
             "--disable-dev-shm-usage", "--remote-debugging-port=0", f"--user-data-dir={self.profile}",
             "--allow-file-access-from-files", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.timeout_s, self.next_id, self.events, self.errors = timeout_s, 0, [], []
        port = self._port()
        deadline = time.monotonic() + timeout_s
        while True:
            targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=timeout_s))
            pages = [t for t in targets if t.get("type") == "page"]
            if pages or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        self.ws = WebSocket(pages[0]["webSocketDebuggerUrl"], timeout_s)
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")

    def _port(self) -> int:
        deadline = time.monotonic() + self.timeout_s
        seen = []
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                break
            seen.append(line.strip())
            m = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
            if m:
                return int(m.group(1))
        self.close()
        raise RuntimeError("chromium printed no DevTools port: " + " | ".join(seen[-5:]))

    def call(self, method: str, **params):
        self.next_id += 1
        mid = self.next_id
        self.ws.send(json.dumps({"id": mid, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == mid:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self._event(msg)

    def _event(self, msg: dict) -> None:
        method, params = msg.get("method"), msg.get("params", {})
        self.events.append(method)
        if method == "Runtime.exceptionThrown":
            d = params["exceptionDetails"]
            self.errors.append(f"exception: {d.get('exception', {}).get('description') or d.get('text')}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append("console.error: " + " ".join(str(a.get("value", a.get("description", "")))
                                                           for a in params.get("args", [])))
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            e = params["entry"]
            self.errors.append(f"{e.get('source')}: {e.get('text')} {e.get('url', '')}".strip())

    def wait_for(self, method: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        start = len(self.events)
        while method not in self.events[start:]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {method} within {self.timeout_s} s")
            self._event(json.loads(self.ws.recv()))

    def navigate(self, url: str) -> None:
        self.errors, self.events = [], []
        result = self.call("Page.navigate", url=url)
        if result.get("errorText"):
            self.errors.append(f"navigate: {result['errorText']} {url}")
            return
        if "Page.loadEventFired" not in self.events:
            self.wait_for("Page.loadEventFired")

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"evaluate: {result['exceptionDetails'].get('text')}: {expression[:80]}")
        return result["result"].get("value")

    def viewport(self, width: int, height: int, mobile: bool) -> None:
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                  mobile=mobile)

    def screenshot(self) -> bytes:
        return base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])

    def close(self) -> None:
        try:
            if getattr(self, "ws", None):
                self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            shutil.rmtree(self.profile, ignore_errors=True)
