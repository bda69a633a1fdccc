"""Tenants (`--api-keys-file`): each key's tenant gets a prefix cache of its own, so whether another
tenant sent a prompt never shows in `cached_tokens` (and the side channel closes), while output is the
same; `--shared-prefix-cache` opens it on purpose; the file is read again on SIGHUP or when it changes,
a bad one is refused at start and ignored (keys kept) on reload; request counters carry the tenant."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.bench_side_channel import attacker_scores, tenants_daemon, trials
from tests.daemon import PATIENCE, ROOT, start_daemon, wait_until
from tests.helpers import tokens
from tests.test_store_daemon import metric
from v4serve.server.tenants import KeysFileError, parse_keys, scoped_salt

DOC = tokens(300, 41)  # two whole 128-token blocks and a tail


def complete(url: str, key: str, prompt: list[int], **fields: object) -> httpx.Response:
    body = {"model": "v4serve-tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            **fields}
    return httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=PATIENCE)


def cached(resp: httpx.Response) -> int:
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def text(resp: httpx.Response) -> str:
    return resp.json()["choices"][0]["text"]


def test_keys_files_parse_with_clear_errors() -> None:
    assert parse_keys("# tenants\nk1 acme\n\n  k2 acme  # second key\nk3 globex\n") == \
        {b"k1": "acme", b"k2": "acme", b"k3": "globex"}
    # Read as bytes: a comment in another encoding is a comment.
    assert parse_keys(b"# caf\xe9 team\nk1 acme # \xff\xfe\n") == {b"k1": "acme"}
    for bad, says in (("k1\n", "line 1: expected 'KEY TENANT', got 1 fields"),
                      ("k1 a\nk2 b c\n", "line 2: expected 'KEY TENANT', got 3 fields"),
                      ("k1 a\nk1 b\n", "line 2: this key is already given to tenant 'a'"),
                      ("k1 {evil}\n", "line 1: tenant '{evil}' must be"),
                      (b"k\xe9y acme\n", "line 1: a key must be 1-512 visible ASCII characters"),
                      (b"k1 acme\n\x00\x01\x02 \xff\n", "line 2: a key must be")):
        with pytest.raises(KeysFileError, match=says.replace("(", r"\(").replace("{", r"\{")):
            parse_keys(bad)
    # A tenant's scope can never be spelled by a raw salt of another scope: the scoped form is JSON of three.
    assert scoped_salt(None, "s") == "s" and scoped_salt("acme", None) != scoped_salt("globex", None)
    assert scoped_salt("acme", "x") != scoped_salt("acme", "y")


@pytest.fixture(scope="module")
def isolated() -> Iterator[str]:
    with tenants_daemon(shared=False, extra=["--api-key", "admin-key"]) as url:
        yield url


def test_tenants_never_see_each_others_prefixes_and_get_the_same_output(isolated: str) -> None:
    victim = complete(isolated, "victim-key", DOC)
    assert cached(victim) == 0
    attacker = complete(isolated, "attacker-key", DOC)
    assert cached(attacker) == 0  # the victim's blocks are not the attacker's
    assert text(attacker) == text(victim)  # a cache scope changes what is found, never what is computed
    again = complete(isolated, "victim-key", DOC)
    assert cached(again) >= 256 and text(again) == text(victim)  # within a tenant, the cache works
    admin = complete(isolated, "admin-key", DOC)  # --api-key: tenant "default", a scope of its own
    assert cached(admin) == 0 and text(admin) == text(victim)
    salted = complete(isolated, "victim-key", DOC, cache_salt="project-b")
    assert cached(salted) == 0  # cache_salt divides a tenant further
    assert cached(complete(isolated, "victim-key", DOC, cache_salt="project-b")) >= 256
    assert complete(isolated, "no-such-key", DOC).status_code == 401
    # Request counters carry the tenant (from the keys file; "default" for --api-key).
    assert metric(isolated, "v4serve_request_success_total", tenant="victim") >= 4
    assert metric(isolated, "v4serve_request_success_total", tenant="attacker") >= 1
    assert metric(isolated, "v4serve_request_success_total", tenant="default") >= 1
    assert metric(isolated, "v4serve_prompt_tokens_total", tenant="attacker") >= 300


def test_the_side_channel_is_closed_between_isolated_tenants(isolated: str) -> None:
    """A short run of bench/bench_side_channel.py: the attacker's own cached_tokens are 0 whatever the
    victim sent, so guessing from them is a coin (AUC 0.5 exactly: every score ties)."""
    scores = attacker_scores(trials(isolated, 12, seed=3))
    assert scores["max_cached_tokens"] == 0
    assert scores["auc_cached_tokens"] == 0.5 <= 0.6


def test_a_shared_prefix_cache_is_the_side_channel_the_default_closes() -> None:
    with tenants_daemon(shared=True) as url:
        scores = attacker_scores(trials(url, 12, seed=3))
        assert cached(complete(url, "victim-key", DOC)) == 0
        assert cached(complete(url, "attacker-key", DOC)) >= 256  # shared on purpose
    assert scores["auc_cached_tokens"] == 1.0 and scores["accuracy_cached_tokens"] == 1.0


def test_tenants_stay_apart_in_the_ssd_store_across_a_restart(tmp_path: Path) -> None:
    """The tenant is in the chain hash, so the files one tenant's prompts wrote are never another's."""
    store = ["--kv-store-dir", str(tmp_path / "store")]
    with tenants_daemon(shared=False, extra=store) as url:
        cold = complete(url, "victim-key", DOC)
    with tenants_daemon(shared=False, extra=store) as url:  # a new process: only the disk remembers
        attacker = complete(url, "attacker-key", DOC)
        victim = complete(url, "victim-key", DOC)
        disk_hits = metric(url, "v4serve_prefix_cache_hits_total", source="disk")
    assert cached(attacker) == 0 and cached(victim) >= 256 and disk_hits >= 256
    assert text(attacker) == text(victim) == text(cold)


def write_keys(path: Path, text: str) -> None:
    """Replace the keys file at once (as an editor or a config manager does: a new file renamed over)."""
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    tmp.replace(path)


def test_the_keys_file_is_read_again_on_change_and_on_sighup(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("first-key acme\n")
    running = start_daemon("--api-keys-file", str(keys))
    try:
        url = running.url
        assert complete(url, "first-key", DOC[:10]).status_code == 200
        assert complete(url, "second-key", DOC[:10]).status_code == 401
        write_keys(keys, "first-key acme\nsecond-key globex\n")
        wait_until(lambda: complete(url, "second-key", DOC[:10]).status_code == 200, "the added key")
        write_keys(keys, "second-key globex\n")
        wait_until(lambda: complete(url, "first-key", DOC[:10]).status_code == 401, "the removed key to go")
        write_keys(keys, "not a keys file at all\n")  # a broken edit: the keys in force stay
        time.sleep(1.5)  # past the file's re-check interval, so the broken file has been looked at
        assert complete(url, "second-key", DOC[:10]).status_code == 200
        # SIGHUP reads it at once, whatever its modification time says.
        keys.write_text("third-key initech\n")
        running.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: complete(url, "third-key", DOC[:10]).status_code == 200, "the key read on SIGHUP")
        assert complete(url, "second-key", DOC[:10]).status_code == 401
    finally:
        assert running.stop() == 0
    log = Path(running.log.name).read_text()
    assert "not reloaded, the 1 keys read before stay in force: " in log and "line 1: expected 'KEY TENANT'" in log


def test_a_bad_keys_file_is_refused_at_start(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k1 acme\nk1 globex\n")
    for args, says in ((["--api-keys-file", str(keys)], "line 2: this key is already given to tenant 'acme'"),
                       (["--api-keys-file", str(tmp_path / "missing")], "No such file"),
                       (["--shared-prefix-cache"], "without that file there are no tenants")):
        done = subprocess.run([sys.executable, "-m", "v4serve.server.cli", "serve", "--port", "0", *args],
                              capture_output=True, text=True, cwd=ROOT, timeout=PATIENCE)
        assert done.returncode == 2 and says in done.stderr, done.stderr
