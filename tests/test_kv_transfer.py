"""Prefill and decode apart, below the HTTP layer: the hand-over's files, the decode side's fetch and
its checks, and that a prompt handed over decodes exactly as it does cold — in every SWA mode, with
the hand-over point (the prompt's last token but one) on a block boundary and one token either side.
Real engines (the small model: 16-token blocks, window 8) and real store files in temporary folders;
tests/test_pd.py runs the same behind vLLM's router over HTTP."""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

import pytest

from tests.daemon import PATIENCE, wait_until
from tests.helpers import engine_for, greedy, rel_err, small_model, tokens
from v4serve.cache.block_pool import root_hash
from v4serve.cache.kv_transfer import ExpectedPrefix, KVSource, KVTransferConfig, fetch, new_transfer_id
from v4serve.cache.ssd_file import _HEAD, KIND_BLOCK, KIND_RESPONSE, KIND_SNAPSHOT, encode, file_tokens
from v4serve.cache.ssd_store import HANDOVER_DIR, MANIFEST, SSDStore

SECRET = "a-peer-secret-for-tests-0123456789"
PRODUCER = KVTransferConfig(kv_role="kv_producer", peer_secret=SECRET)
# Port 9: the address these engine-level tests name (the hand-over is on the shared disk).
CONSUMER = KVTransferConfig(kv_role="kv_consumer", fetch_timeout=PATIENCE, peer_secret=SECRET,
                            producers=("127.0.0.1:9",))


# ---- the flag ------------------------------------------------------------------------------------------


def parse(config: dict, environ: dict[str, str] | None = None) -> KVTransferConfig:
    return KVTransferConfig.parse(json.dumps(config), {} if environ is None else environ)


def test_the_config_takes_vllms_shape_and_names_what_is_wrong(tmp_path) -> None:
    config = parse({
        "kv_connector": "V4ServeConnector", "kv_role": "kv_both", "kv_ip": "10.0.0.5", "kv_port": 8100,
        "kv_buffer_device": "cuda", "kv_connector_extra_config": {
            "hold_seconds": 30, "fetch_timeout": 5, "peer_secret": SECRET,
            "producers": ["10.0.0.6:8001", "[::1]:8002"], "max_fetches": 2}})
    got = config.producer, config.consumer, config.kv_ip, config.kv_port, config.hold_seconds, config.max_fetches
    assert got == (True, True, "10.0.0.5", 8100, 30, 2)
    assert config.lists("10.0.0.6", 8001) and config.lists("::1", 8002) and config.lists("[::1]", 8002)
    assert not config.lists("10.0.0.6", 8002) and not config.lists("10.0.0.7", 8001)
    assert SECRET not in repr(config)  # a config in a log or a traceback never shows the secret
    # The secret from the environment or from a file, each on its own.
    assert parse({"kv_role": "kv_producer"}, {"V4SERVE_KV_PEER_SECRET": SECRET}).peer_secret == SECRET
    (tmp_path / "secret").write_text(SECRET + "\n")
    from_file = parse({"kv_role": "kv_producer",
                       "kv_connector_extra_config": {"peer_secret_file": str(tmp_path / "secret")}})
    assert from_file.peer_secret == SECRET and not from_file.consumer
    keyed = {"peer_secret": SECRET}
    for config, words in [
        ({"kv_role": "kv_producer", "kv_connector": "NixlConnector", "kv_connector_extra_config": keyed},
         "hands KV over itself"),
        ({"kv_role": "prefill", "kv_connector_extra_config": keyed}, "kv_role must be one of"),
        ({"kv_role": "kv_producer", "kv_bogus": 1}, "unknown keys ['kv_bogus']"),
        ({"kv_role": "kv_producer", "kv_connector_extra_config": {"hold": 1}}, "kv_connector_extra_config.hold"),
        ({"kv_role": "kv_producer", "kv_connector_extra_config": {**keyed, "hold_seconds": 0}}, "hold_seconds"),
        ({"kv_role": "kv_producer", "kv_load_failure_policy": "fail", "kv_connector_extra_config": keyed}, "recompute"),
        ({"kv_role": "kv_producer", "kv_port": 70000, "kv_connector_extra_config": keyed}, "kv_port"),
        ({"kv_role": "kv_consumer", "kv_connector_extra_config": {**keyed, "producers": "h:1"}}, "host:port"),
        ({"kv_role": "kv_consumer", "kv_connector_extra_config": {**keyed, "producers": ["h"]}}, "host:port"),
        ({"kv_role": "kv_consumer", "kv_connector_extra_config": keyed}, "fetches only from the producers it lists"),
        ({"kv_role": "kv_producer"}, "V4SERVE_KV_PEER_SECRET"),
        ({"kv_role": "kv_producer", "kv_connector_extra_config": {"peer_secret": "short"}}, "at least 16 bytes"),
        ({"kv_role": "kv_producer", "kv_connector_extra_config": {**keyed, "peer_secret_file": "/no/such"}},
         "given 2 ways"),
        ({"kv_role": "kv_producer", "kv_connector_extra_config": {"peer_secret_file": "/no/such/file"}},
         "No such file"),
        ({"kv_role": "kv_producer", "kv_connector_extra_config": {**keyed, "max_fetches": 0}}, "max_fetches"),
        ({"kv_role": "kv_producer", "kv_connector_extra_config": {**keyed, "hold_seconds": float("nan")}},
         "hold_seconds"),
        ({"kv_role": "kv_producer", "kv_connector_extra_config": {**keyed, "fetch_timeout": float("inf")}},
         "fetch_timeout"),
        ({"kv_role": "kv_consumer", "kv_connector_extra_config": {**keyed, "peer_api_key": "k"}},
         "replaced by peer_secret"),
        ({"kv_role": "kv_consumer", "kv_connector_extra_config": {**keyed, "trusted_producers": []}},
         "replaced by producers"),
    ]:
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            parse(config)
    for text, words in [("[1]", "JSON object"), ("{", "not JSON")]:
        with pytest.raises(ValueError, match=words):
            KVTransferConfig.parse(text, {})


# ---- a prompt handed over decodes as it does cold ---------------------------------------------------------


def cold(model, prompt: list[int], n: int = 6):
    engine = engine_for(model, enable_prefix_caching=False)
    req = greedy("cold", prompt, n)
    engine.generate([req])
    return req.output_token_ids, engine.logits["cold"]


def prefill(model, root: Path, prompt: list[int], mode: str) -> tuple[str, object]:
    """The prefill replica's side: one token (as vLLM's router asks), the KV handed over."""
    engine = engine_for(model, kv_store_dir=str(root), kv_transfer=PRODUCER, swa_cache_mode=mode,
                        swa_checkpoint_interval=32)
    req = greedy("prefill", prompt, 1)
    req.handover = transfer_id = new_transfer_id()
    engine.generate([req])
    engine.close()  # its writes (and the hand-over's links) land first
    assert engine.scheduler.stats.handovers == 1
    return transfer_id, engine


def decode(model, root: Path, prompt: list[int], source: KVSource, mode: str, n: int = 6):
    engine = engine_for(model, kv_store_dir=str(root), kv_transfer=CONSUMER, swa_cache_mode=mode,
                        swa_checkpoint_interval=32, kv_store_read_timeout=PATIENCE)
    req = greedy("decode", prompt, n)
    req.kv_source = source
    engine.generate([req])
    engine.check()
    engine.close()
    return req, engine


@pytest.mark.parametrize("mode", ["full", "periodic", "zero", "auto"])
@pytest.mark.parametrize("length", [32, 33, 34, 41, 42, 43])  # the hand-over at 31/32/33 (a boundary), 40-42
def test_a_prompt_handed_over_through_a_shared_store_decodes_as_cold(tmp_path, mode, length) -> None:
    model = small_model()
    prompt = tokens(length, length)
    want, want_logits = cold(model, prompt)
    transfer_id, _ = prefill(model, tmp_path, prompt, mode)
    req, engine = decode(model, tmp_path, prompt, KVSource("127.0.0.1", 9, transfer_id), mode)
    assert req.output_token_ids == want
    assert rel_err(torch_stack(engine.logits["decode"]), torch_stack(want_logits)) < 1e-5
    assert req.num_cached_tokens == length - 1  # everything but the last token, as any full hit
    stats = engine.scheduler.stats
    assert (stats.fetches, stats.fetches_local, dict(stats.fetch_fallbacks)) == (1, 1, {})
    assert stats.fetched_files == 0  # one store: every file is already under this replica's name for it
    assert not (tmp_path / HANDOVER_DIR / transfer_id).exists()  # fetched: no longer held


def torch_stack(rows):
    import torch

    return torch.stack(rows)


def test_a_hand_over_copied_between_stores_is_checked_and_imported(tmp_path) -> None:
    """Separate stores: each file is checked as a read checks it and written under the decode replica's
    name; a corrupt one is a fallback (what came before it is kept), never a wrong token."""
    model = small_model()
    prompt = tokens(75, 5)  # 4 sealed blocks below the hand-over at 74, then a response end
    want, _ = cold(model, prompt)
    for corrupt in (False, True):
        producer, consumer = tmp_path / f"p{corrupt}", tmp_path / f"d{corrupt}"
        transfer_id, _ = prefill(model, producer, prompt, "periodic")
        folder = producer / HANDOVER_DIR / transfer_id
        manifest = json.loads((folder / MANIFEST).read_text())
        assert manifest["complete"] and [e["kind"] for e in manifest["files"]] == [KIND_BLOCK] * 4 + [KIND_RESPONSE]
        if corrupt:  # the third block flipped in the middle
            third = folder / manifest["files"][2]["name"]
            data = bytearray(third.read_bytes())
            data[len(data) // 2] ^= 0xFF
            third.write_bytes(bytes(data))
        shutil.copytree(folder, consumer / HANDOVER_DIR / transfer_id)
        req, engine = decode(model, consumer, prompt, KVSource("127.0.0.1", 9, transfer_id), "periodic")
        stats = engine.scheduler.stats
        assert req.output_token_ids == want
        if corrupt:
            assert dict(stats.fetch_fallbacks) == {"corrupt": 1} and stats.fetched_files == 2
            assert req.num_cached_tokens < 74
        else:
            assert stats.fetched_files == 5 and not stats.fetch_fallbacks and req.num_cached_tokens == 74


def test_a_hand_over_at_a_boundary_is_a_sealed_snapshot(tmp_path) -> None:
    model = small_model()
    prompt = tokens(49, 6)  # the hand-over at 48: three blocks and the snapshot at their end
    transfer_id, _ = prefill(model, tmp_path, prompt, "zero")  # even where the mode writes no snapshots
    manifest = json.loads((tmp_path / HANDOVER_DIR / transfer_id / MANIFEST).read_text())
    assert [e["kind"] for e in manifest["files"]] == [KIND_BLOCK] * 3 + [KIND_SNAPSHOT]


# ---- what a decode replica imports: only its own request's chain, checked file by file ----------------------


def prefill_salted(model, root: Path, prompt: list[int], salt: str | None) -> str:
    engine = engine_for(model, kv_store_dir=str(root), kv_transfer=PRODUCER, swa_cache_mode="periodic",
                        swa_checkpoint_interval=32)
    req = greedy("prefill", prompt, 1, salt=salt)
    req.handover = transfer_id = new_transfer_id()
    engine.generate([req])
    engine.close()
    return transfer_id


def decode_salted(model, root: Path, prompt: list[int], transfer_id: str, salt: str | None, n: int = 6):
    engine = engine_for(model, kv_store_dir=str(root), kv_transfer=CONSUMER, swa_cache_mode="periodic",
                        swa_checkpoint_interval=32, kv_store_read_timeout=PATIENCE)
    req = greedy("decode", prompt, n, salt=salt)
    req.kv_source = KVSource("127.0.0.1", 9, transfer_id)
    engine.generate([req])
    engine.close()
    return req, engine


def store_files(root: Path) -> set[str]:
    return {p.name for p in root.rglob("*") if p.suffix in (".blk", ".snap", ".resp") and HANDOVER_DIR not in p.parts}


@pytest.mark.parametrize("case", ["another_tenant", "another_prompt"])
def test_a_hand_over_of_another_chain_is_never_imported(tmp_path, case) -> None:
    """A hand-over made under another tenant's root (or for another prompt), placed where this request's
    would be: every file checks as a store file, none is this request's chain, so nothing is written and
    the prompt is computed (once another tenant's blocks were imported under the id a client named)."""
    model = small_model()
    prompt = tokens(75, 21)
    want, _ = cold(model, prompt)
    made_for = (prompt, "tenant-a") if case == "another_tenant" else (tokens(75, 22), "tenant-b")
    transfer_id = prefill_salted(model, tmp_path / "p", made_for[0], made_for[1])
    folder = tmp_path / "d" / HANDOVER_DIR / transfer_id
    shutil.copytree(tmp_path / "p" / HANDOVER_DIR / transfer_id, folder)
    handed = {e["name"] for e in json.loads((folder / MANIFEST).read_text())["files"]}
    req, engine = decode_salted(model, tmp_path / "d", prompt, transfer_id, "tenant-b")
    assert req.output_token_ids == want and req.num_cached_tokens == 0
    stats = engine.scheduler.stats
    assert dict(stats.fetch_fallbacks) == {"unverified": 1} and stats.fetched_files == 0
    assert store_files(tmp_path / "d").isdisjoint(handed)  # what it computed itself is there, none of those


def copied_hand_over(model, root: Path, prompt: list[int]) -> tuple[str, Path, dict]:
    transfer_id = prefill_salted(model, root / "p", prompt, None)
    folder = root / "d" / HANDOVER_DIR / transfer_id
    shutil.copytree(root / "p" / HANDOVER_DIR / transfer_id, folder)
    return transfer_id, folder, json.loads((folder / MANIFEST).read_text())


@pytest.mark.parametrize("forgery", ["extra_entry", "size", "tokens", "entry_order", "endless_manifest"])
def test_a_forged_hand_over_is_a_fallback_and_stores_nothing_unchecked(tmp_path, forgery) -> None:
    """Manifests and files that a real producer never writes: one entry more than the prompt's hand-over
    has, a size other than the kind's, a block file whose tokens are another block's (its hash and
    checksum rewritten to match), entries out of chain order, a manifest larger than the prompt's could be.
    Each is a counted fallback; the output is the cold run's; no file that was not this request's own
    block (checked) is in the store."""
    model = small_model()
    prompt = tokens(75, 23)
    want, _ = cold(model, prompt)
    transfer_id, folder, manifest = copied_hand_over(model, tmp_path, prompt)
    files = manifest["files"]
    if forgery == "extra_entry":
        files.append(dict(files[0]))
    elif forgery == "size":
        files[1]["size"] += 1
    elif forgery == "entry_order":
        files[0], files[1] = files[1], files[0]
    elif forgery == "endless_manifest":
        manifest["padding"] = "x" * (1 << 20)
    elif forgery == "tokens":  # block 2's file rewritten to hold block 1's tokens under block 2's hash
        one, two = (folder / files[i]["name"] for i in (1, 2))
        two.write_bytes(with_tokens(two.read_bytes(), file_tokens(one.read_bytes())))
    (folder / MANIFEST).write_text(json.dumps(manifest))
    req, engine = decode_salted(model, tmp_path / "d", prompt, transfer_id, None)
    assert req.output_token_ids == want
    stats = engine.scheduler.stats
    assert dict(stats.fetch_fallbacks) == {"corrupt" if forgery == "size" else "unverified": 1}
    # The blocks before the forged one were this request's own, checked: kept. Nothing else came in.
    assert stats.fetched_files == (2 if forgery == "tokens" else 0)
    assert req.num_cached_tokens < len(prompt) - 1


def with_tokens(data: bytes, ids: tuple[int, ...]) -> bytes:
    """A store file holding `ids` in place of its own tokens, its checksum made again: a file every check
    but the tokens' passes."""
    fields = _HEAD.unpack_from(data)
    n_tok, n_layout, n_payload = fields[5:8]
    layout = data[_HEAD.size + 4 * n_tok:_HEAD.size + 4 * n_tok + n_layout]
    payload = data[_HEAD.size + 4 * n_tok + n_layout:_HEAD.size + 4 * n_tok + n_layout + n_payload]
    return b"".join(bytes(p) for p in encode(fields[2], fields[3], fields[4], ids, layout, [payload]))


# ---- the fetch's failures: counted fallbacks, nothing wrong -------------------------------------------------


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


def test_a_fetch_from_an_unlisted_or_unreachable_producer_is_a_fallback(tmp_path) -> None:
    store = SSDStore(tmp_path, b"n" * 32, b"L", {KIND_BLOCK: 4, KIND_SNAPSHOT: 4, KIND_RESPONSE: 8})
    try:
        transfer_id = new_transfer_id()
        expected = ExpectedPrefix.of(root_hash(b"n" * 32, None), [], [1, 2, 3], 16)
        listed, unlisted = dead_port(), dead_port()
        config = KVTransferConfig(kv_role="kv_consumer", peer_secret=SECRET, producers=(f"127.0.0.1:{listed}",))
        deadline = time.monotonic() + PATIENCE
        # An address the operator did not list is never connected to (a listening socket would see it).
        with socket.socket() as spy:
            spy.bind(("127.0.0.1", unlisted))
            spy.listen()
            spy.setblocking(False)
            result = fetch(store, KVSource("127.0.0.1", unlisted, transfer_id), expected, config, deadline)
            assert (result.fallback, result.files, result.local) == ("unlisted", 0, False)
            with pytest.raises(BlockingIOError):
                spy.accept()
        result = fetch(store, KVSource("127.0.0.1", listed, transfer_id), expected, config, deadline)
        assert (result.fallback, result.files, result.local) == ("unreachable", 0, False)
        # A fetch whose deadline passed while it waited for a thread does not start.
        late = fetch(store, KVSource("127.0.0.1", listed, transfer_id), expected, config, time.monotonic() - 1)
        assert late.fallback == "timeout"
    finally:
        store.close()


def test_the_decode_engine_computes_when_the_fetch_fails(tmp_path) -> None:
    model = small_model()
    prompt = tokens(40, 7)
    want, _ = cold(model, prompt)
    req, engine = decode(model, tmp_path, prompt, KVSource("127.0.0.1", 9, new_transfer_id()), "periodic")
    assert req.output_token_ids == want and req.num_cached_tokens == 0
    assert dict(engine.scheduler.stats.fetch_fallbacks) == {"unreachable": 1}


def test_unfetched_hand_overs_are_swept_once_past_the_hold_with_none_written_since(tmp_path) -> None:
    """The writer thread sweeps every quarter of the hold, whether or not another hand-over is written."""
    store = SSDStore(tmp_path, b"n" * 32, b"L", {KIND_BLOCK: 4, KIND_SNAPSHOT: 4, KIND_RESPONSE: 8}, read_process=False)
    try:
        # A leftover name the sweep cannot judge (a writer pid past any real one) must not stop it.
        (tmp_path / HANDOVER_DIR / ".tmp-host-99999999999999999999999-x").mkdir(parents=True)
        store.keep_handovers_for(0.5)
        folder = tmp_path / HANDOVER_DIR / new_transfer_id()
        folder.mkdir(parents=True)
        (folder / MANIFEST).write_text('{"files": [], "complete": true}')
        made = folder.stat().st_mtime
        wait_until(lambda: not folder.exists(), "the sweep of a hand-over past its hold")
        assert time.time() - made >= 0.5  # never before its hold was over
        assert store._writer.is_alive()
    finally:
        store.close()


@pytest.mark.parametrize("length", [32, 33, 34])
def test_under_batch_invariant_kernels_a_hand_over_is_bitwise_the_cold_run(tmp_path, length) -> None:
    from tests.helpers import SMALL_ONE_OF_EACH
    from v4serve.engine.model.v4.tiny import build_tiny, tiny_config
    from v4serve.kernels.registry import load_kernels

    model = build_tiny(tiny_config(**SMALL_ONE_OF_EACH), seed=11)
    model.use_kernels(load_kernels("torch", "cpu", batch_invariant=True))
    prompt = tokens(length, 40 + length)
    want, want_logits = cold(model, prompt)
    transfer_id, _ = prefill(model, tmp_path, prompt, "periodic")
    req, engine = decode(model, tmp_path, prompt, KVSource("127.0.0.1", 9, transfer_id), "periodic")
    assert req.output_token_ids == want and req.num_cached_tokens == length - 1
    assert torch_stack(engine.logits["decode"]).equal(torch_stack(want_logits))


def test_both_roles_announce_their_blocks_as_kv_events(tmp_path) -> None:
    """The decode replica announces each block it brings in: on disk as the file is written, on the
    device once read (parents first, as routers need); the prefill replica its own as always."""
    from tests.test_kv_events import EVENTS, catch_up, device_hashes, disk_hashes, subscribed

    model = small_model()
    prompt = tokens(75, 12)
    transfer_id, _ = prefill(model, tmp_path / "p", prompt, "periodic")
    shutil.copytree(tmp_path / "p" / HANDOVER_DIR / transfer_id, tmp_path / "d" / HANDOVER_DIR / transfer_id)
    engine = engine_for(model, kv_store_dir=str(tmp_path / "d"), kv_transfer=CONSUMER, kv_events=EVENTS,
                        kv_store_read_timeout=PATIENCE)
    try:
        with subscribed(engine, model) as sub:
            req = greedy("decode", prompt, 2)
            req.kv_source = KVSource("127.0.0.1", 9, transfer_id)
            engine.generate([req])
            engine.kv.store.flush()
            catch_up(engine, sub)
            assert engine.scheduler.stats.fetched_files == 5 and req.num_cached_tokens == 74
            handed = set(req.kv.block_hashes[:4])
            assert handed <= sub.replica.blocks["DISK"] == disk_hashes(engine)
            assert handed <= sub.replica.blocks["GPU"] == device_hashes(engine)
    finally:
        engine.close()
