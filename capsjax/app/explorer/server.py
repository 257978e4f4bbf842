"""The explorer's web server: the page and its static files, and a small JSON API.

The standard library's threading HTTP server is enough: the API has six routes, the
work in each is one jitted JAX call, and it keeps the explorer free of web-framework
dependencies (see BUILD.md). HTTP/1.1 keep-alive keeps a slider's requests on one
connection. Every failure is an answer (4xx for bad requests, 500 with a message for a
bug), never a crashed server.

Many clients at once: up to MAX_CONNECTIONS connections are served together; more wait in
the listen backlog and are served in turn (a burst queues; nothing is refused). Image
files are read and decoded MAX_FILES_AT_ONCE at a time; the others wait their turn. A slow
client cannot hold a connection: its request line and headers must arrive within
HEAD_DEADLINE_S of their first byte however slowly they trickle (a deadline, not a timeout
that each line restarts), its body within BODY_DEADLINE_S, and a kept-alive connection
may stay idle IDLE_TIMEOUT_S. Clients that leave mid-answer are not reported.

  GET  /                    the page
  GET  /static/NAME         its script and style sheet
  GET  /api/info            mode, sizes, labels, misclassified indices
  GET  /api/example?index=N a test input: image, capsule lengths and vectors, prediction
  POST /api/encode          {"width", "height", "pixels": base64 grey bytes} → as /api/example
  POST /api/encode_file     an image file's bytes (PNG, JPEG, …; any size) → as /api/example
  POST /api/decode          {"vectors": [[dim]…], "classes": [c…]} → {"pixels": [[h·w uint8]…]}
  POST /api/grid            {"vector": [dim], "class": c} → figure 4 as image/png
"""
import base64
import binascii
import json
import mimetypes
import os
import re
import socket
import sys
import threading
import time
import traceback
import urllib.parse
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from capsjax.app.explorer.backend import Explorer, RequestError

STATIC = os.path.join(os.path.dirname(__file__), 'static')
MAX_BODY_BYTES = 4 << 20   # a 1024×1024 drawing is 1 MiB of grey bytes (1.4 MiB as base64)
MAX_DRAWING_SIDE = 1024
MAX_FILE_BYTES = 24 << 20   # an image file opened on the page (a phone's photo is 3–12 MB)
MAX_FILES_AT_ONCE = 4       # files read and decoded at once; more wait (their bytes stay in the socket)
MAX_CONNECTIONS = 256     # connections served at once (a thread each); more wait to be accepted
LISTEN_BACKLOG = 1024      # connections waiting to be accepted (the default 5 reset bursts)
IDLE_TIMEOUT_S = 30        # a connection that sends nothing for this long is closed
HEAD_DEADLINE_S = 10       # request line and headers, from their first byte
BODY_DEADLINE_S = 30       # a POST body (at most MAX_BODY_BYTES; a file MAX_FILE_BYTES)
LOOPBACK = ('127.0.0.1', 'localhost', '::1')


def drawing_from(body) -> np.ndarray:
  """The grey drawing uint8 [height, width] of an /api/encode request."""
  if not isinstance(body, dict):
    raise RequestError('the body must be a JSON object')
  width, height = body.get('width'), body.get('height')
  if not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_DRAWING_SIDE
             for v in (width, height)):
    raise RequestError(f'width and height must be integers in [1, {MAX_DRAWING_SIDE}]')
  try:
    data = base64.b64decode(body.get('pixels', ''), validate=True)
  except (binascii.Error, TypeError, ValueError):
    raise RequestError('pixels must be base64-encoded grey bytes') from None
  if len(data) != width * height:
    raise RequestError(f'pixels hold {len(data)} bytes; a {width}×{height} drawing has {width * height}')
  return np.frombuffer(data, np.uint8).reshape(height, width)


def make_handler(explorer: Explorer):

  class Handler(BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'   # keep-alive: one connection for a slider's requests
    # Headers and body go out as two writes; with Nagle's algorithm the body then waits
    # for the browser's delayed ACK (~40 ms) on a kept-alive connection.
    disable_nagle_algorithm = True
    server_version = 'capsjax-explorer'

    def setup(self):
      self.timeout = IDLE_TIMEOUT_S   # reads and writes (a client that stops reading) wait this long
      super().setup()

    def handle_one_request(self):
      try:   # wait for the next request's first byte (buffered, or from the socket)
        if not self.rfile.peek(1):
          self.close_connection = True   # the client closed the connection
          return
      except (TimeoutError, ConnectionError):
        self.close_connection = True     # idle too long, or gone
        return
      self.server.set_deadline(self.connection, HEAD_DEADLINE_S)
      try:
        super().handle_one_request()
      finally:
        self.server.clear_deadline(self.connection)

    def parse_request(self):
      try:   # reads the request line's rest and the headers, under the head's deadline
        return super().parse_request()
      finally:
        self.server.clear_deadline(self.connection)   # the answer is not under it

    def log_message(self, format, *args):   # pylint: disable=redefined-builtin
      pass   # a slider makes dozens of requests a second; errors are answered, not logged

    # ------------------------------------------------------------------- plumbing

    def _send(self, status: int, body: bytes, content_type: str) -> None:
      self.send_response(status)
      self.send_header('Content-Type', content_type)
      self.send_header('Content-Length', str(len(body)))
      self.send_header('Cache-Control', 'no-store')
      self.end_headers()
      if self.command != 'HEAD':
        self.wfile.write(body)

    def _json(self, value, status: int = HTTPStatus.OK) -> None:
      self._send(status, json.dumps(value, separators=(',', ':')).encode(), 'application/json')

    def _error(self, status: int, message: str) -> None:
      self._json({'error': message}, status)

    def _body(self):
      """The JSON body of a POST."""
      data = self._raw_body(MAX_BODY_BYTES)
      try:
        return json.loads(data)
      except (ValueError, UnicodeDecodeError, RecursionError):
        raise RequestError('the body is not valid JSON (or nests too deep)') from None

    def _raw_body(self, limit: int) -> bytes:
      try:
        length = int(self.headers.get('Content-Length', ''))
      except ValueError:
        self.close_connection = True   # the body's end is unknown: never read it as a request
        raise RequestError('a POST needs a Content-Length') from None
      if not 0 < length <= limit:
        self.close_connection = True   # the unread body must not become the next request
        raise RequestError(f'the body must be 1 to {limit} bytes, got {length}')
      self.server.set_deadline(self.connection, BODY_DEADLINE_S)
      try:
        data = self.rfile.read(length)
      finally:
        self.server.clear_deadline(self.connection)
      if len(data) < length:
        self.close_connection = True
        raise ConnectionAbortedError('the body ended early')   # the client left: nothing to answer
      return data

    def _from_this_page(self) -> bool:
      """Another web page in the same browser must not call the API: the Host must be the
      address served (against DNS rebinding) and an Origin, when sent, this page's own."""
      host = self.headers.get('Host', '')
      allowed = self.server.allowed_hosts
      if allowed is not None and host not in allowed:
        return False
      origin = self.headers.get('Origin')
      return origin is None or origin == f'http://{host}'

    def _refused(self) -> bool:
      if self._from_this_page():
        return False
      self.close_connection = True
      self._error(HTTPStatus.FORBIDDEN, 'refused: the request does not come from the explorer page itself')
      return True

    def _answer(self, route) -> None:
      try:
        route()
      except (ConnectionError, TimeoutError):
        raise   # the client left (or stopped reading) mid-answer: nothing to answer, nothing to report
      except RequestError as e:
        self._error(HTTPStatus.BAD_REQUEST, str(e))
      except (OverflowError, RecursionError) as e:   # a 400-digit number, a structure nested too deep
        self._error(HTTPStatus.BAD_REQUEST, f'a value is out of range: {type(e).__name__}')
      except Exception as e:  # pylint: disable=broad-except
        traceback.print_exc()   # a bug: say so on the console, answer, keep serving
        self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f'{type(e).__name__}: {e}')

    # ------------------------------------------------------------------- routes

    def do_GET(self):   # pylint: disable=invalid-name
      if self._refused():
        return
      url = urllib.parse.urlsplit(self.path)
      query = urllib.parse.parse_qs(url.query)
      if url.path in ('/', '/index.html'):
        self._answer(lambda: self._static('index.html'))
      elif url.path.startswith('/static/'):
        self._answer(lambda: self._static(url.path[len('/static/'):]))
      elif url.path == '/api/info':
        self._answer(lambda: self._json(explorer.info()))
      elif url.path == '/api/example':
        self._answer(lambda: self._json(explorer.example(_query_int(query, 'index'))))
      else:
        self._error(HTTPStatus.NOT_FOUND, f'no such page: {url.path}')

    do_HEAD = do_GET

    def do_POST(self):   # pylint: disable=invalid-name
      if self._refused():
        return
      path = urllib.parse.urlsplit(self.path).path
      if path == '/api/decode':
        self._answer(lambda: self._decode(self._body()))
      elif path == '/api/encode':
        self._answer(lambda: self._json(explorer.encode_drawing(drawing_from(self._body()))))
      elif path == '/api/encode_file':
        self._answer(self._encode_file)
      elif path == '/api/grid':
        self._answer(lambda: self._grid(self._body()))
      else:
        self._error(HTTPStatus.NOT_FOUND, f'no such API: POST {path}')

    def _decode(self, body) -> None:
      if not isinstance(body, dict):
        raise RequestError('the body must be a JSON object with vectors and classes')
      self._json(explorer.reconstruct(body.get('vectors'), body.get('classes')))

    def _encode_file(self) -> None:
      # At most MAX_FILES_AT_ONCE files in memory: 256 connections × 24 MiB would be 6 GiB.
      with self.server.file_slots:
        answer = explorer.encode_file(self._raw_body(MAX_FILE_BYTES))
      self._json(answer)

    def _grid(self, body) -> None:
      if not isinstance(body, dict):
        raise RequestError('the body must be a JSON object with vector and class')
      self._send(HTTPStatus.OK, explorer.grid_png(body.get('vector'), body.get('class')), 'image/png')

    def _static(self, name: str) -> None:
      if '\x00' in name:
        raise RequestError('a path cannot hold a NUL byte')
      path = os.path.realpath(os.path.join(STATIC, name))
      if not path.startswith(os.path.realpath(STATIC) + os.sep) or not os.path.isfile(path):
        self._error(HTTPStatus.NOT_FOUND, f'no such file: {name}')
        return
      with open(path, 'rb') as f:
        body = f.read()
      self._send(HTTPStatus.OK, body, mimetypes.guess_type(path)[0] or 'application/octet-stream')

  return Handler


_ASCII_INTEGER = re.compile(r'[+-]?[0-9]+')


def _query_int(query, name: str) -> int:
  values = query.get(name)
  if not values:
    raise RequestError(f'missing ?{name}=')
  text = values[0].strip(' ')
  # ASCII digits only: Python's int() also reads other scripts' digits ('５', '٥').
  if not _ASCII_INTEGER.fullmatch(text):
    raise RequestError(f'{name} must be an integer in ASCII digits, got {values[0][:40]!r}')
  if len(text.lstrip('+-')) > 9:
    raise RequestError(f'{name} must be an integer of at most 9 digits, got {len(text)} characters')
  return int(text)


class ExplorerServer(ThreadingHTTPServer):
  """ThreadingHTTPServer with a deep listen backlog, at most MAX_CONNECTIONS connections
  served at once (the others wait their turn), deadlines for slow clients (a reaper
  thread closes a connection whose request head or body is late), quiet about clients
  that go away, and the Host names it answers (None: any, when listening beyond loopback)."""
  daemon_threads = True
  request_queue_size = LISTEN_BACKLOG

  def __init__(self, address, handler):
    self._closing = threading.Event()   # before binding: a failed bind calls server_close
    super().__init__(address, handler)
    self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
    self.file_slots = threading.BoundedSemaphore(MAX_FILES_AT_ONCE)
    self._deadlines = {}   # connection → time.monotonic() by which its head or body must be in
    self._deadlines_lock = threading.Lock()
    threading.Thread(target=self._reap_late_clients, daemon=True, name='explorer-deadlines').start()
    host, port = address[0], self.server_address[1]
    self.allowed_hosts = ({f'127.0.0.1:{port}', f'localhost:{port}', f'[::1]:{port}'}
                          if host in LOOPBACK else None)

  # ----------------------------------------------------------------- slow clients

  def set_deadline(self, connection, seconds: float) -> None:
    with self._deadlines_lock:
      self._deadlines[connection] = time.monotonic() + seconds

  def clear_deadline(self, connection) -> None:
    with self._deadlines_lock:
      self._deadlines.pop(connection, None)

  def _reap_late_clients(self) -> None:
    while not self._closing.wait(0.25):
      now = time.monotonic()
      with self._deadlines_lock:
        late = [connection for connection, deadline in self._deadlines.items() if deadline < now]
        for connection in late:
          del self._deadlines[connection]
          try:   # the handler's blocked read returns: its thread ends the connection
            connection.shutdown(socket.SHUT_RDWR)
          except OSError:
            pass

  # ----------------------------------------------------------------- connections

  def process_request(self, request, client_address):
    # A free thread, or wait for one: meanwhile new connections queue in the backlog.
    while not self._slots.acquire(timeout=0.25):
      if self._closing.is_set():
        self.shutdown_request(request)
        return
    super().process_request(request, client_address)

  def process_request_thread(self, request, client_address):
    # ThreadingMixIn's, with the slot given back before the connection is closed: a client
    # that sees the close may connect again at once, and must find the slot free.
    try:
      self.finish_request(request, client_address)
    except Exception:  # pylint: disable=broad-except  (as socketserver does: reported, not raised)
      self.handle_error(request, client_address)
    finally:
      self.clear_deadline(request)
      self._slots.release()
      self.shutdown_request(request)

  def handle_error(self, request, client_address):
    error = sys.exc_info()[1]
    if isinstance(error, (ConnectionError, TimeoutError)):
      return   # the client went away or went silent: nothing to answer, nothing to report
    print(f'explorer: {type(error).__name__}: {error}', file=sys.stderr, flush=True)

  def shutdown(self):
    self._closing.set()
    super().shutdown()

  def server_close(self):
    self._closing.set()
    super().server_close()


def make_server(explorer: Explorer, host: str = '127.0.0.1', port: int = 8000) -> ExplorerServer:
  """A server bound to (host, port) (port 0: any free port); call serve_forever().
  `explorer` may be None and set later with `serve_explorer` (bind first, load after)."""
  return ExplorerServer((host, port), make_handler(explorer))


def serve_explorer(server: ExplorerServer, explorer: Explorer) -> None:
  """Answer with `explorer` (the server was bound before the model loaded)."""
  server.RequestHandlerClass = make_handler(explorer)
