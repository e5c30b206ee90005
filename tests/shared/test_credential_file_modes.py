"""Files the mesh writes are its owner's alone (0600 files, 0700 folders), whatever the umask."""

from __future__ import annotations

import os
import stat

import pytest

from accelmesh.security.credentials import MeshCredentials
from accelmesh.security.files import private_dir, write_private
from accelmesh.security.identity import Role


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture(autouse=True)
def permissive_umask():
    """As CI runs the services: umask 022, under which plain writes are 0644 and folders 0755."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_a_users_token_and_the_token_table_are_owner_only(tmp_path):
    credentials = MeshCredentials(tmp_path / "credentials")
    path = credentials.add_user("alice")
    assert mode(path) == 0o600
    assert mode(credentials.tokens.path) == 0o600
    assert mode(credentials.token_file) == 0o600
    assert mode(credentials.folder) == 0o700
    assert {f.name: oct(mode(f)) for f in credentials.folder.iterdir() if mode(f) != 0o600} == {}  # keys, certificates


def test_a_credentials_folder_made_before_is_tightened_with_its_tokens(tmp_path):
    folder = tmp_path / "credentials"
    MeshCredentials(folder).add_user("bob")
    os.chmod(folder, 0o755)
    os.chmod(folder / "token-bob", 0o644)
    MeshCredentials(folder)
    assert mode(folder) == 0o700 and mode(folder / "token-bob") == 0o600


def test_private_dir_makes_missing_parents_0700_and_leaves_an_existing_parent_alone(tmp_path):
    os.chmod(tmp_path, 0o755)
    made = private_dir(tmp_path / "a" / "b")
    assert mode(tmp_path / "a") == 0o700 and mode(made) == 0o700
    assert mode(tmp_path) == 0o755
    os.chmod(made, 0o755)
    private_dir(made, tighten=False)
    assert mode(made) == 0o755
    private_dir(made)
    assert mode(made) == 0o700


def test_write_private_replaces_a_readable_file_with_an_owner_only_one(tmp_path):
    path = tmp_path / "table.json"
    path.write_text("old")
    os.chmod(path, 0o644)
    write_private(path, "new")
    assert path.read_text() == "new" and mode(path) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["table.json"]


def test_a_user_token_for_an_operator_is_owner_only_too(tmp_path):
    assert mode(MeshCredentials(tmp_path).add_user("root-ops", Role.OPERATOR)) == 0o600


def test_a_sticky_folder_shared_by_every_account_is_never_tightened(tmp_path):
    shared = tmp_path / "tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    private_dir(shared)
    assert mode(shared) == 0o1777
