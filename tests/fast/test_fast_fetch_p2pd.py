"""The p2pd fetcher's idempotency check (no network: the download itself is exercised by
`make install` and the interop tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fetch_p2pd import P2PD_SHA256, is_installed, main, sha256_of


def test_only_an_executable_with_the_pinned_hash_counts_as_installed(tmp_path: Path) -> None:
    fake = tmp_path / "p2pd"
    assert not is_installed(fake)
    fake.write_bytes(b"not the daemon")
    fake.chmod(0o755)
    assert sha256_of(fake) != P2PD_SHA256
    assert not is_installed(fake)


def test_optional_mode_never_fails_the_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An offline `make install` must still succeed; the interop tests then skip with a reason."""
    import fetch_p2pd

    def offline(dest: Path) -> Path:
        raise fetch_p2pd.FetchError("no network")

    monkeypatch.setattr(fetch_p2pd, "fetch", offline)
    assert main(["--dest", str(tmp_path / "p2pd"), "--optional"]) == 0
    assert main(["--dest", str(tmp_path / "p2pd")]) == 1
