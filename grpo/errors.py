"""The errors a user can act on, shared by every floor: the CLI prints them as one line, exit code 2."""


class StageError(RuntimeError):
    """A stage cannot run: missing input, bad data, or a failed check."""


class DatasetError(ValueError):
    """A dataset cannot be read or lacks what the config names."""


class DatasetChangedError(DatasetError):
    """A dataset no longer has the fingerprint its run recorded at grpo init."""


class LayoutError(StageError):
    """A run id or iteration that names no place in storage, or a run that does not exist."""


S3_ERRORS = ("EndpointConnectionError", "ConnectTimeoutError", "NoCredentialsError", "ClientError")


def storage_error(e: BaseException) -> bool:
    """An error from storage, the network or the OS (what `describe` turns into one line)."""
    return isinstance(e, OSError) or type(e).__name__ in S3_ERRORS


def describe(e: BaseException, storage_url: str = "") -> str:
    """One line for an error from storage, the network, the OS or a parser: what failed, where, what to do."""
    import errno

    name = type(e).__name__
    text = " ".join(str(e).split())
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        where = e.filename or "storage"
        return f"no space left on the device writing {where}: free space, then rerun (nothing was committed)"
    if name in ("EndpointConnectionError", "ConnectTimeoutError") or "Could not connect to the endpoint" in text:
        return f"S3 endpoint unreachable ({text}): check AWS_ENDPOINT_URL and that the server is up"
    if name == "NoCredentialsError":
        return "S3: no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
    on_s3 = storage_url.startswith("s3://")
    if (
        name == "ClientError"
        or "InvalidAccessKeyId" in text
        or "SignatureDoesNotMatch" in text
        or (on_s3 and isinstance(e, PermissionError))
    ):
        return f"S3 refused the request ({text}): check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket"
    if isinstance(e, OSError) and e.filename:
        return f"{e.filename}: {e.strerror or text}"
    return f"{name}: {text}"


class LearnError(StageError):
    """The update cannot be committed: non-finite loss, gradients or weights, or a sampler gap."""


def one_line(e: BaseException, limit: int = 300) -> str:
    """An exception's type and message on one line, cut at `limit` characters (transformers' messages
    run to a screenful)."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:limit] + '…' if len(text) > limit else text}"
