"""`grpo export --push-to-hub REPO`: an exported folder, its model card included, uploaded to a Hugging Face Hub model
repository through huggingface_hub (HfApi.create_repo, then upload_folder). The token is the hub's own: HF_TOKEN, or
the one `hf auth login` stored; HF_ENDPOINT names another hub (a mirror, or the tests' local one)."""

from __future__ import annotations

import tempfile

from grpo.record.counts import is_local
from grpo.record.storage import url_to_fs
from stages import StageError


def hub_repo(repo: str) -> tuple[str, str]:
    """(OWNER/NAME, token) for pushing to `repo` (NAME alone: the token's owner's), checked before anything is
    exported or uploaded: one line for a malformed id, no token, or a token the hub refuses."""
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise StageError(f"--push-to-hub {repo}: not a Hub repository id ({first_line(e)}); write NAME or OWNER/NAME")
    token = get_token()
    if not token:
        raise StageError(
            f"--push-to-hub {repo}: no Hugging Face token; set HF_TOKEN or run `hf auth login` (nothing was exported)"
        )
    if "/" in repo:
        return repo, token
    try:
        owner = HfApi(token=token).whoami()["name"]
    except HfHubHTTPError as e:
        raise StageError(f"--push-to-hub {repo}: the hub refused the token: {first_line(e)}") from None
    return f"{owner}/{repo}", token


def push_folder(folder: str, repo_id: str, token: str, private: bool, message: str) -> str:
    """Upload the exported `folder` (a local folder or an fsspec URL) to the model repository `repo_id`, created
    if missing; returns the commit's URL. The hub's refusal is one line."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(token=token)
    fs, root = url_to_fs(folder)
    with tempfile.TemporaryDirectory() as tmp:
        if not is_local(fs):  # upload_folder reads a local folder
            fs.get(root.rstrip("/") + "/", tmp, recursive=True)
        try:
            api.create_repo(repo_id, private=private or None, exist_ok=True)
            done = api.upload_folder(repo_id=repo_id, folder_path=root if is_local(fs) else tmp, commit_message=message)
        except (HfHubHTTPError, ValueError) as e:  # ValueError: the card's metadata, as the hub validates it
            raise StageError(f"--push-to-hub {repo_id}: the hub refused: {first_line(e)}") from None
    return done.commit_url


def first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
