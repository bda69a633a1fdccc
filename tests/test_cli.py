"""The command line: make-checkpoint writes a folder the loader and the daemon read back; serve
settings come from defaults < --config FILE < V4SERVE_* < flags."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from tests.daemon import PATIENCE, ROOT, daemon, start_daemon
from v4serve.engine.model.parallel.single import SingleSequence
from v4serve.engine.model.v4.tiny import build_tiny
from v4serve.engine.model.weights.checkpoint import load_model
from v4serve.server.cli import build_parser, serve_settings
from v4serve.server.config import ServeConfig


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "v4serve.server.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin"})


def test_make_checkpoint_writes_the_served_tiny_model(tmp_path):
    done = run_cli("make-checkpoint", str(tmp_path / "ckpt"), "--max-shard-bytes", "2000000")
    assert done.returncode == 0, done.stderr
    folder = tmp_path / "ckpt"
    names = sorted(p.name for p in folder.iterdir())
    assert "config.json" in names and "tokenizer.json" in names and "model.safetensors.index.json" in names
    assert sum(n.endswith(".safetensors") for n in names) >= 2  # sharded
    # Every file gets the mode the umask gives any new file (safetensors alone made its own 0600, which a
    # container's user cannot read).
    umask = os.umask(0)
    os.umask(umask)
    assert {oct(p.stat().st_mode & 0o777) for p in folder.iterdir()} == {oct(0o666 & ~umask)}
    ids = list(range(64, 200))
    loaded = SingleSequence(load_model(folder, progress=False), 200).prefill(ids)
    embedded = SingleSequence(build_tiny(), 200).prefill(ids)
    assert torch.equal(loaded, embedded)


def test_make_checkpoint_sized_variant_and_bad_size(tmp_path):
    done = run_cli("make-checkpoint", str(tmp_path / "big"), "--set", "hidden_size=192",
                   "--set", "compress_ratios=[0,4,128,4,0]")
    assert done.returncode == 0, done.stderr
    model = load_model(tmp_path / "big", progress=False)
    assert model.cfg.hidden_size == 192 and model.cfg.num_layers == 5
    bad = run_cli("make-checkpoint", str(tmp_path / "bad"), "--set", "no_such_field=1")
    assert bad.returncode == 2 and "invalid model size" in bad.stderr


def test_settings_precedence(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("port: 9001\nmax-num-seqs: 3\nswa_cache_mode: zero\nno-kv-store: true\n")
    args = build_parser().parse_args(["serve", "--config", str(config), "--port", "9003"])
    settings = serve_settings(args, {"V4SERVE_PORT": "9002", "V4SERVE_MAX_NUM_SEQS": "5"})
    assert settings["port"] == 9003  # flag beats environment beats file
    assert settings["max_num_seqs"] == 5  # environment beats file
    assert settings["swa_cache_mode"] == "zero" and settings["no_kv_store"] is True
    config.write_text("prot: 1\n")
    with pytest.raises(ValueError, match="unknown setting"):
        serve_settings(build_parser().parse_args(["serve", "--config", str(config)]), {})
    with pytest.raises(ValueError, match="max-num-seqs"):
        serve_settings(build_parser().parse_args(["serve"]), {"V4SERVE_MAX_NUM_SEQS": "many"})


def test_several_served_model_names_in_every_form(tmp_path):
    def names(argv: list[str], environ: dict[str, str] | None = None) -> tuple[str, ...]:
        return ServeConfig(**serve_settings(build_parser().parse_args(["serve", *argv]), environ or {})).model_names

    config = tmp_path / "serve.yaml"
    config.write_text("served-model-name: [deepseek-chat, deepseek-reasoner]\n")
    assert names(["--served-model-name", "a", "b,c", "a"]) == ("a", "b", "c")  # vLLM's form and commas, once each
    assert names([], {"V4SERVE_SERVED_MODEL_NAME": "x, y"}) == ("x", "y")
    assert names(["--config", str(config)]) == ("deepseek-chat", "deepseek-reasoner")
    assert names(["--served-model-name", "one"]) == ("one",) and names([]) == ("v4serve-tiny",)
    assert ServeConfig(served_model_name="a,b").model_name == "a"  # metrics and logs: the first


def test_bad_serve_settings_exit_with_a_message(tmp_path):
    done = run_cli("serve", "--model", str(tmp_path / "missing"), "--no-kv-store", "--port", "0")
    assert done.returncode == 2 and "not a folder" in done.stderr
    done = run_cli("serve", "--swa-cache-mode", "sometimes", "--no-kv-store", "--port", "0")
    assert done.returncode == 2 and "swa_cache_mode" in done.stderr


def test_daemon_serves_a_checkpoint_folder(tmp_path):
    folder = tmp_path / "my-model"
    assert run_cli("make-checkpoint", str(folder)).returncode == 0
    with daemon("--model", str(folder)) as url:
        models = httpx.get(url + "/v1/models", timeout=PATIENCE).json()
        body = {"prompt": [70, 71, 72], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=PATIENCE).json()
    assert models["data"][0]["id"] == "my-model"
    assert reply["usage"]["completion_tokens"] == 3


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize(("host", "shown"), [
    ("127.0.0.1", "127.0.0.1"),
    ("0.0.0.0", "127.0.0.1"),  # every IPv4 address: the log names one a local client reaches
    pytest.param("::", "[::1]", marks=pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")),
])
def test_port_0_serves_on_a_port_the_system_picks_and_logs_it(host, shown):
    """`--port 0`: the daemon binds a free port itself (nothing can take it between choosing and
    binding it) and its "serving ... at" line gives the one it got; that address answers."""
    running = start_daemon("--host", host, port=0)  # the last --host wins
    try:
        assert running.url.startswith(f"http://{shown}:")
        port = int(running.url.rsplit(":", 1)[1])
        assert port > 0
        assert httpx.get(running.url + "/health", timeout=PATIENCE).status_code == 200
        log = Path(running.log.name).read_text()
        assert "the embedded tiny model has random weights: its text is noise" in log  # it says what it is
        assert "SWA cache mode periodic (window state snapshotted every 4096 tokens and at prompt and" in log
    finally:
        assert running.stop() == 0


def test_a_port_in_use_is_refused_before_the_engine_starts():
    """Exit 2 naming the port, before any engine process starts: refused in a moment, not after
    loading a model."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "v4serve.server.cli", "serve", "--host", "127.0.0.1", "--port",
                               str(port), "--no-kv-store"], cwd=ROOT, capture_output=True, text=True, timeout=PATIENCE)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == (f"v4serve serve: cannot listen on 127.0.0.1 port {port}: address already in use "
                    "(another process listens there: stop it, or choose another --port)")
    assert "engine process" not in done.stderr


def test_a_port_taken_while_the_engine_loads_is_refused_when_listening():
    """Bound but not yet listening while the engine loads, the port can still go to a server that
    binds it with SO_REUSEADDR and listens first: the daemon then refuses with the same message."""
    from v4serve.server.serve import PortUnavailable, bind_sockets, listen

    sockets = bind_sockets("127.0.0.1", 0)
    port = sockets[0].getsockname()[1]
    try:
        with socket.socket() as rival:
            rival.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            rival.bind(("127.0.0.1", port))
            rival.listen()
            with pytest.raises(PortUnavailable, match=f"127.0.0.1 port {port}: address already in use"):
                listen(sockets, "127.0.0.1", 16)
    finally:
        for sock in sockets:
            sock.close()


def test_checkpoint_loading_shows_progress(tmp_path, caplog):
    folder = tmp_path / "ckpt"
    assert run_cli("make-checkpoint", str(folder)).returncode == 0
    with caplog.at_level("INFO"):
        load_model(folder, progress=True)
    assert any("model.safetensors" in r.getMessage() for r in caplog.records)


def test_readme_names_the_two_commands():
    readme = (Path(ROOT) / "README.md").read_text()
    assert "make serve" in readme and "make test" in readme


def test_the_startup_log_says_what_each_swa_mode_keeps():
    from v4serve.server.model_loading import swa_mode_words

    assert swa_mode_words("full", 4096) == "window state snapshotted at every block: a hit never recomputes"
    assert "every 512 tokens and at prompt and response ends" in swa_mode_words("periodic", 512)
    assert swa_mode_words("zero", 4096) == "no window snapshots: a hit recomputes the window"
