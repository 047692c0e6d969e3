"""Tests for cloudckpt.config: config sections, sizes, storage options and redaction."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from cloudckpt.config import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_PART_SIZE,
    S3_MAX_PART_SIZE,
    S3_MAX_PARTS,
    S3_MIN_PART_SIZE,
    CheckpointConfig,
    ConfigError,
    GiB,
    MiB,
    env_storage_options,
    from_dict,
    from_yaml,
    parse_size,
    resolve_storage_options,
)
from cloudckpt.errors import CheckpointingException
from cloudckpt.redact import redact_options, redact_uri

SECRETS = ("AKIAEXAMPLE", "s3cr3t-value", "ya29.tok3n", "sess-t0ken")

# ---------------------------------------------------------------- CheckpointConfig


def test_constants_keep_their_values() -> None:
    assert (MiB, GiB) == (1_048_576, 1_073_741_824)
    limits = (S3_MIN_PART_SIZE, S3_MAX_PART_SIZE, S3_MAX_PARTS)
    assert limits == (5 * MiB, 5 * GiB, 10_000)
    defaults = (DEFAULT_PART_SIZE, DEFAULT_MAX_IN_FLIGHT, DEFAULT_CHUNK_SIZE)
    assert defaults == (32 * MiB, 16, 256 * MiB)


def test_defaults() -> None:
    config = CheckpointConfig()
    assert config.uri is None
    assert config.storage_options == {}
    assert config.backend == "torch_dist"  # Megatron-Core's default
    assert config.part_size == 32 * MiB
    assert config.max_in_flight == 16
    assert config.chunk_size == 256 * MiB
    assert config.max_object_size() == 32 * MiB * 10_000


def test_config_error_is_a_value_error_and_checkpointing_exception() -> None:
    assert issubclass(ConfigError, CheckpointingException)
    assert issubclass(ConfigError, ValueError)


def test_storage_options_are_copied_into_a_plain_dict() -> None:
    options = {"endpoint_url": "http://minio:9000"}
    config = CheckpointConfig(storage_options=options)
    options["endpoint_url"] = "changed"
    assert config.storage_options == {"endpoint_url": "http://minio:9000"}
    assert type(config.storage_options) is dict


def test_config_is_frozen_and_hashable() -> None:
    config = CheckpointConfig(uri="s3://b/run", storage_options={"anon": True})
    with pytest.raises(AttributeError):
        config.uri = "s3://other"  # type: ignore[misc]
    assert hash(config) == hash(CheckpointConfig(uri="s3://b/run", storage_options={"x": 1}))
    assert config == CheckpointConfig(uri="s3://b/run", storage_options={"anon": True})


def test_replace_returns_validated_copy() -> None:
    config = CheckpointConfig(uri="s3://b/run")
    changed = config.replace(part_size=64 * MiB, chunk_size=None)
    assert (changed.uri, changed.part_size, changed.chunk_size) == ("s3://b/run", 64 * MiB, None)
    assert config.part_size == 32 * MiB
    assert changed.max_object_size() == 64 * MiB * 10_000
    with pytest.raises(ConfigError, match="max_in_flight=0"):
        config.replace(max_in_flight=0)


@pytest.mark.parametrize("part_size", [S3_MIN_PART_SIZE, S3_MAX_PART_SIZE])
def test_part_size_limits_are_inclusive(part_size: int) -> None:
    assert CheckpointConfig(part_size=part_size).part_size == part_size


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"part_size": 5 * MiB - 1}, r"part_size=5242879 is out of range.*5 MiB.*5 GiB"),
        ({"part_size": 5 * GiB + 1}, r"part_size=5368709121 is out of range"),
        ({"part_size": "32MiB"}, r"part_size must be an integer, got '32MiB'"),
        ({"max_in_flight": 0}, r"max_in_flight=0 is out of range: must be >= 1"),
        ({"max_in_flight": True}, r"max_in_flight must be an integer, got True"),
        ({"chunk_size": 0}, r"chunk_size=0 is out of range"),
        ({"backend": ""}, r"backend must be a non-empty string, got ''"),
        ({"backend": 3}, r"backend must be a non-empty string, got 3"),
        ({"uri": ""}, r"uri must be a non-empty string or None, got an empty string"),
        ({"storage_options": ["k"]}, r"storage_options must be a mapping, got list"),
        ({"storage_options": {1: "x"}}, r"storage_options keys must be strings, got \[1\]"),
    ],
)
def test_invalid_fields_raise_config_error(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CheckpointConfig(**kwargs)


def test_small_chunk_size_is_allowed() -> None:
    assert CheckpointConfig(chunk_size=1).chunk_size == 1
    assert CheckpointConfig(chunk_size=None).chunk_size is None


def test_repr_hides_secrets() -> None:
    config = CheckpointConfig(
        uri="s3://bucket/run/iter_0000010",
        storage_options={
            "key": "AKIAEXAMPLE",
            "secret": "s3cr3t-value",
            "token": "ya29.tok3n",
            "endpoint_url": "http://minio:9000",
            "client_kwargs": {"aws_session_token": "sess-t0ken", "region_name": "eu-west-1"},
        },
    )
    text = repr(config)
    for secret in SECRETS:
        assert secret not in text
    assert text == (
        "CheckpointConfig(uri='s3://bucket/run/iter_0000010', storage_options={'key': '***', "
        "'secret': '***', 'token': '***', 'endpoint_url': 'http://minio:9000', "
        "'client_kwargs': {'aws_session_token': '***', 'region_name': 'eu-west-1'}}, "
        "backend='torch_dist', part_size=33554432, max_in_flight=16, chunk_size=268435456)"
    )
    assert config.storage_options["secret"] == "s3cr3t-value"  # only the repr hides it


def test_repr_redacts_uri() -> None:
    config = CheckpointConfig(uri="https://user:hunter2@host/ckpt")
    assert "hunter2" not in repr(config)
    assert "uri='https://user:***@host/ckpt'" in repr(config)


# ---------------------------------------------------------------- parse_size


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (5242880, 5242880),
        ("5242880", 5242880),
        ("64MiB", 64 * MiB),
        ("64 MiB", 64 * MiB),
        (" 64 mib ", 64 * MiB),
        ("8MB", 8_000_000),
        ("8mb", 8_000_000),
        ("1GiB", GiB),
        ("1GB", 1_000_000_000),
        ("512KiB", 512 * 1024),
        ("2KB", 2000),
        ("1TiB", 2**40),
        ("3TB", 3 * 10**12),
        ("1.5GiB", 3 * GiB // 2),
        ("0.5KiB", 512),
        (".5KiB", 512),
        ("100B", 100),
        ("100b", 100),
    ],
)
def test_parse_size(value: int | str, expected: int) -> None:
    assert parse_size(value) == expected


@pytest.mark.parametrize(
    "value",
    [-1, True, 1.5, None, "", "MiB", "-5MiB", "64 MiBs", "64M", "1.5", "0.1KiB", "1e6", "5 5MB"],
)
def test_parse_size_rejects_bad_input(value: Any) -> None:
    with pytest.raises(ConfigError, match="invalid size") as info:
        parse_size(value)
    assert repr(value) in str(info.value)


# ---------------------------------------------------------------- from_dict


def test_from_dict_full_section() -> None:
    config = from_dict(
        {
            "uri": "s3://bucket/run/iter_0001000",
            "storage_options": {"endpoint_url": "http://minio:9000", "anon": False},
            "backend": "torch_dist",
            "part_size": "64MiB",
            "max_in_flight": 8,
            "chunk_size": "128 MiB",
        }
    )
    assert config == CheckpointConfig(
        uri="s3://bucket/run/iter_0001000",
        storage_options={"endpoint_url": "http://minio:9000", "anon": False},
        backend="torch_dist",
        part_size=64 * MiB,
        max_in_flight=8,
        chunk_size=128 * MiB,
    )


def test_from_dict_empty_gives_defaults() -> None:
    assert from_dict({}) == CheckpointConfig()


def test_from_dict_unwraps_single_cloudckpt_key() -> None:
    config = from_dict({"cloudckpt": {"uri": "gs://b/ck", "part_size": 8 * MiB}})
    assert (config.uri, config.part_size, config.backend) == ("gs://b/ck", 8 * MiB, "torch_dist")


def test_from_dict_accepts_path_and_nulls(tmp_path: Path) -> None:
    config = from_dict({"uri": tmp_path / "ck", "chunk_size": None, "storage_options": None})
    assert config.uri == str(tmp_path / "ck")
    assert config.chunk_size is None
    assert config.storage_options == {}


def test_from_dict_unknown_keys_listed() -> None:
    with pytest.raises(ConfigError) as info:
        from_dict({"uri": "s3://b/c", "partsize": 1, "bucket": "x"})
    message = str(info.value)
    assert "unknown cloudckpt config key(s): 'bucket', 'partsize'" in message
    assert "allowed keys: uri, storage_options, backend, part_size, max_in_flight, chunk_size" in (
        message
    )


def test_from_dict_cloudckpt_key_among_others_is_unknown() -> None:
    with pytest.raises(ConfigError, match="'cloudckpt'"):
        from_dict({"cloudckpt": {}, "uri": "s3://b/c"})


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"storage_options": "key=abc"}, r"storage_options must be a mapping, got str"),
        ({"max_in_flight": "16"}, r"max_in_flight must be an integer, got '16'"),
        ({"max_in_flight": 0}, r"max_in_flight=0 is out of range"),
        ({"part_size": "4MiB"}, r"part_size=4194304 is out of range"),
        ({"part_size": "6GiB"}, r"part_size=6442450944 is out of range"),
        ({"part_size": "lots"}, r"key 'part_size': invalid size 'lots'"),
        ({"chunk_size": -1}, r"key 'chunk_size': invalid size -1"),
        ({"uri": 42}, r"uri must be a non-empty string or None, got int"),
        ({"backend": None}, r"backend must be a non-empty string, got None"),
    ],
)
def test_from_dict_bad_values_name_the_key(section: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        from_dict(section)


def test_from_dict_rejects_non_mapping() -> None:
    with pytest.raises(ConfigError, match="must be a mapping, got list"):
        from_dict(["uri"])  # type: ignore[arg-type]


# ---------------------------------------------------------------- from_yaml


def test_from_yaml_section_among_training_keys(tmp_path: Path) -> None:
    path = tmp_path / "train.yaml"
    path.write_text(
        "model:\n  hidden_size: 1024\n"
        "optimizer:\n  lr: 0.0003\n"
        "cloudckpt:\n"
        "  uri: s3://bucket/run\n"
        "  part_size: 64MiB\n"
        "  chunk_size: null\n"
        "  storage_options:\n"
        "    endpoint_url: http://localhost:9000\n"
        "    client_kwargs:\n"
        "      region_name: us-east-1\n"
    )
    config = from_yaml(path)
    assert config == CheckpointConfig(
        uri="s3://bucket/run",
        part_size=64 * MiB,
        chunk_size=None,
        storage_options={
            "endpoint_url": "http://localhost:9000",
            "client_kwargs": {"region_name": "us-east-1"},
        },
    )
    assert from_yaml(str(path)) == config


def test_from_yaml_bare_section(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.yaml"
    path.write_text("uri: gs://bucket/ck\nmax_in_flight: 4\nbackend: torch_dist\n")
    config = from_yaml(path)
    assert (config.uri, config.max_in_flight, config.backend) == ("gs://bucket/ck", 4, "torch_dist")
    assert config.part_size == DEFAULT_PART_SIZE


def test_from_yaml_custom_and_no_section(tmp_path: Path) -> None:
    path = tmp_path / "train.yaml"
    path.write_text("checkpoint:\n  max_in_flight: 2\nother: 1\n")
    assert from_yaml(path, section="checkpoint").max_in_flight == 2
    nested = tmp_path / "nested.yaml"
    nested.write_text("cloudckpt:\n  max_in_flight: 3\n")
    assert from_yaml(nested, section=None).max_in_flight == 3


@pytest.mark.parametrize("text", ["", "# only a comment\n", "cloudckpt:\n"])
def test_from_yaml_empty_gives_defaults(tmp_path: Path, text: str) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    assert from_yaml(path) == CheckpointConfig()


def test_from_yaml_missing_section_names_file(tmp_path: Path) -> None:
    path = tmp_path / "train.yaml"
    path.write_text("model:\n  layers: 2\nuri: s3://b/c\n")
    with pytest.raises(ConfigError) as info:
        from_yaml(path)
    message = str(info.value)
    assert str(path) in message
    assert "no 'cloudckpt' section" in message
    assert "top-level keys: model, uri" in message


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("cloudckpt:\n  max_in_flight: 0\n", r"max_in_flight=0 is out of range"),
        ("cloudckpt:\n  nope: 1\n", r"unknown cloudckpt config key\(s\): 'nope'"),
        ("cloudckpt: [1, 2]\n", r"section 'cloudckpt' must be a mapping, got list"),
        ("- 1\n- 2\n", r"expected a mapping at the top level, got list"),
        ("cloudckpt: {uri: [\n", r"invalid YAML"),
    ],
)
def test_from_yaml_errors_name_file(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as info:
        from_yaml(path)
    assert str(info.value).startswith(f"{path}: ")


def test_from_yaml_missing_file_raises_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        from_yaml(tmp_path / "absent.yaml")


# ---------------------------------------------------------------- env_storage_options


def test_env_s3_endpoint_s3_wins_over_generic() -> None:
    environ = {
        "AWS_ENDPOINT_URL_S3": "http://s3-only:9000",
        "AWS_ENDPOINT_URL": "http://generic:9000",
        "AWS_PROFILE": "training",
        "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE",
        "AWS_SECRET_ACCESS_KEY": "s3cr3t-value",
    }
    assert env_storage_options("s3", environ) == {
        "endpoint_url": "http://s3-only:9000",
        "profile": "training",
    }
    assert env_storage_options("s3a", environ) == env_storage_options("s3", environ)


def test_env_s3_generic_endpoint_and_empty_values() -> None:
    assert env_storage_options("s3", {"AWS_ENDPOINT_URL": "http://generic:9000"}) == {
        "endpoint_url": "http://generic:9000"
    }
    environ = {"AWS_ENDPOINT_URL_S3": "", "AWS_ENDPOINT_URL": "http://g:1", "AWS_PROFILE": ""}
    assert env_storage_options("s3", environ) == {"endpoint_url": "http://g:1"}
    assert env_storage_options("s3", {}) == {}


@pytest.mark.parametrize(
    ("host", "endpoint"),
    [
        ("localhost:9023", "http://localhost:9023"),
        ("http://localhost:9023", "http://localhost:9023"),
        ("https://emulator.internal", "https://emulator.internal"),
    ],
)
@pytest.mark.parametrize("protocol", ["gs", "gcs"])
def test_env_gcs_emulator(protocol: str, host: str, endpoint: str) -> None:
    assert env_storage_options(protocol, {"STORAGE_EMULATOR_HOST": host}) == {
        "endpoint_url": endpoint,
        "token": "anon",
    }


def test_env_gcs_without_emulator_and_other_protocols() -> None:
    environ = {"AWS_ENDPOINT_URL": "http://x:1", "STORAGE_EMULATOR_HOST": "localhost:1"}
    assert env_storage_options("gs", {"AWS_ENDPOINT_URL": "http://x:1"}) == {}
    assert env_storage_options("file", environ) == {}
    assert env_storage_options("memory", environ) == {}
    assert env_storage_options("s3", {"STORAGE_EMULATOR_HOST": "localhost:1"}) == {}


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:4443")
    assert env_storage_options("gs") == {"endpoint_url": "http://127.0.0.1:4443", "token": "anon"}


# ---------------------------------------------------------------- resolve_storage_options


def test_resolve_precedence_explicit_over_config_over_environment() -> None:
    environ = {"AWS_ENDPOINT_URL": "http://env:9000", "AWS_PROFILE": "env-profile"}
    config = CheckpointConfig(
        storage_options={"endpoint_url": "http://config:9000", "key": "cfg-key", "anon": False}
    )
    explicit = {"key": "explicit-key", "secret": "explicit-secret"}
    assert resolve_storage_options("s3", explicit, config, environ) == {
        "endpoint_url": "http://config:9000",
        "profile": "env-profile",
        "key": "explicit-key",
        "anon": False,
        "secret": "explicit-secret",
    }
    assert resolve_storage_options("s3", None, None, environ) == {
        "endpoint_url": "http://env:9000",
        "profile": "env-profile",
    }
    assert resolve_storage_options("s3", environ={}) == {}


def test_resolve_deep_merges_client_and_config_kwargs_without_mutating() -> None:
    config = CheckpointConfig(
        storage_options={
            "client_kwargs": {"region_name": "eu-west-1", "verify": False},
            "config_kwargs": {"max_pool_connections": 32},
            "s3_additional_kwargs": {"ACL": "private"},
        }
    )
    explicit: dict[str, dict[str, Any]] = {
        "client_kwargs": {"region_name": "us-east-1"},
        "config_kwargs": {"connect_timeout": 5},
        "s3_additional_kwargs": {"ServerSideEncryption": "AES256"},
    }
    explicit_before = {k: dict(v) for k, v in explicit.items()}
    config_before = {k: dict(v) for k, v in config.storage_options.items()}
    merged = resolve_storage_options("s3", explicit, config, environ={})
    assert merged == {
        "client_kwargs": {"region_name": "us-east-1", "verify": False},
        "config_kwargs": {"max_pool_connections": 32, "connect_timeout": 5},
        "s3_additional_kwargs": {"ServerSideEncryption": "AES256"},  # not deep-merged
    }
    merged["client_kwargs"]["region_name"] = "mutated"
    merged["config_kwargs"]["extra"] = 1
    assert explicit == explicit_before
    assert config.storage_options == config_before


def test_resolve_nested_non_mapping_overrides_whole_value() -> None:
    config = CheckpointConfig(storage_options={"client_kwargs": {"region_name": "eu-west-1"}})
    merged = resolve_storage_options("s3", {"client_kwargs": None}, config, environ={})
    assert merged == {"client_kwargs": None}
    env_only = {"STORAGE_EMULATOR_HOST": "localhost:9023"}
    merged = resolve_storage_options("gs", {"client_kwargs": {"a": 1}}, None, env_only)
    assert merged == {
        "endpoint_url": "http://localhost:9023",
        "token": "anon",
        "client_kwargs": {"a": 1},
    }


def test_resolve_logs_sources_without_secrets(caplog: pytest.LogCaptureFixture) -> None:
    config = CheckpointConfig(
        storage_options={"secret": "s3cr3t-value", "client_kwargs": {"region_name": "r1"}}
    )
    explicit = {"key": "AKIAEXAMPLE", "client_kwargs": {"aws_session_token": "sess-t0ken"}}
    environ = {"AWS_ENDPOINT_URL": "http://env:9000", "AWS_SECRET_ACCESS_KEY": "ya29.tok3n"}
    with caplog.at_level(logging.DEBUG, logger="cloudckpt.config"):
        merged = resolve_storage_options("s3", explicit, config, environ)
    assert merged["secret"] == "s3cr3t-value"
    assert merged["client_kwargs"] == {"region_name": "r1", "aws_session_token": "sess-t0ken"}
    records = [r for r in caplog.records if r.name == "cloudckpt.config"]
    assert len(records) == 1
    message = records[0].getMessage()
    for secret in SECRETS:
        assert secret not in message
    assert "environment {'endpoint_url': 'http://env:9000'}" in message
    assert "config {'secret': '***', 'client_kwargs': {'region_name': 'r1'}}" in message
    assert "explicit {'key': '***', 'client_kwargs': {'aws_session_token': '***'}}" in message
    assert "'s3'" in message


def test_resolve_logs_nothing_above_debug(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="cloudckpt.config"):
        resolve_storage_options("s3", {"key": "AKIAEXAMPLE"}, environ={})
    assert [r for r in caplog.records if r.name == "cloudckpt.config"] == []


# ---------------------------------------------------------------- redact_options / redact_uri


def test_redact_options_nested() -> None:
    options: dict[str, Any] = {
        "key": "AKIAEXAMPLE",
        "secret": "s3cr3t-value",
        "aws_access_key_id": "AKIAEXAMPLE",
        "Password": "pw",
        "credentials": {"private_key": "pem"},
        "token": "anon",
        "session": None,
        "endpoint_url": "http://minio:9000",
        "anon": False,
        "client_kwargs": {
            "region_name": "eu-west-1",
            "aws_session_token": "sess-t0ken",
            "config": {"sse_kms_key_id": "kms-id", "retries": 3},
        },
    }
    assert redact_options(options) == {
        "key": "***",
        "secret": "***",
        "aws_access_key_id": "***",
        "Password": "***",
        "credentials": "***",
        "token": "anon",
        "session": None,
        "endpoint_url": "http://minio:9000",
        "anon": False,
        "client_kwargs": {
            "region_name": "eu-west-1",
            "aws_session_token": "***",
            "config": {"sse_kms_key_id": "***", "retries": 3},
        },
    }
    assert options["key"] == "AKIAEXAMPLE"  # the input is untouched
    assert options["client_kwargs"]["aws_session_token"] == "sess-t0ken"


def test_redact_options_tokens() -> None:
    assert redact_options({"token": "google_default"}) == {"token": "google_default"}
    assert redact_options({"token": "ya29.tok3n"}) == {"token": "***"}
    assert redact_options({"token": {"client_secret": "x"}}) == {"token": "***"}
    assert redact_options({"session_token": "anon"}) == {"session_token": "***"}


def test_redact_options_redacts_uris_in_values() -> None:
    options = {"endpoint_url": "http://admin:hunter2@minio:9000"}
    assert redact_options(options) == {"endpoint_url": "http://admin:***@minio:9000"}


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("https://user:hunter2@host:9000/bucket/ck", "https://user:***@host:9000/bucket/ck"),
        ("s3://:pw@bucket/ck", "s3://:***@bucket/ck"),
        (
            "https://bucket.s3.amazonaws.com/ck/obj?X-Amz-Algorithm=AWS4-HMAC-SHA256"
            "&X-Amz-Credential=AKIAEXAMPLE%2F20240101%2Fus-east-1%2Fs3%2Faws4_request"
            "&X-Amz-Date=20240101T000000Z&X-Amz-Expires=3600&X-Amz-SignedHeaders=host"
            "&X-Amz-Security-Token=sess-t0ken&X-Amz-Signature=abcdef0123",
            "https://bucket.s3.amazonaws.com/ck/obj?X-Amz-Algorithm=AWS4-HMAC-SHA256"
            "&X-Amz-Credential=***&X-Amz-Date=20240101T000000Z&X-Amz-Expires=3600"
            "&X-Amz-SignedHeaders=host&X-Amz-Security-Token=***&X-Amz-Signature=***",
        ),
        (
            "https://storage.googleapis.com/b/o?GoogleAccessId=sa&Expires=1&Signature=c2ln",
            "https://storage.googleapis.com/b/o?GoogleAccessId=sa&Expires=1&Signature=***",
        ),
        ("https://a:b@h/p?apikey=xyz&x=1#frag", "https://a:***@h/p?apikey=***&x=1#frag"),
    ],
)
def test_redact_uri_redacts(uri: str, expected: str) -> None:
    assert redact_uri(uri) == expected


@pytest.mark.parametrize(
    "uri",
    [
        "s3://bucket/run/iter_0001000",
        "gs://bucket/ck/",
        "/tmp/checkpoints/iter_1",
        "relative/path?key=1",
        "file:///tmp/ck",
        "https://user@host/ck",
        "https://host/ck?versionId=3&x=",
        "https://host/ck?token=",
        "memory://ck",
        "http://[::1",
        "",
    ],
)
def test_redact_uri_unchanged(uri: str) -> None:
    assert redact_uri(uri) == uri
