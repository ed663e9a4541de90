"""Object storage's refusals and failures as one line with the cause and the remedy (`StoreError`).

s3fs, gcsfs and huggingface_hub each raise their own: botocore's NoCredentialsError, a PermissionError
("Forbidden", "SignatureDoesNotMatch"), a FileNotFoundError naming a bucket that does not exist,
google-auth's DefaultCredentialsError, gcsfs's HttpError 401/403, the Hub's RepositoryNotFoundError.
`store_error` turns any of them into a StoreError that says what was being done to which URL, why it
failed and what to do; anything else (a bug) is left alone. `translated` wraps a block with it.

The credentials never appear: the message is built from the error's class and text, and the value of
every credentials variable of objstore.SCHEMES is masked out of that text all the same.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from fleet.errors import MASK, FleetError, StoreError

__all__ = ["store_error", "translated"]

_CREDENTIALS = ("set the store's credentials in this shell's environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "GOOGLE_APPLICATION_CREDENTIALS, HF_TOKEN) or name a Prefect block in FLEET_STORE_SECRET / "
                "FLEET_STORE_AWS_BLOCK")


def _masked(text: str) -> str:
    from fleet.generation.data.objstore import STORE_ENV

    for name in (*STORE_ENV, "FLEET_GCS_CREDENTIALS_JSON"):
        value = os.environ.get(name)
        if value and len(value) >= 6 and name not in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL",
                                                       "AWS_ENDPOINT_URL_S3", "HF_ENDPOINT", "STORAGE_EMULATOR_HOST",
                                                       "GOOGLE_CLOUD_PROJECT", "GCSFS_DEFAULT_PROJECT"):
            text = text.replace(value, MASK)
    return text


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and all(e is not s for s in seen):
        seen.append(e)
        e = e.__cause__ or e.__context__
    return seen


def _bucket(url: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0]}"


def store_error(exc: BaseException, url: str, doing: str) -> StoreError | None:
    """The StoreError for `exc`, raised while `doing` (e.g. "reading", "writing a test object under")
    `url`; None when `exc` is not the store's (leave it to propagate: a bug keeps its traceback)."""
    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, FleetError):
        return None
    chain = _chain(exc)
    names = {type(e).__name__ for e in chain}
    text = _masked(" ".join(f"{type(e).__name__}: {e}" for e in chain))
    low = text.lower()
    first = _masked(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)[:200]
    where = f"{doing} {url}"
    if names & {"NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError"} or \
            "unable to locate credentials" in low:
        return StoreError(f"{where} failed: no credentials for the store were found", remedy=_CREDENTIALS, path=url)
    if any(k in text for k in ("SignatureDoesNotMatch", "InvalidAccessKeyId", "InvalidToken", "ExpiredToken",
                               "invalid_grant", "401")) or "unauthorized" in low:
        return StoreError(f"{where} failed: the store refused the credentials ({first})",
                          remedy="check the key and the secret (or token) in the environment are the store's and "
                                 "current; " + _CREDENTIALS, path=url)
    verb = "read" if doing.startswith("read") else "write"
    if "accessdenied" in low or names & {"GatedRepoError"}:
        return StoreError(f"{where} failed: permission denied ({first})",
                          remedy=f"give these credentials permission to {verb} {url} (or use credentials that have it)",
                          path=url)
    if isinstance(exc, PermissionError) or "forbidden" in low or "403" in text:
        # a HEAD's 403 carries no error code: a wrong secret and a missing permission look the same
        return StoreError(f"{where} failed: the store refused access ({first}): wrong credentials, or no "
                          f"permission to {verb} it",
                          remedy=f"check the key and secret in the environment, and that they may {verb} {url}; "
                                 + _CREDENTIALS, path=url)
    if "nosuchbucket" in low or "bucket does not exist" in low or ("bucket" in low and "not found" in low):
        again = "" if doing.startswith("read") else ", then run the same command again to resume"
        return StoreError(f"{where} failed: the bucket {_bucket(url)} does not exist",
                          remedy=f"create the bucket {_bucket(url)} (or give a URL in a bucket that exists){again}",
                          path=url)
    if names & {"RepositoryNotFoundError", "RevisionNotFoundError"}:
        return StoreError(f"{where} failed: the Hub has no such repository or revision, or it is private ({first})",
                          remedy="check the repository's name; for a private one set HF_TOKEN", path=url)
    if isinstance(exc, FileNotFoundError) or names & {"EntryNotFoundError"}:
        return StoreError(f"{where} failed: not found ({first})", remedy="check the URL", path=url)
    if isinstance(exc, (OSError, ValueError)) or names & {"ClientError", "HttpError", "HfHubHTTPError",
                                                          "EndpointConnectionError", "ConnectTimeoutError"}:
        return StoreError(f"{where} failed: {type(exc).__name__}: {first}",
                          remedy="check the URL, that the store answers from here (its endpoint: AWS_ENDPOINT_URL, "
                                 "STORAGE_EMULATOR_HOST, HF_ENDPOINT), and its credentials", path=url)
    return None


@contextmanager
def translated(url: str, doing: str) -> Iterator[None]:
    """Run the block; a store's own error raised in it becomes its StoreError (see `store_error`)."""
    try:
        yield
    except Exception as exc:
        err = store_error(exc, url, doing)
        if err is None:
            raise
        raise err from None
