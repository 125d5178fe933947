"""A Hugging Face Hub on localhost, for tests that download as a user would:
`HF_ENDPOINT=hub.url` makes huggingface_hub talk to it. It answers the calls
`snapshot_download` makes: the revision's info, the file tree, and each file's
`resolve` URL (HEAD, then GET, with the commit and ETag headers the Hub sends);
files are sent in chunks with a pause between them, so a download takes long
enough to be watched."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

CHUNK = 16 * 1024


class FakeHub:
    def __init__(self, repos: dict[str, Path], chunk_delay: float = 0.0):
        self.files = {repo: {f.name: f.read_bytes() for f in Path(d).iterdir() if f.is_file()}
                      for repo, d in repos.items()}
        self.commit = {repo: hashlib.sha1(repo.encode()).hexdigest() for repo in repos}
        self.chunk_delay = chunk_delay
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "FakeHub":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, body: bytes, headers: dict, head: bool = False) -> None:
                self.send_response(200)
                for k, v in {**headers, "Content-Length": str(len(body))}.items():
                    self.send_header(k, v)
                self.end_headers()
                if head:
                    return
                for i in range(0, len(body), CHUNK):
                    self.wfile.write(body[i:i + CHUNK])
                    self.wfile.flush()
                    time.sleep(hub.chunk_delay)

            def do_HEAD(self) -> None:
                self.do_GET(head=True)

            def do_GET(self, head: bool = False) -> None:
                path = self.path.split("?")[0]
                for repo, files in hub.files.items():
                    sha = hub.commit[repo]
                    if path.startswith(f"/api/models/{repo}/revision/"):
                        body = {"id": repo, "sha": sha, "siblings": [{"rfilename": f} for f in files]}
                        return self._send(json.dumps(body).encode(), {"Content-Type": "application/json"})
                    if path.startswith(f"/api/models/{repo}/tree/"):
                        body = [{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                                for f, b in files.items()]
                        return self._send(json.dumps(body).encode(), {"Content-Type": "application/json"})
                    prefix = f"/{repo}/resolve/"
                    if path.startswith(prefix):
                        name = path[len(prefix):].split("/", 1)[-1]
                        if name in files:
                            body = files[name]
                            return self._send(body, {"X-Repo-Commit": sha,
                                                     "ETag": f'"{hashlib.sha1(body).hexdigest()}"'}, head)
                self.send_response(404)
                self.send_header("X-Error-Code", "RepoNotFound")
                self.send_header("Content-Length", "0")
                self.end_headers()

        return Handler
