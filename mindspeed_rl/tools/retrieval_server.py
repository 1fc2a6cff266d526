"""A retrieval server speaking Search-R1's `/retrieve` protocol (what MindSpeed-RL's SearchTool calls), BM25 over a
JSONL corpus (`rank_bm25`, pinned):

    python -m mindspeed_rl.tools.retrieval_server --corpus FILE.jsonl --port 8080 [--host 127.0.0.1]

Corpus rows: {"id": ..., "contents": "Title\\nText..."}. Request: POST /retrieve {"queries": [...], "topk": k,
"return_scores": true}; answer: {"result": [[{"document": {"id", "contents"}, "score"}, ...] per query]} (without
"score" when return_scores is false). A bad request is a 400 with {"error": ...}; bodies over `MAX_REQUEST_BYTES` and
more than `MAX_QUERIES` queries or `MAX_TOPK` results are refused, so a query the model wrote cannot stall it.
`serve_in_background` runs one in this process (a SearchTool's `retrieval_service_url: local`).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

MAX_REQUEST_BYTES = 1 << 20
MAX_QUERIES, MAX_TOPK, MAX_QUERY_CHARS = 64, 50, 4096
_WORD = re.compile(r"\w+")


def tokens(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class Bm25Index:
    """BM25 (Okapi, rank_bm25's defaults k1 1.5, b 0.75) over the corpus's `contents`."""

    def __init__(self, documents: list[dict]):
        from rank_bm25 import BM25Okapi

        if not documents:
            raise ValueError("the corpus has no documents")
        self.documents = documents
        self.bm25 = BM25Okapi([tokens(document["contents"]) for document in documents])

    @classmethod
    def from_jsonl(cls, path: str | Path) -> "Bm25Index":
        documents = []
        for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("contents"), str):
                raise ValueError(f"{path}:{number}: a corpus row is {{\"id\": ..., \"contents\": str}}")
            documents.append({"id": str(row.get("id", number)), "contents": row["contents"]})
        return cls(documents)

    def search(self, query: str, topk: int) -> list[tuple[dict, float]]:
        scores = self.bm25.get_scores(tokens(query[:MAX_QUERY_CHARS]))
        best = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:topk]
        return [(self.documents[i], float(scores[i])) for i in best]


def answer(index: Bm25Index, request: dict) -> dict:
    """The /retrieve answer of a request, or ValueError saying what is wrong with it."""
    queries, topk = request.get("queries"), request.get("topk", 3)
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries) or len(queries) > MAX_QUERIES:
        raise ValueError(f"queries must be a list of at most {MAX_QUERIES} strings")
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"topk must be an integer in [1, {MAX_TOPK}]")
    with_scores = bool(request.get("return_scores", True))
    result = []
    for query in queries:
        hits = index.search(query, topk)
        result.append([{"document": dict(document), **({"score": score} if with_scores else {})}
                       for document, score in hits])
    return {"result": result}


def _handler(index: Bm25Index):
    class RetrieveHandler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.rstrip("/") != "/retrieve":
                return self._reply(404, {"error": f"no such endpoint {self.path}; POST /retrieve"})
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_REQUEST_BYTES:
                return self._reply(400, {"error": f"a request body of 1 to {MAX_REQUEST_BYTES} bytes is expected"})
            try:
                self._reply(200, answer(index, json.loads(self.rfile.read(length))))
            except (ValueError, AttributeError) as error:
                self._reply(400, {"error": str(error)})

        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:  # one line per request would flood a training log
            pass

    return RetrieveHandler


def make_server(corpus: str | Path, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    index = Bm25Index.from_jsonl(corpus)
    server = ThreadingHTTPServer((host, port), _handler(index))
    server.daemon_threads = True
    server.documents = len(index.documents)
    return server


def serve_in_background(corpus: str | Path) -> str:
    """A server on a free loopback port, in a daemon thread of this process (it ends with the run); its URL."""
    server = make_server(corpus)
    threading.Thread(target=server.serve_forever, name="retrieval-server", daemon=True).start()
    host, port = server.server_address[:2]
    return f"http://{host}:{port}/retrieve"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True, help="JSONL of {id, contents}")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    try:
        server = make_server(args.corpus, args.host, args.port)
    except (OSError, ValueError) as error:
        print(f"retrieval_server: {error}", file=sys.stderr)
        return 2
    print(f"retrieval_server: {server.documents} documents at http://{args.host}:{server.server_address[1]}/retrieve",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
