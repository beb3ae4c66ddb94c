"""`grpo export --push-to-hub REPO` (issue 54, item 7) against a local stand-in for the Hugging Face Hub: an HTTP
server in the test answering the calls huggingface_hub's create_repo and upload_folder make (HF_ENDPOINT points the
library at it), so the real library runs its real requests and never reaches the network."""

import base64
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from test_stages import make_run

from grpo.record.storage import open_storage
from stages.iteration import run_warm

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_local_test_token"


class FakeHub(BaseHTTPRequestHandler):
    """The hub's API as upload_folder uses it: whoami, create a repo, preupload (every file a regular blob, so its
    bytes ride in the commit), commit. Anything else is a 404, recorded."""

    hub: dict

    def log_message(self, *args):  # quiet
        pass

    def reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def do_GET(self):
        self.handle_call("GET", b"")

    def do_POST(self):
        self.handle_call("POST", self.body())

    def handle_call(self, method: str, data: bytes) -> None:
        hub, path = self.hub, self.path.split("?")[0]
        hub["calls"].append(f"{method} {path}")
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self.reply(401, {"error": "Invalid credentials in Authorization header"})
        endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        if path == "/api/whoami-v2":
            return self.reply(200, {"type": "user", "name": "tester"})
        if path == "/api/validate-yaml":  # the card's front matter, as the hub checks it before an upload
            content = json.loads(data)["content"]
            try:
                hub["metadata"] = yaml.safe_load(content.split("---\n")[1])
            except (IndexError, yaml.YAMLError) as e:
                return self.reply(400, {"errors": [{"message": f"bad front matter: {e}"}]})
            return self.reply(200, {})
        if path == "/api/repos/create":
            asked = json.loads(data)
            repo = f"{asked['organization'] or 'tester'}/{asked['name']}"
            hub["repos"][repo] = {"visibility": asked.get("visibility"), "files": {}}
            return self.reply(200, {"url": f"{endpoint}/{repo}"})
        parts = path.split("/")  # /api/models/OWNER/NAME/(preupload|commit)/main
        if method == "POST" and len(parts) == 7 and parts[2] == "models" and f"{parts[3]}/{parts[4]}" in hub["repos"]:
            repo = hub["repos"][f"{parts[3]}/{parts[4]}"]
            if parts[5] == "preupload":
                files = json.loads(data)["files"]
                modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                return self.reply(200, {"files": modes})
            if parts[5] == "commit":
                for line in data.splitlines():
                    item = json.loads(line)
                    if item["key"] == "header":
                        repo["message"] = item["value"]["summary"]
                    elif item["key"] == "file":
                        repo["files"][item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                oid = "0" * 40
                url = f"{endpoint}/{parts[3]}/{parts[4]}/commit/{oid}"
                return self.reply(200, {"commitUrl": url, "commitOid": oid})
        hub["unknown"].append(f"{method} {path}")
        return self.reply(404, {"error": f"not served here: {path}"})


@pytest.fixture
def hub():
    state = {"calls": [], "repos": {}, "unknown": []}
    handler = type("Handler", (FakeHub,), {"hub": state})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state["endpoint"] = f"http://127.0.0.1:{server.server_address[1]}"
    yield state
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Run r: one iteration of the tiny settings."""
    url = (tmp_path_factory.mktemp("push") / "store").as_uri()
    storage = open_storage(url)
    make_run(storage, "r")
    for _ in run_warm(storage, "r", 0, 1):
        pass
    return url


def grpo(url: str, hub: dict, tmp_path: Path, *args: str, token: str | None = TOKEN) -> subprocess.CompletedProcess:
    """`grpo --storage URL ARGS` as a user runs it, the hub at HF_ENDPOINT, HF_HOME empty (no stored login)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env |= {"HF_ENDPOINT": hub["endpoint"], "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    env |= {"HF_TOKEN": token} if token else {}
    cli = [sys.executable, "-m", "flows.cli", "--storage", url, *args]
    return subprocess.run(cli, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)


def test_export_pushes_the_folder_and_its_card_to_the_hub(trained, hub, tmp_path):
    done = grpo(trained, hub, tmp_path, "export", "--run", "r", str(tmp_path / "out"), "--push-to-hub", "grpo-tiny")
    assert done.returncode == 0, done.stderr[-3000:]
    assert hub["unknown"] == [], hub["unknown"]
    assert list(hub["repos"]) == ["tester/grpo-tiny"]  # NAME alone: under the token's owner
    pushed = hub["repos"]["tester/grpo-tiny"]["files"]
    local = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    assert pushed == local, (sorted(pushed), sorted(local))  # every file, byte for byte
    assert any(name.endswith(".safetensors") for name in pushed), sorted(pushed)
    card = pushed["README.md"].decode()
    assert "grpo-flow" in card and 'from_pretrained("tester/grpo-tiny")' in card, card
    assert hub["metadata"]["library_name"] == "transformers" and "grpo" in hub["metadata"]["tags"], hub["metadata"]
    assert "pushed to tester/grpo-tiny" in done.stdout, done.stdout


def test_pushing_an_export_made_before_with_the_stored_login_uploads_it_with_a_card_for_the_hub(trained, hub, tmp_path):
    assert grpo(trained, hub, tmp_path, "export", "--run", "r").returncode == 0  # the default folder
    (tmp_path / "hf_home").mkdir()
    (tmp_path / "hf_home" / "token").write_text(TOKEN)  # where `hf auth login` stores it: no HF_TOKEN this time
    done = grpo(trained, hub, tmp_path, "export", "--run", "r", "--push-to-hub", "team/model", "--private", token=None)
    assert done.returncode == 0, done.stderr[-3000:]
    repo = hub["repos"]["team/model"]
    assert repo["visibility"] == "private" and 'from_pretrained("team/model")' in repo["files"]["README.md"].decode()
    assert "/api/whoami-v2" not in " ".join(hub["calls"])  # OWNER/NAME given: no need to ask whose


def test_no_token_is_one_line_before_anything_is_exported_or_uploaded(trained, hub, tmp_path):
    done = grpo(trained, hub, tmp_path, "export", "--run", "r", str(tmp_path / "out"), "--push-to-hub", "m", token=None)
    assert done.returncode != 0
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .endswith("--push-to-hub m: no Hugging Face token; set HF_TOKEN or run `hf auth login` (nothing was exported)")
    ), done.stderr[-2000:]
    assert hub["calls"] == [] and not (tmp_path / "out").exists()


def test_a_token_the_hub_refuses_and_a_malformed_repo_are_one_line(trained, hub, tmp_path):
    done = grpo(trained, hub, tmp_path, "export", "--run", "r", "--push-to-hub", "m", token="hf_wrong")
    assert done.returncode != 0 and "--push-to-hub m: the hub refused the token: Invalid" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and hub["repos"] == {}
    done = grpo(trained, hub, tmp_path, "export", "--run", "r", "x", "--push-to-hub", "team/m", token="hf_wrong")
    assert done.returncode != 0 and "--push-to-hub team/m: the hub refused: " in done.stderr, done.stderr
    assert "401" in done.stderr and "Traceback" not in done.stderr and hub["repos"] == {}
    assert (tmp_path / "x" / "README.md").exists()  # exported here, nothing uploaded
    done = grpo(trained, hub, tmp_path, "export", "--run", "r", "--push-to-hub", "a/b/c")
    assert done.returncode != 0 and "--push-to-hub a/b/c: not a Hub repository id" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
