"""A small static file server with what ``http.server`` lacks: Range requests, ETags and
``If-Match``. Each GET is logged on stdout (its path, range and If-Match).

Usage: range_http_server.py DIRECTORY PORT [CERTFILE KEYFILE]   (TLS when a cert is given)
In its environment: RANGES=off, it sends every file whole, whatever range is asked;
IF_MATCH=off, it ignores If-Match; ETAGS=weak, its ETags are weak (W/"...") and ETAGS=none,
it gives none; HEAD=refused, it answers a HEAD 405; SIGNED=GET, it
serves only GETs whose query holds "signature=" (a URL presigned for GET: a HEAD is refused);
BEARER=<token>, it answers 401 to a request without "Authorization: Bearer <token>";
AUTHORIZATION=refused, it answers 400 to a request with any Authorization (as S3 does to a
presigned URL's); REDIRECT=<base URL>, it answers each request it takes with a 302 to the base
URL followed by the request's path.
"""

import hashlib
import http.server
import os
import ssl
import sys
from pathlib import Path

ROOT = Path(sys.argv[1]).resolve()
RANGES = os.environ.get("RANGES") != "off"
IF_MATCH = os.environ.get("IF_MATCH") != "off"
ETAGS = os.environ.get("ETAGS", "strong")
SIGNED = os.environ.get("SIGNED") == "GET"
HEAD = os.environ.get("HEAD") != "refused"
BEARER = os.environ.get("BEARER")
AUTHORIZATION = os.environ.get("AUTHORIZATION") != "refused"
REDIRECT = os.environ.get("REDIRECT")


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _file(self):
        if SIGNED and (self.command != "GET" or "signature=" not in self.path.lower()):
            self.send_error(403)
            return None
        given = self.headers.get("Authorization")
        if (BEARER and given != f"Bearer {BEARER}") or (given and not AUTHORIZATION):
            self.send_error(401 if BEARER else 400)
            return None
        if REDIRECT:
            self.send_response(302)
            self.send_header("Location", REDIRECT + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        path = (ROOT / self.path.lstrip("/").split("?")[0]).resolve()
        if ROOT not in path.parents or not path.is_file():
            self.send_error(404)
            return None
        return path

    def _headers(self, path, status, start, end, size):
        self.send_response(status)
        self.send_header("Content-Length", str(end - start))
        if RANGES:
            self.send_header("Accept-Ranges", "bytes")
        if ETAGS != "none":
            self.send_header("ETag", self._etag(path))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()

    @staticmethod
    def _etag(path):
        stat = path.stat()
        digest = hashlib.md5(f"{stat.st_mtime_ns}-{stat.st_size}".encode()).hexdigest()
        return f'W/"{digest}"' if ETAGS == "weak" else f'"{digest}"'

    def _span(self, size):
        header = self.headers.get("Range")
        if not RANGES or not header or not header.startswith("bytes="):
            return 200, 0, size
        first, _, last = header[6:].partition("-")
        start = int(first)
        end = min(int(last) + 1 if last else size, size)
        return 206, start, end

    def do_HEAD(self):
        if not HEAD:
            self.send_error(405)
            return
        path = self._file()
        if path:
            size = path.stat().st_size
            self._headers(path, 200, 0, size, size)

    def do_GET(self):
        path = self._file()
        if not path:
            return
        wanted = self.headers.get("If-Match")
        said = ("GET", self.path, str(self.headers.get("Range")), str(wanted))
        sys.stdout.write(" ".join(said) + "\n")  # one write: lines of threads are not mixed
        sys.stdout.flush()
        if IF_MATCH and wanted and wanted != self._etag(path):
            self.send_error(412)
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
                try:
                    self.wfile.write(chunk)
                except OSError:  # the client went (a ranged GET answered whole, given up)
                    return
                remaining -= len(chunk)


class Server(http.server.ThreadingHTTPServer):
    """Room for as many connections at once as clients of ranges open (at five, the default,
    the ones past it wait a second for the kernel to try them again)."""

    request_queue_size = 128


server = Server(("127.0.0.1", int(sys.argv[2])), Handler)
if len(sys.argv) > 4:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(sys.argv[3], sys.argv[4])
    server.socket = context.wrap_socket(server.socket, server_side=True)
print("ready", flush=True)
os.environ.pop("PYTHONPATH", None)
server.serve_forever()
