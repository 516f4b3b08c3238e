"""The rendezvous server every local and cluster launch starts (lightning_straggler.launcher)."""
import socket

from lightning_straggler.launcher import RENDEZVOUS_BACKLOG, rendezvous_server


def _connect_all(address, n, timeout_s):
    """Open ``n`` connections to ``address`` (nobody accepts them); how many completed their handshake."""
    socks, done = [], 0
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.settimeout(timeout_s)
            socks.append(s)
            try:
                s.connect(address)
                done += 1
            except (socket.timeout, OSError):
                pass
    finally:
        for s in socks:
            s.close()
    return done


def test_the_server_queues_a_whole_world_of_workers_connecting_at_once():
    """Workers connect to the rendezvous together; the server takes them one by one. A listen backlog of 5
    (Python's HTTP server default) dropped the 7th and later connections, which TCP retried after 1 s, 2 s,
    ...: ~5.5 s in hvd.init at 8 workers. Here nothing accepts, so every connection must wait in the queue."""
    world = 64
    assert RENDEZVOUS_BACKLOG >= world
    server = rendezvous_server("127.0.0.1", 0)  # bound and listening, not serving
    try:
        assert _connect_all(server.server_address, world, timeout_s=5.0) == world
    finally:
        server.server_close()


def test_the_default_backlog_is_what_made_workers_wait():
    """The reference: the same server class with Python's default backlog loses connections past it (so the
    test above can fail)."""
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

    server = RendezvousHTTPServer(("127.0.0.1", 0), RendezvousHandler, 0)
    try:
        assert RendezvousHTTPServer.request_queue_size == 5
        assert _connect_all(server.server_address, 8, timeout_s=0.3) < 8  # 8 workers: what took 5.5 s
    finally:
        server.server_close()
