"""A byte relay between TCP on loopback and a Unix socket, so a process in a
network namespace of its own reaches the host's broker without any address but
loopback ever being dialled (test_worker_netns.py).

    python netns_relay.py to-unix   HOST:PORT SOCKET   # in the namespace: TCP HOST:PORT → SOCKET
    python netns_relay.py from-unix SOCKET HOST:PORT   # on the host: SOCKET → TCP HOST:PORT

Prints READY once listening."""

from __future__ import annotations

import asyncio
import os
import sys


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        try:
            writer.close()
        except Exception:  # noqa: BLE001
            pass


async def main() -> None:
    mode, a, b = sys.argv[1:4]
    if mode == "to-unix":
        host, port = a.rsplit(":", 1)

        async def serve(r, w):
            ur, uw = await asyncio.open_unix_connection(b)
            await asyncio.gather(pipe(r, uw), pipe(ur, w))

        server = await asyncio.start_server(serve, host, int(port))
    else:
        host, port = b.rsplit(":", 1)

        async def serve(r, w):
            tr, tw = await asyncio.open_connection(host, int(port))
            await asyncio.gather(pipe(r, tw), pipe(tr, w))

        if os.path.exists(a):
            os.unlink(a)
        server = await asyncio.start_unix_server(serve, a)
    print("READY", flush=True)
    async with server:
        await server.serve_forever()


asyncio.run(main())
