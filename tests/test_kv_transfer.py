"""Prefill and decode apart, below the HTTP layer: the hand-over's files, the decode side's fetch and
its checks, and that a prompt handed over decodes exactly as it does cold — in every SWA mode, with
the hand-over point (the prompt's last token but one) on a block boundary and one token either side.
Real engines (the small model: 16-token blocks, window 8) and real store files in temporary folders;
tests/test_pd.py runs the same behind vLLM's router over HTTP."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest

from tests.daemon import PATIENCE
from tests.helpers import engine_for, greedy, rel_err, small_model, tokens
from v4serve.cache.kv_transfer import KVSource, KVTransferConfig, fetch, new_transfer_id, signature
from v4serve.cache.ssd_file import KIND_BLOCK, KIND_RESPONSE, KIND_SNAPSHOT
from v4serve.cache.ssd_store import HANDOVER_DIR, MANIFEST, SSDStore

PRODUCER = KVTransferConfig(kv_role="kv_producer")
CONSUMER = KVTransferConfig(kv_role="kv_consumer", fetch_timeout=PATIENCE)


# ---- the flag ------------------------------------------------------------------------------------------


def test_the_config_takes_vllms_shape_and_names_what_is_wrong() -> None:
    config = KVTransferConfig.parse(json.dumps({
        "kv_connector": "V4ServeConnector", "kv_role": "kv_both", "kv_ip": "10.0.0.5", "kv_port": 8100,
        "kv_buffer_device": "cuda", "kv_connector_extra_config": {"hold_seconds": 30, "fetch_timeout": 5}}))
    assert (config.producer, config.consumer, config.kv_ip, config.kv_port, config.hold_seconds) == (
        True, True, "10.0.0.5", 8100, 30)
    assert KVTransferConfig.parse('{"kv_role": "kv_consumer"}').producer is False
    for text, words in [
        ('{"kv_role": "kv_producer", "kv_connector": "NixlConnector"}', "hands KV over itself"),
        ('{"kv_role": "prefill"}', "kv_role must be one of"),
        ('{"kv_role": "kv_producer", "kv_bogus": 1}', "unknown keys ['kv_bogus']"),
        ('{"kv_role": "kv_producer", "kv_connector_extra_config": {"hold": 1}}', "kv_connector_extra_config.hold"),
        ('{"kv_role": "kv_producer", "kv_connector_extra_config": {"hold_seconds": 0}}', "hold_seconds"),
        ('{"kv_role": "kv_producer", "kv_load_failure_policy": "fail"}', "recompute"),
        ('{"kv_role": "kv_producer", "kv_port": 70000}', "kv_port"),
        ('{"kv_role": "kv_consumer", "kv_connector_extra_config": {"trusted_producers": "h:1"}}', "host:port"),
        ("[1]", "JSON object"), ("{", "not JSON"),
    ]:
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            KVTransferConfig.parse(text)


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


# ---- the fetch's failures: counted fallbacks, nothing wrong -------------------------------------------------


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


def test_a_fetch_from_nowhere_or_unsigned_is_a_fallback(tmp_path) -> None:
    store = SSDStore(tmp_path, b"n" * 32, b"L", {KIND_BLOCK: 4, KIND_SNAPSHOT: 4, KIND_RESPONSE: 8})
    try:
        transfer_id = new_transfer_id()
        result = fetch(store, KVSource("127.0.0.1", dead_port(), transfer_id), 5.0, None)
        assert (result.fallback, result.files, result.local) == ("unreachable", 0, False)
        # With a key, a decode replica sends it only to addresses a prefill replica signed with it.
        unsigned = fetch(store, KVSource("127.0.0.1", dead_port(), transfer_id), 5.0, "sk-shared")
        assert unsigned.fallback == "unsigned" and "not sent" in unsigned.detail
        forged = KVSource("127.0.0.1", 8000, transfer_id, signature("sk-other", transfer_id, "127.0.0.1", 8000))
        assert fetch(store, forged, 5.0, "sk-shared").fallback == "unsigned"
        # A producer listed as trusted is asked unsigned (SGLang's router carries no signature).
        port = dead_port()
        trusted = fetch(store, KVSource("127.0.0.1", port, transfer_id), 5.0, "sk-shared", (f"127.0.0.1:{port}",))
        assert trusted.fallback == "unreachable"
    finally:
        store.close()


def test_the_decode_engine_computes_when_the_fetch_fails(tmp_path) -> None:
    model = small_model()
    prompt = tokens(40, 7)
    want, _ = cold(model, prompt)
    req, engine = decode(model, tmp_path, prompt, KVSource("127.0.0.1", dead_port(), new_transfer_id()), "periodic")
    assert req.output_token_ids == want and req.num_cached_tokens == 0
    assert dict(engine.scheduler.stats.fetch_fallbacks) == {"unreachable": 1}


def test_unfetched_hand_overs_are_dropped_after_the_hold(tmp_path) -> None:
    model = small_model()
    prompt = tokens(40, 8)
    old, _ = prefill(model, tmp_path, prompt, "periodic")
    folder = tmp_path / HANDOVER_DIR / old
    import os

    os.utime(folder, (1.0, 1.0))  # written long ago
    newer, _ = prefill(model, tmp_path, tokens(40, 9), "periodic")  # each hand-over sweeps those past the hold
    assert not folder.exists() and (tmp_path / HANDOVER_DIR / newer / MANIFEST).is_file()


@pytest.mark.parametrize("length", [32, 33, 34])
def test_under_batch_invariant_kernels_a_hand_over_is_bitwise_the_cold_run(tmp_path, length) -> None:
    from tests.helpers import SMALL_ONE_OF_EACH
    from v4serve.engine.model.tiny import build_tiny, tiny_config
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
