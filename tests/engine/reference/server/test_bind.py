"""The listening socket the server binds itself (to print its port before serving)."""

import asyncio
import socket

from ddtree.engine.reference.server import bind_socket


def test_accepted_connections_have_nagle_off():
    # A listener made with proto 0 left Nagle on: every streamed chunk after the first waited for
    # the client's delayed ACK, 40 ms on the first token of each request on a kept-alive connection.
    sock = bind_socket("127.0.0.1", 0)

    async def main() -> int:
        accepted = asyncio.get_running_loop().create_future()

        def on_connect(reader, writer):
            accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        try:
            return await asyncio.wait_for(accepted, 10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(main()) != 0
