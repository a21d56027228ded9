"""``blob serve``'s TOML configuration: the file gives defaults, flags win, mistakes are
usage errors that name the file and the key (read through ``--print-config``, which exits
before any node starts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.blob_cli import blob_here


def _serve(tmp_path: Path, *args: str, code: int = 0) -> str:
    done = blob_here(["--store", str(tmp_path / "store"), "serve", *args], code=code)
    return done.stdout if code == 0 else done.stderr


def test_the_file_gives_defaults_and_flags_win(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(
        '[serve]\nlisten = ["/ip4/127.0.0.1/tcp/4001"]\nupload-limit = 50\n'
        'metrics = "127.0.0.1:9464"\nno_dht = true\ndownload-limit = 20\n'
    )
    merged = _serve(tmp_path, "--config", str(config), "--print-config")
    assert 'listen = ["/ip4/127.0.0.1/tcp/4001"]' in merged
    assert "upload-limit = 50.0" in merged and "no-dht = true" in merged
    assert "download-limit = 20.0" in merged
    flagged = _serve(
        tmp_path, "--config", str(config), "--print-config",
        "--upload-limit", "7", "--listen", "/ip4/127.0.0.1/tcp/5001",
    )  # fmt: skip
    assert "upload-limit = 7.0" in flagged
    assert 'listen = ["/ip4/127.0.0.1/tcp/5001"]' in flagged
    assert 'metrics = "127.0.0.1:9464"' in flagged  # kept from the file


def test_the_default_file_is_read_from_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "xdg" / "blobnet").mkdir(parents=True)
    (tmp_path / "xdg" / "blobnet" / "config.toml").write_text('[serve]\nmetrics = ":9000"\n')
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert 'metrics = ":9000"' in _serve(tmp_path, "--print-config")


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('[serve]\nlisten = "/ip4/127.0.0.1/tcp/1"\n', "serve.listen takes a list"),
        ("[serve]\nuplod-limit = 5\n", "unknown key serve.uplod-limit"),
        ("[server]\n", "unknown table(s) server"),
        ("[serve\n", "not valid TOML"),
    ],
)
def test_mistakes_in_the_file_are_usage_errors(tmp_path: Path, text: str, said: str) -> None:
    config = tmp_path / "c.toml"
    config.write_text(text)
    err = _serve(tmp_path, "--config", str(config), "--print-config", code=2)
    assert said in err and str(config) in err


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("[serve]\nupload-limit = nan\n", "is not a number of MB/s"),
        ("[serve]\ndownload-limit = inf\n", "is not a number of MB/s"),
        ("[serve]\nlisten = " + "[" * 5000 + "]" * 5000 + "\n", "nest too deeply"),
    ],
)
def test_values_no_parser_or_rate_can_take_are_usage_errors(
    tmp_path: Path, text: str, said: str
) -> None:
    """Guards against a traceback: `upload-limit = nan` passed click's FloatRange (no
    comparison with nan is true) and reached the Pacer, and 5,000-deep arrays ran tomllib
    out of stack (RecursionError)."""
    config = tmp_path / "c.toml"
    config.write_text(text)
    err = _serve(tmp_path, "--config", str(config), "--print-config", code=2)
    assert said in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("value", ["nan", "inf", "-nan"])
def test_a_rate_flag_must_be_a_finite_number(tmp_path: Path, value: str) -> None:
    """Guards against `serve --upload-limit nan` reaching the Pacer (a traceback)."""
    err = _serve(tmp_path, "--upload-limit", value, "--print-config", code=2)
    assert "is not a number of MB/s" in err and len(err.strip().splitlines()) == 1, err
    # get's --download-limit is a rate too (it reaches the node's receive pacer).
    got = blob_here(["--store", str(tmp_path / "s"), "get", "a" * 64, "--download-limit", value])
    assert got.returncode == 2 and "is not a number of MB/s" in got.stderr, got


@pytest.mark.timeout(30)
def test_a_fifo_as_the_config_file_is_refused_at_once(tmp_path: Path) -> None:
    """Guards against a hang: the file was opened for a blocking read, and a FIFO with no
    writer never answers."""
    import os

    fifo = tmp_path / "c.toml"
    os.mkfifo(fifo)
    err = _serve(tmp_path, "--config", str(fifo), "--print-config", code=2)
    assert "is not a regular file" in err and str(fifo) in err
