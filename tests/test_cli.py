"""End-to-end tests of ``cloudckpt ls / inspect / verify / gc / rm``: the real command in
a subprocess, against checkpoints saved in-process on local disk and on the S3 API."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import cloudckpt
from cloudckpt import ShardedTensor, cli
from tests.fixtures_object_stores import S3Endpoint
from tests.servers import free_loopback_port

ZARR = ("zarr", 1)  # these tests look at the zarr layout (chunk objects)

REPO_ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120


def _env(**extra: str) -> dict[str, str]:
    """The test environment without stray AWS or GCS settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "STORAGE_EMULATOR"))}
    return {**env, **extra}


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cloudckpt", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        env=env if env is not None else _env(),
        stdin=subprocess.DEVNULL,
    )


def _output(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stdout + proc.stderr


def _save(uri: str, iteration: int, options: dict[str, Any] | None = None) -> None:
    """A small single-process checkpoint: two tensors and a common state."""
    state = {
        "model": {
            "w": ShardedTensor.from_rank_offsets("model.w", torch.arange(12.0).reshape(3, 4)),
            "b": ShardedTensor.from_rank_offsets("model.b", torch.ones(5, dtype=torch.bfloat16)),
        },
        "iteration": iteration,
        "args": {"lr": 0.1},
    }
    cloudckpt.save(state, uri, storage_options=options, sharded_strategy=ZARR)


LONG_AGO = "2020-01-01T00:00:00Z"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A local run: iter_0000010 and iter_0000020 committed, iter_0000030 uncommitted
    (its metadata.json deleted), and a directory that is no checkpoint."""
    run = tmp_path / "run"
    for iteration in (10, 20, 30):
        _save(str(run / f"iter_{iteration:07d}"), iteration)
    (run / "iter_0000030" / "metadata.json").unlink()
    # a save that failed at its last step long ago (a manifest just written is spared by
    # gc for three request deadlines: its metadata.json may still come)
    manifest = run / "iter_0000030" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "created": LONG_AGO}))
    (run / "logs").mkdir()
    (run / "logs" / "train.log").write_text("not a checkpoint\n")
    return run


def _row(stdout: str, name: str) -> list[str]:
    return next(line.split() for line in stdout.splitlines() if line.startswith(name + " "))


# -- help and argument errors -------------------------------------------------------------


@pytest.mark.parametrize("command", ["ls", "inspect", "verify", "gc", "rm"])
def test_help_of_each_subcommand(command: str) -> None:
    proc = _cli(command, "--help")
    assert proc.returncode == 0, _output(proc)
    assert f"usage: cloudckpt {command}" in proc.stdout
    assert "--storage-option KEY=VALUE" in proc.stdout and "--config YAML" in proc.stdout


def test_malformed_storage_option_is_a_usage_error_that_hides_the_value(tmp_path: Path) -> None:
    proc = _cli("ls", str(tmp_path), "--storage-option", "hunter2-not-a-pair")
    assert proc.returncode == 2
    assert "expected KEY=VALUE" in proc.stderr
    assert "hunter2" not in _output(proc)


# -- ls -----------------------------------------------------------------------------------


def test_ls_table(run_dir: Path) -> None:
    proc = _cli("ls", str(run_dir))
    assert proc.returncode == 0, _output(proc)
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["NAME", "ITERATION", "STATE", "SIZE", "CREATED", "WORLD"]
    ten, thirty = _row(proc.stdout, "iter_0000010"), _row(proc.stdout, "iter_0000030")
    assert ten[1:3] == ["10", "committed"] and ten[-1] == "1"
    assert " ".join(ten[3:5]) == "2.0 kB"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", ten[5])
    assert thirty[1:3] == ["30", "uncommitted"]
    assert _row(proc.stdout, "iter_0000020")[2] == "committed"
    assert "logs" not in proc.stdout
    assert lines[-1] == f"3 checkpoints under {run_dir}: 2 committed, 1 uncommitted"


def test_ls_json_and_an_empty_prefix(run_dir: Path, tmp_path: Path) -> None:
    proc = _cli("ls", str(run_dir), "--json")
    assert proc.returncode == 0, _output(proc)
    records = json.loads(proc.stdout)
    assert [r["name"] for r in records] == ["iter_0000010", "iter_0000020", "iter_0000030"]
    assert [r["iteration"] for r in records] == [10, 20, 30]
    assert [r["state"] for r in records] == ["committed", "committed", "uncommitted"]
    manifest = json.loads((run_dir / "iter_0000010" / "manifest.json").read_text())
    assert records[0]["size"] == sum(entry[1] for entry in manifest["objects"])
    assert records[0]["uri"] == f"{run_dir}/iter_0000010"
    assert records[0]["world_size"] == 1 and records[0]["created"] == manifest["created"]

    nothing = _cli("ls", str(tmp_path / "nothing-here"))
    assert nothing.returncode == 2, _output(nothing)
    assert f"no checkpoint under '{tmp_path / 'nothing-here'}': nothing is stored" in nothing.stderr
    assert nothing.stdout == ""

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("no checkpoint here\n")
    empty = _cli("ls", str(tmp_path / "other"))
    assert empty.returncode == 0, _output(empty)
    assert empty.stdout.strip() == f"no checkpoints under {tmp_path / 'other'}"


# -- inspect ------------------------------------------------------------------------------


def test_inspect_table(run_dir: Path) -> None:
    proc = _cli("inspect", str(run_dir / "iter_0000010"))
    assert proc.returncode == 0, _output(proc)
    out = proc.stdout
    assert "state:       committed\n" in out
    assert "backends:    sharded zarr v1, common torch v1" in out
    assert "world size:  1" in out
    assert re.search(r"objects:     6 \(2\.0 kB\)", out), out
    assert re.search(r"^KEY +SHAPE +DTYPE +CHUNKS$", out, re.M), out
    assert re.search(r"^model\.b +\(5,\) +bfloat16 +\(5,\)$", out, re.M), out
    assert re.search(r"^model\.w +\(3, 4\) +float32 +\(3, 4\)$", out, re.M), out
    assert "2 common keys:\n  args.lr\n  iteration" in out


def test_inspect_json_and_uncommitted(run_dir: Path) -> None:
    proc = _cli("inspect", str(run_dir / "iter_0000020"), "--json")
    assert proc.returncode == 0, _output(proc)
    doc = json.loads(proc.stdout)
    assert doc["committed"] is True and doc["foreign"] is False
    assert doc["world_size"] == 1 and doc["objects"] == 6
    assert doc["tensors"] == [
        {"key": "model.b", "shape": [5], "dtype": "bfloat16", "chunks": [5]},
        {"key": "model.w", "shape": [3, 4], "dtype": "float32", "chunks": [3, 4]},
    ]
    assert doc["common_keys"] == ["args.lr", "iteration"]
    assert doc["backends"]["sharded_backend"] == "zarr"

    uncommitted = _cli("inspect", str(run_dir / "iter_0000030"))
    assert uncommitted.returncode == 1
    assert uncommitted.stdout == ""
    assert "is not committed: metadata.json is missing" in uncommitted.stderr
    assert "Traceback" not in uncommitted.stderr


def test_inspect_foreign_checkpoint_without_manifest(tmp_path: Path) -> None:
    """Megatron-Core's layout: metadata.json but no manifest and no claim."""
    uri = tmp_path / "iter_0000005"
    _save(str(uri), 5)
    (uri / "manifest.json").unlink()
    (uri / ".cloudckpt-claim.json").unlink()
    proc = _cli("inspect", str(uri))
    assert proc.returncode == 0, _output(proc)
    assert "state:       committed (foreign: no cloudckpt manifest)" in proc.stdout
    assert re.search(r"^model\.w +\(3, 4\) +float32 +-$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^model\.b +\(5,\) +bfloat16 +-$", proc.stdout, re.M), proc.stdout
    assert "2 common keys:\n  args\n  iteration" in proc.stdout


# -- verify -------------------------------------------------------------------------------


def test_verify_ok_and_missing_chunk(run_dir: Path) -> None:
    uri = run_dir / "iter_0000010"
    ok = _cli("verify", str(uri))
    assert ok.returncode == 0, _output(ok)
    assert ok.stdout.splitlines()[-1].startswith("OK: 6 objects, 2.0 kB")
    assert ok.stderr == ""  # no progress bar: stderr is not a terminal

    (uri / "model.w" / "0.0").unlink()
    broken = _cli("verify", str(uri), "--json")
    assert broken.returncode == 1, _output(broken)
    report = json.loads(broken.stdout)
    assert report["ok"] is False and report["committed"] is True
    assert {"kind": "missing-object", "path": "model.w/0.0"} in [
        {k: p[k] for k in ("kind", "path")} for p in report["problems"]
    ]


def test_verify_names_the_missing_chunk_in_the_table(run_dir: Path) -> None:
    uri = run_dir / "iter_0000020"
    (uri / "model.b" / "0").unlink()
    proc = _cli("verify", str(uri))
    assert proc.returncode == 1, _output(proc)
    assert re.search(r"^missing-object +model\.b/0 +listed in manifest\.json$", proc.stdout, re.M)
    assert proc.stdout.splitlines()[-1] == "INCONSISTENT: 1 problem"


def test_verify_flipped_byte_passes_shallow_and_fails_deep(run_dir: Path) -> None:
    uri = run_dir / "iter_0000010"
    chunk = uri / "model.w" / "0.0"
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0xFF
    chunk.write_bytes(bytes(data))

    shallow = _cli("verify", str(uri))
    assert shallow.returncode == 0, _output(shallow)
    deep = _cli("verify", str(uri), "--deep", "--progress")
    assert deep.returncode == 1, _output(deep)
    assert re.search(r"^checksum-mismatch +model\.w/0\.0 +CRC-32C 0x", deep.stdout, re.M)
    assert "check:       deep" in deep.stdout
    assert "verify: 100%" in deep.stderr  # the tqdm bar, forced on by --progress


def test_verify_nothing_at_the_uri_is_an_error(tmp_path: Path) -> None:
    proc = _cli("verify", str(tmp_path / "missing"), "--json")
    assert proc.returncode == 2
    assert "no checkpoint at" in proc.stderr
    assert json.loads(proc.stdout)["ok"] is False


def test_verify_uncommitted_is_inconsistent(run_dir: Path) -> None:
    proc = _cli("verify", str(run_dir / "iter_0000030"))
    assert proc.returncode == 1, _output(proc)
    assert re.search(r"^missing-metadata +metadata\.json ", proc.stdout, re.M)
    assert proc.stdout.splitlines()[-1] == "INCONSISTENT: not committed; 1 problem"


# -- gc -----------------------------------------------------------------------------------


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_gc_dry_run_changes_nothing(run_dir: Path) -> None:
    before = _tree(run_dir)
    proc = _cli("gc", str(run_dir), "--keep-last", "1", "--dry-run", "--grace", "0")
    assert proc.returncode == 0, _output(proc)
    assert _tree(run_dir) == before
    out = proc.stdout
    assert "(dry run: nothing was changed)" in out
    assert re.search(rf"^would remove +{run_dir}/iter_0000010 +older than the newest 1", out, re.M)
    assert re.search(rf"^would remove +{run_dir}/iter_0000030 +uncommitted", out, re.M)
    assert f"kept 1 checkpoint:\n  {run_dir}/iter_0000020" in out


def test_gc_removes_older_and_uncommitted_keeps_the_newest(run_dir: Path) -> None:
    proc = _cli("gc", str(run_dir), "--keep-last", "1", "--grace", "0", "--json")
    assert proc.returncode == 0, _output(proc)
    report = json.loads(proc.stdout)
    assert report["dry_run"] is False
    assert report["kept"] == [f"{run_dir}/iter_0000020"]
    reasons = {a["uri"]: a["reason"] for a in report["actions"]}
    assert reasons == {
        f"{run_dir}/iter_0000010": "older than the newest 1",
        f"{run_dir}/iter_0000030": "uncommitted",
    }
    assert sorted(p.name for p in run_dir.iterdir()) == ["iter_0000020", "logs"]
    assert (run_dir / "iter_0000020" / "metadata.json").is_file()


def test_gc_default_grace_keeps_a_young_uncommitted_save(run_dir: Path) -> None:
    proc = _cli("gc", str(run_dir), "--keep-last", "2")
    assert proc.returncode == 0, _output(proc)
    assert "nothing to collect" in proc.stdout
    assert (run_dir / "iter_0000030" / "manifest.json").is_file()


def test_gc_keep_last_must_be_positive(run_dir: Path) -> None:
    proc = _cli("gc", str(run_dir), "--keep-last", "0")
    assert proc.returncode == 2
    assert "--keep-last: must be an integer >= 1" in proc.stderr


# -- rm -----------------------------------------------------------------------------------


def test_rm_requires_yes_without_a_terminal(run_dir: Path) -> None:
    uri = run_dir / "iter_0000010"
    before = _tree(uri)
    refused = _cli("rm", str(uri))
    assert refused.returncode == 2
    assert f"refusing to remove {uri} without --yes" in refused.stderr
    assert _tree(uri) == before

    removed = _cli("rm", str(uri), "--yes")
    assert removed.returncode == 0, _output(removed)
    assert removed.stdout.strip() == f"removed 8 objects from {uri}"
    assert not uri.exists()
    assert (run_dir / "iter_0000020" / "metadata.json").is_file()


# -- the S3 API ---------------------------------------------------------------------------


def test_s3_via_storage_options_never_prints_the_secret(
    s3_server: S3Endpoint, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    bucket_uri, options = s3_bucket
    run = f"{bucket_uri}/run"
    _save(f"{run}/iter_0000100", 100, options)
    _save(f"{run}/iter_0000200", 200, options)
    flags = [
        f"--storage-option=endpoint_url={s3_server.endpoint_url}",
        f"--storage-option=key={s3_server.key}",
        f"--storage-option=secret={s3_server.secret}",
        f'--storage-option=client_kwargs={{"region_name": "{s3_server.region}"}}',
    ]
    listed = _cli("ls", run, *flags)
    assert listed.returncode == 0, _output(listed)
    assert _row(listed.stdout, "iter_0000200")[1:3] == ["200", "committed"]

    verified = _cli("verify", f"{run}/iter_0000100", "--deep", *flags)
    assert verified.returncode == 0, _output(verified)
    assert "sizes and CRC-32C checksums match" in verified.stdout

    missing = _cli("verify", f"{run}/iter_0000999", *flags)
    assert missing.returncode == 2
    assert "no checkpoint at" in missing.stderr
    for proc in (listed, verified, missing):
        assert s3_server.secret not in _output(proc)


def test_s3_via_the_environment_and_a_config_file(
    s3_server: S3Endpoint, s3_bucket: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    bucket_uri, options = s3_bucket
    run = f"{bucket_uri}/run"
    for iteration in (1, 2, 3):
        _save(f"{run}/iter_{iteration:07d}", iteration, options)
    env = _env(
        AWS_ENDPOINT_URL_S3=s3_server.endpoint_url,
        AWS_ACCESS_KEY_ID=s3_server.key,
        AWS_SECRET_ACCESS_KEY=s3_server.secret,
        AWS_DEFAULT_REGION=s3_server.region,
    )
    inspected = _cli("inspect", f"{run}/iter_0000003", env=env)
    assert inspected.returncode == 0, _output(inspected)
    assert re.search(r"^model\.w +\(3, 4\) +float32 +\(3, 4\)$", inspected.stdout, re.M)

    config = tmp_path / "train.yaml"
    section = {"part_size": "8MiB", "max_in_flight": 4}
    config.write_text(yaml.safe_dump({"model": {"layers": 2}, "cloudckpt": section}))
    collected = _cli("gc", run, "--keep-last", "2", "--config", str(config), "--json", env=env)
    assert collected.returncode == 0, _output(collected)
    assert [a["uri"] for a in json.loads(collected.stdout)["actions"]] == [f"{run}/iter_0000001"]
    bucket = bucket_uri.removeprefix("s3://")
    listing = s3_server.boto3_client().list_objects_v2(Bucket=bucket, Prefix="run/")
    prefixes = {obj["Key"].split("/")[1] for obj in listing.get("Contents", [])}
    assert prefixes == {"iter_0000002", "iter_0000003"}
    assert s3_server.secret not in _output(inspected) + _output(collected)


# -- one exit-status contract for every subcommand --------------------------------------
# 0 ok; 1 a checkpoint problem found; 2 usage error, no checkpoint at the URI, store
# unreachable or credentials refused. In-process (main()), so the matrix stays fast.


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A run with a committed and an uncommitted checkpoint, a directory of other files,
    a missing path and a closed loopback port."""
    root = tmp_path_factory.mktemp("exit-status")
    _save(str(root / "run" / "iter_0000001"), 1)
    _save(str(root / "run" / "iter_0000002"), 2)
    (root / "run" / "iter_0000002" / "metadata.json").unlink()
    (root / "other" / "logs").mkdir(parents=True)
    (root / "other" / "logs" / "train.log").write_text("not a checkpoint\n")
    return {
        "run": str(root / "run"),
        "committed": str(root / "run" / "iter_0000001"),
        "uncommitted": str(root / "run" / "iter_0000002"),
        "other": str(root / "other"),
        "missing": str(root / "missing"),
        "dst": str(root / "converted"),
        "closed": f"http://127.0.0.1:{free_loopback_port()}",
    }


# (command words, with {placeholders} from `places`) -> expected exit status
EXIT_MATRIX: dict[str, tuple[list[str], int]] = {
    "ls-ok": (["ls", "{run}"], 0),
    "ls-other-files": (["ls", "{other}"], 0),
    "ls-missing": (["ls", "{missing}"], 2),
    "ls-usage": (["ls", "{run}", "--no-such-flag"], 2),
    "inspect-ok": (["inspect", "{committed}"], 0),
    "inspect-uncommitted": (["inspect", "{uncommitted}"], 1),
    "inspect-missing": (["inspect", "{missing}"], 2),
    "inspect-other-files": (["inspect", "{other}"], 2),
    "inspect-usage": (["inspect"], 2),
    "verify-ok": (["verify", "{committed}"], 0),
    "verify-uncommitted": (["verify", "{uncommitted}"], 1),
    "verify-missing": (["verify", "{missing}"], 2),
    "verify-other-files": (["verify", "{other}"], 2),
    "verify-usage": (["verify", "{committed}", "--config", "{missing}"], 2),
    "gc-ok": (["gc", "{run}", "--keep-last", "1", "--dry-run"], 0),
    "gc-missing": (["gc", "{missing}", "--keep-last", "1"], 2),
    "gc-usage": (["gc", "{run}", "--keep-last", "0"], 2),
    "rm-missing": (["rm", "{missing}", "--yes"], 2),
    "rm-other-files": (["rm", "{other}", "--yes"], 2),
    "rm-usage": (["rm", "{committed}"], 2),  # no --yes and no terminal
    "convert-uncommitted": (["convert", "{uncommitted}", "{dst}"], 1),
    "convert-missing": (["convert", "{missing}", "{dst}"], 2),
    "convert-usage": (["convert", "{committed}", "{dst}", "--backend", "nope"], 2),
}
STORE_COMMANDS = {
    "ls": ["ls", "s3://bucket/run"],
    "inspect": ["inspect", "s3://bucket/run/iter_1"],
    "verify": ["verify", "s3://bucket/run/iter_1"],
    "gc": ["gc", "s3://bucket/run", "--keep-last", "1"],
    "rm": ["rm", "s3://bucket/run/iter_1", "--yes"],
    "convert": ["convert", "s3://bucket/run/iter_1", "{dst}"],
}


def _main(words: list[str], places: dict[str, str]) -> int:
    argv = [w.format(**places) for w in words]
    try:
        return cli.main(argv)
    except SystemExit as exc:  # argparse's usage errors
        return int(exc.code or 0)


@pytest.mark.parametrize("case", list(EXIT_MATRIX))
def test_exit_status_contract(
    case: str, places: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    words, expected = EXIT_MATRIX[case]
    assert _main(words, places) == expected, capsys.readouterr()
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if case.endswith(("-missing", "-other-files")) and expected == 2:
        assert "no checkpoint" in err


@pytest.mark.parametrize("command", list(STORE_COMMANDS))
def test_an_unreachable_store_is_exit_status_2_for_every_command(
    command: str,
    places: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", places["closed"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFAKE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "fake-secret")
    assert _main(STORE_COMMANDS[command], places) == 2
    assert "cannot reach the S3 endpoint" in capsys.readouterr().err


def test_help_documents_the_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    assert _main(["--help"], {}) == 0
    out = capsys.readouterr().out
    assert "exit status (every command):" in out
    assert "0  success" in out and "1  a checkpoint problem" in out
    assert "2  usage error, no checkpoint at the URI" in out
