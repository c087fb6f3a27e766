"""The ``redis-server`` child process helper."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import redis

from spin.stats import RedisServer, find_redis_server, free_port


@pytest.fixture(autouse=True)
def _require_redis_server() -> None:
    if find_redis_server() is None:
        pytest.fail("redis-server is required for tests/stats (apt-get install redis-server)")


def ping(url: str) -> bool:
    try:
        with redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5) as client:
            return bool(client.ping())
    except redis.ConnectionError:
        return False


def test_free_port_is_bindable() -> None:
    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_start_stop_url_works() -> None:
    server = RedisServer()
    with pytest.raises(RuntimeError):
        _ = server.url  # no port before start()
    server.start()
    try:
        assert server.running
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        with redis.Redis.from_url(server.url, decode_responses=True) as client:
            client.set("k", "v")
            assert client.get("k") == "v"
            assert client.config_get("save") == {"save": ""}
            assert client.config_get("appendonly") == {"appendonly": "no"}
        log_dir = server.log_path.parent if server.log_path else None
    finally:
        server.stop()
    assert not server.running
    assert not ping(server.url)
    assert log_dir is not None and not log_dir.exists()
    server.stop()  # idempotent
    assert not server.running


def test_context_manager_and_explicit_port() -> None:
    port = free_port()
    with RedisServer(port=port) as server:
        assert server.port == port
        assert ping(f"redis://127.0.0.1:{port}/0")
    assert not ping(f"redis://127.0.0.1:{port}/0")


def test_restart_keeps_port_not_data() -> None:
    with RedisServer() as server:
        url, port = server.url, server.port
        with redis.Redis.from_url(url) as client:
            client.set("k", "v")
        server.restart()
        assert (server.url, server.port) == (url, port)
        with redis.Redis.from_url(url) as client:
            assert client.get("k") is None  # no persistence
        server.stop()
        assert not ping(url)
        server.start()  # start() after stop() reuses the port too
        assert server.port == port and ping(url)


def test_missing_binary_raises_file_not_found(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        RedisServer(binary=str(tmp_path / "no-such-redis-server"))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_redis_server() is None
    with pytest.raises(FileNotFoundError, match="redis-server not found"):
        RedisServer()


def test_start_failure_reports_log_tail() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = RedisServer(port=port)
        with pytest.raises(RuntimeError, match=r"(?s)exited with code .*already in use"):
            server.start()
        assert not server.running
        server.stop()
