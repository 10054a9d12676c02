"""`serve --auth-file` with a file whose shape JSON itself hides: duplicate tokens, sections that are not objects,
names that are not strings, bytes that are not UTF-8. Each refuses the start (one line, exit 2) and a reload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rendezvous.server.authfile import AuthPolicy, digest
from tests.service.test_cli_listen import refused

TOKEN = "decode-0-token-8c1f9a"
OTHER = "prefill-0-token-77e2b4"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        # json.load keeps the last of two equal keys: "decode-0" silently lost its token to "impostor".
        (
            f'{{"tokens": {{"{TOKEN}": {{"name": "decode-0"}}, "{TOKEN}": {{"name": "impostor", "roles": '
            '["admin"]}}}',
            f"a key ({len(TOKEN)} bytes) is given twice",
        ),
        # The same token in the clear and by its digest: the second entry silently replaced the first.
        (
            json.dumps({"tokens": {TOKEN: {"name": "decode-0"}, f"sha256:{digest(TOKEN)}": {"name": "impostor"}}}),
            "identities 'decode-0' and 'impostor' have the same token",
        ),
        (json.dumps({"tokens": [[TOKEN, {"name": "decode-0"}]]}), "'tokens' must be an object"),  # was dict(list)
        (json.dumps({"certificates": []}), "'certificates' must be an object"),
        (json.dumps({"tokens": {TOKEN: {"name": 7}}}), "must be a non-empty string"),
        (f'{{"tokens": {{"{TOKEN}": {{"name": "d0", "name": "d1"}}}}}}', "a key 'name' is given twice"),
    ],
)
def test_an_auth_file_json_would_misread_refuses_the_start(text: str, says: str, tmp_path: Path) -> None:
    path = tmp_path / "auth.json"
    path.write_text(text)
    line = refused("--auth-file", str(path))
    assert line.startswith(f"kv-rendezvous: --auth-file {path}: ") and says in line
    assert TOKEN not in line


def test_an_auth_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "auth.json"
    path.write_bytes(b"\xff\xfe{}")
    assert refused("--auth-file", str(path)) == f"kv-rendezvous: --auth-file {path}: is not UTF-8 text"


def test_a_reload_to_a_file_with_a_duplicate_token_keeps_the_identities(tmp_path: Path) -> None:
    path = tmp_path / "auth.json"
    path.write_text(json.dumps({"tokens": {TOKEN: {"name": "decode-0"}, OTHER: {"name": "prefill-0"}}}))
    policy = AuthPolicy(str(path))
    path.write_text(f'{{"tokens": {{"{TOKEN}": {{"name": "decode-0"}}, "{TOKEN}": {{"name": "prefill-0"}}}}}}')
    assert not policy.reload()
    identity = policy.by_token(TOKEN)
    assert identity is not None and identity.name == "decode-0"
    assert policy.by_token(OTHER) is not None
