"""MindSpeed-RL's search tool (tools/search_tool.py) and the retrieval server the project ships
(tools/retrieval_server.py, Search-R1's /retrieve, BM25): their own config file, its URL pointed at the shipped server,
returns the right passage in their text format; the server's protocol and its refusals; `local` serving.

Runs where: in the pytest process; the server in a thread on a loopback port.
"""
import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from mindspeed_rl.tools.registry import load_tools
from mindspeed_rl.tools.retrieval_server import make_server

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "configs/tools/search_corpus.jsonl"
THEIR_FILE = REPO / "tests/data/mindspeed_rl_recipes/tools/search_tool_config.yaml"


@pytest.fixture(scope="module")
def server_url():
    server = make_server(CORPUS)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    server.shutdown()


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_server_answers_search_r1s_protocol(server_url):
    status, answer = _post(server_url, {"queries": ["highest mountain", "speed of light"], "topk": 2,
                                        "return_scores": True})
    assert status == 200 and len(answer["result"]) == 2
    first, second = answer["result"]
    assert first[0]["document"]["contents"].startswith("Mount Everest") and first[0]["score"] > first[1]["score"]
    assert second[0]["document"]["contents"].startswith("Speed of light") and set(second[0]["document"]) == {
        "id", "contents"}


@pytest.mark.parametrize("body", [{"queries": "one"}, {"queries": ["q"], "topk": 0}, {"queries": ["q"] * 65}])
def test_the_server_refuses_a_bad_request(server_url, body):
    status, answer = _post(server_url, body)
    assert status == 400 and "error" in answer


def test_their_file_pointed_at_the_shipped_server_returns_the_right_passage(tmp_path, server_url):
    path = tmp_path / "search_tool_config.yaml"
    path.write_text(THEIR_FILE.read_text().replace("http://localhost:8080/retrieve", server_url))
    (tool,) = load_tools(str(path)).values()
    text, reward, metrics = tool.execute(tool.create(), {"query_list": ["Who painted the Mona Lisa?"]})
    result = json.loads(text)["result"]
    assert result.startswith("Doc 1 (Title: Leonardo da Vinci)\nLeonardo da Vinci painted the Mona Lisa")
    assert result.count("Doc ") == 3 and metrics["status"] == "success" and reward == 0.0


def test_their_file_loads_unchanged_and_an_unreachable_service_answers_an_error_in_time():
    (tool,) = load_tools(str(THEIR_FILE)).values()
    assert (tool.name, tool.topk, tool.rate_limit) == ("search", 3, 120)
    tool.retrieval_service_url, tool.timeout = "http://127.0.0.1:9/retrieve", 2.0  # nothing listens on port 9
    text, _, metrics = tool.execute(tool.create(), {"query_list": ["anything"]})
    assert json.loads(text)["result"].startswith("Search error:") and metrics["status"] == "api_error"


def test_local_serves_the_corpus_from_this_process(monkeypatch):
    monkeypatch.chdir(REPO)
    (tool,) = load_tools(str(REPO / "configs/tools/search_local.yaml")).values()
    text, _, _ = tool.execute(tool.create(), {"query_list": ["When were the first modern Olympic Games?"]})
    assert json.loads(text)["result"].startswith("Doc 1 (Title: Olympic Games)")
    missing = tool.execute(tool.create(), {"query": "no list"})[0]
    assert "query_list" in json.loads(missing)["result"]


def test_the_global_rate_limit_is_one_semaphore_per_kind_of_tool_in_the_process():
    from mindspeed_rl.tools.sandbox_fusion_tool import SandboxFusionTool
    from mindspeed_rl.tools.search_tool import SearchTool

    (first,), (second,) = (load_tools(str(THEIR_FILE)).values() for _ in range(2))
    assert first._slots is second._slots  # their file's enable_global_rate_limit: true
    separate = SearchTool({**first.config, "enable_global_rate_limit": False}, first.tool_schema)
    assert separate._slots is not first._slots
    code = SandboxFusionTool({"sandbox_fusion_url": "http://127.0.0.1:9/run_code"}, first.tool_schema)
    assert code._slots is not first._slots  # the code tools share their own
