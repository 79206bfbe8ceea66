"""A small static file server with what ``http.server`` lacks: Range requests and ETags.

Usage: range_http_server.py DIRECTORY PORT [CERTFILE KEYFILE]   (TLS when a cert is given)
"""

import hashlib
import http.server
import os
import ssl
import sys
from pathlib import Path

ROOT = Path(sys.argv[1]).resolve()


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _file(self):
        path = (ROOT / self.path.lstrip("/").split("?")[0]).resolve()
        if ROOT not in path.parents or not path.is_file():
            self.send_error(404)
            return None
        return path

    def _headers(self, path, status, start, end, size):
        self.send_response(status)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        stat = path.stat()
        etag = hashlib.md5(f"{stat.st_mtime_ns}-{size}".encode()).hexdigest()
        self.send_header("ETag", f'"{etag}"')
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()

    def _span(self, size):
        header = self.headers.get("Range")
        if not header or not header.startswith("bytes="):
            return 200, 0, size
        first, _, last = header[6:].partition("-")
        start = int(first)
        end = min(int(last) + 1 if last else size, size)
        return 206, start, end

    def do_HEAD(self):
        path = self._file()
        if path:
            size = path.stat().st_size
            self._headers(path, 200, 0, size, size)

    def do_GET(self):
        path = self._file()
        if not path:
            return
        size = path.stat().st_size
        status, start, end = self._span(size)
        self._headers(path, status, start, end, size)
        with open(path, "rb") as handle:
            handle.seek(start)
            remaining = end - start
            while remaining > 0:
                chunk = handle.read(min(remaining, 1 << 20))
                if not chunk:
                    break
                self.wfile.write(chunk)
                remaining -= len(chunk)


server = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), Handler)
if len(sys.argv) > 4:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(sys.argv[3], sys.argv[4])
    server.socket = context.wrap_socket(server.socket, server_side=True)
print("ready", flush=True)
os.environ.pop("PYTHONPATH", None)
server.serve_forever()
