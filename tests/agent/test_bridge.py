"""The tunnel keys' forced command (`nebula_cli.agent.bridge`) on its own: the targets it
chooses, and the source address its first session notes (the real sshd's sessions are in
tests/agent/test_grants.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nebula_cli.agent import bridge
from nebula_cli.agent.grants import read_seen


def test_only_an_allowed_target_is_chosen() -> None:
    allowed = ["127.0.0.1:29400", "[::1]:29401"]
    assert bridge.choose(allowed, "") == "127.0.0.1:29400"
    assert bridge.choose(allowed, " [::1]:29401\n") == "[::1]:29401"
    assert bridge.choose(allowed, "id") is None
    assert bridge.split("[::1]:29401") == ("::1", 29401)


def test_the_first_session_notes_its_address_and_no_later_one_replaces_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = tmp_path / "east.from"
    monkeypatch.setenv("SSH_CONNECTION", "198.18.0.7 50022 198.18.1.2 22")
    bridge.note_source(str(seen))
    monkeypatch.setenv("SSH_CONNECTION", "198.18.9.9 50023 198.18.1.2 22")
    bridge.note_source(str(seen))
    assert seen.read_text() == "198.18.0.7\n" and seen.stat().st_mode & 0o777 == 0o600
    assert read_seen(seen) == "198.18.0.7"
    monkeypatch.delenv("SSH_CONNECTION")
    other = tmp_path / "west.from"
    bridge.note_source(str(other))  # not an SSH session: nothing to note
    assert not other.exists()


def test_a_seen_file_that_is_a_link_or_not_an_address_pins_nothing(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("198.18.0.7\n")
    link = tmp_path / "east.from"
    link.symlink_to(target)
    assert read_seen(link) is None
    bad = tmp_path / "west.from"
    bad.write_text("from=\"*\"\n")
    assert read_seen(bad) is None
    assert read_seen(tmp_path / "absent.from") is None


def test_a_refused_target_notes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    seen = tmp_path / "east.from"
    monkeypatch.setenv("SSH_CONNECTION", "198.18.0.7 50022 198.18.1.2 22")
    monkeypatch.setenv("SSH_ORIGINAL_COMMAND", "id")
    assert bridge.main(["--seen", str(seen), "127.0.0.1:1"]) == 2
    assert not seen.exists()
    assert "'id' is not a target this key may reach (allowed: 127.0.0.1:1)" in \
        capsys.readouterr().err
    assert os.environ["SSH_ORIGINAL_COMMAND"] == "id"
