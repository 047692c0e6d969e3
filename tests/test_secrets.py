"""Secrets never reach logs, errors, reprs or CLI output.

Real operations run with DEBUG logging for every logger - cloudckpt's and those of the
clients under it (s3fs, fsspec, botocore, aiobotocore, gcsfs, google-auth, urllib3,
aiohttp) - against SeaweedFS's S3 API, fake-gcs-server and a loopback HTTP server,
with known sentinel secrets: credentials in storage options, in the URI and in the
endpoint, a session token, a GCS OAuth token (also through gcsfs's tokeninfo check,
whose error quoted ``access_token=...``), a service account's private key. Every
captured record, the CLI's stdout and stderr (subprocesses, ``-vv``, text and
``--json``), every exception's text, repr and traceback, and the reprs of what the
API returns are then searched for the sentinels.
"""

from __future__ import annotations

import base64
import datetime
import functools
import json
import logging
import os
import pickle
import subprocess
import sys
import threading
import traceback
from collections.abc import Iterable, Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt import ShardedTensor, checker, logfilter, tracker
from cloudckpt.config import CheckpointConfig
from cloudckpt.errors import CheckpointingException
from cloudckpt.redact import redact_text, redact_uri
from cloudckpt.storage import CheckpointStorage
from tests.fixtures_object_stores import S3_CASES, GCSEndpoint, S3Endpoint, server_for
from tests.fixtures_object_stores import bucket_location as _bucket_location
from tests.servers import free_loopback_port

SEAWEEDFS = "s3-seaweedfs" if "s3-seaweedfs" in S3_CASES else S3_CASES[0]
FAKE_GCS = "gs-fakegcs"
REPO_ROOT = Path(__file__).resolve().parents[1]

SESSION_TOKEN = "sentinel-session-token-5c1e9a"
INLINE_SECRET = "sentinel-inline-secret-8d2f"
ENDPOINT_PASSWORD = "sentinel-endpoint-pw-41b7"
GCS_TOKEN = "sentinel-gcs-token-93e0d1"
HTTP_PASSWORD = "sentinel-http-pw-2a6c"
NO_RETRY = {"retries": {"mode": "standard", "max_attempts": 1}}


# -- collecting and searching ------------------------------------------------------------


def exception_texts(exc: BaseException) -> list[str]:
    """The traceback of ``exc`` (chained errors included), and str / repr of each."""
    texts = ["".join(traceback.format_exception(exc))]
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        texts += [str(current), repr(current)]
        current = current.__cause__ or current.__context__
    return texts


def log_texts(caplog: pytest.LogCaptureFixture) -> list[str]:
    records = caplog.records
    return [caplog.text] + [r.getMessage() + (r.exc_text or "") for r in records]


def assert_clean(texts: Iterable[str], sentinels: Iterable[str]) -> None:
    for text in texts:
        for secret in sentinels:
            at = text.find(secret)
            assert at < 0, f"{secret!r} shown: ...{text[max(0, at - 200) : at + 80]}..."


@pytest.fixture
def debug_everywhere(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Every logger at DEBUG, its records captured by ``caplog`` on the root logger."""
    manager = logging.Logger.manager
    loggers = [v for v in manager.loggerDict.values() if isinstance(v, logging.Logger)]
    saved = [(lg, lg.level, lg.disabled) for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.NOTSET)
        lg.disabled = False
    caplog.set_level(logging.DEBUG)
    yield caplog
    for lg, level, disabled in saved:
        lg.setLevel(level)
        lg.disabled = disabled


def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m cloudckpt -vv ARGS`` (DEBUG logging) without stray credentials."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "STORAGE_EMU"))}
    return subprocess.run(
        [sys.executable, "-m", "cloudckpt", "-vv", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**base, **env},
        stdin=subprocess.DEVNULL,
    )


def small_state(iteration: int) -> dict[str, Any]:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.arange(12.0).reshape(3, 4)),
        "iteration": iteration,
    }


@pytest.fixture(params=[SEAWEEDFS])
def seaweedfs(request: pytest.FixtureRequest) -> tuple[S3Endpoint, str, dict[str, Any]]:
    """SeaweedFS (the real S3 server): ``(server, bucket uri, storage options)``."""
    server = server_for(request, request.param)
    assert isinstance(server, S3Endpoint)
    return (server, *_bucket_location(request, request.param))


@pytest.fixture(params=[FAKE_GCS])
def fake_gcs(request: pytest.FixtureRequest) -> tuple[GCSEndpoint, str, dict[str, Any]]:
    server = server_for(request, request.param)
    assert isinstance(server, GCSEndpoint)
    return (server, *_bucket_location(request, request.param))


# -- S3 ----------------------------------------------------------------------------------


def test_s3_api_at_debug_shows_no_secret(
    seaweedfs: tuple[S3Endpoint, str, dict[str, Any]], debug_everywhere: Any
) -> None:
    server, bucket_uri, options = seaweedfs
    run = f"{bucket_uri}/run"
    texts: list[str] = []
    for iteration in (1, 2):
        cloudckpt.save(small_state(iteration), f"{run}/iter_{iteration}", storage_options=options)
    loaded = cloudckpt.load(small_state(0), f"{run}/iter_2", storage_options=options)
    assert isinstance(loaded, dict) and loaded["iteration"] == 2
    common = cloudckpt.load_common_state_dict(f"{run}/iter_2", storage_options=options)
    report = checker.verify(f"{run}/iter_2", deep=True, storage_options=options)
    assert report.ok, report
    infos = tracker.list_checkpoints(run, storage_options=options)
    assert tracker.latest(run, storage_options=options) == f"{run}/iter_2"
    gc = tracker.collect_garbage(run, keep_last=1, storage_options=options)
    assert [a.uri for a in gc.actions] == [f"{run}/iter_1"]
    config = CheckpointConfig(uri=f"s3://AKIDEXAMPLE:{INLINE_SECRET}@b/r", storage_options=options)
    storage = CheckpointStorage(f"{run}/iter_2", storage_options=options)
    inline = CheckpointStorage(f"s3://{server.key}:{INLINE_SECRET}@b/r", storage_options=options)
    reprs = (loaded, common, report, infos, gc, config, storage, inline, inline.location)
    texts += [repr(x) for x in reprs]
    texts += [json.dumps(report.to_dict()), json.dumps(gc.to_dict())]

    failures = {
        "session token": lambda: checker.verify(
            f"{run}/iter_2",
            storage_options={**options, "token": SESSION_TOKEN, "config_kwargs": NO_RETRY},
        ),
        "credentials in the URI": lambda: cloudckpt.load_common_state_dict(
            f"s3://{server.key}:{INLINE_SECRET}@{bucket_uri.removeprefix('s3://')}/run/iter_2",
            storage_options={"endpoint_url": server.endpoint_url, "skip_instance_cache": True},
        ),
        "credentials in the endpoint": lambda: _with_endpoint_password(server, run).list(),
    }
    for what, call in failures.items():
        with pytest.raises(CheckpointingException) as info:
            call()
        texts += exception_texts(info.value)
        if what == "credentials in the URI":
            assert f"s3://***:***@{bucket_uri.removeprefix('s3://')}" in str(info.value)

    logged = log_texts(debug_everywhere)
    names = {r.name for r in debug_everywhere.records}
    assert {"s3fs", "botocore.endpoint", "botocore.auth", "cloudckpt.config"} <= names, names
    assert "'Authorization': b'***'" in debug_everywhere.text  # botocore's signed headers
    secrets = (server.key, server.secret, SESSION_TOKEN, INLINE_SECRET, ENDPOINT_PASSWORD)
    assert_clean(texts + logged, secrets)


def _with_endpoint_password(server: S3Endpoint, run: str) -> CheckpointStorage:
    """A storage on a filesystem built by the caller, whose endpoint carries a password
    (aiohttp refuses it); one attempt per request (s3fs retries 5 times otherwise)."""
    import s3fs  # noqa: PLC0415 - only this test builds its own filesystem

    endpoint = server.endpoint_url.replace("://", f"://admin:{ENDPOINT_PASSWORD}@")
    fs = s3fs.S3FileSystem(
        endpoint_url=endpoint,
        key=server.key,
        secret=server.secret,
        client_kwargs={"region_name": server.region},
        config_kwargs=NO_RETRY,
        skip_instance_cache=True,
    )
    fs.retries = 1
    return CheckpointStorage(run, fs=fs)


def test_s3_cli_at_debug_shows_no_secret(
    seaweedfs: tuple[S3Endpoint, str, dict[str, Any]],
) -> None:
    server, bucket_uri, options = seaweedfs
    run = f"{bucket_uri}/run"
    for iteration in (1, 2):
        cloudckpt.save(small_state(iteration), f"{run}/iter_{iteration}", storage_options=options)
    flags = [
        f"--storage-option=endpoint_url={server.endpoint_url}",
        f"--storage-option=key={server.key}",
        f"--storage-option=secret={server.secret}",
        f'--storage-option=client_kwargs={{"region_name": "{server.region}"}}',
    ]
    inline = f"s3://{server.key}:{INLINE_SECRET}@{bucket_uri.removeprefix('s3://')}/run"
    token = f"--storage-option=token={SESSION_TOKEN}"
    runs = {
        "ls": (cli("ls", run, "--json", *flags), 0),
        "inspect": (cli("inspect", f"{run}/iter_2", *flags), 0),
        "verify": (cli("verify", f"{run}/iter_2", "--deep", "--json", *flags), 0),
        "gc": (cli("gc", run, "--keep-last", "1", "--dry-run", *flags), 0),
        "denied": (cli("verify", f"{run}/iter_2", "--json", *flags, token), 2),
        "inline": (cli("ls", inline, "--json", flags[0], flags[3]), 2),
    }
    for name, (proc, status) in runs.items():
        assert proc.returncode == status, (name, proc.stdout, proc.stderr[-3000:])
    assert "DEBUG botocore.endpoint" in runs["verify"][0].stderr  # -vv logs the requests
    assert '"uri": "s3://***:***@' in runs["inline"][0].stdout
    outputs = [p.stdout + p.stderr for p, _ in runs.values()]
    assert_clean(outputs, (server.key, server.secret, SESSION_TOKEN, INLINE_SECRET))


# -- GCS -----------------------------------------------------------------------------------


def _dead_proxy(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Send this process's (and a child's) HTTPS requests to a loopback port where
    nothing listens: gcsfs's check of a raw token (a GET of Google's tokeninfo URL with
    ``access_token=TOKEN``) then fails at once, offline or not."""
    proxy = {"HTTPS_PROXY": f"http://127.0.0.1:{free_loopback_port()}"}
    proxy["https_proxy"] = proxy["HTTPS_PROXY"]
    for name, value in proxy.items():
        monkeypatch.setenv(name, value)
    for name in ("NO_PROXY", "no_proxy", "FETCH_RAW_TOKEN_EXPIRY"):
        monkeypatch.delenv(name, raising=False)
    return proxy


def _service_account(token_uri: str) -> tuple[dict[str, str], list[str]]:
    """A service account's info with a fresh RSA key, and sentinels from it."""
    from cryptography.hazmat.primitives import serialization  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric import rsa  # noqa: PLC0415

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    info = {
        "type": "service_account",
        "project_id": "test",
        "private_key_id": "sentinel-private-key-id-7e21",
        "private_key": pem,
        "client_email": "ckpt@test.iam.gserviceaccount.com",
        "client_id": "1",
        "token_uri": token_uri,
    }
    body = pem.splitlines()[1:-1]
    return info, [info["private_key_id"], body[3], body[-2]]


def test_gcs_tokens_and_private_keys_at_debug_show_no_secret(
    fake_gcs: tuple[GCSEndpoint, str, dict[str, Any]],
    debug_everywhere: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, bucket_uri, options = fake_gcs
    uri = f"{bucket_uri}/run/iter_1"
    token_options = {**options, "token": GCS_TOKEN}
    texts: list[str] = []

    # a raw OAuth token, sent as "Authorization: Bearer ..." (its expiry not looked up)
    monkeypatch.setenv("FETCH_RAW_TOKEN_EXPIRY", "false")
    cloudckpt.save(small_state(1), uri, storage_options=token_options)
    assert checker.verify(uri, deep=True, storage_options=token_options).ok
    common = cloudckpt.load_common_state_dict(uri, storage_options=token_options)
    texts.append(repr(common))

    # gcsfs looks its expiry up: GET tokeninfo?access_token=TOKEN, which fails
    env = _dead_proxy(monkeypatch)
    with pytest.raises(CheckpointingException) as info:
        checker.verify(uri, storage_options=token_options)
    assert "tokeninfo?access_token=***" in str(info.value), str(info.value)
    texts += exception_texts(info.value)

    # a service account's private key, whose token endpoint is unreachable
    account, key_sentinels = _service_account(f"http://127.0.0.1:{free_loopback_port()}/token")
    with pytest.raises(CheckpointingException) as info:
        checker.verify(uri, storage_options={**options, "token": account})
    texts += exception_texts(info.value)

    flags = [
        f"--storage-option=endpoint_url={server.endpoint_url}",
        "--storage-option=project=test",
    ]
    verified = cli("verify", uri, "--json", *flags, f"--storage-option=token={GCS_TOKEN}", **env)
    assert verified.returncode == 2, verified.stdout + verified.stderr[-3000:]
    assert "tokeninfo?access_token=***" in json.loads(verified.stdout)["error"]
    texts += [verified.stdout, verified.stderr]

    assert {"gcsfs", "cloudckpt.config"} <= {r.name for r in debug_everywhere.records}
    assert_clean(texts + log_texts(debug_everywhere), [GCS_TOKEN, *key_sentinels])


# -- fsspec's HTTP filesystem and aiohttp's errors ----------------------------------------


class _Files(SimpleHTTPRequestHandler):
    """Serves a directory; any path with "broken" in it answers 500."""

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        if "broken" in self.path:
            self.send_error(500)
        else:
            super().do_GET()


@pytest.fixture
def http_root(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """``(directory, http://127.0.0.1:PORT)``: a loopback HTTP server of the directory."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Files, directory=tmp_path))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield tmp_path, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_http_userinfo_and_aiohttp_errors_show_no_secret(
    http_root: tuple[Path, str], debug_everywhere: Any
) -> None:
    """fsspec.http logs every URL it fetches; aiohttp's ClientResponseError shows the
    request's URL and (in its repr) headers, Basic credentials included."""
    root, base = http_root
    cloudckpt.save(small_state(3), str(root / "ckpt"))
    served = base.replace("://", f"://user:{HTTP_PASSWORD}@")
    common = cloudckpt.load_common_state_dict(f"{served}/ckpt")
    assert common == {"iteration": 3}
    with pytest.raises(CheckpointingException) as info:
        cloudckpt.load_common_state_dict(f"{served}/broken/ckpt?token={HTTP_PASSWORD}")
    client_error = info.value.__cause__
    import aiohttp  # noqa: PLC0415

    assert isinstance(client_error, aiohttp.ClientResponseError), repr(client_error)
    assert type(client_error).__name__ == "ClientResponseError" and client_error.status == 500
    assert "'Authorization': '***'" in repr(client_error)  # Basic credentials masked
    basic = base64.b64encode(f"user:{HTTP_PASSWORD}".encode()).decode()
    assert any(r.name.startswith("fsspec") for r in debug_everywhere.records)
    texts = exception_texts(info.value) + log_texts(debug_everywhere)
    assert_clean(texts, [HTTP_PASSWORD, basic])


# -- the patterns, on what the clients really print ---------------------------------------

SECRET = "Sentinel0Secret0Value0123"  # what each text below hides


@pytest.mark.parametrize(
    "text",
    [
        # botocore.endpoint's signed request and botocore.auth's canonical request
        f"headers={{'X-Amz-Date': b'20240101T000000Z', 'Authorization': b'AWS4-HMAC-SHA256 "
        f"Credential={SECRET}/20240101/us-east-1/s3/aws4_request, SignedHeaders=host, "
        f"Signature=abc', 'X-Amz-Security-Token': b'{SECRET}'}}",
        f"CanonicalRequest:\nGET\n/b/k\n\nhost:h\nx-amz-security-token:{SECRET}\n",
        f"Signature:\n{SECRET}",
        f"AWS4-HMAC-SHA256 Credential=AKIA/x, SignedHeaders=host, Signature={SECRET}",
        # presigned / signed URLs, google-auth's tokeninfo URL
        f"https://b.s3.amazonaws.com/k?X-Amz-Credential={SECRET}%2F2024&X-Amz-Date=1",
        f"https://b.s3.amazonaws.com/k?AWSAccessKeyId=A&Signature={SECRET}&Expires=1",
        f"https://storage.googleapis.com/b/o?GoogleAccessId={SECRET}&Expires=1&Signature=s",
        f"https://storage.googleapis.com/b/o?X-Goog-Signature={SECRET}",
        f"Max retries exceeded with url: /tokeninfo?access_token={SECRET} (Caused by X)",
        # credentials in URIs and in reprs of options, headers, JSON
        f"{{'Bucket': 'AKIDEXAMPLE:{SECRET}@bucket', 'Key': 'run/x'}}",
        f"{{'Endpoint': 'http://admin:{SECRET}@127.0.0.1:9000', 'ForcePathStyle': True}}",
        f"s3://{SECRET}:pw@bucket/run",
        f"Credentials(token='{SECRET}', expiry=None)",
        f'{{"type": "service_account", "private_key": "-----BEGIN PRIVATE KEY-----\\n{SECRET}"}}',
        f"-----BEGIN RSA PRIVATE KEY-----\n{SECRET}\n-----END RSA PRIVATE KEY-----",
        f"Authorization: Bearer {SECRET}",
        f"<CIMultiDictProxy('Authorization': 'Basic {SECRET}')>",
        f"aws_secret_access_key={SECRET} aws_session_token={SECRET}",
    ],
)
def test_redact_text_hides_what_the_clients_print(text: str) -> None:
    clean = redact_text(text)
    assert SECRET not in clean, clean
    assert redact_text(clean) == clean  # idempotent


@pytest.mark.parametrize(
    "text",
    [
        "failed to read s3://bucket/run/iter_1/w/0.0: An error occurred (ExpiredToken) "
        "when calling the GetObject operation: The provided token has expired.",
        "(InvalidToken: An error occurred)",
        "validation failed for key 'model.tok_embeddings.weight' (ShardedTensor(key='x'))",
        "http://127.0.0.1:9000/bucket?list-type=2&prefix=run%2F&max-keys=1",
        "storage options {'token': 'anon', 'project': 'test', 'num_tokens': 5}",
        "refresh_token=None",
    ],
)
def test_redact_text_leaves_ordinary_messages_alone(text: str) -> None:
    assert redact_text(text) == text


def test_presigned_urls_are_never_logged(debug_everywhere: Any) -> None:
    """Presigned URLs made by botocore (with a session token) and by google-cloud-storage
    (V2 and V4): redacted as text, as URIs and in any watched logger's records."""
    import boto3  # noqa: PLC0415
    from botocore.config import Config  # noqa: PLC0415
    from google.cloud import storage as gcs  # noqa: PLC0415
    from google.oauth2 import service_account  # noqa: PLC0415

    client_kwargs = {  # presigning is local: no server needed
        "endpoint_url": "http://127.0.0.1:9",
        "aws_access_key_id": "AKIDSENTINELKEY0042",
        "aws_secret_access_key": INLINE_SECRET,
        "aws_session_token": SESSION_TOKEN,
        "region_name": "us-east-1",
    }
    client = boto3.client("s3", **client_kwargs)
    v4_client = boto3.client("s3", config=Config(signature_version="s3v4"), **client_kwargs)
    where = {"Bucket": "bucket", "Key": "run/iter_1/common.pt"}
    s3_urls = [c.generate_presigned_url("get_object", where) for c in (client, v4_client)]
    info, _ = _service_account("https://oauth2.googleapis.com/token")
    account = service_account.Credentials.from_service_account_info(info)
    blob = gcs.Client(project="test", credentials=account).bucket("b").blob("o")
    expiry = datetime.timedelta(minutes=5)
    v2, v4 = (
        blob.generate_signed_url(expiry, version=v, credentials=account) for v in ("v2", "v4")
    )
    urls = [*s3_urls, v2, v4]
    signatures = [u.split("ignature=")[1].split("&")[0] for u in urls]
    logfilter.install()
    for url in urls:
        logging.getLogger("botocore.endpoint").debug("presigned %s", url)
        logging.getLogger("cloudckpt.storage").debug("url %s", url)
    texts = [redact_text(u) for u in urls] + log_texts(debug_everywhere)
    secrets = [SESSION_TOKEN, INLINE_SECRET, "AKIDSENTINELKEY0042", info["client_email"]]
    assert_clean(texts, signatures + secrets)
    assert "X-Amz-Signature=***" in redact_uri(s3_urls[1])


# -- how the filter is installed ------------------------------------------------------------


class _BuiltFromState(Exception):
    """An error whose text comes from an attribute, as aiohttp's do."""

    def __init__(self, url: object) -> None:
        super().__init__(url)
        self.where = {"url": url}

    def __str__(self) -> str:
        return f"request to {self.where['url']} failed"


class _Url:
    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


def test_scrub_exception_keeps_the_class_and_pickles() -> None:
    from cloudckpt.redact import scrub_exception  # noqa: PLC0415

    try:
        try:
            raise _BuiltFromState(_Url(f"https://h/o?X-Amz-Signature={SECRET}"))
        except _BuiltFromState as inner:
            raise OSError(5, f"read failed: token={SECRET}", f"s3://k:{SECRET}@b/x") from inner
    except OSError as exc:
        scrub_exception(exc)
        texts = exception_texts(exc)
        cause = exc.__cause__
    assert isinstance(cause, _BuiltFromState) and type(cause).__qualname__ == "_BuiltFromState"
    assert str(cause) == "request to https://h/o?X-Amz-Signature=*** failed"
    assert type(pickle.loads(pickle.dumps(cause))) is _BuiltFromState
    assert_clean(texts, [SECRET])


def test_the_record_factory_is_chained_reinstalled_and_spares_other_loggers(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.DEBUG)
    original = logging.getLogRecordFactory()
    made: list[str] = []

    def users_factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = logging.LogRecord(*args, **kwargs)
        made.append(record.name)
        return record

    try:
        logging.setLogRecordFactory(users_factory)  # replaces cloudckpt's, not chaining
        logging.getLogger("botocore.auth").debug("Signature:\n%s", SECRET)
        CheckpointStorage(str(tmp_path))  # cloudckpt used again: installs itself again
        installed = logging.getLogRecordFactory()
        logfilter.install()
        assert logging.getLogRecordFactory() is installed  # idempotent
        logging.getLogger("botocore.auth").debug("Signature:\n%s", SECRET)
        logging.getLogger("myapp").debug("token=%s", SECRET)  # not cloudckpt's business
        try:
            raise ValueError(f"https://h/o?X-Amz-Signature={SECRET}")
        except ValueError:
            logging.getLogger("s3fs").debug("failed", exc_info=True)
    finally:
        logging.setLogRecordFactory(original)
    names = ("botocore.auth", "myapp", "s3fs")
    first, second, mine, failed = (r for r in caplog.records if r.name in names)
    assert [n for n in made if n in names] == ["botocore.auth", "botocore.auth", "myapp", "s3fs"]
    assert SECRET in first.getMessage()  # made before cloudckpt was used again
    assert second.getMessage() == "Signature:\n***" and mine.getMessage() == f"token={SECRET}"
    assert failed.exc_info is None and failed.exc_text and SECRET not in failed.exc_text
    assert "X-Amz-Signature=***" in failed.exc_text


def test_the_cli_handler_filter_scrubs_every_logger() -> None:
    handler = logfilter.install_on_handler(logging.StreamHandler())
    assert logfilter.install_on_handler(handler) is handler and len(handler.filters) == 1
    record = logging.LogRecord("any.logger", logging.INFO, __file__, 1, "key %s", None, None)
    record.args = (f"s3://k:{SECRET}@b",)
    assert handler.filter(record) and record.getMessage() == "key s3://***:***@b"
